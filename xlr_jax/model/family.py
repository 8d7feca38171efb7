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
    norm: bool = False  # a norm's weight (takes the family's `norm_offset`)


@dataclass(frozen=True)
class ExpertNames:
    """Where a MoE family's HF checkpoints keep a layer's experts (after
    `model.layers.{i}.`): `{block}gate.weight` the router; per expert
    `{block}experts.{e}.{gate|up|down}.weight`, or fused as transformers v5 writes them,
    `{block}experts.gate_up_proj` [E, 2I, d] and `{block}experts.down_proj` [E, d, I]."""
    block: str
    gate: str
    up: str
    down: str


@dataclass(frozen=True)
class Family:
    """One family's differences from the base decoder (see the module docstring)."""
    name: str
    gguf_name: str | None = None    # a GGUF's general.architecture (default: `name`)
    qkv_bias: bool = False          # the Q/K/V projections have biases
    qk_norm: bool = False           # each head's Q and K are RMS-normed before RoPE
    # without `layer_types` in its config, a window covers the layers from
    # `max_window_layers` on (else every layer, as Mistral's)
    window_from_layer: bool = False
    gguf_permuted_qk: bool = False  # llama.cpp interleaves the Q/K rows of its files
    layer_tensors: tuple[LayerTensor, ...] = ()
    experts: ExpertNames | None = None  # a mixture of experts in every layer
    norm_topk: bool = False  # the chosen experts' weights renormalized, where no key says
    # the norm before the MLP in an HF checkpoint (after `model.layers.{i}.`)
    mlp_norm_hf: str = "post_attention_layernorm.weight"
    # Gemma: HF checkpoints keep a norm's weight w where the norm multiplies by 1 + w
    # (added at load; llama.cpp adds it when it writes a GGUF)
    norm_offset: float = 0.0
    hidden_act: str = "silu"        # the MLP's activation where the config does not say
    scale_embeddings: bool = False  # embeddings times sqrt(hidden)
    post_norms: bool = False        # norms after attention and the MLP (`layer_tensors`)
    # without `layer_types` in its config, every `window_pattern`-th layer attends to the
    # whole context and the others through the window (0: see `window_from_layer`)
    window_pattern: int = 0
    local_rope_theta: float | None = None  # the windowed layers' RoPE base by default
    # llama.cpp scales queries by (hidden / heads) ** -0.5 for a model of this many
    # layers (Gemma's 27B) and by head_dim ** -0.5 otherwise; its GGUFs do not say
    gguf_width_scaled_layers: int = 0

    @property
    def gguf(self) -> str:
        return self.gguf_name or self.name


@lru_cache(maxsize=1)
def families() -> dict[str, Family]:
    """Every family, by name."""
    from xlr_jax.model.families import gemma, llama, mixtral, qwen2, qwen3, qwen_moe

    return {f.name: f for module in (llama, mixtral, qwen2, qwen3, qwen_moe, gemma)
            for f in module.FAMILIES}


def family(name: str | None, where: str = "architecture") -> Family:
    """The family a checkpoint names (`where`: the field that names it, for the error)."""
    known = families()
    if name not in known:
        raise UnsupportedModelError(f"{where} {name!r} is not supported; supported: "
                                    f"{', '.join(known)}")
    return known[name]


def gguf_family(arch: str | None, experts: int) -> Family:
    """The family of a GGUF file: its `general.architecture` and whether it has experts
    (llama.cpp writes Mixtral as "llama" with experts)."""
    for f in families().values():
        if f.gguf == arch and (f.experts is not None) == (experts > 0):
            return f
    names = sorted({f.gguf for f in families().values()})
    raise UnsupportedModelError(f"GGUF architecture {arch!r}{' with experts' if experts else ''}"
                                f" is not supported; supported: {', '.join(names)}")
