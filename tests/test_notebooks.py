"""Every notebook in notebooks/ runs top to bottom (on the embedded model, or on the plans
of preset ones); the cells assert what they show (batched equals alone, the stable tier
hits, speculative equals greedy, 70B splits over 8 H200s); none is committed with
outputs."""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_is_a_notebook():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_a_notebook_is_committed_without_outputs(path):
    """A reader runs it for themselves; outputs in the repository would go stale."""
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and not [c for c in code if c.outputs or c.execution_count is not None]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path, monkeypatch, cache_dir):
    monkeypatch.setenv("XLR_CACHE_DIR", str(cache_dir))  # the tests' cache, not ~/.cache
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any(o.output_type == "stream" and o.get("text") for o in outputs)
