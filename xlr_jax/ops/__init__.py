"""Attention kernels behind one entry point, and their pure-JAX references."""
from xlr_jax.ops.paged_attention import paged_attention, paged_attention_xla

__all__ = ["paged_attention", "paged_attention_xla"]
