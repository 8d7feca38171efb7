"""The frozen model description every other module reads."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Rope frequency scaling; kind is "default", "linear" or "llama3"."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a family's name (`model.family`; others only for the roofline)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense FFN width
    rms_norm_eps: float
    rope_theta: float
    max_context: int
    tie_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False  # each head's Q and K RMS-normed before RoPE (Qwen3)
    sliding_window: int | None = None
    # which layers the window covers, by index (empty: every layer); the others see all
    window_layers: tuple[int, ...] = ()
    rope_scaling: RopeScaling = RopeScaling()
    # the windowed layers' own RoPE base, unscaled (Gemma-3); None: rope_theta as the rest
    rope_local_theta: float | None = None
    # Gemma: the MLP's activation, embeddings times sqrt(hidden), a query scale of
    # query_pre_attn_scalar ** -0.5 (not head_dim's), norms after attention and the MLP
    # too, and tanh soft-capping of attention scores and final logits (Gemma-2)
    hidden_act: str = "silu"  # "silu", or "gelu_tanh" (GeGLU)
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    post_norms: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # MoE (0 experts = dense); the first `dense_layers` layers stay dense
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    norm_topk_prob: bool = False  # the chosen experts' weights renormalized to sum to 1
    # the shared experts' width, all together (0: shared_experts x moe_intermediate_size);
    # a gated shared expert (Qwen2-MoE) scales its output by sigmoid(x @ gate)
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    # MLA-style attention through low-rank latents; the cache holds one
    # `kv_latent_dim` vector per token and layer (0 = plain GQA)
    q_latent_dim: int = 0
    kv_latent_dim: int = 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def window(self, layer: int) -> int | None:
        """The sliding window `layer` attends through (None: the whole context)."""
        if self.window_layers and layer not in self.window_layers:
            return None
        return self.sliding_window

    def rope_base(self, layer: int) -> tuple[float, RopeScaling]:
        """`layer`'s RoPE base and scaling."""
        if self.rope_local_theta is not None and self.window(layer) is not None:
            return self.rope_local_theta, RopeScaling()
        return self.rope_theta, self.rope_scaling

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.dense_layers if self.num_experts else 0

    def attention_params(self) -> int:
        d, q = self.hidden_size, self.q_size
        if self.kv_latent_dim:
            q_in = d * self.q_latent_dim + self.q_latent_dim * q if self.q_latent_dim else d * q
            return q_in + d * self.kv_latent_dim + self.kv_latent_dim * 2 * q + q * d
        return (d * (q + 2 * self.kv_size) + q * d + ((q + 2 * self.kv_size) if self.qkv_bias else 0)
                + (2 * self.head_dim if self.qk_norm else 0))

    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def shared_width(self) -> int:
        return self.shared_intermediate_size or self.shared_experts * self.moe_intermediate_size

    def ffn_params(self, active: bool = False) -> int:
        """All layers' FFN weights (routers included); `active`: those one token uses."""
        dense = (self.num_layers - self.moe_layers) * 3 * self.hidden_size * self.intermediate_size
        experts = self.experts_per_token if active else self.num_experts
        d = self.hidden_size
        moe = self.moe_layers * (experts * self.expert_params() + 3 * d * self.shared_width
                                 + d * (self.num_experts + self.shared_expert_gate))
        return dense + moe

    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def num_params(self) -> int:
        d = self.hidden_size
        norms = 4 if self.post_norms else 2
        layers = self.num_layers * (self.attention_params() + norms * d) + self.ffn_params()
        head = 0 if self.tie_embeddings else self.embed_params()
        return self.embed_params() + layers + d + head

    def active_matmul_params(self) -> int:
        """Weights one token multiplies by: all but idle experts and the input embedding
        (a lookup); the LM head counts."""
        return (self.num_layers * self.attention_params() + self.ffn_params(active=True)
                + self.embed_params())

    def kv_values_per_token(self) -> int:
        """Cached values per token, all layers."""
        return self.num_layers * (self.kv_latent_dim or 2 * self.kv_size)

    def kv_bytes_per_token(self, value_bytes: float) -> float:
        """KV bytes a cached token takes, all layers, at `value_bytes` a value: quantized
        pages (a byte a value, int8 or fp8) also hold an f32 scale per token, head and K/V
        (`kv.paged_kv`). The one count of it: the plan's pages, the roofline and the
        benchmarks use it."""
        values = self.kv_values_per_token()
        scales = values // self.head_dim * 4 if value_bytes <= 1 else 0
        return values * value_bytes + scales

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        raw = json.loads(text)
        raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
        raw["window_layers"] = tuple(raw.get("window_layers", ()))  # a list in JSON
        return cls(**raw)
