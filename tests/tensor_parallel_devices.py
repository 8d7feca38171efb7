"""Tensor parallel on 8 virtual CPU devices, run by tests/test_tensor_parallel.py in a
process of its own (XLA_FLAGS=--xla_force_host_platform_device_count=8; by hand:
`XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/tensor_parallel_devices.py`).

A split model gives one device's greedy tokens and logits, for KV-head counts that split
(kv 2 over 2, 8 over 8) and that must be repeated (kv 1 over 8, 2 over 4, 4 over 8), on
dense, biased and MoE models (experts whole on the devices, or each split) and the
embedded one (9 query heads, 3 KV heads: 3 exact, 2 refused); the runtime's features run
unchanged split; prefill on devices of its own; the experiments' quick runs (the layout
choices' too) and the GPU script's smoke run."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen2MoeConfig, Qwen2MoeForCausalLM)

import xlr_jax
from xlr_jax.errors import InvalidRequestError, PlanError
from xlr_jax.model.tensor_parallel import kv_heads

# both sides run in f32 and differ in summation order only (psum over shards); a wrong
# split (a head on the wrong shard, a missing all-reduce) is off by order 1
TOL = 1e-5
VOCAB = 64
TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, head_dim=16,
            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=512,
            initializer_range=0.2, tie_word_embeddings=False, bos_token_id=None,
            eos_token_id=0)
MODELS = {  # name: (class, config)
    "llama_kv1": (LlamaForCausalLM, LlamaConfig(num_key_value_heads=1, **TINY)),
    "llama_kv2": (LlamaForCausalLM, LlamaConfig(num_key_value_heads=2, **TINY)),
    "llama_kv4": (LlamaForCausalLM, LlamaConfig(num_key_value_heads=4, **TINY)),
    "llama_kv8": (LlamaForCausalLM, LlamaConfig(num_key_value_heads=8, **TINY)),
    "qwen2_bias": (Qwen2ForCausalLM, Qwen2Config(num_key_value_heads=2, **TINY)),
    "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig(
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, **TINY)),
}
# (model, tensor parallel, experts whole on the devices, load options): splits and
# repeats of KV heads, each model once or twice; the MoE's 8 experts 4 and 1 a device, or
# each split 4 ways; besides the CPU kernels, the Pallas kernel (interpreted) and XLA's
# attention and products per device
CASES = [("llama_kv1", 8, False, {}), ("llama_kv2", 2, False, {"attn_impl": "pallas"}),
         ("llama_kv2", 4, False, {}), ("llama_kv4", 8, False, {}), ("llama_kv8", 8, False, {}),
         ("qwen2_bias", 4, False, {"attn_impl": "xla", "linear_impl": "xla"}),
         ("qwen2_moe", 2, True, {}), ("qwen2_moe", 8, True, {}), ("qwen2_moe", 4, False, {})]
PROMPT = [5, 9, 3, 17, 22, 41, 8, 30, 2, 11]
LONG = np.random.default_rng(0).integers(1, VOCAB, 150).tolist()  # two full 64-token pages


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each model of MODELS saved as a Hugging Face directory with a word-level tokenizer."""
    root = tmp_path_factory.mktemp("tp_models")
    paths = {}
    for name, (cls, config) in MODELS.items():
        torch.manual_seed(0)
        cls(config).float().eval().save_pretrained(root / name, safe_serialization=True)
        tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)},
                                               unk_token="t1"))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer.save(str(root / name / "tokenizer.json"))
        (root / name / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t0"}))
        paths[name] = root / name
    return paths


def load(path, cache_dir, tensor_parallel=None, **options):
    return xlr_jax.load_model(path, tensor_parallel=tensor_parallel, cache_dir=cache_dir,
                              max_context=256, max_batch=4, **options)


def outputs(model, prompt=PROMPT, max_tokens=12):
    """Greedy tokens and the prompt's logits."""
    tokens = model.generate(prompt, max_tokens=max_tokens, ignore_eos=True).token_ids
    return tokens, model.logits(prompt)


def experiment(name: str):
    """experiments/NAME.py, loaded as a module (its quick run goes in this process)."""
    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).resolve().parents[1] / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rel_err(out, ref) -> float:
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def test_the_process_has_eight_devices():
    assert jax.device_count() >= 8, ("run with XLA_FLAGS="
                                     "--xla_force_host_platform_device_count=8")


@pytest.mark.parametrize("name", sorted({case[0] for case in CASES}))
def test_a_split_model_gives_one_devices_tokens_and_logits(name, saved, cache_dir):
    one = load(saved[name], cache_dir)
    ref_tokens, ref_logits = outputs(one)
    one.shutdown()
    assert one.plan.tensor_parallel == 1  # a model that fits one device is not split
    for model_name, n, experts, options in CASES:
        if model_name != name:
            continue
        # experts whole by default where they divide; split by width when told
        split = load(saved[name], cache_dir, n, expert_parallel=None if experts else False,
                     **options)
        assert split.plan.expert_parallel == experts
        assert {k: getattr(split.plan, k) for k in options} == options
        tokens, logits = outputs(split)
        kv = split.engine.runner.kv.k  # (read now: the next step donates it)
        head = split.engine.runner.params.lm_head  # split by vocabulary: 64 rows divide
        assert {s.data.shape[0] for s in head.addressable_shards} == {VOCAB // n}
        split.shutdown()
        assert split.plan.mesh == {"data": 1, "model": n}
        # the pool holds the repeated KV heads, a device's share each
        config = split.config
        assert kv.shape[2] == kv_heads(config, n) == max(config.num_kv_heads, n)
        assert {s.data.shape[2] for s in kv.addressable_shards} == {kv.shape[2] // n}
        assert len(kv.sharding.device_set) == n
        assert tokens == ref_tokens, (name, n)
        assert rel_err(logits, ref_logits) < TOL, (name, n)


def test_the_embedded_model_splits_over_three_and_refuses_two(cache_dir):
    """9 query heads and 3 KV heads: over 3 devices each holds 3 and 1 (its Q4_1 blocks
    too on an AVX-512 CPU, groups of 32 splitting the output product's 576 inputs in
    three), and a third of the tied head's vocabulary as a copy; 2 refused with the
    reason, before anything is read."""
    prompts = ["The capital of France is", "List three uses of copper."]
    got = {}
    for n in (1, 3):  # the plan the experiment's quick run loads too (its steps shared)
        model = xlr_jax.load_model("smollm2", dtype="float32", tensor_parallel=n,
                                   cache_dir=cache_dir)
        got[n] = ([model.generate(p, max_tokens=16).token_ids for p in prompts],
                  model.logits(prompts[0]), model.plan.weights)
        head = model.engine.runner.params.lm_head  # tied: None, or a split copy
        assert (head is None) if n == 1 else {
            s.data.shape[0] for s in jax.tree.leaves(head)[0].addressable_shards} == {16384}
        model.shutdown()
    assert got[3][0] == got[1][0] and got[3][2] == got[1][2]
    assert rel_err(got[3][1], got[1][1]) < TOL
    with pytest.raises(PlanError, match="9 query heads do not split evenly over 2"):
        xlr_jax.load_model("smollm2", tensor_parallel=2, cache_dir=cache_dir)


def test_prefix_cache_speculation_and_preemption_run_unchanged_split(saved, cache_dir):
    """On one device and split over 2: the prefix cache's hit, exact speculation (n-gram
    and a self draft) and SMC with a seed, and requests preempted by a small pool, give
    the same tokens."""
    def run(n):
        model = load(saved["llama_kv2"], cache_dir, n)
        out = {"plain": outputs(model)[0], "long": outputs(model, LONG)[0]}
        out["cached"] = outputs(model, LONG)[0]
        out["cache_hits"] = sum(v for k, v in model.prefix_cache.stats().items()
                                if k.endswith("_cached_tokens"))
        for name, spec in (("ngram", {"method": "exact", "draft": "ngram", "gamma": 3}),
                           ("self", {"method": "exact", "draft": "self:1", "gamma": 3})):
            out[name] = model.generate(PROMPT, max_tokens=12, ignore_eos=True,
                                       speculative=spec).token_ids
        out["smc"] = model.generate(PROMPT, max_tokens=12, ignore_eos=True, temperature=1.0,
                                    seed=7, speculative={"method": "smc", "draft": "self:1",
                                                         "particles": 3}).token_ids
        model.shutdown()
        # 15 pages of 4 tokens for 4 requests of up to 11 + 40 tokens: some are preempted
        small = load(saved["llama_kv2"], cache_dir, n, page_size=4, num_pages=16)
        prompts = [[3 + i] + PROMPT for i in range(4)]
        out["preempted"] = [r.token_ids for r in small.generate(
            prompts, max_tokens=40, ignore_eos=True)]
        out["preemptions"] = small.stats()["preemptions"]
        small.shutdown()
        return out

    one, split = run(1), run(2)
    assert split["cache_hits"] >= 128 and split["cached"] == split["long"]
    assert split["preemptions"] > 0
    assert one == split
    assert split["plain"] == split["ngram"] == split["self"]  # exact: greedy's own tokens


def test_prefill_on_devices_of_its_own_gives_one_devices_tokens(saved, cache_dir):
    """Prompts of 1 to 5 chunks submitted together (streams decode while the others'
    chunks prefill apart, their pages then moved) into a pool too small for all of them
    (requests are preempted and resume by prefill, apart too): prefill on device 1 beside
    one decode device, and on devices 2-3 beside two, give the tokens of one device that
    does both; each slice holds its own pool; the warm-up compiles decode steps on one
    and chunk steps on the other; speculation is refused."""
    prompts = [PROMPT, LONG, LONG[:70], [3] + PROMPT]

    def run(decode, prefill=None, warm=False):
        # 47 pages of 4 tokens: LONG fits alone, not beside the others' 16 tokens each
        model = load(saved["llama_kv2"], cache_dir, decode, prefix_cache=False,
                     prefill_chunk=32, page_size=4, num_pages=48, prefill_devices=prefill)
        report = model.warmup(progress=False) if warm else []
        out = {"tokens": [r.token_ids for r in model.generate(prompts, max_tokens=16,
                                                              ignore_eos=True)],
               "preempted": model.stats()["preemptions"] > 0}
        # 4 x 13 pages: requests preempted after some tokens resume with them
        out["resumed"] = [r.token_ids for r in model.generate(
            [[3 + i] + PROMPT for i in range(4)], max_tokens=40, ignore_eos=True)]
        slices = [model.engine.runner.kv.k.sharding.device_set]
        if prefill:
            slices.append(model.engine.prefill_runner.kv.k.sharding.device_set)
            out["prefill_steps"] = model.stats()["prefill_steps"]
            with pytest.raises(InvalidRequestError, match="prefill_devices"):
                model.generate(PROMPT, max_tokens=4, speculative={"method": "exact"})
        model.shutdown()
        return out, slices, report

    (one, _, _), devices = run(None), jax.devices()
    apart, slices, report = run(None, 1, warm=True)
    assert slices == [{devices[0]}, {devices[1]}]
    assert {(r["decode_rows"] > 0, r["chunk"] > 0) for r in report} == {(True, False),
                                                                         (False, True)}
    assert apart.pop("prefill_steps") >= 1 + 5 + 3 + 1  # every chunk apart
    assert apart["preempted"] and apart == one
    split, slices, _ = run(2, 2)
    assert slices == [set(devices[:2]), set(devices[2:4])]
    split.pop("prefill_steps")
    assert split == one


def test_a_split_models_stable_tier_survives_a_restart(saved, tmp_path):
    """A stable tier written by a model split over 2 devices (its pages gathered from
    both) is read back by the next process's split model: the whole tier cached, the
    same tokens."""
    stable = [t % (VOCAB - 1) + 1 for t in range(200)]
    runs = []
    for _ in range(2):
        model = load(saved["llama_kv2"], tmp_path, 2)
        r = model.generate({"stable": stable, "volatile": [5, 6, 7]}, max_tokens=8,
                           ignore_eos=True)
        model.shutdown()
        runs.append((r.token_ids, r.metrics["stable_cached_tokens"]))
    assert runs[0][1] == 0 and runs[1][1] == len(stable)
    assert runs[1][0] == runs[0][0]


def test_the_tensor_parallel_experiment_quick(tmp_path, cache_dir):
    """experiments/tensor_parallel.py --quick (its small random Llama; the embedded model's
    split is the test above): each split's figures, the same tokens as one device, and
    ratios to it."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "experiments" / "tensor_parallel.py"),
                          "--quick", "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=900, env={**os.environ, "XLR_CACHE_DIR": str(cache_dir)})
    assert out.returncode == 0, out.stderr[-3000:]
    (path,) = tmp_path.glob("tensor_parallel-quick-*.json")
    r = json.loads(path.read_text())
    assert r["experiment"] == "tensor_parallel" and r["quick"] and "sha" in r["git"]
    assert r["environment"]["device_count"] >= 4
    assert "embedded" not in r
    figures = r["random_llama_8_heads"]["figures"]
    assert tuple(figures) == ("tp1", "tp2", "tp4")
    for f in figures.values():
        assert f["same_tokens_as_one_device"]
        assert f["decode_tokens_per_s"] > 0 and f["ttft_s"] > 0
        assert f["decode_vs_one_device"] > 0
    assert figures["tp1"]["decode_vs_one_device"] == 1.0


def test_the_prefill_split_experiment_quick(saved, tmp_path, cache_dir, monkeypatch):
    """experiments/prefill_split.py --quick, in this process, on a tiny model (the embedded
    model's runs are the experiment's own): the same tokens with prefill apart as with
    prefill in the decode steps, and both setups have their ITL, TTFT and throughput
    figures and ratios."""
    monkeypatch.setenv("XLR_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # (the script adds)
    r = experiment("prefill_split").main(["--quick", "--out", str(tmp_path),
                                          "--model", str(saved["llama_kv2"])])
    (path,) = tmp_path.glob("prefill_split-quick-*.json")
    assert json.loads(path.read_text())["same_tokens"] is r["same_tokens"] is True
    assert r["model"] == str(saved["llama_kv2"])
    assert tuple(r["figures"]) == ("prefill in the decode steps",
                                   "prefill on a device of its own")
    for f in r["figures"].values():
        assert 0 < f["itl_p50_s"] <= f["itl_p99_s"] <= f["itl_max_s"]
        assert f["prompt_ttft_s"] > 0 and f["stream_tokens_per_s"] > 0
    assert r["split_over_base"]["itl_p99_s"] > 0


def test_the_tensor_parallel_choices_experiment_quick(tmp_path):
    """experiments/tensor_parallel_choices.py --quick, over 2 and 4 of this process's
    devices: every LM head layout and both MLP placements give the same output (the
    vocabulary-split best token too), each timed, with the GPU roofline's head figures."""
    r = experiment("tensor_parallel_choices").main(["--quick", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("tensor_parallel_choices-quick-*.json")
    assert json.loads(path.read_text())["figures"] == r["figures"]
    assert tuple(r["figures"]) == ("tp2", "tp4")
    for f in r["figures"].values():
        assert f["agree"] and len(f["head"]) == len(f["mlp"]) == 3  # 1, 8, 256 rows
        for layouts in (*f["head"].values(), *f["mlp"].values()):
            assert all(seconds > 0 for seconds in layouts.values())
    for head in r["gpu_roofline"]["tp4"].values():
        assert head["replicated_s"] > 0 and head["vocab_split_s"] > 0


def test_the_gpu_tensor_parallel_script_smoke(tmp_path):
    """experiments/gpu_tensor_parallel.py --smoke, in this 8-device process: every split
    of 1, 2, 4 and 8 runs on its mesh (1 too) with its roofline figures."""
    experiment("gpu_tensor_parallel").main(["--smoke", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("gpu_tensor_parallel-quick-*.json")
    r = json.loads(path.read_text())
    assert tuple(r["figures"]) == ("tp1", "tp2", "tp4", "tp8")
    for name, f in r["figures"].items():
        assert f["mesh"] == {"data": 1, "model": int(name[2:])}
        assert f["decode_tokens_per_s"] > 0 and f["roofline_itl_s"] > 0
        assert f["roofline_fraction"] > 0 and f["speedup_vs_one_device"] > 0
