"""Stable-tier KV on disk: written beside the decode loop, loaded by the next process.

A snapshot holds the KV pages of one stable tier (its full pages and its last,
partial one) as a safetensors file named by the hash of the cache namespace
(model file hash, dtypes, page size) and the tier's token ids. Its metadata
repeats the namespace, the token ids and a sha256 of the page bytes, checked once
per file (`disk_cache.check_once`: a rewritten or damaged file is checked again); a
file whose key, shape or checksum does not match is ignored with a warning (the
tier is then prefilled as if there were no file) and replaced.

Writes run on one background thread: the caller hands over device arrays
already gathered from the pool (dispatch is asynchronous), the thread reads
them back and writes a temporary file, then renames it into place.

The directory has a disk quota (`max_bytes`, shared by every model writing there):
after each write the least recently used snapshots (by modification time, which a
load refreshes) are deleted until the rest fits; the one just written stays.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from xlr_jax.loading.disk_cache import check_once, mark_checked

log = logging.getLogger(__name__)


def tier_digest(namespace: str, tokens) -> str:
    ids = np.asarray(tokens, np.int64).tobytes()
    return hashlib.sha256(namespace.encode() + b"|" + ids).hexdigest()


def _payload_digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        h.update(name.encode())
        h.update(np.ascontiguousarray(arrays[name]).view(np.uint8).tobytes())
    return h.hexdigest()


def _check_payload(raw: dict[str, np.ndarray], digest: str | None) -> None:
    if digest != _payload_digest(raw):
        raise ValueError("checksum mismatch")


DEFAULT_QUOTA = 4 * 2 ** 30  # bytes of snapshots kept on disk


class TierStore:
    def __init__(self, root: str | os.PathLike, namespace: str,
                 max_bytes: int = DEFAULT_QUOTA):
        self.root = Path(root)
        self.namespace = namespace
        self.max_bytes = max_bytes
        self.evicted = 0
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xlr-tier-store")
        self._pending: list[Future] = []
        self.written = self.loaded = self.rejected = 0

    def path(self, tokens) -> Path:
        return self.root / f"{tier_digest(self.namespace, tokens)}.safetensors"

    def save_async(self, tokens, pages: dict, then: Callable[[], None] | None = None) -> Future:
        """Queue a snapshot of `pages` ({leaf: device array [layers, n, ...]}) for
        `tokens`; `then` runs after it on the same background thread (a failure there is
        logged: it must not cost the snapshot)."""
        future = self._writer.submit(self._save, tuple(int(t) for t in tokens), pages, then)
        self._pending.append(future)
        return future

    def _save(self, tokens: tuple, pages: dict, then: Callable[[], None] | None) -> None:
        self._write(tokens, pages)
        if then is not None:
            try:
                then()
            except Exception as e:  # noqa: BLE001 - an optimization for the next process
                log.warning("after saving a stable tier: %s", e)

    def _write(self, tokens: tuple, pages: dict) -> None:
        from safetensors.numpy import save_file

        arrays = {name: np.asarray(x) for name, x in pages.items()}
        raw = {name: a.view(np.uint8) for name, a in arrays.items()}  # any dtype, bytes as-is
        meta = {"namespace": self.namespace, "tokens": json.dumps(list(tokens)),
                "sha256": _payload_digest(raw),
                "layout": json.dumps({n: [str(a.dtype), list(a.shape)] for n, a in arrays.items()})}
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path(tokens)
        tmp = final.with_suffix(f".tmp{os.getpid()}")
        try:
            save_file(raw, str(tmp), metadata=meta)
            os.replace(tmp, final)  # atomic: a reader sees the old file or the whole new one
            mark_checked(final)
            self.written += 1
            self._enforce_quota(keep=final)
        except OSError as e:  # a full or read-only disk costs the warm start, nothing else
            log.warning("could not persist a stable tier to %s: %s", final, e)
            tmp.unlink(missing_ok=True)

    def load(self, tokens, expect: dict[str, tuple]) -> dict[str, np.ndarray] | None:
        """The snapshot for `tokens` if present and intact ({leaf: array}), else None.

        `expect` maps each leaf to its (dtype, shape); anything else is rejected.
        """
        from safetensors import safe_open

        path = self.path(tokens)
        if not path.exists():
            return None
        try:
            with safe_open(str(path), framework="numpy") as f:
                meta = f.metadata() or {}
                raw = {name: f.get_tensor(name) for name in f.keys()}
            if meta.get("namespace") != self.namespace or \
                    json.loads(meta.get("tokens", "null")) != [int(t) for t in tokens]:
                raise ValueError("it belongs to another model or tier")
            check_once(path, lambda: _check_payload(raw, meta.get("sha256")))
            layout = json.loads(meta["layout"])
            arrays = {}
            for name, (dtype, shape) in expect.items():
                if layout.get(name) != [str(np.dtype(dtype)), list(shape)]:
                    raise ValueError(f"{name} is {layout.get(name)}, expected {dtype} {shape}")
                arrays[name] = raw[name].view(np.dtype(dtype)).reshape(shape)
        except Exception as e:  # truncated, garbled or foreign: recompute, never trust it
            log.warning("ignoring stable-tier snapshot %s (%s); prefilling instead", path, e)
            self.rejected += 1
            return None
        self.loaded += 1
        try:
            os.utime(path)  # recently used: the quota evicts it last
        except OSError:
            pass
        return arrays

    def _enforce_quota(self, keep: Path) -> None:
        """Delete the least recently used snapshots, never `keep`, until the directory's
        snapshots fit in max_bytes."""
        files = []
        for path in self.root.glob("*.safetensors"):
            try:
                stat = path.stat()
            except FileNotFoundError:  # another process evicted it meanwhile
                continue
            files.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files, key=lambda f: f[0]):
            if total <= self.max_bytes:
                break
            if path != keep:
                path.unlink(missing_ok=True)
                total -= size
                self.evicted += 1

    def flush(self) -> None:
        """Wait for queued writes (tests, shutdown)."""
        for future in self._pending:
            future.result()
        self._pending.clear()
