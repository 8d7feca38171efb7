"""Llama and Mistral: the base decoder itself (Mistral's window comes from its config)."""
from xlr_jax.model.family import Family

FAMILIES = (Family("llama", gguf_permuted_qk=True), Family("mistral"))
