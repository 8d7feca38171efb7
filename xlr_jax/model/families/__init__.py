"""One module per model family; `xlr_jax.model.family` is the registry."""
