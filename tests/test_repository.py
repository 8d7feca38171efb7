"""The repository holds source, not build outputs: no wheels, archives or large files."""
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_BYTES = 2 * 1024 * 1024
ARCHIVES = (".whl", ".zip", ".tar", ".gz", ".tgz", ".bz2", ".xz", ".zst", ".7z", ".egg")
RESULTS = "experiments/results/"  # benchmark JSON and plots are kept on purpose


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [p for p in out.decode().split("\0") if p]


def unwanted(paths: list[str], root: Path = ROOT) -> list[str]:
    """Tracked paths that are archives, or over MAX_BYTES outside experiments/results/."""
    bad = []
    for path in paths:
        if path.lower().endswith(ARCHIVES):
            bad.append(f"{path} (archive)")
        elif not path.startswith(RESULTS) and (root / path).is_file() \
                and (root / path).stat().st_size > MAX_BYTES:
            bad.append(f"{path} (over 2 MB)")
    return bad


def test_no_archives_or_large_files_are_tracked():
    bad = unwanted(_tracked())
    assert not bad, "remove these from git (git rm --cached) and ignore them: " + ", ".join(bad)


def test_the_rule_flags_what_it_should(tmp_path):
    (tmp_path / "big.bin").write_bytes(b"\0" * (MAX_BYTES + 1))
    (tmp_path / "small.py").write_text("x = 1\n")
    (tmp_path / "experiments" / "results").mkdir(parents=True)
    (tmp_path / "experiments" / "results" / "plot.png").write_bytes(b"\0" * (MAX_BYTES + 1))
    paths = ["big.bin", "small.py", "pkg-1.0-py3-none-any.whl", "data.tar.gz",
             "experiments/results/plot.png", "experiments/results/run.zip"]
    assert unwanted(paths, tmp_path) == [
        "big.bin (over 2 MB)", "pkg-1.0-py3-none-any.whl (archive)", "data.tar.gz (archive)",
        "experiments/results/run.zip (archive)"]
