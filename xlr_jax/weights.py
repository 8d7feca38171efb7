"""Weights loading: GGUF files and Hugging Face directories -> ModelConfig + Params.

Converted params are cached with orbax under `cache_dir/params/<key>`, where
the key hashes the source bytes, the dtype and the converter version, so the
second load of a model skips dequantization and re-layout.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from xlr_jax.config import ModelConfig, RopeScaling
from xlr_jax.errors import ModelLoadError, UnsupportedModelError

log = logging.getLogger(__name__)

CONVERTER_VERSION = 2
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass
class LoadedWeights:
    config: ModelConfig
    params: dict          # nested dict of numpy arrays, the Params layout
    source: Path          # the model file or directory
    source_hash: str
    load_s: float
    from_cache: bool


# ---------------------------------------------------------------- helpers

def _stack_layers(per_layer: list[dict]) -> dict:
    return {name: np.stack([layer[name] for layer in per_layer]) for name in per_layer[0]}


def _layer_dict(q, k, v, o, attn_norm, mlp_norm, gate, up, down, biases, dtype):
    out = {
        "attn_norm": attn_norm, "mlp_norm": mlp_norm,
        "wqkv": np.concatenate([q, k, v], axis=0), "wo": o,
        "w_gate_up": np.concatenate([gate, up], axis=0), "w_down": down,
    }
    if biases is not None:
        out["bqkv"] = np.concatenate(biases)
    return {name: np.asarray(a, dtype=dtype) for name, a in out.items()}


def params_digest(params: dict) -> str:
    """Content hash of a nested dict of arrays: a cache entry must restore bit-exact."""
    h = hashlib.sha256()

    def walk(node, path):
        for name in sorted(node):
            value, where = node[name], f"{path}/{name}"
            if isinstance(value, dict):
                walk(value, where)
            else:
                a = np.ascontiguousarray(value)
                h.update(f"{where}:{a.dtype.str}:{a.shape}".encode())
                h.update(a.data)

    walk(params, "")
    return h.hexdigest()


def file_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in sorted(paths):
        with open(path, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()[:32]


# ---------------------------------------------------------------- GGUF

def _gguf_field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows (its RoPE pairs adjacent dims)."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_config(reader) -> ModelConfig:
    arch = _gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise UnsupportedModelError(
            "this GGUF stores llama3 rope scaling as rope_freqs; load the Hugging Face "
            "directory of the model instead")

    def f(key, default=None):
        return _gguf_field(reader, f"{arch}.{key}", default)

    hidden, heads = int(f("embedding_length")), int(f("attention.head_count"))
    tensors = {t.name for t in reader.tensors}
    tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
    scaling = RopeScaling()
    if f("rope.scaling.type") == "linear":
        scaling = RopeScaling(kind="linear", factor=float(f("rope.scaling.factor")))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(f("vocab_size", len(tokens) if tokens else 0)),
        hidden_size=hidden, num_layers=int(f("block_count")), num_heads=heads,
        num_kv_heads=int(f("attention.head_count_kv", heads)),
        head_dim=int(f("attention.key_length", hidden // heads)),
        intermediate_size=int(f("feed_forward_length")),
        rms_norm_eps=float(f("attention.layer_norm_rms_epsilon")),
        rope_theta=float(f("rope.freq_base", 10000.0)),
        max_context=int(f("context_length")),
        tie_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        sliding_window=None, rope_scaling=scaling)


def _gguf_reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises bare ValueError/struct errors
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}; the file is corrupt or "
                             "truncated, download it again") from e


def _load_gguf(path: Path, dtype) -> tuple[ModelConfig, dict]:
    import gguf

    reader = _gguf_reader(path)
    config = gguf_config(reader)
    by_name = {t.name: t for t in reader.tensors}
    bar = tqdm(total=len(by_name), desc=f"Loading {path.name}", unit="tensor",
               disable=None, leave=False)

    def get(name):
        t = by_name.get(name)
        if t is None:
            raise ModelLoadError(f"GGUF file {path} lacks tensor {name!r}; the file is "
                                 "incomplete or not a supported model")
        data = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        bar.update()
        return data.reshape([int(n) for n in reversed(t.shape)])

    permute = config.architecture == "llama"
    layers = []
    for i in range(config.num_layers):
        b = f"blk.{i}."
        q, k = get(b + "attn_q.weight"), get(b + "attn_k.weight")
        if permute:
            q = _unpermute_rows(q, config.num_heads)
            k = _unpermute_rows(k, config.num_kv_heads)
        biases = None
        if config.qkv_bias:
            biases = [get(b + f"attn_{n}.bias") for n in "qkv"]
        layers.append(_layer_dict(
            q, k, get(b + "attn_v.weight"), get(b + "attn_output.weight"),
            get(b + "attn_norm.weight"), get(b + "ffn_norm.weight"),
            get(b + "ffn_gate.weight"), get(b + "ffn_up.weight"),
            get(b + "ffn_down.weight"), biases, dtype))
    params = {"embed": get("token_embd.weight").astype(dtype),
              "layers": _stack_layers(layers),
              "final_norm": get("output_norm.weight").astype(dtype)}
    if not config.tie_embeddings:
        params["lm_head"] = get("output.weight").astype(dtype)
    bar.close()
    return config, params


# ---------------------------------------------------------------- HF directories

def hf_config(raw: dict) -> ModelConfig:
    arch = raw.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"model_type {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
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
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    types = raw.get("layer_types")
    if types is None and arch == "qwen2":  # Qwen2 windows only layers >= max_window_layers
        types = ["sliding_attention" if window and i >= raw.get("max_window_layers", 0)
                 else "full_attention" for i in range(raw["num_hidden_layers"])]
    if types is not None:
        if len(set(types)) > 1:
            raise UnsupportedModelError("models mixing sliding-window and full-attention "
                                        "layers are not supported yet")
        window = raw.get("sliding_window") if types[0] == "sliding_attention" else None
    return ModelConfig(
        architecture=arch, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"], num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        intermediate_size=raw["intermediate_size"], rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=float(theta), max_context=raw.get("max_position_embeddings", 4096),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        sliding_window=window, rope_scaling=scaling)


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


def _load_hf(path: Path, dtype) -> tuple[ModelConfig, dict]:
    from safetensors import safe_open

    try:
        config = hf_config(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {e!r}") from e
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

    def get(name):
        try:
            return np.asarray(tensors[name], dtype=np.float32)
        except KeyError:
            raise ModelLoadError(f"{path} lacks tensor {name!r}") from None

    layers = []
    for i in range(config.num_layers):
        b = f"model.layers.{i}."
        a = b + "self_attn."
        biases = None
        if config.qkv_bias:
            biases = [get(a + f"{n}_proj.bias") for n in "qkv"]
        layers.append(_layer_dict(
            get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight"),
            get(a + "o_proj.weight"), get(b + "input_layernorm.weight"),
            get(b + "post_attention_layernorm.weight"), get(b + "mlp.gate_proj.weight"),
            get(b + "mlp.up_proj.weight"), get(b + "mlp.down_proj.weight"), biases, dtype))
    params = {"embed": get("model.embed_tokens.weight").astype(dtype),
              "layers": _stack_layers(layers),
              "final_norm": get("model.norm.weight").astype(dtype)}
    if not config.tie_embeddings:
        params["lm_head"] = get("lm_head.weight").astype(dtype)
    return config, params


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
        return hf_config(json.loads((path / "config.json").read_text()))
    return gguf_config(_gguf_reader(path))


def load_weights(path: str | os.PathLike, dtype=np.float32, cache_dir=None) -> LoadedWeights:
    """Load a GGUF file or HF directory; use/refresh the orbax cache when cache_dir is set."""
    path = Path(path).expanduser()
    _check_source(path)
    start = time.perf_counter()
    digest = file_digest(source_files(path))
    dtype_name = np.dtype(dtype).name
    key = f"{digest}-{dtype_name}-v{CONVERTER_VERSION}"
    entry = Path(cache_dir, "params", key) if cache_dir else None
    if entry is not None and (entry / "config.json").exists():
        try:
            config, params = _restore(entry)
            return LoadedWeights(config, params, path, digest,
                                 time.perf_counter() - start, True)
        except Exception as e:  # a damaged cache entry is rebuilt, never trusted
            log.warning("params cache %s unreadable (%s); converting again", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    config, params = (_load_hf if path.is_dir() else _load_gguf)(path, dtype)
    if entry is not None:
        _save(entry, config, params)
    return LoadedWeights(config, params, path, digest, time.perf_counter() - start, False)


def _save(entry: Path, config: ModelConfig, params: dict) -> None:
    import orbax.checkpoint as ocp

    tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp / "params", params)
    (tmp / "params.sha256").write_text(params_digest(params))
    (tmp / "config.json").write_text(config.to_json())  # written last: marks completeness
    shutil.rmtree(entry, ignore_errors=True)
    os.replace(tmp, entry)


def _restore(entry: Path) -> tuple[ModelConfig, dict]:
    import orbax.checkpoint as ocp

    config = ModelConfig.from_json((entry / "config.json").read_text())
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(entry / "params")
    if params_digest(params) != (entry / "params.sha256").read_text().strip():
        raise ModelLoadError(f"params cache {entry} does not match its checksum")
    return config, params
