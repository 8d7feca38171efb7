"""Entries under the cache directory: atomic writes, memoized file digests, and flat
array files that load as read-only memory maps.

A warm load must cost next to nothing, so what it reads is checked cheaply:
- a source file's sha256 is computed once per file stamp (size, mtime, ctime, inode),
  which any write, copy or replacement of the file changes;
- a large file's checksum is verified once per stamp of that file (`check_once`), and
  then trusted until the file changes (a garbled or truncated file has a new stamp, so
  it is verified again and rejected).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 names with numpy)
import numpy as np

ALIGN = 64  # byte alignment of every array in a flat file: the CPU maps them without a copy
ARRAYS, LAYOUT = "arrays.bin", "arrays.json"


def stamp(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _checked_marker(path: Path) -> Path:
    return path.with_name(path.name + ".checked")


def mark_checked(path: Path) -> None:
    """Record that `path`, as it is now, passed its check (e.g. its writer just made it)."""
    with contextlib.suppress(OSError):  # a read-only cache only costs the next check
        write_atomic(_checked_marker(path), json.dumps(stamp(path)))


def check_once(path: Path, check) -> None:
    """Run `check()`, which raises on a bad file, unless this very file (same stamp) passed
    it before; then remember that it did."""
    with contextlib.suppress(OSError, ValueError):
        if json.loads(_checked_marker(path).read_text()) == stamp(path):
            return
    check()
    mark_checked(path)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_entry(entry: Path):
    """Yield a fresh temporary directory that becomes `entry` once the block succeeds.
    Where another process published `entry` first (two loads of one model at once), its
    entry is kept and this one dropped: the key names the content, so they are the same;
    removing it first would race the other's rename (ENOTEMPTY). A damaged entry is the
    caller's to remove before writing again."""
    tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        try:
            os.replace(tmp, entry)
        except OSError:
            if not entry.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def file_digest(paths: list[Path], cache_dir: str | os.PathLike | None = None) -> str:
    """sha256 of the files' contents (32 hex digits); with `cache_dir`, remembered per
    file stamp under cache_dir/digests/ so an unchanged file is not read again."""
    paths = sorted(Path(p).resolve() for p in paths)
    memo = None
    if cache_dir is not None:
        key = json.dumps([[str(p), *stamp(p)] for p in paths])
        memo = Path(cache_dir, "digests", hashlib.sha256(key.encode()).hexdigest()[:32])
        with contextlib.suppress(OSError, UnicodeDecodeError):
            known = memo.read_text().strip()
            if len(known) == 32:
                return known
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    digest = h.hexdigest()[:32]
    if memo is not None:
        with contextlib.suppress(OSError):  # a read-only cache only costs the hashing
            memo.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(memo, digest)
    return digest


def _flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{name}/"))
        else:
            out[f"{prefix}{name}"] = np.ascontiguousarray(value)
    return out


def save_arrays(directory: Path, tree: dict) -> None:
    """Write a nested dict of arrays as one flat file plus its layout and sha256."""
    leaves, layout, offset = _flatten(tree), [], 0
    h = hashlib.sha256()
    with open(directory / ARRAYS, "wb") as f:
        for name, a in leaves.items():
            pad = -offset % ALIGN
            f.write(b"\0" * pad)
            offset += pad
            data = a.view(np.uint8).reshape(-1)
            f.write(data)
            item = {"name": name, "dtype": a.dtype.name, "shape": list(a.shape),
                    "offset": offset}
            _hash_leaf(h, item, data)
            layout.append(item)
            offset += a.nbytes
    (directory / LAYOUT).write_text(json.dumps({"arrays": layout, "sha256": h.hexdigest()}))
    mark_checked(directory / ARRAYS)


def load_arrays(directory: Path) -> dict:
    """The nested dict `save_arrays` wrote, as read-only views of one memory map.

    Raises ValueError (or OSError) when the files are incomplete or do not match their
    checksum. The map stays valid if the entry is later replaced or deleted (the file
    lives on until unmapped); it must never be truncated in place."""
    layout = json.loads((directory / LAYOUT).read_text())
    data = np.memmap(directory / ARRAYS, mode="r")
    leaves = {}
    for item in layout["arrays"]:
        dtype = np.dtype(item["dtype"])
        size = int(np.prod(item["shape"], dtype=np.int64)) * dtype.itemsize
        raw = data[item["offset"]:item["offset"] + size]
        if raw.size != size:
            raise ValueError(f"{directory / ARRAYS} is shorter than its layout says")
        leaves[item["name"]] = raw.view(dtype).reshape(item["shape"])
    check_once(directory / ARRAYS, lambda: _verify(directory / ARRAYS, layout, leaves.values()))
    tree: dict = {}
    for name, a in leaves.items():
        *parents, leaf = name.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = a
    return tree


def _hash_leaf(h, item: dict, data: np.ndarray) -> None:
    h.update(f"{item['name']}:{item['dtype']}:{item['shape']}:{item['offset']}".encode())
    h.update(data)


def _verify(path: Path, layout: dict, arrays) -> None:
    h = hashlib.sha256()
    for item, a in zip(layout["arrays"], arrays):
        _hash_leaf(h, item, a.view(np.uint8).reshape(-1))
    if h.hexdigest() != layout["sha256"]:
        raise ValueError(f"{path} does not match its checksum")
