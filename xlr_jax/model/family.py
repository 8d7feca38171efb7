"""Model families: what each one changes in the base decoder (`model.decoder`, Llama's).

A family is a small declaration in its own module (`model/families/`): the name its
checkpoints go by (an HF config's `model_type`, a GGUF's `general.architecture`), the
switches the decoder reads from `ModelConfig`, and the tensors its layers carry beyond
the base's. The loader reads every checkpoint through its family; an architecture with
no family is refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from xlr_jax.errors import UnsupportedModelError


@dataclass(frozen=True)
class LayerTensor:
    """A per-layer tensor a family adds: its `LayerParams` leaf and its names in an HF
    checkpoint (after `model.layers.{i}.`) and a GGUF file (after `blk.{i}.`)."""
    leaf: str
    hf: str
    gguf: str


@dataclass(frozen=True)
class Family:
    """One family's differences from the base decoder (see the module docstring)."""
    name: str
    qkv_bias: bool = False          # the Q/K/V projections have biases
    qk_norm: bool = False           # each head's Q and K are RMS-normed before RoPE
    # without `layer_types` in its config, a window covers the layers from
    # `max_window_layers` on (else every layer, as Mistral's)
    window_from_layer: bool = False
    gguf_permuted_qk: bool = False  # llama.cpp interleaves the Q/K rows of its files
    layer_tensors: tuple[LayerTensor, ...] = ()


@lru_cache(maxsize=1)
def families() -> dict[str, Family]:
    """Every family, by name."""
    from xlr_jax.model.families import llama, qwen2, qwen3

    return {f.name: f for module in (llama, qwen2, qwen3) for f in module.FAMILIES}


def family(name: str | None, where: str = "architecture") -> Family:
    """The family a checkpoint names (`where`: the field that names it, for the error)."""
    known = families()
    if name not in known:
        raise UnsupportedModelError(f"{where} {name!r} is not supported; supported: "
                                    f"{', '.join(known)}")
    return known[name]
