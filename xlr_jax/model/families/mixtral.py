"""Mixtral: Llama's attention, and a mixture of experts in every layer: top-k of E by the
router's softmax, the chosen renormalized (a softmax over the chosen)."""
from xlr_jax.model.family import ExpertNames, Family

FAMILIES = (Family("mixtral", gguf_name="llama", gguf_permuted_qk=True, norm_topk=True,
                   experts=ExpertNames("block_sparse_moe.", "w1", "w3", "w2")),)
