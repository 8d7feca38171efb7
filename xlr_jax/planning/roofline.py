"""The roofline model: analytic FLOPs and bytes of prefill and decode against a device's peaks.

For any ModelConfig (a loaded model's or a preset: dense or MoE, GQA or an
MLA-style compressed KV) and a workload (prompt length, batch,
context), `estimate` counts:

- FLOPs: 2 per multiply-add of every weight a token passes through (attention
  projections, the FFN or the routed + shared experts, the router, the LM
  head), plus attention scores and the weighted sum over the cached
  positions (causal in prefill: position i sees i + 1 positions, or a windowed
  layer's window at most);
- bytes: every weight read once per step (for MoE, the experts the batch's
  tokens are expected to touch), KV read over the context (a windowed layer's
  over its window) and KV written for
  the new tokens. Activations are assumed to stay on chip (not counted); the
  input embedding is gathered, not read whole.

A phase's time is max(FLOPs / peak FLOP/s, bytes / peak bandwidth): the
roofline. TTFT is the prefill's time, ITL one decode step's at the prompt's
context.

Split over `tensor_parallel` devices (model.tensor_parallel), the figures are one
device's: its share of every layer's FLOPs, weights and KV (KV heads repeated where
fewer than the devices), its share of the LM head where the devices divide the
vocabulary (else all of it); plus two all-reduces a layer of the step's activations,
each a ring's 2 (n - 1) / n of them through the device's link (`interconnect_gb_s`) and
a fixed latency, and with the head split, one all-gather of the logits (f32, (n - 1) / n
of them), added to the phase's time (not overlapped: a bound).
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from xlr_jax.model.config import ModelConfig, RopeScaling
from xlr_jax.model.tensor_parallel import device_config, splits_head
from xlr_jax.planning.hardware import HardwareProfile

# an all-reduce's fixed cost within one host (NCCL's small-message latency over NVLink is
# of this order); it is what a decode step's many small all-reduces pay most
ALLREDUCE_LATENCY_S = 10e-6
ACTIVATION_BYTES = 2  # bf16 activations in an all-reduce


def weight_bytes_read(c: ModelConfig, tokens: int, weight_bytes: float) -> float:
    """Weights a step over `tokens` tokens reads: all but unread experts and the input
    embedding (an untied table is only gathered)."""
    unread = 0.0
    if c.moe_layers:
        k, e = c.experts_per_token, c.num_experts
        touched = e * (1 - (1 - k / e) ** tokens)  # expected distinct experts per layer
        unread = c.moe_layers * (e - touched) * c.expert_params()
    gathered = 0 if c.tie_embeddings else c.embed_params()
    return (c.num_params() - unread - gathered) * weight_bytes


def attention_flops(c: ModelConfig, queries: int, positions: float) -> float:
    """Scores + weighted sum for `queries` sequences whose queries see `positions`
    positions in all, summed over the layers (`prefill_positions`, `decode_positions`)."""
    width = c.kv_latent_dim or c.head_dim  # MLA: absorbed, in the latent space
    return 4.0 * c.num_heads * width * queries * positions


def prefill_positions(c: ModelConfig, tokens: int) -> float:
    """Positions a prompt of `tokens` causal queries sees, summed over the layers: query
    i sees i + 1, or a windowed layer's window at most."""
    def causal(w: int) -> float:
        return w * (w + 1) / 2 + (tokens - w) * w
    return sum(causal(min(c.window(i) or tokens, tokens)) for i in range(c.num_layers))


def decode_positions(c: ModelConfig, context: int) -> int:
    """Positions one decode query at `context` reads, summed over the layers: a windowed
    layer reads its window only."""
    return sum(min(c.window(i) or context, context) for i in range(c.num_layers))


def _preset(vocab, d, layers, heads, kv_heads, ffn, **extra) -> ModelConfig:
    return ModelConfig(extra.pop("architecture", "llama"), vocab, d, layers, heads, kv_heads,
                       128, ffn, 1e-5, extra.pop("rope_theta", 500000.0),
                       extra.pop("max_context", 8192), False, **extra)


PRESETS: dict[str, ModelConfig] = {
    "llama-3-8b": _preset(128256, 4096, 32, 32, 8, 14336),
    "llama-3-70b": _preset(128256, 8192, 80, 64, 8, 28672),
    "qwen2.5-72b": _preset(152064, 8192, 80, 64, 8, 29568, architecture="qwen2", qkv_bias=True,
                           rope_theta=1e6, max_context=32768),
    "mixtral-8x7b": _preset(32000, 4096, 32, 32, 8, 14336, architecture="mixtral",
                            rope_theta=1e6, max_context=32768, num_experts=8,
                            experts_per_token=2, moe_intermediate_size=14336),
    # Qwen3-30B-A3B: 128 experts of width 768, 8 active, per-head Q/K norms
    "qwen3-30b-a3b": ModelConfig("qwen3_moe", 151936, 2048, 48, 32, 4, 128, 6144, 1e-6, 1e6,
                                 40960, False, qk_norm=True, num_experts=128,
                                 experts_per_token=8, moe_intermediate_size=768,
                                 norm_topk_prob=True),
    # Gemma-2-9B: windows of 4,096 on every other layer, 256-dim heads
    "gemma-2-9b": ModelConfig("gemma2", 256000, 3584, 42, 16, 8, 256, 14336, 1e-6, 10000.0,
                              8192, True, sliding_window=4096,
                              window_layers=tuple(range(0, 42, 2)),
                              hidden_act="gelu_tanh", scale_embeddings=True,
                              query_pre_attn_scalar=256.0, post_norms=True, attn_softcap=50.0,
                              final_softcap=30.0),
    # Gemma-3-27B (its text model): windows of 1,024 on five layers of every six
    "gemma-3-27b": ModelConfig("gemma3_text", 262208, 5376, 62, 32, 16, 128, 21504, 1e-6, 1e6,
                               131072, True, qk_norm=True, sliding_window=1024,
                               window_layers=tuple(i for i in range(62) if (i + 1) % 6),
                               rope_scaling=RopeScaling("linear", 8.0), rope_local_theta=10000.0,
                               hidden_act="gelu_tanh", scale_embeddings=True,
                               query_pre_attn_scalar=168.0, post_norms=True),
    # DeepSeek-V3-like: MLA latents (512 + 64 rope dims cached), 3 dense layers, 256 routed
    # experts (top 8) and one shared expert per MoE layer
    "deepseek-v3-like": _preset(129280, 7168, 61, 128, 128, 18432, architecture="deepseek_v3",
                                rope_theta=10000.0, max_context=163840, num_experts=256,
                                experts_per_token=8, moe_intermediate_size=2048,
                                shared_experts=1, dense_layers=3, q_latent_dim=1536,
                                kv_latent_dim=576),
}


def phase(flops: float, nbytes: float, hw: HardwareProfile) -> dict:
    compute_s = flops / (hw.peak_tflops * 1e12)
    memory_s = nbytes / (hw.peak_bandwidth_gb_s * 1e9)
    return {"flops": flops, "bytes": nbytes, "intensity_flops_per_byte": flops / nbytes,
            "time_s": max(compute_s, memory_s),
            "bound": "compute" if compute_s > memory_s else "memory"}


def allreduce_s(nbytes: float, n: int, hw: HardwareProfile, passes: int = 2) -> float:
    """One ring all-reduce of `nbytes` over `n` devices: 2 (n - 1) / n of it each way
    through a device's link, plus the fixed latency (`passes` 1: an all-gather of
    `nbytes` in all, half the traffic)."""
    if n == 1:
        return 0.0
    link = hw.interconnect_gb_s or hw.peak_bandwidth_gb_s
    return passes * (n - 1) / n * nbytes / (link * 1e9) + ALLREDUCE_LATENCY_S


def estimate(c: ModelConfig, hw: HardwareProfile, *, prompt: int, batch: int = 1,
             weight_bytes: float = 2, kv_bytes: float = 2, context: int | None = None,
             name: str = "model", tensor_parallel: int = 1) -> dict:
    """Prefill of `prompt` tokens x `batch` sequences, and one decode step at `context`;
    one device's figures over `tensor_parallel` devices (see the module docstring)."""
    n = tensor_parallel
    context = prompt if context is None else context
    # a device's share of the KV heads (repeated where fewer than the devices)
    kv_token = device_config(c, n).kv_bytes_per_token(kv_bytes)
    matmul = c.active_matmul_params()
    lm_head = c.embed_params()
    head_bytes = lm_head * weight_bytes
    split = splits_head(c.vocab_size, n)
    share = n if split else 1  # of the head a device holds
    tokens = batch * prompt
    # prefill: the LM head only for each sequence's last token
    pre_flops = ((2.0 * tokens * (matmul - lm_head)
                  + attention_flops(c, batch, prefill_positions(c, prompt))) / n
                 + 2.0 * batch * lm_head / share)
    pre_bytes = ((weight_bytes_read(c, tokens, weight_bytes) - head_bytes) / n
                 + head_bytes / share + tokens * kv_token)
    seen = decode_positions(c, context + 1)  # a windowed layer reads its window only
    dec_flops = (2.0 * batch * (matmul - lm_head) + attention_flops(c, batch, seen)) / n \
        + 2.0 * batch * lm_head / share
    dec_bytes = ((weight_bytes_read(c, batch, weight_bytes) - head_bytes) / n
                 + head_bytes / share + batch * seen * kv_token / c.num_layers)
    pre, dec = phase(pre_flops, pre_bytes, hw), phase(dec_flops, dec_bytes, hw)
    # two all-reduces a layer of the step's hidden states; a split head's logits gathered
    reduces = 2 * c.num_layers

    def gathered(rows):  # a split head's logits [rows, V], f32, gathered on every device
        return allreduce_s(rows * c.vocab_size * 4, n, hw, passes=1) if split else 0.0

    pre_comm = (reduces * allreduce_s(tokens * c.hidden_size * ACTIVATION_BYTES, n, hw)
                + gathered(batch))
    dec_comm = (reduces * allreduce_s(batch * c.hidden_size * ACTIVATION_BYTES, n, hw)
                + gathered(batch))
    pre["time_s"] += pre_comm
    dec["time_s"] += dec_comm
    return {
        "model": name, "hardware": hw.device_name, "prompt_tokens": prompt,
        "tensor_parallel": n, "interconnect_gb_s": hw.interconnect_gb_s,
        "allreduce_bytes_per_layer_decode": 2 * batch * c.hidden_size * ACTIVATION_BYTES,
        "prefill_comm_s": pre_comm, "decode_comm_s": dec_comm,
        "decode_comm_share": dec_comm / dec["time_s"],
        "batch": batch, "decode_context_tokens": context, "weight_bytes_per_param": weight_bytes,
        "kv_bytes_per_value": kv_bytes, "params": c.num_params(),
        "weight_bytes": c.num_params() * weight_bytes,
        "device_memory_bytes": hw.memory_total_bytes * hw.device_count,
        "active_params_per_token": matmul, "kv_bytes_per_token": kv_token,
        "peak_bandwidth_gb_s": hw.peak_bandwidth_gb_s, "peak_tflops": hw.peak_tflops,
        "ridge_flops_per_byte": hw.ridge_flops_per_byte,
        "prefill_flops": pre["flops"], "prefill_bytes": pre["bytes"],
        "prefill_intensity": pre["intensity_flops_per_byte"], "prefill_bound": pre["bound"],
        "ttft_s": pre["time_s"],
        "decode_flops_per_step": dec["flops"], "decode_bytes_per_step": dec["bytes"],
        "decode_bytes_per_token": dec["bytes"] / batch,
        "decode_intensity": dec["intensity_flops_per_byte"], "decode_bound": dec["bound"],
        "itl_s": dec["time_s"], "decode_tokens_per_s": batch / dec["time_s"],
    }


def measured_points(result: dict) -> list[dict]:
    """Decode points from an `xlr bench` JSON: achieved bytes/s and FLOP/s per engine.

    FLOPs per token are taken as 2 per weight read (attention's share is small at
    these contexts and left out), so the point's intensity is 2 / bytes per param.
    """
    points = []
    for label, engine in result.get("engines", {}).items():
        roof = engine.get("roofline")
        if not roof or "decode_tokens_per_s" not in engine:
            continue
        itemsize = jnp.dtype(engine.get("dtype", "float32")).itemsize
        flops = 2 * roof["weight_bytes_per_token"] / itemsize
        rate = engine["decode_tokens_per_s"]
        points.append({"label": f"{label} decode", "intensity": flops / roof["bytes_per_token"],
                       "tflops": rate * flops / 1e12,
                       "gb_s": rate * roof["bytes_per_token"] / 1e9})
    return points


def plot(figures: dict, hw: HardwareProfile, out: str, measured: list[dict] = ()) -> None:
    """Log-log roofline of `hw` with the estimate's prefill and decode points (and any
    measured ones) at their predicted attainable FLOP/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    attainable = draw_roof(ax, hw.peak_tflops, hw.peak_bandwidth_gb_s, hw.device_name)
    for phase, marker in (("prefill", "o"), ("decode", "s")):
        x = figures[f"{phase}_intensity"]
        ax.loglog([x], [attainable(x)], marker, markersize=9,
                  label=f"{figures['model']} {phase} (predicted)")
    for point in measured:
        ax.loglog([point["intensity"]], [point["tflops"]], "x", markersize=9,
                  label=f"{point['label']} (measured)")
    ax.set_title(f"{figures['model']}: prompt {figures['prompt_tokens']}, "
                 f"batch {figures['batch']}")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def draw_roof(ax, peak_tflops: float | None, bandwidth_gb_s: float, device: str,
              span: tuple[float, float] = (1e-2, 1e5)):
    """A log-log roofline on `ax` over `span` FLOP/byte (compute peak and bandwidth slope,
    the ridge dotted, axes labelled; with no peak known, the slope alone); returns
    attainable TFLOP/s as a function of FLOP/byte."""
    bw = bandwidth_gb_s * 1e9 / 1e12  # TFLOP/s per (FLOP/byte)

    def attainable(x: float) -> float:
        return bw * x if not peak_tflops else min(peak_tflops, bw * x)

    lo, hi = (math.log10(x) for x in span)
    n = max(round((hi - lo) * 20), 2)  # 20 points a decade
    xs = [10 ** (lo + (hi - lo) * k / n) for k in range(n + 1)]
    peak = f", {peak_tflops:g} TFLOP/s" if peak_tflops else " read"
    ax.loglog(xs, [attainable(x) for x in xs], color="black",
              label=f"{device}: {bandwidth_gb_s:.0f} GB/s{peak}")
    if peak_tflops:
        ax.axvline(peak_tflops / bw, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attainable TFLOP/s")
    return attainable
