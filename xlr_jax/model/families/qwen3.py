"""Qwen3 (dense): no Q/K/V biases, an RMS norm over each head of Q and K before RoPE
(`q_norm`, `k_norm`: [head_dim] weights), and a head_dim of its own (not hidden / heads)."""
from xlr_jax.model.family import Family, LayerTensor

QK_NORMS = (LayerTensor("q_norm", "self_attn.q_norm.weight", "attn_q_norm.weight", norm=True),
            LayerTensor("k_norm", "self_attn.k_norm.weight", "attn_k_norm.weight", norm=True))
FAMILIES = (Family("qwen3", qk_norm=True, window_from_layer=True, layer_tensors=QK_NORMS),)
