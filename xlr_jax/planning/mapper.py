"""The Capability Mapper: hardware + model + workload -> one frozen Execution Plan.

`plan()` fixes every choice the runtime makes before it compiles anything:
dtypes, page size, the KV page budget, batch and chunk sizes, the shape
buckets every step is compiled for, the attention implementation and the
speculative policy. Each choice carries a one-line reason. Any choice can be
overridden; an override that cannot fit is refused with the numbers.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field

import jax.numpy as jnp

from xlr_jax.errors import PlanError
from xlr_jax.kv.paged_kv import is_quantized
from xlr_jax.kv.pages import pages_for
from xlr_jax.model import quantized
from xlr_jax.model.config import ModelConfig
from xlr_jax.model.tensor_parallel import (device_config, expert_parallel_for, kv_heads,
                                           splits_head)
from xlr_jax.model.tensor_parallel import problem as tensor_parallel_problem
from xlr_jax.model.weight_formats import FORMATS, WEIGHTS
from xlr_jax.ops import IMPLS, cpu_attention, cpu_kernels, cpu_linear, walk_sizes
from xlr_jax.planning.buckets import ATTN_BLOCK_PAGES, REDUCE_ROWS, Buckets, buckets_for
from xlr_jax.planning.hardware import HardwareProfile

log = logging.getLogger(__name__)
GB = 1e9

DTYPE_NAMES = {"float32": "float32", "f32": "float32", "bfloat16": "bfloat16",
               "bf16": "bfloat16", "float16": "float16", "f16": "float16"}
KV_DTYPE_NAMES = {**DTYPE_NAMES, "int8": "int8", "fp8": "float8_e4m3fn",
                  "float8_e4m3fn": "float8_e4m3fn"}
WAITING_PER_SLOT = 32      # default max_waiting per max_batch slot
MAX_PREEMPTIONS = 2        # a request preempted this often is protected: it runs to the end
MAX_PINNED_SHARE = 0.5     # stable tiers pinning more of the pool unpin LRU-first
LINEAR_IMPLS = ("auto", "xla", "cpu")
PAGE_SIZE = {"gpu": 16, "cpu": 64}      # tokens per KV page (see plan's reasons)
PREFILL_CHUNK = {"gpu": 512, "cpu": 256}  # prefill tokens per step
CPU_STEP_CHUNK = 64        # XLA:CPU: prompt tokens a step carries beside decode rows
CPU_STEP_COST = 16         # XLA:CPU: a step's cost beyond its chunk's tokens, in tokens


@dataclass(frozen=True)
class Workload:
    """What the runtime will be asked to do; None leaves the choice to the mapper."""

    max_context: int | None = None
    max_batch: int | None = None
    prefill_chunk: int | None = None
    draft: str | None = None      # a draft model for speculative decoding, if any
    max_waiting: int | None = None  # requests queued beyond the running batch
    max_step_tokens: int | None = None  # decode rows + the prefill chunk beside them


@dataclass(frozen=True)
class SpeculativePolicy:
    draft: str | None
    gamma: int                     # draft tokens proposed per cycle
    particle_cap: int              # SMC particles at most
    rule: str
    # a speculating request verifies as rows of the ragged step (not a cycle of its own)
    # beside at least this many plain streams, or with a context of at most this many
    # tokens (or when the step carries a prefill chunk): see ROWS_RULE
    rows_from_streams: int = 3
    rows_up_to_context: int = 512


# Where rows of the ragged step beat a cycle of its own (experiments/verify_rows.py, gamma 4,
# one loop iteration, the CPU): from 3 plain streams on, at 300 tokens from 1 (n-gram
# 0.61-0.82 of the cycle's time, self:20 0.79-0.98); at 1,000 tokens with 1 stream the cycle
# wins (rows 1.05x, self:20 1.31x): each decode row walks the context's pages on its own.
ROWS_RULE = ("verify as rows of the ragged step beside 3+ plain streams, at a context of "
             "512 tokens or less, or beside a prefill chunk; else a cycle of its own "
             "(measured on the CPU by experiments/verify_rows.py; the GPU keeps the rule "
             "unmeasured)")


@dataclass(frozen=True)
class MemoryBudget:
    device_bytes: int              # free memory the plan started from
    usable_bytes: int
    weight_bytes: int
    activation_bytes: int
    reserve_bytes: int
    kv_budget_bytes: int
    page_bytes: int

    @property
    def kv_pages(self) -> int:
        """KV pages the budget holds beside the scratch page (page 0)."""
        return self.kv_budget_bytes // self.page_bytes - 1


@dataclass(frozen=True)
class ExecutionPlan:
    backend: str
    device_name: str
    compute_dtype: str
    weights: str                   # the weight matrices' format (model.WEIGHTS)
    kv_dtype: str
    page_size: int
    num_pages: int
    max_context: int
    max_batch: int
    prefill_chunk: int
    max_step_tokens: int           # tokens one ragged step carries: decode rows + a chunk
    # a step's cost beyond its bucket's tokens, in tokens: where a prompt's tail is cheaper
    # in smaller buckets than padded into one (0: always one padded bucket)
    step_cost_tokens: int
    max_waiting: int
    max_preemptions: int           # then a request runs to its end, never preempted
    max_pinned_share: float        # of the pool that registered stable tiers may pin
    batch_buckets: tuple[int, ...]
    chunk_buckets: tuple[int, ...]
    page_buckets: tuple[int, ...]
    attn_block_pages: int          # pages the XLA attention reads at a time
    reduce_rows: int               # a step's products of 2..this many rows: multiply-sum
    attn_impl: str
    linear_impl: str               # "cpu": few-row products by the CPU kernel; "xla"
    kernel_rows: int               # linear_impl "cpu": the kernel takes 2..this many rows
    speculative: SpeculativePolicy
    memory: MemoryBudget
    # XLA options every step is compiled with (jax.jit's compiler_options)
    compiler_options: dict = field(default_factory=dict, hash=False)
    reasons: dict = field(default_factory=dict, hash=False, compare=False)
    # the device mesh's axes and sizes: "model" splits each layer (tensor parallel)
    mesh: dict = field(default_factory=lambda: {"data": 1, "model": 1}, hash=False)
    expert_parallel: bool = False  # a MoE's experts whole on the "model" devices, E / n each

    @property
    def tensor_parallel(self) -> int:
        return self.mesh["model"]

    @property
    def prefill_devices(self) -> int:
        """Devices of their own that prefill prompts (0: chunks ride in the decode steps)."""
        return self.mesh.get("prefill", 0)

    @property
    def buckets(self) -> Buckets:
        return Buckets(self.batch_buckets, self.chunk_buckets, self.page_buckets,
                       self.attn_block_pages, self.reduce_rows, self.kernel_rows)

    def particles_for(self, free_pages: int, context_len: int, gamma: int | None = None) -> int:
        return particles_for(free_pages, context_len,
                             self.speculative.gamma if gamma is None else gamma,
                             page_size=self.page_size,
                             cap=min(self.speculative.particle_cap, self.max_batch))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "ExecutionPlan":
        raw = json.loads(text)
        for key in ("batch_buckets", "chunk_buckets", "page_buckets"):
            raw[key] = tuple(raw[key])
        raw["speculative"] = SpeculativePolicy(**raw["speculative"])
        raw["memory"] = MemoryBudget(**raw["memory"])
        raw.setdefault("max_waiting", WAITING_PER_SLOT * raw["max_batch"])  # older plans
        raw.setdefault("max_preemptions", MAX_PREEMPTIONS)
        raw.setdefault("max_pinned_share", MAX_PINNED_SHARE)
        raw.setdefault("max_step_tokens", raw["max_batch"] + raw["prefill_chunk"])
        raw.setdefault("step_cost_tokens", 0)
        raw.setdefault("attn_block_pages", ATTN_BLOCK_PAGES)
        raw.setdefault("reduce_rows", 0)  # older plans: every product a dot
        raw.setdefault("linear_impl", "xla")
        raw.setdefault("kernel_rows", cpu_linear.MAX_ROWS if raw["linear_impl"] == "cpu" else 0)
        raw.setdefault("mesh", {"data": 1, "model": 1})
        return cls(**raw)


def particle_pages(context_len: int, gamma: int, page_size: int) -> int:
    """Private pages one extra particle needs: its copy of the shared partial page plus
    room for gamma + 1 new tokens (full prefix pages are shared, copy-on-write)."""
    return pages_for(context_len % page_size + gamma + 1, page_size)


def particles_for(free_pages: int, context_len: int, gamma: int, *, page_size: int,
                  cap: int) -> int:
    """SMC particle count N for one sequence: 1 (plain speculative decoding) when pages are
    tight, up to `cap` when plentiful. A tenth of the free pages is kept as headroom for
    the other sequences' growth; the extra particles never take more than the rest."""
    usable = max(free_pages, 0) - math.ceil(max(free_pages, 0) / 10)
    return max(1, min(cap, 1 + usable // particle_pages(context_len, gamma, page_size)))


def _itemsize(dtype_name: str) -> int:
    return jnp.dtype(dtype_name).itemsize


def page_bytes(config: ModelConfig, page_size: int, kv_dtype: str) -> int:
    return int(config.kv_bytes_per_token(_itemsize(kv_dtype))) * page_size


def activation_bytes(config: ModelConfig, max_batch: int, chunk: int, max_context: int,
                     compute: str, dense_scores: bool) -> int:
    """Peak transient memory of one prefill step over max_batch x chunk tokens: hidden
    states through a layer, the XLA reference's f32 scores over the whole context (the
    Pallas kernel keeps them on chip), and one chunk's f32 logits (the scoring API)."""
    tokens = max_batch * chunk
    per_token = (6 * config.hidden_size + 2 * config.intermediate_size) * _itemsize(compute)
    if dense_scores:
        per_token += 4 * config.num_heads * max_context
    return tokens * per_token + chunk * config.vocab_size * 4


def _cpu_impl(config: ModelConfig, kv_dtype: str, page_size: int) -> tuple[str, str]:
    """The CPU's attention: its attention kernel where it builds and takes the model's
    pages, else the XLA walk; and why."""
    group = config.num_heads // config.num_kv_heads
    if cpu_attention.takes(config.head_dim, group, page_size, kv_dtype):
        why = cpu_kernels.build_error()
    else:
        why = (f"head dim {config.head_dim}, {group} query heads a KV head, "
               f"{page_size}-slot {kv_dtype} pages")
    if why is None:
        return "cpu", ("CPU: the paged-attention kernel (an XLA custom call) for decode rows, "
                       "verify rows and prefill chunks (experiments/decode_attention_floor.py, "
                       "chunk_attention.py)")
    return "xla", f"CPU: the XLA walk (the attention kernel is off: {why})"


def _kernel_rows() -> int:
    """The most rows the CPU's few-row kernel takes, as built for this CPU (see
    cpu_linear.rows_it_pays)."""
    return cpu_linear.rows_it_pays(cpu_kernels.vector_lanes() or 0)


def _cpu_linear(compute: str) -> tuple[str, str]:
    """The CPU's few-row weight products: its kernel where it builds and the weights are
    f32, else XLA's multiply-sums; and why."""
    why = (f"{compute} weights" if compute != "float32" else cpu_kernels.build_error())
    if why is None:
        rows = _kernel_rows()
        rest = (f"{rows + 1}-{REDUCE_ROWS} rows multiply-sums, more XLA's dot"
                if rows < REDUCE_ROWS else "larger chunks by XLA's dot")
        return "cpu", (f"CPU: a step's weight products of 2 to {rows} rows by the few-row "
                       f"kernel (an XLA custom call; {cpu_kernels.vector_lanes()}-float "
                       "vectors: see cpu_linear.rows_it_pays, experiments/"
                       f"few_row_products.py), one row by XLA's matrix-vector product, {rest}")
    return "xla", f"CPU: XLA's products (the few-row kernel is off: {why})"


def _weights_for(hw: HardwareProfile, linear_impl: str) -> tuple[str, str]:
    """The weight format a plan keeps by default, and why: a GGUF's quantized matrices as
    they are where the quantized product is at least as fast as float's on this machine
    (the CPU kernels for AVX-512), else float. A float file loads as float either way.
    Decided before a first kernel build is done (a load overlaps the two): from the
    hardware, unless the kernels are off for good or by request."""
    if hw.backend == "gpu":
        return "float", ("GPU: quantized weights would be dequantized for XLA's dot (no "
                         "fused kernel measured yet)")
    if linear_impl == "xla" or not cpu_kernels.may_run():
        return "float", "CPU: the quantized kernel is off (XLA would dequantize for its dot)"
    lanes = cpu_kernels.vector_lanes() or (
        16 if hw.cpu_vector_bits >= 512 and cpu_kernels.default_target() == "native" else 8)
    if lanes >= 16:
        return "native", (
            "CPU, AVX-512 kernels: a GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K matrices kept quantized "
            "(a float file loads as float): on the embedded model's Q4_1 file the quantized "
            "kernel decodes 1.8x faster than f32 in 18% of its bytes and prefills 1,024 "
            "tokens in 0.9x its time (experiments/quantized_weights.py)")
    return "float", (
        f"CPU, {lanes}-float kernels: the quantized kernel decoded the Q4_1 file 0.96-1.06x "
        "as fast as f32 over two runs (8-bit values 1.4-1.7x), prefill 0.9-1.2x its time "
        "(AVX2, experiments/quantized_weights.py): float; weights='native' keeps the file "
        "quantized for its memory")


def plan(hardware: HardwareProfile, config: ModelConfig, workload: Workload = Workload(),
         *, dtype: str | None = None, kv_dtype: str | None = None, page_size: int | None = None,
         num_pages: int | None = None, attn_impl: str = "auto", linear_impl: str = "auto",
         compiler_options: dict | None = None, weights: str | None = None,
         tensor_parallel: int | None = None, expert_parallel: bool | None = None,
         prefill_devices: int | None = None) -> ExecutionPlan:
    """The Execution Plan for `config` on `hardware`; keyword arguments override choices."""
    gpu = hardware.backend == "gpu"
    why: dict[str, str] = {}

    def choose(name, given, default, reason):
        if given is not None:
            why[name] = "set by the caller"
            return given
        why[name] = reason
        return default

    compute = choose("compute_dtype", dtype, "bfloat16" if gpu else "float32",
                     "GPU: bf16 halves weight bytes and runs on tensor cores" if gpu else
                     "CPU: XLA:CPU runs bf16/int8 matrix-vector 10-30x slower than f32 (measured)")
    compute = _named(compute, DTYPE_NAMES, "dtype")
    kv = _named(choose("kv_dtype", kv_dtype, compute, "same as compute; int8/fp8 halve KV "
                       "bytes at a small accuracy cost (opt in with kv_dtype)"),
                KV_DTYPE_NAMES, "kv_dtype")
    if kv != compute and not gpu and kv_dtype is not None and is_quantized(kv):
        log.warning("quantized KV on the CPU is slow (XLA:CPU converts int8/fp8 slowly); "
                    "it saves memory, not time")
    ps = choose("page_size", page_size, PAGE_SIZE[hardware.backend],
                "GPU: 16-token pages share prefixes finely; the kernel reads 4 pages a block"
                if gpu else "CPU: decode measured fastest at 64 of 16/32/64/128")
    if ps < 1:
        raise PlanError(f"page_size must be a positive integer (got {ps})")
    context = choose("max_context", workload.max_context, config.max_context,
                     "the model's trained context")
    context = min(context, config.max_context)
    batch = choose("max_batch", workload.max_batch, 64 if gpu else 8,
                   "GPU: decode is bandwidth-bound; 64 rows share each weight read" if gpu else
                   "CPU: 8 rows share each weight read; 2 cores saturate beyond")
    chunk = choose("prefill_chunk", workload.prefill_chunk, PREFILL_CHUNK[hardware.backend],
                   "prefill tokens per step: large enough to be compute-bound, small enough "
                   "to interleave decode steps")
    step_tokens = choose(
        "max_step_tokens", workload.max_step_tokens,
        batch + (chunk if gpu else min(chunk, CPU_STEP_CHUNK)),
        "GPU: every decode row and one full prefill chunk (a long prompt adds at most one "
        "chunk to the running streams' step)" if gpu else
        f"CPU: the decode rows and a {CPU_STEP_CHUNK}-token chunk beside them; with nothing "
        "decoding a prompt takes whole chunks. 4-8 streams under load "
        "(experiments/load_budget.py, 4 runs): ITL p99 47-57% lower than with a whole chunk "
        "per step, for 0.3-0.6 s more TTFT; the median ITL rises when newcomers keep most "
        "steps carrying a chunk")
    step_cost = choose(
        "step_cost_tokens", None, 0 if gpu else CPU_STEP_COST,
        "GPU: a chunk's padding costs little beside a step's weight reads: a prompt's tail "
        "takes one padded bucket" if gpu else
        f"CPU: a step costs about {CPU_STEP_COST} prompt tokens beyond its bucket's (chunks "
        "alone at 2k positions: 16 tokens 34 ms, 64 87 ms, 128 159 ms, 256 316 ms): a "
        "prompt's tail shorter than a chunk goes in smaller buckets where that beats padding "
        "it (a 171-token tail: 128 + 64)")
    for name, value in (("max_batch", batch), ("prefill_chunk", chunk), ("max_context", context),
                        ("max_step_tokens", step_tokens)):
        if value < 1:
            raise PlanError(f"{name} must be a positive integer (got {value})")

    impl = choose("attn_impl", None if attn_impl == "auto" else attn_impl,
                  *attention_for(hardware, config, kv, ps))
    if impl not in IMPLS[1:]:
        raise PlanError(f"attn_impl {impl!r} is not supported; choose one of {IMPLS}")
    linear = choose("linear_impl", None if linear_impl == "auto" else linear_impl,
                    *(("xla", "GPU: XLA's dot (the matrix units take a few rows at "
                       "matrix-vector cost)") if gpu else _cpu_linear(compute)))
    if linear not in LINEAR_IMPLS[1:]:
        raise PlanError(f"linear_impl {linear!r} is not supported; choose one of "
                        f"{LINEAR_IMPLS}")
    if linear == "cpu" and (gpu or cpu_kernels.build_error()):
        raise PlanError("linear_impl 'cpu' needs the CPU backend and its kernels ("
                        f"{'this is a GPU' if gpu else cpu_kernels.build_error()}); "
                        "use 'auto' or 'xla'")
    formats = choose("weights", weights, *_weights_for(hardware, linear_impl))
    if formats not in WEIGHTS:
        raise PlanError(f"weights {formats!r} is not supported; choose one of "
                        f"{', '.join(WEIGHTS)}")

    wide = not gpu and hardware.cpu_vector_bits >= 512
    xla = choose("compiler_options", compiler_options,
                 {"xla_cpu_prefer_vector_width": 512} if wide else {},
                 "AVX-512 CPU: 512-bit vectors in XLA's own loops and matrix-vector products "
                 "(decode measured 4% faster than the default 256)" if wide else
                 "XLA's defaults")
    if not isinstance(xla, dict) or not all(
            isinstance(k, str) and isinstance(v, (bool, int, float, str)) for k, v in xla.items()):
        raise PlanError(f"compiler_options must map XLA option names to values, e.g. "
                        f"{{'xla_cpu_prefer_vector_width': 512}} (got {xla!r})")

    shards, experts = _tensor_parallel_for(hardware, config, compute, formats, tensor_parallel,
                                           expert_parallel, why)
    why["memory"] = (f"budgeted from {hardware.memory_free_bytes / GB:.2f} GB free"
                     + (" a device" if shards > 1 else "")
                     + (f": {hardware.memory_source}" if hardware.memory_source else ""))
    per_context = pages_for(context, ps)
    while True:
        memory = memory_budget(hardware, config, compute, kv, ps, batch, chunk, context, impl,
                               formats, shards)
        fits = memory.kv_pages
        if fits >= per_context or workload.max_batch is not None or batch <= 8:
            break
        batch //= 2  # prefill activations scale with the batch: trade rows for context
        why["max_batch"] = f"halved to {batch}: the prefill activations left no room for a context"
    if fits < per_context:
        if workload.max_context is not None or num_pages is not None:
            raise _no_room(memory, per_context, context, ps, hardware)
        if fits < 1:
            raise _no_room(memory, per_context, context, ps, hardware)
        context = fits * ps
        per_context = fits
        why["max_context"] = (f"shrunk to {context} tokens: the KV budget "
                              f"({memory.kv_budget_bytes / GB:.2f} GB) holds no more")
        log.warning("max_context %s", why["max_context"])
    want = (batch if gpu else 2) * per_context + 1
    pages = choose("num_pages", num_pages, min(want, fits + 1),
                   f"{'max_batch' if gpu else 'two'} full contexts of "
                   f"{per_context} pages (+ scratch), within the KV budget"
                   + ("" if gpu else "; host RAM is zero-filled, so no more than that"))
    if pages > fits + 1:
        need = pages * memory.page_bytes / GB
        raise PlanError(f"num_pages={pages} needs {need:.2f} GB of KV but only "
                        f"{memory.kv_budget_bytes / GB:.2f} GB is left after weights and "
                        f"activations; at most {fits + 1} pages fit (or quantize the KV)")
    if pages < 2:
        raise PlanError(f"num_pages={pages} leaves no page beside the scratch page; "
                        "use at least 2")

    prefill = _prefill_devices_for(hardware, config, prefill_devices, shards, pages, why,
                                   lambda n: memory_budget(hardware, config, compute, kv, ps,
                                                           batch, chunk, context, impl,
                                                           formats, n))
    buckets = buckets_for(batch, chunk, per_context, dense=not gpu)
    why["buckets"] = ("a step is (decode rows, chunk): decode rows alone (a power of two up "
                      "to max_batch), a chunk alone (a power of two from 16 to "
                      "prefill_chunk), or a chunk beside max_batch rows (the chunk dominates "
                      f"its cost): {len(buckets.batch) + 2 * len(buckets.chunk)} executables "
                      "in all; its attention walks only the pages each row sees (a decode "
                      f"row {walk_sizes(buckets.attn_block, buckets.table_width)} pages at a "
                      f"time, {buckets.batch[-1]} rows "
                      f"{walk_sizes(buckets.attn_block, buckets.table_width, buckets.batch[-1])}"
                      "), so the block-table width is not a shape to compile for. "
                      "Speculative cycles and scoring keep block-table widths: "
                      + ("every 2 pages to 32, then ~1.25x (XLA reads the whole width)"
                         if not gpu else "powers of two (the kernel skips unseen pages)"))
    untaken = " that the few-row kernel does not take" if linear == "cpu" else ""
    why["reduce_rows"] = (
        f"a step's weight products of 2 to {buckets.reduce_rows} rows{untaken} are a "
        "multiply and a sum over the input: each weight row is read once for every row, "
        "where XLA:CPU's dot of 2-8 rows costs 2-3x a matrix-vector product (an 8-row decode "
        "step 0.66-0.76x the time, measured)" if buckets.reduce_rows else
        "every product a dot: the GPU's matrix units take a few rows at matrix-vector cost")
    spec = SpeculativePolicy(
        draft=workload.draft, gamma=4, particle_cap=8 if gpu else 4,
        rule="N = 1 + (free pages - 10% headroom) // pages per extra particle "
             "(its partial page + gamma + 1 tokens), clamped to [1, min(cap, max_batch)]; "
             + ROWS_RULE)
    waiting = choose("max_waiting", workload.max_waiting, WAITING_PER_SLOT * batch,
                     f"{WAITING_PER_SLOT} queued requests per batch slot: a burst is absorbed, "
                     "a flood is refused at once (QueueFullError) instead of timing out")
    if waiting < 1:
        raise PlanError(f"max_waiting must be a positive integer (got {waiting})")
    why["memory_policy"] = (
        "requests are admitted on need (prompt + one token); when a step runs short, "
        f"pinned stable tiers are unpinned least recently used first, then the newest "
        f"request is preempted and later resumed by prefill, at most {MAX_PREEMPTIONS} "
        "times (then it is admitted for its worst case and runs to the end); stable "
        f"tiers pin at most {MAX_PINNED_SHARE:.0%} of the pool")
    why["speculative"] = ("no draft model given: plain decoding until one is set"
                          if workload.draft is None else f"draft {workload.draft}")
    return ExecutionPlan(
        backend=hardware.backend, device_name=hardware.device_name, compute_dtype=compute,
        weights=formats, kv_dtype=kv, page_size=ps, num_pages=pages, max_context=context,
        max_batch=batch,
        prefill_chunk=chunk, max_step_tokens=step_tokens, step_cost_tokens=step_cost,
        max_waiting=waiting, max_preemptions=MAX_PREEMPTIONS,
        max_pinned_share=MAX_PINNED_SHARE, batch_buckets=buckets.batch,
        chunk_buckets=buckets.chunk, page_buckets=buckets.pages,
        attn_block_pages=buckets.attn_block, reduce_rows=buckets.reduce_rows, attn_impl=impl,
        linear_impl=linear, kernel_rows=_kernel_rows() if linear == "cpu" else 0,
        speculative=spec, memory=memory,
        compiler_options=xla, reasons=why,
        mesh={"data": 1, "model": shards, **({"prefill": prefill} if prefill else {})},
        expert_parallel=experts)


def _named(value: str, names: dict, what: str) -> str:
    if value not in names:
        raise PlanError(f"{what} {value!r} is not supported; choose one of {sorted(names)}")
    return names[value]


def attention_for(hw: HardwareProfile, config: ModelConfig, kv: str, ps: int) -> tuple[str, str]:
    """The attention a plan runs by default, and why: Pallas on the GPU, the CPU kernel
    or the XLA walk on the CPU."""
    if hw.backend == "gpu":
        return "pallas", "GPU: the Pallas paged-attention kernel"
    return _cpu_impl(config, kv, ps)


def weight_bytes(config: ModelConfig, compute: str, weights: str = "float",
                 tensor_parallel: int = 1) -> float:
    """The weights' bytes: in `compute`, or with the matrices in format `weights` (the
    experts, norms and biases stay in `compute`; "native" counts as `compute`, a bound:
    the file's own formats are not in the config). Over `tensor_parallel` devices, one
    device's: the embedding whole, the LM head split by vocabulary where the devices
    divide it (a tied one then held apart, a second copy) else whole, the layers split
    (KV heads repeated where fewer than the devices; model.tensor_parallel)."""
    n = tensor_parallel
    config = dataclasses.replace(config, num_kv_heads=kv_heads(config, n))
    value = quantized.BYTES_PER_VALUE[weights] if weights in FORMATS else _itemsize(compute)
    experts = config.moe_layers * config.num_experts * config.expert_params()
    whole = (config.num_params() - experts) * value + experts * _itemsize(compute)
    table = config.embed_params() * value  # one [vocab, d] matrix
    layers = whole - table * (1 if config.tie_embeddings else 2)
    if splits_head(config.vocab_size, n):
        return table + table / n + layers / n
    return table * (1 if config.tie_embeddings else 2) + layers / n


def shard_page_bytes(config: ModelConfig, page_size: int, kv_dtype: str,
                     tensor_parallel: int = 1) -> int:
    """A KV page's bytes on one device: its share of the KV heads (repeated where fewer
    than the devices)."""
    return page_bytes(device_config(config, tensor_parallel), page_size, kv_dtype)


def _tensor_parallel_for(hw: HardwareProfile, config: ModelConfig, compute: str, formats: str,
                         given: int | None, experts: bool | None,
                         why: dict) -> tuple[int, bool]:
    """How many devices each layer splits over, and whether a MoE's experts go whole to
    them: the caller's; else one device where the weights fit one (the others are left
    for replicas), else every device the model's heads divide over (decode reads weights,
    so each of n devices reads 1/n of them); experts whole where they divide evenly."""
    def expert_split(k: int) -> bool:
        return expert_parallel_for(config, k) if experts is None else bool(experts and k > 1)

    if given is not None:
        if not isinstance(given, int) or given < 1:
            raise PlanError(f"tensor_parallel must be a positive integer (got {given!r})")
        if given > hw.device_count:
            raise PlanError(f"tensor_parallel {given} needs {given} devices but "
                            f"{hw.device_name} has {hw.device_count}")
        if (problem := tensor_parallel_problem(config, given, expert_split(given))):
            raise PlanError(f"tensor_parallel {given}: {problem}")
        why["mesh"] = "set by the caller"
        n = given
    elif (whole := weight_bytes(config, compute, formats)) + _reserve(hw) <= _usable(hw) \
            or hw.device_count == 1:
        why["mesh"] = ("one device holds the weights" +
                       (f"; the other {hw.device_count - 1} are left free"
                        if hw.device_count > 1 else ""))
        n = 1
    else:
        n = max(k for k in range(1, hw.device_count + 1)
                if tensor_parallel_problem(config, k, expert_split(k)) is None)
        why["mesh"] = (
            f"the weights ({whole / GB:.1f} GB) do not fit one device's "
            f"{_usable(hw) / GB:.1f} GB usable: split over {n} of the {hw.device_count} "
            "devices (the most the model's heads and widths divide over: decode reads 1/n "
            "of the weights on each, and the KV pool has n devices' room)")
    if config.num_experts and n > 1:
        why["expert_parallel"] = (
            "set by the caller" if experts is not None else
            f"{config.num_experts // n} whole experts a device: no expert's FFN cut into "
            "slivers, and a token's expert outputs come back in the MLP's all-reduce"
            if expert_split(n) else
            f"{config.num_experts} experts do not divide over {n} devices: each expert's "
            "FFN width is split instead")
    return n, expert_split(n)


def _prefill_devices_for(hw: HardwareProfile, config: ModelConfig, given: int | None,
                         shards: int, pages: int, why: dict, budget) -> int:
    """Devices of their own that prefill prompts, after the `shards` decode devices: the
    caller's (each layer split over them, their pool as many `pages` as the decode
    devices', within `budget(n)`, a device's MemoryBudget over n), else none."""
    if not given:
        why["prefill_devices"] = ("none: a prompt's chunks ride in the decode steps, the step "
                                  "budget (max_step_tokens) bounding what they add to them")
        return 0
    if not isinstance(given, int) or given < 1:
        raise PlanError(f"prefill_devices must be a positive integer (got {given!r})")
    if shards + given > hw.device_count:
        raise PlanError(f"prefill_devices {given} beside {shards} decode device(s) needs "
                        f"{shards + given} devices but {hw.device_name} has {hw.device_count}")
    experts = expert_parallel_for(config, given)
    if (problem := tensor_parallel_problem(config, given, experts)):
        raise PlanError(f"prefill_devices {given}: {problem}")
    if kv_heads(config, given) != kv_heads(config, shards):
        raise PlanError(
            f"prefill_devices {given} holds {kv_heads(config, given)} KV heads where the "
            f"{shards} decode device(s) hold {kv_heads(config, shards)} (a head repeated "
            f"for each device past the model's {config.num_kv_heads}); pages move between "
            "them as they are: use counts of at most the KV heads, or equal ones")
    room = budget(given).kv_pages + 1
    if pages > room:
        raise PlanError(f"prefill_devices {given}: their KV pool of {pages} pages (the decode "
                        f"devices' page ids) does not fit; {room} do")
    where = f"devices {shards}..{shards + given - 1}" if given > 1 else f"device {shards}"
    why["prefill_devices"] = (
        f"set by the caller: prompts prefill on {where} (each layer split over {given}), "
        "their KV pages moved to the decode devices when a prompt is whole, so decode "
        "steps never wait for a chunk; the prefix cache is off (a page's KV lives on one "
        "slice only) and speculative decoding is refused")
    return given


def _usable(hw: HardwareProfile) -> int:
    """A device's memory the plan may use: on the GPU 90% of what is free (the runtime and
    fragmentation take the rest), on the CPU half the free RAM (the OS, the Python heap
    and converted-weight copies live there too)."""
    return int(hw.memory_free_bytes * (0.9 if hw.backend == "gpu" else 0.5))


def _reserve(hw: HardwareProfile) -> int:
    return int(1 * GB) if hw.backend == "gpu" else int(0.5 * GB)


def memory_budget(hw: HardwareProfile, config: ModelConfig, compute: str, kv: str, ps: int,
                  batch: int, chunk: int, context: int, impl: str,
                  weights: str = "float", tensor_parallel: int = 1) -> MemoryBudget:
    """Where a device's free memory goes: the weights (`weight_bytes`, its share over
    `tensor_parallel` devices), one prefill step's activations (whole on each device: a
    bound), a reserve, and the KV pages' budget (the rest; a page's bytes are its share
    of the KV heads). Refused (PlanError) when the weights do not fit."""
    device, usable, reserve = hw.memory_free_bytes, _usable(hw), _reserve(hw)
    weights = int(weight_bytes(config, compute, weights, tensor_parallel))
    act = activation_bytes(config, batch, chunk, context, compute, dense_scores=impl == "xla")
    if weights + reserve > usable:
        split = f" over {tensor_parallel} devices" if tensor_parallel > 1 else ""
        raise PlanError(
            f"the model's weights need {weights / GB:.2f} GB a device{split} "
            f"({config.num_params() / 1e9:.2f} B params in {compute}) but only "
            f"{usable / GB:.2f} GB of the device's {device / GB:.2f} GB free is usable; use "
            "a smaller model, a smaller dtype or format, more devices (tensor_parallel) "
            "or another device")
    kv_budget = usable - weights - act - reserve
    return MemoryBudget(device, usable, weights, act, reserve, max(kv_budget, 0),
                        shard_page_bytes(config, ps, kv, tensor_parallel))


def _no_room(memory: MemoryBudget, per_context: int, context: int, ps: int,
             hw: HardwareProfile) -> PlanError:
    need = (per_context + 1) * memory.page_bytes
    return PlanError(
        f"a {context}-token context needs {need / GB:.2f} GB of KV ({per_context} pages of "
        f"{ps} tokens) but {memory.kv_budget_bytes / GB:.2f} GB is left on {hw.device_name} "
        f"after {memory.weight_bytes / GB:.2f} GB of weights and "
        f"{memory.activation_bytes / GB:.2f} GB of activations; use a smaller max_context, "
        "a smaller max_batch or prefill_chunk, quantized KV (kv_dtype='int8') or another device")


def draft_bytes(plan: ExecutionPlan, draft: ModelConfig, name: str, taken: int = 0,
                weights: str = "float") -> int:
    """Memory a separate draft model takes from the plan's budget: its weights (in the
    compute dtype, or with its matrices in format `weights`, as `weight_bytes` counts
    them) plus its own KV over all the plan's pages (it shares the target's page ids).
    Refused with the numbers (PlanError) unless it fits in what the plan left after the
    target's KV pool and the `taken` bytes of drafts loaded before."""
    n = plan.tensor_parallel  # a draft model splits over the target's devices too
    weights = int(weight_bytes(draft, plan.compute_dtype, weights, n))
    kv = plan.num_pages * shard_page_bytes(draft, plan.page_size, plan.kv_dtype, n)
    spare = plan.memory.kv_budget_bytes - plan.num_pages * plan.memory.page_bytes - taken
    if weights + kv > spare:
        raise PlanError(
            f"draft model {name} needs {_size(weights + kv)} ({_size(weights)} of weights and "
            f"{_size(kv)} of KV over the target's {plan.num_pages} pages) but only "
            f"{_size(max(spare, 0))} is left beside the target; load the target with fewer "
            'num_pages or a shorter max_context, or draft with "self:K" (it needs no memory '
            "of its own)")
    return weights + kv


def _size(n: int) -> str:
    return f"{n / GB:.2f} GB" if n >= GB / 10 else f"{n / 1e6:.1f} MB"
