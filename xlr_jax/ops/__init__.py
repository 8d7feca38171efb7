"""Attention kernels behind one entry point, and their pure-JAX references."""
from xlr_jax.ops.paged_attention import paged_attention, paged_attention_xla, resolve_impl
from xlr_jax.ops.pallas_attention import ragged_paged_attention_pallas

__all__ = ["paged_attention", "paged_attention_xla", "ragged_paged_attention_pallas",
           "resolve_impl"]
