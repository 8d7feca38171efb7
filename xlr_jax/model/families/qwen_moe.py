"""Qwen2-MoE and Qwen3-MoE: their dense siblings' attention (Q/K/V biases; per-head Q/K
norms), a mixture of experts in every layer (top-k of a softmax over all experts,
renormalized where `norm_topk_prob` says), and for Qwen2-MoE a shared expert beside them
whose output a sigmoid gate scales."""
from xlr_jax.model.families.qwen3 import QK_NORMS
from xlr_jax.model.family import ExpertNames, Family

EXPERTS = ExpertNames("mlp.", "gate_proj", "up_proj", "down_proj")
FAMILIES = (
    Family("qwen2_moe", gguf_name="qwen2moe", qkv_bias=True, window_from_layer=True,
           experts=EXPERTS),
    Family("qwen3_moe", gguf_name="qwen3moe", qk_norm=True, window_from_layer=True,
           layer_tensors=QK_NORMS, experts=EXPERTS, norm_topk=True),
)
