"""The `xlr` command line, run as a real subprocess on the embedded model."""
import json
import subprocess
import sys


def run_cli(*args, input=None):
    return subprocess.run([sys.executable, "-m", "xlr_jax.cli", *args], capture_output=True,
                          text=True, timeout=600, input=input)


def test_generate_json_matches_the_api(model, cache_dir):
    proc = run_cli("generate", "--json", "--max-tokens", "10", "--cache-dir", str(cache_dir),
                   "The capital of France is")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    ref = model.generate("The capital of France is", max_tokens=10)
    assert out["token_ids"] == ref.token_ids and out["text"] == ref.text
    assert out["finish_reason"] == "length"
    assert set(out["metrics"]) >= {"ttft_s", "decode_tokens_per_s", "prompt_tokens",
                                   "completion_tokens"}
    assert "params from cache" in proc.stderr  # the session fixture converted them already


def test_generate_streams_text_and_reports_timings(model, cache_dir):
    proc = run_cli("generate", "--chat", "--max-tokens", "12", "--cache-dir", str(cache_dir),
                   "Say hello.")
    assert proc.returncode == 0, proc.stderr
    ref = model.chat([{"role": "user", "content": "Say hello."}], max_tokens=12)
    assert proc.stdout.rstrip("\n") == ref.text
    assert "TTFT" in proc.stderr and "ITL" in proc.stderr and "tok/s" in proc.stderr


def test_chat_keeps_history_across_turns(model, cache_dir):
    proc = run_cli("chat", "--max-tokens", "8", "--cache-dir", str(cache_dir),
                   input="Hi there!\nWhat did I just say?\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    first = model.chat([{"role": "user", "content": "Hi there!"}], max_tokens=8)
    second = model.chat([{"role": "user", "content": "Hi there!"},
                         {"role": "assistant", "content": first.text},
                         {"role": "user", "content": "What did I just say?"}], max_tokens=8)
    assert proc.stdout == f"> {first.text}\n> {second.text}\n> "


def test_info_reports_architecture_and_plan(cache_dir):
    proc = run_cli("info", "--json", "--cache-dir", str(cache_dir))
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["architecture"] == "llama" and info["layers"] == 30
    assert info["heads"] == 9 and info["kv_heads"] == 3 and info["vocab_size"] == 49152
    assert abs(info["parameters"] - 134.5e6) < 1e6
    assert info["plan"]["dtype"] == "float32" and info["plan"]["page_size"] > 0


def test_help_explains_commands():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for word in ("generate", "chat", "info", "bench"):
        assert word in proc.stdout


def test_generate_with_spec_matches_the_api(model, cache_dir):
    proc = run_cli("generate", "--json", "--max-tokens", "12", "--cache-dir", str(cache_dir),
                   "--spec", "exact,draft=ngram,gamma=4", "one two three one two three one")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    ref = model.generate("one two three one two three one", max_tokens=12)
    assert out["token_ids"] == ref.token_ids
    assert out["metrics"]["target_passes"] < len(ref.token_ids)  # it speculated
    bad = run_cli("generate", "--spec", "exact,gamma=zero", "hi")
    assert bad.returncode == 2 and "gamma=zero: not a number" in bad.stderr


def test_generate_says_when_smc_falls_back(cache_dir):
    """SMC with a poor draft (8 of 30 layers) keeps to exact speculation and says so on
    stderr; SMC with an n-gram draft is refused before the model loads."""
    proc = run_cli("generate", "--max-tokens", "16", "--temperature", "0.8", "--cache-dir",
                   str(cache_dir), "--spec", "smc,draft=self:8,gamma=4,particles=2",
                   # mid-sentence: a first token of EOS would end it before any cycle
                   "Once upon a time, in a small village by the sea, there lived")
    assert proc.returncode == 0, proc.stderr
    assert "SMC fell back to exact speculation: draft agreement" in proc.stderr
    bad = run_cli("generate", "--temperature", "0.8", "--spec", "smc,draft=ngram", "hi")
    assert bad.returncode == 2 and "n-gram lookup proposes one fixed token" in bad.stderr
