"""The GPU suite in one call: every GPU check and figure of the runtime from the source tree,
one JSON with what passed, in under 8 minutes on one H200 (issue 41 §3).

A lent GPU machine has its own image (Python 3.12, jax 0.11 with the CUDA plugin, Triton,
torch and transformers; no fastapi, llguidance or gguf; no network), so nothing here
downloads a model: the parts run on random weights of real shapes.

Parts, in this order, each in processes of its own (a part that fails, hangs past its
time or crashes its process is reported with its error, and the rest go on):
  kernels          experiments/gpu_kernels.py: the Pallas paged-attention kernel against the
                   XLA reference (decode, verify, ragged prefill, int8 and fp8 pages) and
                   its timings against JAX's kernel and the copy bandwidth
  decode_8b        a Llama-3-8B-shaped model (random bf16 weights) decoding one stream:
                   tokens/s against the read roofline at the bandwidth measured beside it
  engine_batches   the online engine on a ~1B-shaped random Llama (a Hugging Face folder
                   written here, with a word-level tokenizer and a chat template): 1, 8 and
                   32 streams decoded at once
  speculation      the same model greedy with and without exact speculation (n-gram and
                   self-drafts: the same tokens), and SMC-SD sampled over 4 particles with
                   its first half of layers as the draft
  prefix_cache     an agent conversation with the prefix cache off, on and after a restart
  quantized        the same model's decode with its weights float, int8, int4 and fp8
Checks (what "passed" means) are correctness, not speed: speed figures are reported with
their targets where the issue gives one.

Run (GPU):  PYTHONPATH=. python3 experiments/gpu_suite.py --out experiments/results/
Smoke (CPU, tiny shapes; the tests run it):  python experiments/gpu_suite.py --smoke --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("kernels", "decode_8b", "engine_batches", "speculation", "prefix_cache", "quantized")
LLAMA3_8B = dict(architecture="llama", vocab_size=128256, hidden_size=4096, num_heads=32,
                 num_kv_heads=8, head_dim=128, intermediate_size=14336, rms_norm_eps=1e-5,
                 rope_theta=500000.0, max_context=2048, tie_embeddings=False, num_layers=32)
TINY_8B = dict(LLAMA3_8B, vocab_size=1024, hidden_size=256, num_heads=8, num_kv_heads=2,
               head_dim=32, intermediate_size=512, max_context=512, num_layers=2)
FULL = dict(
    budget_s=470, dtype="bfloat16", bandwidth_gib=2.0,
    timeouts=dict(kernels=200, decode_8b=120, engine_batches=90, speculation=120,
                  prefix_cache=120, quantized=120),
    model=dict(vocab_size=32768, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
               num_key_value_heads=4, head_dim=128, intermediate_size=8192),
    decode_8b=dict(shape=LLAMA3_8B, prompt_tokens=128, decode_tokens=64, runs=3),
    batches=dict(streams=[1, 8, 32], prompt_tokens=256, decode_tokens=64, runs=2),
    speculation=dict(prompt_tokens=256, max_tokens=64, runs=2, drafts=["ngram", "self:8"]),
    agent=dict(turns=6, max_tokens=24, rules=12, tools=8),
    quantized=dict(formats=["float", "int8", "int4", "fp8"], prompt_tokens=256,
                   decode_tokens=64, runs=3),
    engine=dict(max_context=4096, max_batch=32))
SMOKE = dict(
    budget_s=900, dtype="float32", bandwidth_gib=0.05,
    timeouts=dict(kernels=300, decode_8b=120, engine_batches=120, speculation=180,
                  prefix_cache=180, quantized=120),
    model=dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, intermediate_size=128),
    decode_8b=dict(shape=TINY_8B, prompt_tokens=32, decode_tokens=8, runs=1),
    batches=dict(streams=[1, 2], prompt_tokens=16, decode_tokens=4, runs=1),
    speculation=dict(prompt_tokens=24, max_tokens=8, runs=1, drafts=["ngram", "self:1"]),
    # a stable tier long enough that its prefill outweighs a step's noise (~10 ms to ~2)
    agent=dict(turns=2, max_tokens=4, rules=8, tools=4),
    quantized=dict(formats=["float", "int8"], prompt_tokens=16, decode_tokens=4, runs=1),
    engine=dict(max_context=1024, max_batch=4, prefill_chunk=128))
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")


def agent_words(s: dict, nonces: list[str]) -> set[str]:
    """Every word of the prefix_cache part's conversations (each cell's system prompt and
    its warm-up's, the turns): in the tokenizer's vocabulary, so that two cells' prompts
    are two different token sequences, as with a real tokenizer."""
    from xlr_jax.bench.serving import TURNS, agent_system_prompt

    size = {"rules": s["agent"]["rules"], "tools": s["agent"]["tools"]}
    texts = [agent_system_prompt(f"{kind}{n}", **size) for n in nonces
             for kind in ("agent", "warmup")]
    return set(" ".join(texts + TURNS).split())


def random_hf_model(root: Path, shape: dict, dtype: str, corpus: set[str]) -> Path:
    """A random Llama saved as a Hugging Face folder, its word-level tokenizer's vocabulary
    the corpus's words (then fillers), with a chat template; returns the folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    words = ["<|end|>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
    words += sorted(corpus - set(words))
    vocab_size = max(shape["vocab_size"], len(words))
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    torch.manual_seed(0)
    config = LlamaConfig(**{**shape, "vocab_size": vocab_size}, max_position_embeddings=8192,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=0)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(root, safe_serialization=True)
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|end|>", "chat_template": CHAT_TEMPLATE}))
    return root


# ---------------------------------------------------------------- the parts


def _cells(cells: dict[str, dict], timeout_s: float) -> dict[str, dict]:
    """Each named cell in a fresh process (`xlr_jax.bench.cells`), one after another;
    a failed cell raises with its error (the part fails)."""
    from xlr_jax.bench.cells import run_cell_process

    out = {}
    deadline = time.monotonic() + timeout_s
    for name, cell in cells.items():
        left = deadline - time.monotonic()
        if left <= 5:
            raise TimeoutError(f"out of time before the {name} cell")
        out[name] = run_cell_process(cell, left)
        if "error" in out[name]:
            raise RuntimeError(f"the {name} cell failed: {out[name]['error']}\n"
                               f"{out[name].get('stderr_tail', '')[-1500:]}")
    return out


def kernels(s: dict, work: Path, model: Path | None, timeout_s: float) -> dict:
    out = work / "kernels"
    cmd = [sys.executable, str(ROOT / "experiments" / "gpu_kernels.py"), "--out", str(out)]
    done = subprocess.run(cmd + (["--smoke"] if s is SMOKE else []), capture_output=True,
                          text=True, timeout=timeout_s, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"gpu_kernels.py exited {done.returncode}:\n{done.stderr[-2000:]}")
    (path,) = out.glob("gpu_kernels*.json")
    result = json.loads(path.read_text())
    checks = {f"kernel_matches_reference_{c['case']}": c["pass"] for c in result["correctness"]}
    return {"checks": checks, "targets": result["targets"],
            "figures": {"copy_bandwidth_gb_per_s":
                        result["copy_bandwidth"]["copy_bandwidth_gb_per_s"],
                        "timings": result["timings"]}}


def decode_8b(s: dict, work: Path, model: Path | None, timeout_s: float) -> dict:
    c = s["decode_8b"]
    cell = {"measure": "decode", "engine": {"kind": "xlr-random", "shape": c["shape"],
                                            "dtype": s["dtype"], "label": "llama3-8b-shape"},
            "run": {"prompt_tokens": c["prompt_tokens"], "decode_tokens": c["decode_tokens"],
                    "runs": c["runs"], "bandwidth_gib": s["bandwidth_gib"],
                    "bandwidth_runs": 5},
            "prompt": {"kind": "random", "seed": 0}}
    got = _cells({"decode": cell}, timeout_s)["decode"]
    f = got["figures"]
    return {"checks": {"same_tokens_every_run": got["detail"]["tokens_identical_across_runs"],
                       "decoded_every_token": len(got["detail"]["token_ids"])
                       == c["decode_tokens"]},
            "targets": {"roofline_fraction": {"value": f["roofline_fraction"], "min": 0.7,
                                              "pass": f["roofline_fraction"] >= 0.7}},
            "figures": f}


def engine_batches(s: dict, work: Path, model: Path | None, timeout_s: float) -> dict:
    c = s["batches"]
    cell = {"measure": "streams",
            "engine": {"kind": "xlr", "model": str(model), "dtype": s["dtype"], **s["engine"]},
            "run": {"streams": c["streams"], "prompt_tokens": c["prompt_tokens"],
                    "decode_tokens": c["decode_tokens"], "runs": c["runs"]},
            "prompt": {"kind": "random", "seed": 0}}
    got = _cells({"streams": cell}, timeout_s)["streams"]
    streams = got["detail"]["streams"]
    same = {n: streams[n]["tokens_identical_across_runs"] for n in streams}
    return {"checks": {f"same_tokens_every_round_{n}_streams": ok for n, ok in same.items()},
            "figures": got["figures"]}


def speculation(s: dict, work: Path, model: Path | None, timeout_s: float) -> dict:
    c = s["speculation"]
    engine = {"model": str(model), "dtype": s["dtype"], **s["engine"]}
    greedy = {"max_tokens": c["max_tokens"], "runs": c["runs"], "temperature": 0.0,
              "prompt_tokens": c["prompt_tokens"]}
    prompt = {"kind": "random", "seed": 1}
    cells = {"off": {"measure": "speculative", "engine": {**engine, "method": "off"},
                     "run": greedy, "prompt": prompt}}
    for draft in c["drafts"]:
        cells[f"exact {draft}"] = {"measure": "speculative", "run": greedy, "prompt": prompt,
                                   "engine": {**engine, "method": "exact", "draft": draft,
                                              "gamma": 4}}
    draft = f"self:{max(s['model']['num_hidden_layers'] // 2, 1)}"  # the first half
    cells["smc"] = {"measure": "speculative", "prompt": prompt,
                    "run": {**greedy, "temperature": 0.7},
                    "engine": {**engine, "method": "smc", "draft": draft, "gamma": 2,
                               "particles": 4, "min_agreement": 0}}
    got = _cells(cells, timeout_s)
    off = got["off"]["detail"]["token_ids"][0]
    checks = {f"greedy_{name}_equals_plain_greedy": g["detail"]["token_ids"][0] == off
              for name, g in got.items() if name.startswith("exact")}
    smc = got["smc"]["figures"]
    checks["smc_ran_every_cycle_with_4_particles"] = (
        smc["smc_fallbacks"] == 0 and set(smc["particles"]) == {4})
    return {"checks": checks, "figures": {name: g["figures"] for name, g in got.items()}}


RUN_ID = f"gpu{time.time_ns()}"


def nonces() -> dict[str, str]:
    """Each prefix-cache mode's nonce (the words go in the tiny model's vocabulary);
    imported here, not at the top, so that a broken import fails a part, not the suite."""
    from xlr_jax.bench.cells import AGENT_MODES

    return {mode: f"{RUN_ID}{mode}" for mode in AGENT_MODES}


def prefix_cache(s: dict, work: Path, model: Path | None, timeout_s: float) -> dict:
    engine = {"model": str(model), "dtype": s["dtype"], **s["engine"], "max_batch": 1}
    cells = {mode: {"measure": "agent", "engine": {**engine, "prefix_cache": mode},
                    "run": s["agent"], "nonce": nonce}
             for mode, nonce in nonces().items()}
    got = _cells(cells, timeout_s)
    hits = {mode: g["figures"]["stable_hit_fraction"] for mode, g in got.items()}
    later = [1.0] * (s["agent"]["turns"] - 1)
    return {"checks": {"off_never_hits": hits["off"] == [0.0] * (len(later) + 1),
                       "on_hits_the_stable_tier_from_turn_2": hits["on"] == [0.0] + later,
                       "a_restart_hits_it_at_turn_1": hits["warm"] == [1.0] + later},
            "figures": {mode: g["figures"] for mode, g in got.items()}}


def quantized(s: dict, work: Path, model: Path | None, timeout_s: float) -> dict:
    c = s["quantized"]
    cells = {fmt: {"measure": "decode",
                   "engine": {"kind": "xlr", "model": str(model), "dtype": s["dtype"],
                              "weights": fmt, **s["engine"], "max_batch": 1},
                   "run": {"prompt_tokens": c["prompt_tokens"], "decode_tokens": c["decode_tokens"],
                           "runs": c["runs"], "bandwidth_gib": s["bandwidth_gib"],
                           "bandwidth_runs": 5},
                   "prompt": {"kind": "random", "seed": 2}} for fmt in c["formats"]}
    got = _cells(cells, timeout_s)
    nbytes = {fmt: g["figures"]["bytes_per_token"] for fmt, g in got.items()}
    checks = {f"{fmt}_reads_fewer_bytes_than_float": nbytes[fmt] < nbytes["float"]
              for fmt in nbytes if fmt != "float"}
    checks.update({f"{fmt}_loaded_as_{fmt}": g["detail"]["engine"]["weights"] == fmt
                   for fmt, g in got.items()})
    return {"checks": checks, "figures": {fmt: g["figures"] for fmt, g in got.items()}}


RUNNERS = {"kernels": kernels, "decode_8b": decode_8b, "engine_batches": engine_batches,
           "speculation": speculation, "prefix_cache": prefix_cache, "quantized": quantized}


def run_suite(s: dict, parts: list[str], work: Path) -> dict:
    """Each part in turn within the budget; a part's exception is its error, not the
    suite's end."""
    started = time.monotonic()
    os.environ["XLR_CACHE_DIR"] = str(work / "cache")  # the cells' cache, this run's own
    model, results = None, {}
    for name in parts:
        left = s["budget_s"] - (time.monotonic() - started)
        t0 = time.monotonic()
        if left < 20:
            results[name] = {"ok": False, "error": "skipped: the suite's time budget is spent"}
            continue
        try:
            if model is None and name not in ("kernels", "decode_8b"):
                model = random_hf_model(work / "model", s["model"], s["dtype"],
                                        agent_words(s, list(nonces().values())))
            part = RUNNERS[name](s, work, model, min(s["timeouts"][name], left))
            results[name] = {"ok": all(part["checks"].values()), **part}
        except Exception as e:  # noqa: BLE001 (a part's failure is reported; the rest go on)
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[-3000:]}
        results[name]["wall_s"] = time.monotonic() - t0
        print(f"{name:>15}: {_verdict(results[name])} in {results[name]['wall_s']:.0f} s",
              flush=True)
    return results


def _verdict(part: dict) -> str:
    if part["ok"]:
        return "passed"
    return f"FAILED ({part.get('error') or [k for k, v in part['checks'].items() if not v]})"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="experiments/results", help="folder for the JSON")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (the tests)")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                    help="run only these parts (default: all, in order)")
    args = ap.parse_args(argv)

    import dataclasses

    import jax

    from xlr_jax.bench.run import write_result
    from xlr_jax.planning.hardware import probe

    if not args.smoke and jax.default_backend() != "gpu":
        raise SystemExit("gpu_suite.py needs a GPU (use --smoke for the CPU check)")
    s = SMOKE if args.smoke else FULL
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="xlr-gpu-suite-") as tmp:
        parts = run_suite(s, args.parts, Path(tmp))
    failed = [name for name, p in parts.items() if not p["ok"]]
    path = write_result(args.out, "gpu_suite", {
        "smoke": args.smoke, "hardware": dataclasses.asdict(probe()), "parts": parts,
        "passed": not failed, "failed_parts": failed, "wall_s": time.monotonic() - t0},
        quick=args.smoke)
    print(json.dumps({"out": str(path), "passed": not failed, "failed_parts": failed,
                      "wall_s": round(time.monotonic() - t0)}))
    return json.loads(path.read_text())


if __name__ == "__main__":
    main()
