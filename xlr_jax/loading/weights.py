"""Weights loading: GGUF files and Hugging Face directories -> ModelConfig + Params.

A load opens its source once (`open_source`): the content hash of the file(s), the
config and the tokenizer. For a GGUF file, whose metadata takes seconds to parse
(the `gguf` package builds a field per vocabulary entry), the config and tokenizer
are cached under `cache_dir/source/<hash>/`, so a warm load parses no GGUF at all;
a cold load parses it once and hands the parsed reader on to the weights.

Converted params are cached under `cache_dir/params/<key>`, where the key is the
source hash, the dtype and the converter version, as one flat file that a warm load
memory-maps (see disk_cache): no dequantization, re-layout or copy.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from xlr_jax.errors import ModelLoadError, UnsupportedModelError
from xlr_jax.loading.disk_cache import atomic_entry, file_digest, load_arrays, save_arrays
from xlr_jax.loading.tokenizer import Tokenizer
from xlr_jax.model.config import ModelConfig, RopeScaling
from xlr_jax.model import quantized
from xlr_jax.model.weight_formats import WEIGHTS
from xlr_jax.model.family import Family, family, gguf_family

log = logging.getLogger(__name__)

CONVERTER_VERSION = 3  # 3: flat memory-mapped params files (2: orbax)


@dataclass
class ModelSource:
    """A model file or directory, opened once per load."""

    path: Path
    digest: str                   # content hash: the key of every cache entry derived from it
    config: ModelConfig
    tokenizer: Tokenizer | None   # None for a weights-only HF directory
    from_cache: bool              # config and tokenizer came from the cache (no GGUF parse)
    reader: object | None = None  # a GGUF parsed by this load, handed on to the weights


@dataclass
class LoadedWeights:
    config: ModelConfig
    params: dict          # nested dict of numpy arrays, the Params layout
    source: Path          # the model file or directory
    source_hash: str
    load_s: float
    from_cache: bool


# ---------------------------------------------------------------- helpers

MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")  # the layer leaves a format applies to


def _stack_layers(per_layer: list[dict]) -> dict:
    """Each leaf stacked over the layers (a quantized weight's arrays each)."""
    return jax.tree.map(lambda *parts: np.stack(parts), *per_layer)


def _layer_dict(q, k, v, o, attn_norm, mlp_norm, ffn, biases, extra, dtype, weights):
    """One layer's leaves (`LayerParams`); `ffn`: its MLP's and experts' (`_ffn`);
    `extra`: its family's own, by leaf; its matrices in the format `weights` asks."""
    out = {
        "attn_norm": attn_norm, "mlp_norm": mlp_norm,
        "wqkv": quantized.join_rows([q, k, v]), "wo": o, **ffn, **extra,
    }
    if biases is not None:
        out["bqkv"] = np.concatenate(biases)
    return {name: quantized.as_weight(a, weights, dtype) if name in MATRICES
            else np.asarray(a, dtype=dtype) for name, a in out.items()}


def _ffn(mlp, experts=None, shared_gate=None) -> dict:
    """A layer's FFN leaves: its gated MLP `mlp` (gate, up, down; a MoE layer's shared
    expert, or None), and a MoE layer's `experts` (router [E, d], gate and up [E, I, d],
    down [E, d, I], as the checkpoints hold them) in the grouped product's [in, out]
    layout."""
    out = {}
    if mlp is not None:
        gate, up, down = mlp
        out.update(w_gate_up=quantized.join_rows([gate, up]), w_down=down)
    if experts is not None:
        router, gate, up, down = experts
        out.update(router=router,
                   w_experts_gate_up=np.concatenate([gate, up], axis=1).transpose(0, 2, 1),
                   w_experts_down=down.transpose(0, 2, 1))
    if shared_gate is not None:
        out["w_shared_gate"] = shared_gate.reshape(1, -1)
    return out


def _moe_fields(fam: Family, experts: int, used: int, width: int, shared: int,
                norm_topk: bool) -> dict:
    """The ModelConfig fields of a mixture of experts in every layer (none for a dense
    model); a family with experts must have them."""
    if (fam.experts is not None) != (experts > 0):
        raise UnsupportedModelError(f"a {fam.name} model {'needs' if fam.experts else 'has'} "
                                    "experts; the config says otherwise")
    if not experts:
        return {}
    return dict(num_experts=experts, experts_per_token=used, moe_intermediate_size=width,
                norm_topk_prob=norm_topk, shared_experts=int(shared > 0),
                shared_intermediate_size=shared, shared_expert_gate=shared > 0)


# ---------------------------------------------------------------- GGUF

def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows (its RoPE pairs adjacent dims)."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_config(reader) -> ModelConfig:
    arch = reader.fields.get("general.architecture")
    experts = int(reader.fields.get(f"{arch}.expert_count", 0))
    fam = gguf_family(arch, experts)
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise UnsupportedModelError(
            "this GGUF stores llama3 rope scaling as rope_freqs; load the Hugging Face "
            "directory of the model instead")

    def f(key, default=None):
        return reader.fields.get(f"{arch}.{key}", default)

    hidden, heads = int(f("embedding_length")), int(f("attention.head_count"))
    tensors = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    scaling = RopeScaling()
    if f("rope.scaling.type") == "linear":
        scaling = RopeScaling(kind="linear", factor=float(f("rope.scaling.factor")))
    ffn = int(f("feed_forward_length", 0))
    moe = _moe_fields(fam, experts, int(f("expert_used_count", 0)),
                      int(f("expert_feed_forward_length", ffn)),
                      int(f("expert_shared_feed_forward_length", 0)),
                      bool(f("expert_weights_norm", fam.norm_topk)))
    layers, head_dim = int(f("block_count")), int(f("attention.key_length", hidden // heads))
    window, window_layers = f("attention.sliding_window"), ()
    if window and fam.window_pattern:  # llama.cpp's rule for the family: not in the file
        every = fam.window_pattern
        window_layers = _windowed(tuple(i for i in range(layers) if (i + 1) % every), layers)
    scalar = None
    if fam.gguf_width_scaled_layers:
        scalar = hidden // heads if layers == fam.gguf_width_scaled_layers else head_dim
    return ModelConfig(
        architecture=fam.name,
        vocab_size=int(f("vocab_size", len(tokens) if tokens else 0)),
        hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=int(f("attention.head_count_kv", heads)), head_dim=head_dim,
        intermediate_size=ffn,
        rms_norm_eps=float(f("attention.layer_norm_rms_epsilon")),
        rope_theta=float(f("rope.freq_base", 10000.0)),
        max_context=int(f("context_length")),
        tie_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors, qk_norm=fam.qk_norm,
        sliding_window=int(window) if window else None, window_layers=window_layers,
        rope_scaling=scaling,
        rope_local_theta=fam.local_rope_theta if window else None,
        hidden_act=fam.hidden_act, scale_embeddings=fam.scale_embeddings,
        query_pre_attn_scalar=None if scalar is None else float(scalar),
        post_norms=fam.post_norms, attn_softcap=_cap(f("attn_logit_softcapping")),
        final_softcap=_cap(f("final_logit_softcapping")), **moe)


def _gguf_reader(path: Path):
    """The parsed GGUF file (`loading.gguf_file`, imported here: a warm load imports no
    GGUF code)."""
    from xlr_jax.loading.gguf_file import GGUFFile

    try:
        return GGUFFile(path)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}; the file is corrupt or "
                             "truncated, download it again") from e


def _gguf_tokenizer(reader, path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_gguf(reader)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"cannot read the tokenizer of {path}: {e}") from e


def _load_gguf(source: ModelSource, dtype, weights: str) -> dict:
    import gguf

    from xlr_jax.loading.gguf_file import readable_types

    path, config = source.path, source.config
    reader, source.reader = source.reader or _gguf_reader(path), None  # parsed at most once
    by_name = {t.name: t for t in reader.tensors}
    bar = tqdm(total=len(by_name), desc=f"Loading {path.name}", unit="tensor",
               disable=None, leave=False)

    used = set()

    def get(name, matrix=False):
        """The tensor as f32, or a matrix of a type kept quantized as it is (`native`)."""
        used.add(name)
        t = by_name.get(name)
        if t is None:
            raise ModelLoadError(f"GGUF file {path} lacks tensor {name!r}; the file is "
                                 "incomplete or not a supported model")
        bar.update()
        if t.tensor_type.name not in readable_types():
            raise ModelLoadError(f"GGUF tensor {name!r} is of type {t.tensor_type.name}, "
                                 f"which xlr-jax does not read; it reads "
                                 f"{', '.join(readable_types())} (requantize the file)")
        shape = [int(n) for n in reversed(t.shape)]
        if matrix and weights == "native" and t.tensor_type.name in quantized.GGUF_KEPT:
            return quantized.from_gguf_blocks(t.tensor_type.name, t.data, tuple(shape))
        data = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        return data.reshape(shape)

    fam = family(config.architecture)
    layers = []
    for i in range(config.num_layers):
        b = f"blk.{i}."
        q, k = get(b + "attn_q.weight", True), get(b + "attn_k.weight", True)
        if fam.gguf_permuted_qk:
            q = quantized.map_rows(lambda w: _unpermute_rows(w, config.num_heads), q)
            k = quantized.map_rows(lambda w: _unpermute_rows(w, config.num_kv_heads), k)
        biases = None
        if config.qkv_bias:
            biases = [get(b + f"attn_{n}.bias") for n in "qkv"]
        layers.append(_layer_dict(
            q, k, get(b + "attn_v.weight", True), get(b + "attn_output.weight", True),
            get(b + "attn_norm.weight"), get(b + "ffn_norm.weight"),
            _gguf_ffn(get, b, config), biases,
            {t.leaf: get(b + t.gguf) for t in fam.layer_tensors}, dtype, weights))
    params = {"embed": quantized.as_weight(get("token_embd.weight", True), weights, dtype),
              "layers": _stack_layers(layers),
              "final_norm": get("output_norm.weight").astype(dtype)}
    if not config.tie_embeddings:
        params["lm_head"] = quantized.as_weight(get("output.weight", True), weights, dtype)
    bar.close()
    _check_all_used(by_name, used, path)
    return params


def _gguf_ffn(get, b: str, config: ModelConfig) -> dict:
    """A layer's FFN from llama.cpp's names: the MLP, or the experts stacked
    (`ffn_*_exps`, the router `ffn_gate_inp`) with a shared expert (`ffn_*_shexp`)."""
    if not config.num_experts:
        return _ffn([get(b + f"ffn_{n}.weight", True) for n in ("gate", "up", "down")])
    shared = None
    if config.shared_width:
        shared = [get(b + f"ffn_{n}_shexp.weight") for n in ("gate", "up", "down")]
    return _ffn(shared, [get(b + "ffn_gate_inp.weight"),
                         *(get(b + f"ffn_{n}_exps.weight") for n in ("gate", "up", "down"))],
                get(b + "ffn_gate_inp_shexp.weight") if config.shared_expert_gate else None)


# ---------------------------------------------------------------- HF directories

ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF's name: ours


def hf_config(raw: dict) -> ModelConfig:
    arch = raw.get("model_type")
    fam = family(arch, "model_type")
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    local_theta = raw.get("rope_local_base_freq", fam.local_rope_theta)
    if "full_attention" in rope:  # per layer type (Gemma-3, transformers v5)
        local = rope.get("sliding_attention", {})
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError("rope_parameters.sliding_attention: only unscaled "
                                        "RoPE is supported on windowed layers")
        local_theta = local.get("rope_theta", local_theta)
        rope = rope["full_attention"]
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported; "
                                    "supported: default, linear, llama3")
    scaling = RopeScaling()
    if kind != "default":
        scaling = RopeScaling(
            kind=kind, factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position=int(rope.get("original_max_position_embeddings", 8192)))
    heads = raw["num_attention_heads"]
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    window, window_layers = _hf_windows(raw, fam)
    act = raw.get("hidden_activation") or raw.get("hidden_act") or fam.hidden_act
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"hidden_activation {act!r} is not supported; "
                                    f"supported: {', '.join(ACTIVATIONS)}")
    experts = raw.get("num_local_experts") or raw.get("num_experts") or 0
    for key, dense in (("mlp_only_layers", []), ("decoder_sparse_step", 1)):
        if experts and raw.get(key, dense) != dense:
            raise UnsupportedModelError(f"{key}={raw[key]!r}: dense layers between MoE "
                                        "layers are not supported yet")
    moe = _moe_fields(fam, experts, raw.get("num_experts_per_tok", 0),
                      raw.get("moe_intermediate_size") or raw["intermediate_size"],
                      raw.get("shared_expert_intermediate_size", 0),
                      bool(raw.get("norm_topk_prob", fam.norm_topk)))
    scalar = raw.get("query_pre_attn_scalar")
    return ModelConfig(
        architecture=arch, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"], num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        intermediate_size=raw["intermediate_size"], rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=float(theta), max_context=raw.get("max_position_embeddings", 4096),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=fam.qkv_bias or bool(raw.get("attention_bias", False)), qk_norm=fam.qk_norm,
        sliding_window=window, window_layers=window_layers, rope_scaling=scaling,
        rope_local_theta=None if local_theta is None or not window else float(local_theta),
        hidden_act=ACTIVATIONS[act], scale_embeddings=fam.scale_embeddings,
        query_pre_attn_scalar=None if scalar is None else float(scalar),
        post_norms=fam.post_norms, attn_softcap=_cap(raw.get("attn_logit_softcapping")),
        final_softcap=_cap(raw.get("final_logit_softcapping")), **moe)


def _cap(value) -> float | None:
    return float(value) if value else None


def _hf_windows(raw: dict, fam: Family) -> tuple[int | None, tuple[int, ...]]:
    """The sliding window and the layers it covers (empty: all), from `layer_types` or,
    without it, the family's rule."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    layers = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None and fam.window_pattern:
        every = (raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern")
                 or fam.window_pattern)
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                 for i in range(layers)]
    elif types is None and fam.window_from_layer:
        types = ["sliding_attention" if window and i >= raw.get("max_window_layers", 0)
                 else "full_attention" for i in range(layers)]
    if types is None:
        return window, ()
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown or len(types) != layers:
        raise UnsupportedModelError(f"layer_types {sorted(unknown) or types!r}: one of "
                                    "sliding_attention, full_attention per layer is supported")
    windowed = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not window or not windowed:
        return None, ()
    return window, _windowed(windowed, layers)


def _windowed(windowed: tuple[int, ...], layers: int) -> tuple[int, ...]:
    """ModelConfig.window_layers: the windowed layers, or () when that is all of them."""
    return () if len(windowed) == layers else windowed


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files; save the model with "
                             "safe_serialization=True")
    return files


def _read_hf_config(path: Path) -> ModelConfig:
    try:
        return hf_config(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {e!r}") from e


def _load_hf(source: ModelSource, dtype, weights: str) -> dict:
    from safetensors import safe_open

    path, config = source.path, source.config
    tensors = {}
    files = _safetensors_files(path)
    for file in tqdm(files, desc=f"Loading {path.name}", unit="file", disable=None,
                     leave=False):
        try:
            with safe_open(str(file), framework="flax") as f:
                for name in f.keys():
                    tensors[name] = np.asarray(f.get_tensor(name))
        except Exception as e:  # safetensors raises its own SafetensorError
            raise ModelLoadError(f"cannot read {file}: {e}; the file is corrupt or "
                                 "truncated") from e

    used = set()

    def get(name):
        used.add(name)
        try:
            return np.asarray(tensors[name], dtype=np.float32)
        except KeyError:
            raise ModelLoadError(f"{path} lacks tensor {name!r}") from None

    fam = family(config.architecture)
    norm = lambda name: get(name) + fam.norm_offset  # noqa: E731 (Gemma: 1 + w)
    layers = []
    for i in range(config.num_layers):
        b = f"model.layers.{i}."
        a = b + "self_attn."
        biases = None
        if config.qkv_bias:
            biases = [get(a + f"{n}_proj.bias") for n in "qkv"]
        layers.append(_layer_dict(
            get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight"),
            get(a + "o_proj.weight"), norm(b + "input_layernorm.weight"),
            norm(b + fam.mlp_norm_hf), _hf_ffn(get, tensors, b, fam, config), biases,
            {t.leaf: (norm if t.norm else get)(b + t.hf) for t in fam.layer_tensors}, dtype,
            weights))
    params = {"embed": quantized.as_weight(get("model.embed_tokens.weight"), weights, dtype),
              "layers": _stack_layers(layers),
              "final_norm": norm("model.norm.weight").astype(dtype)}
    if not config.tie_embeddings:
        params["lm_head"] = quantized.as_weight(get("lm_head.weight"), weights, dtype)
    _check_all_used(tensors, used, path)
    return params


def _hf_ffn(get, tensors: dict, b: str, fam: Family, config: ModelConfig) -> dict:
    """A layer's FFN from HF names: the MLP, or the experts (per expert, or fused as
    transformers v5 writes them) with a shared expert and its gate (Qwen2-MoE)."""
    mlp = lambda p: [get(f"{p}{n}_proj.weight") for n in ("gate", "up", "down")]  # noqa: E731
    if not config.num_experts:
        return _ffn(mlp(b + "mlp."))
    names = fam.experts
    e = b + names.block + "experts."
    if e + "gate_up_proj" in tensors:  # fused: [E, 2I, d] and [E, d, I]
        gate, up = np.split(get(e + "gate_up_proj"), 2, axis=1)
        experts = [gate, up, get(e + "down_proj")]
    else:
        experts = [np.stack([get(f"{e}{i}.{n}.weight") for i in range(config.num_experts)])
                   for n in (names.gate, names.up, names.down)]
    shared = mlp(b + "mlp.shared_expert.") if config.shared_width else None
    return _ffn(shared, [get(b + names.block + "gate.weight"), *experts],
                get(b + "mlp.shared_expert_gate.weight") if config.shared_expert_gate else None)


def _check_all_used(tensors, used: set, path: Path) -> None:
    """Refuse a checkpoint with tensors its family does not read: they would change what
    the model computes (a norm, an expert, a bias), so running without them is wrong."""
    left = sorted(set(tensors) - used)
    if left:
        more = f" and {len(left) - 1} more" if len(left) > 1 else ""
        raise UnsupportedModelError(f"{path} has tensor {left[0]!r}{more} that its family "
                                    "does not use; this model is not supported as it is")


# ---------------------------------------------------------------- entry point

def source_files(path: Path) -> list[Path]:
    if path.is_dir():
        return [path / "config.json", *_safetensors_files(path)]
    return [path]


def _check_source(path: Path) -> None:
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist; pass a GGUF file, a "
                             "Hugging Face directory, or 'smollm2' for the embedded model")
    if path.is_dir() and not (path / "config.json").exists():
        raise ModelLoadError(f"{path} is a directory without config.json; point at a "
                             "Hugging Face model directory or a .gguf file")


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The model's config alone (no weights read): for plans and rooflines."""
    path = Path(path).expanduser()
    _check_source(path)
    if path.is_dir():
        return _read_hf_config(path)
    return gguf_config(_gguf_reader(path))


def open_source(path: str | os.PathLike, cache_dir=None) -> ModelSource:
    """Hash, config and tokenizer of a GGUF file or HF directory; with `cache_dir`, a GGUF's
    are read from (or written to) cache_dir/source/<hash>/ instead of parsing the file."""
    path = Path(path).expanduser()
    _check_source(path)
    digest = file_digest(source_files(path), cache_dir)
    if path.is_dir():  # a weights-only directory still runs on token ids
        has_tokenizer = (path / "tokenizer.json").exists()
        return ModelSource(path, digest, _read_hf_config(path),
                           Tokenizer.from_hf_dir(path) if has_tokenizer else None, False)
    entry = Path(cache_dir, "source", digest) if cache_dir else None
    if entry is not None and entry.exists():
        try:
            return ModelSource(path, digest, *_read_source_entry(entry, digest), True)
        except Exception as e:  # a damaged or foreign entry is rebuilt, never trusted
            log.warning("model metadata cache %s unreadable (%s); parsing %s again",
                        entry, e, path.name)
            shutil.rmtree(entry, ignore_errors=True)
    reader = _gguf_reader(path)
    source = ModelSource(path, digest, gguf_config(reader), _gguf_tokenizer(reader, path),
                         False, reader)
    if entry is not None:
        with atomic_entry(entry) as tmp:
            (tmp / "config.json").write_text(source.config.to_json())
            source.tokenizer.save(tmp)
            files = {f.name: file_digest([f]) for f in sorted(tmp.iterdir())}
            # written last: names the source and checksums every file
            (tmp / "source.json").write_text(json.dumps({"digest": digest, "files": files}))
    return source


def _read_source_entry(entry: Path, digest: str) -> tuple[ModelConfig, Tokenizer]:
    manifest = json.loads((entry / "source.json").read_text())
    if manifest["digest"] != digest:
        raise ValueError(f"it belongs to source {manifest['digest']}")
    for name, expected in manifest["files"].items():
        if file_digest([entry / name]) != expected:
            raise ValueError(f"{name} does not match its checksum")
    return ModelConfig.from_json((entry / "config.json").read_text()), Tokenizer.load(entry)


def load_weights(source: ModelSource | str | os.PathLike, dtype=np.float32,
                 cache_dir=None, weights: str = "float") -> LoadedWeights:
    """Load a GGUF file or HF directory (a path, or a source `open_source` opened); with
    `cache_dir`, use or refresh the params cache (cached params are read-only memory maps).

    weights: the format of the weight matrices (attention, MLP, embedding, LM head):
    "float" (in `dtype`), "native" (a GGUF's matrices of the types in
    `quantized.GGUF_KEPT` kept quantized, the rest in `dtype`), "int8", "int4" or "fp8"
    (quantized at load; `model.quantized`).
    Norms, biases, routers and experts stay in `dtype`."""
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; choose one of "
                         f"{', '.join(WEIGHTS)}")
    start = time.perf_counter()
    if not isinstance(source, ModelSource):
        source = open_source(source, cache_dir)
    key = f"{source.digest}-{np.dtype(dtype).name}-v{CONVERTER_VERSION}"
    if weights != "float":
        key += f"-{weights}"
    entry = Path(cache_dir, "params", key) if cache_dir else None
    if entry is not None and entry.exists():
        try:
            return LoadedWeights(source.config, load_arrays(entry), source.path, source.digest,
                                 time.perf_counter() - start, True)
        except Exception as e:  # a damaged cache entry is rebuilt, never trusted
            log.warning("params cache %s unreadable (%s); converting again", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    params = (_load_hf if source.path.is_dir() else _load_gguf)(source, dtype, weights)
    if entry is not None:
        with atomic_entry(entry) as tmp:
            save_arrays(tmp, params)
    return LoadedWeights(source.config, params, source.path, source.digest,
                         time.perf_counter() - start, False)
