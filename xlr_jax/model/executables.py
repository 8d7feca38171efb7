"""Compiled step executables on disk, so a new process neither traces nor compiles.

JAX's persistent compilation cache skips XLA's compile, but each process still
traces and lowers every step (~0.5 s for a 30-layer model's step on the CPU) to
find its cache key. This store keys executables by what shapes the program instead,
and loads them with no tracing at all (`jax.experimental.serialize_executable`).

Layout: cache_dir/executables/<fingerprint>/<step>.bin, one file per step shape
(e.g. `step-1-32.bin`: one decode row and a 32-token prefill chunk). The
fingerprint hashes the jax and jaxlib versions, the devices and the CPU's instruction
set, this package's source code (Python and C++), XLA_FLAGS, the caller's options (model
config, dtypes, KV pool, compile options) and the params' layout: any change gives a new
directory, never a stale executable. `recent.json` lists the steps the last process
used, in the order it first used them; `preload` reads those (the same command run
again needs exactly these) on background threads, while the caller goes on loading.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import pickle
import platform
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import jax

from xlr_jax.errors import MemoryMapLimitError
from xlr_jax.loading.disk_cache import write_atomic
from xlr_jax.planning.hardware import cpu_features

log = logging.getLogger(__name__)
_FRESH = threading.Condition()  # guards the two below; notified when no compile is fresh
_fresh_compiles = 0  # compile_fresh calls running now
_cache_was_enabled = True  # the persistent cache's switch before the first of them
STORE_VERSION = 1
PRELOAD_LIMIT = 8  # a longer session's other steps load when first needed
# memory maps one more step may take: XLA:CPU maps ~2.5 regions per kernel it loads (the
# embedded model's decode step, 439 kernels: ~1,100), a 30-layer 8B model's about as many
MAP_HEADROOM = 4096


PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # xlr_jax/, not this module's folder


@functools.lru_cache(maxsize=4)
def code_digest(root: Path = PACKAGE_ROOT) -> str:
    """The package's whole source: a step's code spans model/, ops/ (the CPU kernels'
    C++ too), kv/, runtime/..., and an edit anywhere in it must not run an old executable."""
    h = hashlib.sha256()
    for path in sorted(p for pattern in ("*.py", "*.cc", "*.h") for p in root.rglob(pattern)):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def fingerprint(options, *example_args) -> str:
    """A directory name for the executables of steps with these options (JSON-able) over
    arguments like `example_args` (their tree structure, shapes, dtypes and shardings)."""
    import jaxlib

    devices = jax.devices()
    layout = [(str(x.shape), str(x.dtype), str(x.sharding))
              for x in jax.tree.leaves(example_args)]
    text = json.dumps([STORE_VERSION, jax.__version__, jaxlib.__version__,
                       devices[0].client.platform, devices[0].client.platform_version,
                       [d.device_kind for d in devices], platform.machine(), cpu_features(),
                       code_digest(), os.environ.get("XLA_FLAGS", ""), options,
                       str(jax.tree.structure(example_args)), layout])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def memory_maps() -> tuple[int, int] | None:
    """(memory maps this process holds, the kernel's limit vm.max_map_count), or None
    where there is no such limit to watch (not Linux)."""
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
        return len(Path("/proc/self/maps").read_bytes().splitlines()), limit
    except (OSError, ValueError):
        return None


def ensure_map_headroom(need: int = MAP_HEADROOM) -> None:
    """Raise MemoryMapLimitError if loading one more executable could pass the kernel's
    limit on a process's memory maps (vm.max_map_count): there XLA:CPU's loader fails
    to map its code ("LLVM compilation error: Cannot allocate memory", jaxlib 0.10.2)
    and the process segfaults. Every live executable holds its maps until it is freed."""
    maps = memory_maps()
    if maps is not None and maps[0] + need > maps[1]:
        used, limit = maps
        raise MemoryMapLimitError(
            f"this process holds {used:,} memory maps of the {limit:,} the kernel allows "
            f"(vm.max_map_count), and a compiled step needs up to {need:,} more: free "
            "models you no longer use (model.shutdown(); del model; jax.clear_caches()) "
            "or raise the limit (sysctl -w vm.max_map_count=262144)")


def compile_fresh(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """Compile without JAX's persistent cache: an executable fetched from it serializes
    without its kernels (jaxlib 0.10.2 on the CPU: "Function ... not found" when the
    reloaded copy runs), so what goes into the store is always compiled here; a load
    without a store (compile_cache=False) asked for no cache at all. The cache
    is switched off while any of these compiles (they may run in parallel threads) and
    picked up again after the last."""
    ensure_map_headroom()
    with _persistent_cache_off():
        return lowered.compile()


def compile_for_later(lowerings: Callable[[], list[jax.stages.Lowered]]) -> None:
    """Compile what `lowerings()` gives into JAX's persistent cache, for a later process
    (nothing to do without a cache), even from a thread beside `compile_fresh` calls:
    waits until none runs, and holds new ones back until done (they would switch the
    cache off halfway)."""
    if not jax.config.jax_compilation_cache_dir:
        return
    with _FRESH:
        _FRESH.wait_for(lambda: _fresh_compiles == 0)
        for lowered in lowerings():
            lowered.compile()


@contextlib.contextmanager
def _persistent_cache_off():
    """JAX's persistent cache off for the block, from any thread (the switch is global:
    the first block in turns it off, the last out back on)."""
    from jax.experimental.compilation_cache.compilation_cache import reset_cache

    global _fresh_compiles, _cache_was_enabled
    with _FRESH:
        if _fresh_compiles == 0:
            _cache_was_enabled = jax.config.jax_enable_compilation_cache
            jax.config.update("jax_enable_compilation_cache", False)
            reset_cache()  # JAX decides once whether the cache is used; make it ask again
        _fresh_compiles += 1
    try:
        yield
    finally:
        with _FRESH:
            _fresh_compiles -= 1
            if _fresh_compiles == 0:
                jax.config.update("jax_enable_compilation_cache", _cache_was_enabled)
                reset_cache()
                _FRESH.notify_all()


def _file_name(key: tuple) -> str:
    """("step", 1, 32) -> "step-1-32.bin"; a tuple part joins with x."""
    return "-".join("x".join(map(str, p)) if isinstance(p, tuple) else str(p)
                    for p in key) + ".bin"


def _as_key(item: list) -> tuple:
    return tuple(tuple(p) if isinstance(p, list) else p for p in item)


class ExecutableStore:
    """One directory of serialized executables, each under a key: a tuple of strings,
    ints and tuples of ints (see the module docstring). `devices`: those its executables
    run on, in their order (a mesh's, flattened; default: the first device): a loaded
    executable is given these, not every device the process sees."""

    def __init__(self, directory: str | Path, devices: list | None = None):
        self.directory = Path(directory)
        self.devices = list(devices) if devices is not None else jax.devices()[:1]
        self._used: dict[tuple, None] = {}  # in order of first use
        self._reading: dict[tuple, Future] = {}

    def preload(self, limit: int = PRELOAD_LIMIT) -> None:
        """Start reading the first `limit` executables the last process used, two at a
        time on background threads (deserializing releases the GIL)."""
        keys = self.recent()[:limit]
        if keys:
            pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="xlr-step-load")
            self._reading = {key: pool.submit(self._read, key) for key in keys}
            pool.shutdown(wait=False)  # the threads end with their reads

    def take_preloaded(self) -> Iterator[tuple]:
        """(key, executable) of each preloaded executable that could be read, in order,
        each as soon as it is read."""
        reading, self._reading = self._reading, {}
        for key, future in reading.items():
            if (exe := future.result()) is not None:
                yield key, exe

    def load(self, key: tuple):
        """The executable saved under `key`, or None (a damaged file is deleted)."""
        future = self._reading.pop(key, None)
        return future.result() if future is not None else self._read(key)

    def _read(self, key: tuple):
        from jax.experimental.serialize_executable import deserialize_and_load

        ensure_map_headroom()
        path = self.directory / _file_name(key)
        try:
            blob = path.read_bytes()
        except OSError:
            return None
        try:
            digest, body = blob[:64].decode(), blob[64:]
            if hashlib.sha256(body).hexdigest() != digest:
                raise ValueError("checksum mismatch")
            payload, in_tree, out_tree = pickle.loads(body)
            return deserialize_and_load(payload, in_tree, out_tree,
                                        execution_devices=self.devices)
        except Exception as e:  # damaged or from an incompatible build: compile instead
            log.warning("compiled step %s unreadable (%s); compiling it again", path, e)
            path.unlink(missing_ok=True)
            return None

    def save(self, key: tuple, compiled) -> None:
        from jax.experimental.serialize_executable import serialize

        body = pickle.dumps(serialize(compiled))
        path = self.directory / _file_name(key)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(hashlib.sha256(body).hexdigest().encode() + body)
            tmp.replace(path)
        except OSError as e:  # a read-only cache costs the next process a compile, no more
            log.warning("cannot save compiled step %s (%s)", path, e)
            tmp.unlink(missing_ok=True)

    def recent(self) -> list[tuple]:
        """The keys the last process used, in the order it first used them."""
        with contextlib.suppress(OSError, ValueError, TypeError):
            return [_as_key(item) for item in
                    json.loads((self.directory / "recent.json").read_text())]
        return []

    def note_use(self, key: tuple) -> None:
        """Record the first use of `key` in this process (for the next one's preload)."""
        if key in self._used:
            return
        self._used[key] = None
        with contextlib.suppress(OSError):
            self.directory.mkdir(parents=True, exist_ok=True)
            write_atomic(self.directory / "recent.json", json.dumps(list(self._used)))
