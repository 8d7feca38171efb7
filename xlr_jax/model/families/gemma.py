"""Gemma-2 and Gemma-3: GeGLU (tanh GELU), embeddings scaled by sqrt(hidden), RMS norms
that multiply by 1 + weight, a norm after attention and after the MLP as well as before,
queries scaled by query_pre_attn_scalar ** -0.5, and sliding-window layers between
global ones (Gemma-2: every other layer; Gemma-3: five of every six, with a RoPE base of
their own). Gemma-2 soft-caps attention scores and final logits; Gemma-3 norms each
head's Q and K instead (Qwen3's norms)."""
from xlr_jax.model.families.qwen3 import QK_NORMS
from xlr_jax.model.family import Family, LayerTensor

POST_NORMS = (
    LayerTensor("post_attn_norm", "post_attention_layernorm.weight",
                "post_attention_norm.weight", norm=True),
    LayerTensor("post_mlp_norm", "post_feedforward_layernorm.weight", "post_ffw_norm.weight",
                norm=True),
)
GEMMA = dict(mlp_norm_hf="pre_feedforward_layernorm.weight", norm_offset=1.0,
             hidden_act="gelu_tanh", scale_embeddings=True, post_norms=True)
FAMILIES = (
    Family("gemma2", window_pattern=2, layer_tensors=POST_NORMS,
           gguf_width_scaled_layers=46, **GEMMA),
    Family("gemma3_text", gguf_name="gemma3", window_pattern=6, local_rope_theta=10000.0,
           qk_norm=True, layer_tensors=QK_NORMS + POST_NORMS, gguf_width_scaled_layers=62,
           **GEMMA),
)
