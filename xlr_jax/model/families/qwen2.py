"""Qwen2 (and Qwen2.5): biases on the Q/K/V projections; a window, when used, only on the
layers from `max_window_layers` on."""
from xlr_jax.model.family import Family

FAMILIES = (Family("qwen2", qkv_bias=True, window_from_layer=True),)
