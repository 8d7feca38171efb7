"""The CPU kernels (XLA FFI custom calls in C++): paged attention (`paged_attention.cc`,
used through `cpu_attention`) and few-row weight products (`linear.cc`, through
`cpu_linear`).

They are built on first use with the host's C++ compiler (-march=native, 4-6 s) into
one library, once per source, jaxlib, compiler and CPU, under <cache dir>/kernels/;
later processes load it from there. Without a compiler, or if the build fails,
`build_error()` says why and the plan keeps XLA's own ops.
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

HERE = Path(__file__).parent
SOURCES = (HERE / "paged_attention.cc", HERE / "linear.cc")
HEADERS = (HERE / "cpu_kernels.h",)
# custom-call target -> the symbol its handler is exported as
TARGETS = {"xlr_paged_attention": "XlrPagedAttention", "xlr_linear": "XlrLinear"}
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")

_lock = threading.Lock()
_built: dict[str, str | None] = {}  # "error": None once registered in this process


def build_error() -> str | None:
    """None once the kernels are built and registered in this process, else why they are
    not (tried once per process)."""
    with _lock:
        if "error" not in _built:
            _built["error"] = _build_and_register()
        return _built["error"]


def library_path(compiler: str) -> Path:
    """Where the kernels built by `compiler` for these sources, jaxlib and CPU lie."""
    from xlr_jax.loading.registry import default_cache_dir
    from xlr_jax.planning.hardware import cpu_features  # -march=native runs only there

    key = hashlib.sha256(b"\0".join(x.encode() if isinstance(x, str) else x for x in (
        *(p.read_bytes() for p in SOURCES + HEADERS), importlib.metadata.version("jaxlib"),
        compiler, " ".join(FLAGS), platform.machine(), cpu_features()))).hexdigest()[:16]
    return default_cache_dir() / "kernels" / f"xlr_cpu_kernels-{key}.so"


def _build_and_register() -> str | None:
    if jax.default_backend() != "cpu":
        return f"the CPU kernels serve the CPU backend (this is {jax.default_backend()})"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        return "no C++ compiler found (install g++ or set CXX)"
    path = library_path(compiler)
    names = " and ".join(p.name for p in SOURCES)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # concurrent builds: last wins
        try:
            run = subprocess.run([compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{HERE}",
                                  *map(str, SOURCES), "-o", str(tmp)],
                                 capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"building {names} with {compiler} failed: {e}"
        if run.returncode:
            tmp.unlink(missing_ok=True)
            lines = [x for x in run.stderr.splitlines() if "error" in x] or [run.stderr[-300:]]
            return f"building {names} with {compiler} failed: {lines[0].strip()}"
        os.replace(tmp, path)
    try:
        library = ctypes.cdll.LoadLibrary(str(path))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                        platform="cpu")
    except (OSError, AttributeError) as e:
        return f"loading {path} failed: {e}"
    return None
