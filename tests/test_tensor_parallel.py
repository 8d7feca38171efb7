"""Tensor parallel: the layout, the refusals, the plan's per-device arithmetic and the
roofline, by hand; and the split models themselves on 8 virtual CPU devices, in a process
of their own (tests/tensor_parallel_devices.py): XLA:CPU with 8 virtual devices runs even
one device's programs at about half speed (measured), so the rest of the suite keeps one."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from xlr_jax.errors import InvalidRequestError, PlanError
from xlr_jax.model.config import ModelConfig
from xlr_jax.model.tensor_parallel import kv_heads, problem, shard_layer
from xlr_jax.planning.hardware import preset
from xlr_jax.planning.mapper import Workload, plan, weight_bytes
from xlr_jax.planning.roofline import PRESETS


def test_problems_name_what_does_not_divide():
    base = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, num_layers=2,
                       num_heads=8, num_kv_heads=2, head_dim=8, intermediate_size=100,
                       rms_norm_eps=1e-6, rope_theta=1e4, max_context=128,
                       tie_embeddings=True)
    assert problem(base, 1) is None and problem(base, 2) is None
    assert "query heads" in problem(base, 3)
    assert "FFN width 100" in problem(base, 8)
    assert "KV heads" in problem(dataclasses.replace(base, num_kv_heads=3, num_heads=12), 4)
    assert kv_heads(base, 2) == 2 and kv_heads(base, 8) == 8


def test_a_layer_is_laid_out_shard_major_with_kv_heads_repeated():
    """Over 4 shards with 2 KV heads: shard s's rows are its 2 query heads, then K and V
    of head s // 2; gate/up rows are shard s's quarter of gate, then of up."""
    config = ModelConfig(architecture="llama", vocab_size=64, hidden_size=4, num_layers=1,
                         num_heads=8, num_kv_heads=2, head_dim=2, intermediate_size=8,
                         rms_norm_eps=1e-6, rope_theta=1e4, max_context=128,
                         tie_embeddings=True)
    rows = np.arange(16 + 2 * 4)  # each row's number as its value: q 0-15, k 16-19, v 20-23
    wqkv = np.repeat(rows[:, None], 4, axis=1)
    gate_up = np.repeat(np.arange(16)[:, None], 4, axis=1)
    quantized = {"values": wqkv.astype(np.int8), "scales": rows[:, None].astype(np.float32)}
    out = shard_layer({"wqkv": wqkv, "w_gate_up": gate_up, "bqkv": rows,
                       "w_down": gate_up.T}, config, 4)
    per_shard = out["wqkv"][:, 0].reshape(4, -1)
    for s in range(4):
        head = s // 2
        k = 16 + 2 * head + np.arange(2)
        assert per_shard[s].tolist() == [*range(4 * s, 4 * s + 4), *k, *(k + 4)]
    assert out["bqkv"].tolist() == out["wqkv"][:, 0].tolist()
    assert out["w_gate_up"][:, 0].reshape(4, -1).tolist() == [
        [2 * s, 2 * s + 1, 8 + 2 * s, 9 + 2 * s] for s in range(4)]
    assert out["w_down"] is not None and (out["w_down"] == gate_up.T).all()  # split in place
    q = shard_layer({"wqkv": quantized}, config, 4)["wqkv"]
    assert (q["scales"][:, 0] == out["wqkv"][:, 0]).all()  # a quantized weight's rows move
    assert (q["values"][:, 0] == out["wqkv"][:, 0]).all()  # with their scales


def test_the_70b_plan_on_eight_h200s_splits_eight_ways_and_adds_up():
    """Llama-3-70B in bf16 (141 GB) does not fit one H200's usable 126.9 GB: the plan
    splits it over all 8, and a device's weights are the untied embedding whole plus an
    eighth of the LM head (its 128,256 rows divide) and of the rest; a page an eighth of
    the KV heads (8 of 8: one)."""
    config = PRESETS["llama-3-70b"]
    hw = dataclasses.replace(preset("h200"), device_count=8)
    p = plan(hw, config, Workload())
    assert p.mesh == {"data": 1, "model": 8}
    assert "do not fit one device" in p.reasons["mesh"]
    embed = config.vocab_size * config.hidden_size * 2  # bf16, embedding and LM head
    rest = config.num_params() * 2 - 2 * embed
    assert p.memory.weight_bytes == int(embed + embed / 8 + rest / 8)
    per_token = config.num_layers * 2 * (config.num_kv_heads // 8) * config.head_dim * 2
    assert p.memory.page_bytes == per_token * p.page_size
    assert p.memory.kv_budget_bytes == (p.memory.usable_bytes - p.memory.weight_bytes
                                        - p.memory.activation_bytes - p.memory.reserve_bytes)
    one = dataclasses.replace(hw, device_count=1)
    with pytest.raises(PlanError, match="more devices"):
        plan(one, config, Workload())
    assert plan(hw, PRESETS["llama-3-8b"], Workload()).tensor_parallel == 1
    with pytest.raises(PlanError, match="64 query heads do not split evenly over 3"):
        plan(hw, config, Workload(), tensor_parallel=3)
    with pytest.raises(PlanError, match="needs 16 devices"):
        plan(hw, config, Workload(), tensor_parallel=16)
    assert weight_bytes(config, "bfloat16", tensor_parallel=1) == config.num_params() * 2


def test_prefill_devices_are_planned_after_the_decode_ones_or_refused_with_a_reason():
    """Llama-3-70B over 8 H200s: 4 decode and 4 prefill devices each hold a quarter of the
    weights and the same page ids (8 KV heads: 2 a device on both); more devices than
    there are, heads that do not divide, KV heads held differently on the two slices and
    a prefill slice too small for the weights are refused, each with its reason."""
    config = PRESETS["llama-3-70b"]
    hw = dataclasses.replace(preset("h200"), device_count=8)
    p = plan(hw, config, Workload(), tensor_parallel=4, prefill_devices=4)
    assert p.mesh == {"data": 1, "model": 4, "prefill": 4} and p.prefill_devices == 4
    assert "devices 4..7" in p.reasons["prefill_devices"]
    assert "prefix cache is off" in p.reasons["prefill_devices"]
    assert plan(hw, config, Workload(), tensor_parallel=8).prefill_devices == 0
    with pytest.raises(PlanError, match="needs 9 devices"):
        plan(hw, config, Workload(), tensor_parallel=8, prefill_devices=1)
    with pytest.raises(PlanError, match="prefill_devices 3: its 64 query heads"):
        plan(hw, config, Workload(), tensor_parallel=4, prefill_devices=3)
    with pytest.raises(PlanError, match="the model's weights need"):  # 141 GB on one
        plan(hw, config, Workload(), tensor_parallel=4, prefill_devices=1)
    kv1 = dataclasses.replace(config, num_kv_heads=1)  # 1 head, repeated over 2
    with pytest.raises(PlanError, match="holds 2 KV heads where the 4 decode"):
        plan(hw, kv1, Workload(), tensor_parallel=4, prefill_devices=2)
    with pytest.raises(PlanError, match="positive integer"):
        plan(hw, config, Workload(), tensor_parallel=4, prefill_devices=-1)


def test_a_mesh_larger_than_the_devices_is_refused_with_the_flag():
    from xlr_jax.model.tensor_parallel import make_mesh

    with pytest.raises(InvalidRequestError, match="xla_force_host_platform_device_count"):
        make_mesh(jax.device_count() + 1)


def test_the_roofline_splits_a_step_and_adds_its_all_reduces():
    """A device's decode bytes over 8 H200s: an eighth of the weights, the LM head's
    included (its vocabulary divides), an eighth of the KV heads' bytes; 160 all-reduces
    of one token's hidden state (2 x 8192 bf16) and one all-gather of its logits (128,256
    f32) through 450 GB/s NVLink, each with its latency. A vocabulary 8 does not divide
    keeps the head whole on each device, and gathers nothing."""
    from xlr_jax.planning.roofline import ALLREDUCE_LATENCY_S, estimate

    c, hw = PRESETS["llama-3-70b"], dataclasses.replace(preset("h200"), device_count=8)
    one = estimate(c, hw, prompt=1024)
    split = estimate(c, hw, prompt=1024, tensor_parallel=8)
    kv = 1025 * c.num_layers * 2 * 128 * 2  # a KV head's bytes over the context
    weights_one = one["decode_bytes_per_step"] - 8 * kv
    assert split["decode_bytes_per_step"] == pytest.approx(weights_one / 8 + kv)
    assert hw.interconnect_gb_s == 450
    one_reduce = 2 * 7 / 8 * (8192 * 2) / 450e9 + ALLREDUCE_LATENCY_S
    gather = 7 / 8 * (128256 * 4) / 450e9 + ALLREDUCE_LATENCY_S
    assert split["decode_comm_s"] == pytest.approx(160 * one_reduce + gather)
    odd = dataclasses.replace(c, vocab_size=128257)  # 8 do not divide it: whole on each
    odd_one, odd_split = (estimate(odd, hw, prompt=1024, tensor_parallel=n) for n in (1, 8))
    odd_head = odd.embed_params() * 2
    assert odd_split["decode_bytes_per_step"] == pytest.approx(
        (odd_one["decode_bytes_per_step"] - 8 * kv - odd_head) / 8 + odd_head + kv)
    assert odd_split["decode_comm_s"] == pytest.approx(160 * one_reduce)
    assert split["itl_s"] == pytest.approx(split["decode_bytes_per_step"] / 4800e9
                                           + split["decode_comm_s"])
    assert one["decode_comm_s"] == 0 and split["itl_s"] < one["itl_s"] / 4




def test_split_models_on_eight_virtual_devices():
    """tests/tensor_parallel_devices.py, every test passing (none skipped), in a process
    with 8 virtual CPU devices."""
    flags = (os.environ.get("XLA_FLAGS", "")
             + " --xla_force_host_platform_device_count=8").strip()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(Path(__file__).with_name("tensor_parallel_devices.py"))],
                         env={**os.environ, "XLA_FLAGS": flags}, capture_output=True,
                         text=True, timeout=1800)
    report = out.stdout[-6000:] + out.stderr[-2000:]
    assert out.returncode == 0, report
    summary = out.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, report


def test_repeated_kv_heads_are_budgeted_on_every_device():
    """2 KV heads over 8 devices: each device holds one (a copy), so a page costs a
    device half the whole page's bytes, not an eighth; the weights count the repeated
    K/V rows (8 heads' worth) before they split."""
    from xlr_jax.planning.mapper import page_bytes, shard_page_bytes

    config = dataclasses.replace(PRESETS["llama-3-8b"], num_kv_heads=2)
    whole = page_bytes(config, 16, "bfloat16")
    assert shard_page_bytes(config, 16, "bfloat16", 8) == whole // 2
    assert shard_page_bytes(config, 16, "bfloat16", 2) == whole // 2
    assert shard_page_bytes(config, 16, "bfloat16", 1) == whole
    repeated = dataclasses.replace(config, num_kv_heads=8)
    table = config.vocab_size * config.hidden_size * 2  # the embedding whole, the head split
    assert weight_bytes(config, "bfloat16", tensor_parallel=8) == pytest.approx(
        table + (repeated.num_params() * 2 - table) / 8)
    tied = dataclasses.replace(config, tie_embeddings=True)  # the head a split copy
    layers = dataclasses.replace(repeated, tie_embeddings=True).num_params() * 2 - table
    assert weight_bytes(tied, "bfloat16", tensor_parallel=8) == pytest.approx(
        table + table / 8 + layers / 8)


def test_the_cli_plans_and_rooflines_a_split(tmp_path):
    """`xlr plan llama-3-70b --hardware h200 --devices 8 --json` prints the 8-way mesh
    and a device's budget (with --prefill-devices, that slice too, or the one-line
    refusal); `xlr roofline ... --tensor-parallel 8 --json` a device's
    figures and decode for each split (1, 2, 4, 8); a split the heads refuse is one line."""
    def xlr(*args):
        return subprocess.run([sys.executable, "-m", "xlr_jax.cli", *args],
                              capture_output=True, text=True, timeout=300)

    out = xlr("plan", "llama-3-70b", "--hardware", "h200", "--devices", "8", "--json")
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)
    assert p["mesh"] == {"data": 1, "model": 8} and "do not fit" in p["reasons"]["mesh"]
    assert p["memory"]["weight_bytes"] == plan(
        dataclasses.replace(preset("h200"), device_count=8), PRESETS["llama-3-70b"],
        Workload()).memory.weight_bytes
    out = xlr("plan", "llama-3-70b", "--hardware", "h200", "--devices", "8",
              "--tensor-parallel", "4", "--prefill-devices", "4", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["mesh"] == {"data": 1, "model": 4, "prefill": 4}
    out = xlr("plan", "llama-3-70b", "--hardware", "h200", "--devices", "8",
              "--tensor-parallel", "8", "--prefill-devices", "1")
    assert out.returncode != 0 and "needs 9 devices" in out.stderr
    out = xlr("roofline", "llama-3-70b", "--hardware", "h200", "--tensor-parallel", "8",
              "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["tensor_parallel"] == 8 and r["interconnect_gb_s"] == 450
    assert [s["tensor_parallel"] for s in r["scaling"]] == [1, 2, 4, 8]
    itl = [s["itl_s"] for s in r["scaling"]]
    assert itl == sorted(itl, reverse=True) and r["scaling"][0]["decode_comm_share"] == 0
    out = xlr("roofline", "llama-3-70b", "--tensor-parallel", "3")
    assert out.returncode == 2 and "64 query heads do not split evenly over 3" in out.stderr
