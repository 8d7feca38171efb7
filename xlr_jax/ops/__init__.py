"""Attention kernels behind one entry point, and their pure-JAX references.

The Pallas kernel itself is in `xlr_jax.ops.pallas_attention`, imported only where it runs:
Pallas and Triton add ~0.1 s to every start. The CPU's kernels (XLA custom calls built
on first use by `xlr_jax.ops.cpu_kernels`) are in `xlr_jax.ops.cpu_attention` (paged
attention) and `xlr_jax.ops.cpu_linear` (few-row weight products).
"""
from xlr_jax.ops.paged_attention import (IMPLS, paged_attention, paged_attention_xla,
                                         resolve_impl, soft_cap, walk_sizes)

__all__ = ["IMPLS", "paged_attention", "paged_attention_xla", "resolve_impl", "soft_cap",
           "walk_sizes"]
