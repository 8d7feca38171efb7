"""The roofline model: analytic FLOPs and bytes of prefill and decode against a device's peaks.

For any architecture (`Arch`, from a ModelConfig or a preset: dense or MoE,
GQA or an MLA-style compressed KV) and a workload (prompt length, batch,
context), `estimate` counts:

- FLOPs: 2 per multiply-add of every weight a token passes through (attention
  projections, the FFN or the routed + shared experts, the router, the LM
  head), plus attention scores and the weighted sum over the cached
  positions (causal in prefill: position i sees i + 1 positions);
- bytes: every weight read once per step (for MoE, the experts the batch's
  tokens are expected to touch), KV read over the context and KV written for
  the new tokens. Activations are assumed to stay on chip (not counted); the
  input embedding is gathered, not read whole.

A phase's time is max(FLOPs / peak FLOP/s, bytes / peak bandwidth): the
roofline. TTFT is the prefill's time, ITL one decode step's at the prompt's
context.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax.numpy as jnp

from xlr_jax.config import ModelConfig
from xlr_jax.hardware import HardwareProfile


@dataclass(frozen=True)
class Arch:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int          # dense FFN width (dense layers)
    tie_embeddings: bool = False
    qkv_bias: bool = False
    # MoE: 0 experts = dense. The first `dense_layers` layers stay dense.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    # MLA-style attention: queries and KV through low-rank latents; the cache
    # holds one `kv_latent_dim` vector per token and layer (0 = plain GQA)
    q_latent_dim: int = 0
    kv_latent_dim: int = 0

    @classmethod
    def from_config(cls, config: ModelConfig, name: str = "model") -> "Arch":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(name=name, **{k: v for k, v in dataclasses.asdict(config).items()
                                 if k in fields and k != "name"})

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.dense_layers if self.num_experts else 0

    # ---- parameters
    def attention_params(self) -> int:
        d, q = self.hidden_size, self.num_heads * self.head_dim
        if self.kv_latent_dim:
            qin = d * self.q_latent_dim + self.q_latent_dim * q if self.q_latent_dim else d * q
            return qin + d * self.kv_latent_dim + self.kv_latent_dim * 2 * q + q * d
        kv = self.num_kv_heads * self.head_dim
        return d * (q + 2 * kv) + q * d + ((q + 2 * kv) if self.qkv_bias else 0)

    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    def dense_ffn_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def num_params(self) -> int:
        d = self.hidden_size
        dense = self.num_layers - self.moe_layers
        moe = self.moe_layers * ((self.num_experts + self.shared_experts) * self.expert_params()
                                 + d * self.num_experts)
        layers = (self.num_layers * (self.attention_params() + 2 * d)
                  + dense * self.dense_ffn_params() + moe)
        head = 0 if self.tie_embeddings else self.embed_params()
        return self.embed_params() + layers + d + head

    def active_matmul_params(self) -> int:
        """Weights one token multiplies by (the input embedding is a lookup)."""
        d = self.hidden_size
        dense = self.num_layers - self.moe_layers
        moe = self.moe_layers * ((self.experts_per_token + self.shared_experts)
                                 * self.expert_params() + d * self.num_experts)
        return (self.num_layers * self.attention_params() + dense * self.dense_ffn_params()
                + moe + self.embed_params())  # + the LM head

    def weight_bytes_read(self, tokens: int, weight_bytes: float) -> float:
        """Weights a step over `tokens` tokens reads: all but the unread experts and the embedding."""
        if self.moe_layers:
            k, e = self.experts_per_token, self.num_experts
            touched = e * (1 - (1 - k / e) ** tokens)  # expected distinct experts per layer
            unread = self.moe_layers * (e - touched) * self.expert_params()
        else:
            unread = 0
        gathered = 0 if self.tie_embeddings else self.embed_params()  # input table: lookups only
        return (self.num_params() - unread - gathered) * weight_bytes

    # ---- the KV cache
    def kv_values_per_token(self) -> int:
        """Cached values per token, all layers."""
        per_layer = self.kv_latent_dim or 2 * self.num_kv_heads * self.head_dim
        return self.num_layers * per_layer

    def attention_flops(self, queries: int, positions: int) -> float:
        """Scores + weighted sum for `queries` tokens that each see `positions` positions."""
        width = self.kv_latent_dim or self.head_dim  # MLA: absorbed, in the latent space
        return 4.0 * self.num_layers * self.num_heads * width * queries * positions


PRESETS: dict[str, Arch] = {a.name: a for a in [
    Arch("llama-3-8b", 128256, 4096, 32, 32, 8, 128, 14336),
    Arch("llama-3-70b", 128256, 8192, 80, 64, 8, 128, 28672),
    Arch("qwen2.5-72b", 152064, 8192, 80, 64, 8, 128, 29568, qkv_bias=True),
    Arch("mixtral-8x7b", 32000, 4096, 32, 32, 8, 128, 14336, num_experts=8,
         experts_per_token=2, moe_intermediate_size=14336),
    # DeepSeek-V3-like: MLA latents (512 + 64 rope dims cached), 3 dense layers, 256 routed
    # experts (top 8) and one shared expert per MoE layer
    Arch("deepseek-v3-like", 129280, 7168, 61, 128, 128, 128, 18432, num_experts=256,
         experts_per_token=8, moe_intermediate_size=2048, shared_experts=1, dense_layers=3,
         q_latent_dim=1536, kv_latent_dim=576),
]}


def phase(flops: float, nbytes: float, hw: HardwareProfile) -> dict:
    compute_s = flops / (hw.peak_tflops * 1e12)
    memory_s = nbytes / (hw.peak_bandwidth_gb_s * 1e9)
    return {"flops": flops, "bytes": nbytes, "intensity_flops_per_byte": flops / nbytes,
            "time_s": max(compute_s, memory_s),
            "bound": "compute" if compute_s > memory_s else "memory"}


def estimate(arch: Arch, hw: HardwareProfile, *, prompt: int, batch: int = 1,
             weight_bytes: float = 2, kv_bytes: float = 2, context: int | None = None) -> dict:
    """Prefill of `prompt` tokens x `batch` sequences, and one decode step at `context`."""
    context = prompt if context is None else context
    kv_token = arch.kv_values_per_token() * kv_bytes
    matmul = arch.active_matmul_params()
    lm_head = arch.embed_params()
    tokens = batch * prompt
    # prefill: the LM head only for each sequence's last token
    pre_flops = (2.0 * tokens * (matmul - lm_head) + 2.0 * batch * lm_head
                 + arch.attention_flops(batch, prompt * (prompt + 1) / 2))
    pre_bytes = arch.weight_bytes_read(tokens, weight_bytes) + tokens * kv_token
    dec_flops = 2.0 * batch * matmul + arch.attention_flops(batch, context + 1)
    dec_bytes = (arch.weight_bytes_read(batch, weight_bytes)
                 + batch * (context * kv_token + kv_token))
    pre, dec = phase(pre_flops, pre_bytes, hw), phase(dec_flops, dec_bytes, hw)
    return {
        "model": arch.name, "hardware": hw.device_name, "prompt_tokens": prompt,
        "batch": batch, "decode_context_tokens": context, "weight_bytes_per_param": weight_bytes,
        "kv_bytes_per_value": kv_bytes, "params": arch.num_params(),
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

    peak = hw.peak_tflops
    bw = hw.peak_bandwidth_gb_s * 1e9 / 1e12  # TFLOP/s per (FLOP/byte)
    xs = [10 ** (k / 20) for k in range(-40, 101)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.loglog(xs, [min(peak, bw * x) for x in xs], color="black",
              label=f"{hw.device_name}: {hw.peak_bandwidth_gb_s:.0f} GB/s, {peak:g} TFLOP/s")
    ax.axvline(hw.ridge_flops_per_byte, color="grey", linestyle=":", linewidth=1)
    for phase, marker in (("prefill", "o"), ("decode", "s")):
        x = figures[f"{phase}_intensity"]
        ax.loglog([x], [min(peak, bw * x)], marker, markersize=9,
                  label=f"{figures['model']} {phase} (predicted)")
    for point in measured:
        ax.loglog([point["intensity"]], [point["tflops"]], "x", markersize=9,
                  label=f"{point['label']} (measured)")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(f"{figures['model']}: prompt {figures['prompt_tokens']}, "
                 f"batch {figures['batch']}")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
