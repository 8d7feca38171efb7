"""The CPU decode-attention kernel (`decode_attention.cc`): an XLA FFI custom call.

XLA:CPU runs the pure-JAX walk as many small ops one after another, each reading a few
pages on one thread (experiments/decode_attention_floor.py: 1.4-1.6x a lone read of the
same bytes, which itself runs at 10-15 GB/s). The kernel reads each page in place, folds
it into an online softmax while it is in the cache, and spreads the work over XLA's
intra-op threads. It is built on first use with the host's C++ compiler (-march=native,
3-4 s), once per source, jaxlib, compiler and CPU, into <cache dir>/kernels/, and later
processes load it from there. Without a compiler, or if the build fails, `build_error()`
says why and the plan keeps the XLA walk.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import jax
import jax.numpy as jnp

SOURCE = Path(__file__).with_name("decode_attention.cc")
TARGET = "xlr_decode_attention"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
HEAD_DIMS = (32, 64, 128, 256)
MAX_GROUP = 8
MAX_PAGE_SIZE = 256

_lock = threading.Lock()
_built: dict[str, str | None] = {}  # "error": None once registered in this process


def build_error() -> str | None:
    """None once the kernel is built and registered in this process, else why it is not
    (tried once per process)."""
    with _lock:
        if "error" not in _built:
            _built["error"] = _build_and_register()
        return _built["error"]


def takes(head_dim: int, group: int, page_size: int, kv_dtype) -> bool:
    """Whether the kernel takes a model's pages: f32, a head dim of 32, 64, 128 or 256, at
    most 8 query heads per KV head, at most 256 slots a page."""
    return (jnp.dtype(kv_dtype) == jnp.float32 and head_dim in HEAD_DIMS
            and 1 <= group <= MAX_GROUP and page_size <= MAX_PAGE_SIZE)


def supports(q_shape, kv_pages, kv_scales=None) -> bool:
    """Whether the kernel takes this decode call (`takes`, and no scales: f32 pages)."""
    k, v = kv_pages
    heads, dim = q_shape[-2], q_shape[-1]
    kv_heads, page_size = k.shape[-3], k.shape[-2]
    return (kv_scales is None and v.dtype == k.dtype and heads % kv_heads == 0
            and takes(dim, heads // kv_heads, page_size, k.dtype))


def decode_attention(q, kv_pages, block_tables, lengths, q_positions, *, layer=None,
                     sliding_window=None):
    """paged_attention's padded decode (q [rows, 1, heads, dim], q_positions [rows, 1])
    by the kernel; call `build_error()` first (it registers the target)."""
    k, v = kv_pages
    if layer is None:  # one layer's pages: a layer axis of one
        k, v, layer = k[None], v[None], 0
    pos = q_positions[:, 0].astype(jnp.int32)
    last = jnp.minimum(pos + 1, lengths.astype(jnp.int32))
    first = (jnp.zeros_like(pos) if sliding_window is None
             else jnp.maximum(pos - sliding_window + 1, 0))
    rows, _, heads, dim = q.shape
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows, heads, dim), jnp.float32))(
        q[:, 0].astype(jnp.float32), k, v, block_tables.astype(jnp.int32), first, last,
        jnp.asarray(layer, jnp.int32))
    return out[:, None].astype(q.dtype)


def library_path(compiler: str) -> Path:
    """Where the kernel built by `compiler` for this source, jaxlib and CPU lies."""
    from xlr_jax.loading.registry import default_cache_dir
    from xlr_jax.planning.hardware import cpu_features  # -march=native runs only there

    key = hashlib.sha256(b"\0".join(x.encode() if isinstance(x, str) else x for x in (
        SOURCE.read_bytes(), importlib.metadata.version("jaxlib"), compiler, " ".join(FLAGS),
        platform.machine(), cpu_features()))).hexdigest()[:16]
    return default_cache_dir() / "kernels" / f"decode_attention-{key}.so"


def _build_and_register() -> str | None:
    if jax.default_backend() != "cpu":
        return f"the CPU kernel serves the CPU backend (this is {jax.default_backend()})"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        return "no C++ compiler found (install g++ or set CXX)"
    path = library_path(compiler)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # concurrent builds: last wins
        try:
            run = subprocess.run([compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE),
                                  "-o", str(tmp)], capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"building {SOURCE.name} with {compiler} failed: {e}"
        if run.returncode:
            tmp.unlink(missing_ok=True)
            lines = [x for x in run.stderr.splitlines() if "error" in x] or [run.stderr[-300:]]
            return f"building {SOURCE.name} with {compiler} failed: {lines[0].strip()}"
        os.replace(tmp, path)
    try:
        library = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.XlrDecodeAttention),
                                    platform="cpu")
    except (OSError, AttributeError) as e:
        return f"loading {path} failed: {e}"
    return None
