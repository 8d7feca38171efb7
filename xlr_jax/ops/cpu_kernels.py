"""The CPU kernels (XLA FFI custom calls in C++): paged attention (`paged_attention.cc`,
used through `cpu_attention`) and few-row weight products (`linear.cc`, through
`cpu_linear`), as one library per target CPU.

`cpu_build` builds the library with the host's C++ compiler ($CXX, else c++ or g++) for
the CPU this runs on (-march=native; $XLR_CPU_TARGET names another -march target) into
$XLR_KERNEL_DIR (default <cache dir>/kernels); the source picks its vector width from
the target (16 floats with AVX-512, 8 with AVX2, 4 elsewhere). The build takes 5-10 s
on two cores and never stalls a caller that does not ask to wait: a process that finds
no library starts it in the background, at the lowest priority, and uses XLA's ops
until the library is there. A model load starts it first and waits for it (at most
`wait_s_for_load()`) only once the model file is parsed, so a first load pays what the
parsing did not hide and compiles its steps once, for the kernels. A failed build is
recorded beside the library, so later processes know in milliseconds; `status()` says in
one line why the kernels are off, and `xlr plan --warmup` builds again what failed.
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import os
import platform
import re
import shutil
import subprocess
import threading
from pathlib import Path

import jax

from xlr_jax.ops import cpu_build

log = logging.getLogger(__name__)

# custom-call target -> the symbol its handler is exported as
TARGETS = {"xlr_paged_attention": "XlrPagedAttention", "xlr_linear": "XlrLinear",
           "xlr_linear_q4": "XlrLinearQ4", "xlr_linear_q8": "XlrLinearQ8",
           "xlr_linear_f8": "XlrLinearF8"}
# A model load waits this long for a kernel build under way (a build takes 5-10 s on two
# cores, started beside the model file's parsing): less than compiling the model's steps
# for XLA's ops and then again, in the next process, for the kernels.
LOAD_WAIT_S = 30.0

_lock = threading.Lock()
# target CPU -> None once registered in this process, else (why not, whether that is final)
_state: dict[str, tuple[str, bool] | None] = {}
_builders: dict[str, subprocess.Popen] = {}  # target CPU -> the build this process started
_libraries: dict[str, ctypes.CDLL] = {}  # target CPU -> its registered library


def default_target() -> str:
    """The -march target the runtime's kernels are built for: $XLR_CPU_TARGET, else
    "native"."""
    return os.environ.get("XLR_CPU_TARGET") or "native"


def kernel_dir() -> Path:
    """$XLR_KERNEL_DIR, else <cache dir>/kernels."""
    from xlr_jax.loading.registry import default_cache_dir

    return Path(os.environ.get("XLR_KERNEL_DIR") or default_cache_dir() / "kernels")


def target_name(name: str, target: str | None = None) -> str:
    """The custom-call target `name` (a key of TARGETS) is registered as for the library
    built for `target`: `name` itself for the default target."""
    target = target or default_target()
    return name if target == default_target() else f"{name}_{re.sub(r'[^0-9A-Za-z]', '_', target)}"


def build_error(target: str | None = None, *, wait_s: float = 0.0,
                retry: bool = False) -> str | None:
    """None once the kernels for `target` (default: `default_target()`) are registered in
    this process, else why they are not. A library on disk is loaded; a recorded failure
    or a missing compiler is final for the process; with neither, the build starts in the
    background (or goes on, in whichever process started it), and a later call looks
    again. `wait_s`: wait that long for a build under way; `retry`: build again what
    failed before, waiting for it."""
    target = target or default_target()
    with _lock:
        state = _state.get(target, ("", False))
        if state is None or (state[1] and not retry):
            return None if state is None else state[0]
        _state[target] = state = _load(target, float("inf") if retry else wait_s, retry)
        return None if state is None else state[0]


def may_run(target: str | None = None) -> bool:
    """Whether the kernels for `target` are registered or may still be (a build under way
    or not yet tried), not off for good in this process."""
    build_error(target)
    state = _state.get(target or default_target())
    return state is None or not state[1]


def wait_s_for_load() -> float:
    """How long a model load waits for a kernel build under way: $XLR_KERNEL_WAIT seconds
    (default LOAD_WAIT_S; 0: never, XLA's ops until a later load finds the library)."""
    given = os.environ.get("XLR_KERNEL_WAIT")
    try:
        return LOAD_WAIT_S if given is None else max(float(given), 0.0)
    except ValueError:
        log.warning("XLR_KERNEL_WAIT=%s is not a number of seconds: waiting %s s", given,
                    LOAD_WAIT_S)
        return LOAD_WAIT_S


def status() -> str | None:
    """One line saying that the default target's kernels are off and why, or None when
    they are on (or this is not the CPU backend)."""
    if jax.default_backend() != "cpu" or (why := build_error()) is None:
        return None
    return f"CPU kernels off: {why}; using XLA's ops"


def library_build(target: str | None = None) -> cpu_build.Build | str:
    """The build of the kernels for `target` with this host's compiler, or why there is
    none."""
    target = target or default_target()
    given = os.environ.get("CXX")
    compiler = shutil.which(given) if given else shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return (f"CXX={given} is not a program (set CXX to a C++ compiler)" if given else
                "no C++ compiler found (install g++ or set CXX)")
    compiler = os.path.realpath(compiler)
    versions = (importlib.metadata.version("jaxlib"), platform.machine())
    if target == "native":
        from xlr_jax.planning.hardware import cpu_features  # what -march=native may use

        versions += (cpu_features(),)
    try:
        key = cpu_build.key_for(compiler, target, versions)
    except OSError as e:
        return f"cannot read the compiler {compiler} ({e.strerror or e})"
    return cpu_build.Build(compiler, target, (jax.ffi.include_dir(),), str(kernel_dir()), key)


def _load(target: str, wait_s: float, retry: bool) -> tuple[str, bool] | None:
    """Register the library for `target`, building or waiting for it as `build_error`
    says; else (why not, whether that is final for this process)."""
    if jax.default_backend() != "cpu":
        return f"the CPU kernels serve the CPU backend (this is {jax.default_backend()})", True
    build = library_build(target)
    if isinstance(build, str):
        return build, True
    if build.library.exists() and not retry:
        if cpu_build.intact(build):
            why = _register(build)
            if why is None:
                return None
        else:
            why = f"{build.library} is damaged (not the checksum its build wrote)"
        log.warning("%s: removing it and building it again", why)
        try:
            build.library.unlink()
        except OSError as e:
            return f"{why}, and it cannot be removed ({e.strerror or e})", True
    if wait_s > 0:
        why = cpu_build.build_library(build, wait_s=wait_s, retry=retry) or _register(build)
        if why is None:
            return None
        return why, not cpu_build.being_built(build)
    for why in (cpu_build.recorded_failure(build), cpu_build.unwritable(build)):
        if why is not None:
            return why, True
    builder = _builders.get(target)
    if builder is None and not cpu_build.being_built(build):
        _builders[target] = cpu_build.start_in_background(build)
        return f"building in the background (log: {build.log})", False
    if builder is not None and (builder.poll() is None or cpu_build.being_built(build)):
        return f"building in the background (log: {build.log})", False
    if builder is None:
        return f"being built by another process (lock: {build.lock})", False
    return (f"the background build ended without a library (exit {builder.returncode}; "
            f"log: {build.log})"), True


def vector_lanes(target: str | None = None) -> int | None:
    """The floats a vector of `target`'s registered kernels holds (16 with AVX-512, 8 with
    AVX2, 4 otherwise), or None before they are registered."""
    library = _libraries.get(target or default_target())
    return None if library is None else library.XlrVectorLanes()


def _register(build: cpu_build.Build) -> str | None:
    try:
        library = ctypes.cdll.LoadLibrary(str(build.library))
        for name, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target_name(name, build.target),
                                        jax.ffi.pycapsule(getattr(library, symbol)),
                                        platform="cpu")
    except (OSError, AttributeError) as e:
        return f"loading {build.library} failed ({e})"
    _libraries[build.target] = library
    return None
