"""What fits where: a model's weight formats and KV dtypes against one device's memory.

For each weight format the runtime runs and each KV dtype, from the config alone (no
weights read): the weights' bytes, a cached token's KV bytes, the longest context one
sequence can hold and the most sequences of `context` tokens that fit, by the mapper's
own memory budget (`mapper.memory_budget`: usable memory less the weights, one prefill
step's activations and a reserve). Beside the table, what `plan()` itself picks for the
device and why. `xlr plan MODEL --fit` prints it.
"""
from __future__ import annotations

import jax.numpy as jnp

from xlr_jax.errors import PlanError
from xlr_jax.kv.pages import pages_for
from xlr_jax.model.config import ModelConfig
from xlr_jax.model.weight_formats import FORMATS
from xlr_jax.planning.hardware import HardwareProfile
from xlr_jax.planning.mapper import (PAGE_SIZE, PREFILL_CHUNK, Workload, attention_for,
                                     memory_budget, plan, weight_bytes)

# weight formats the runtime runs: float, or matrices quantized at load (model.quantized;
# experts, norms and biases in the compute dtype: bf16 on a GPU, f32 on a CPU)
WEIGHT_FORMATS = ("float32", "bfloat16") + FORMATS
KV_FORMATS = ("float32", "bfloat16", "int8", "float8_e4m3fn")
MAX_BATCH = 4096  # the search's ceiling


def fit_row(hw: HardwareProfile, config: ModelConfig, weights: str, kv: str,
            context: int) -> dict:
    """One format pair: its bytes, and what fits (`fits` False with `why` if nothing)."""
    ps, chunk = PAGE_SIZE[hw.backend], PREFILL_CHUNK[hw.backend]
    impl = attention_for(hw, config, kv, ps)[0]
    kept = weights in FORMATS
    compute = ("bfloat16" if hw.backend == "gpu" else "float32") if kept else weights
    fmt = weights if kept else "float"
    row = {"weights": weights, "kv": kv,
           "weight_bytes": int(weight_bytes(config, compute, fmt)),
           "kv_bytes_per_token": config.kv_bytes_per_token(jnp.dtype(kv).itemsize)}

    def pages_left(batch: int) -> int:
        return memory_budget(hw, config, compute, kv, ps, batch, chunk, context, impl,
                             fmt).kv_pages

    try:
        one = pages_left(1)
    except PlanError as e:
        return {**row, "fits": False, "why": str(e), "longest_context": 0,
                "largest_batch": 0}
    per_sequence = pages_for(context, ps)
    batch = 0
    while batch < MAX_BATCH and (batch + 1) * per_sequence <= pages_left(batch + 1):
        batch += 1
    return {**row, "fits": batch > 0, "longest_context": min(max(one, 0) * ps, config.max_context),
            "largest_batch": batch,
            "why": "" if batch else f"one {context}-token context needs {per_sequence} pages; "
                                    f"{max(one, 0)} fit"}


def fit(hw: HardwareProfile, config: ModelConfig, context: int | None = None) -> dict:
    """Every (weight format, KV dtype) pair's row (`fit_row`) at `context` tokens a
    sequence (default and cap: the model's trained context), and the plan's own pick."""
    context = min(context or config.max_context, config.max_context)
    rows = [fit_row(hw, config, w, kv, context) for w in WEIGHT_FORMATS for kv in KV_FORMATS]
    try:
        p = plan(hw, config, Workload(max_context=context))
        pick = {"weights": p.compute_dtype if p.weights == "float" else p.weights,
                "kv": p.kv_dtype, "max_context": p.max_context,
                "max_batch": p.max_batch, "num_pages": p.num_pages,
                "why": f"{p.reasons['compute_dtype']}; KV: {p.reasons['kv_dtype']}"}
    except PlanError as e:
        pick = {"error": str(e)}
    return {"device": hw.device_name, "memory_bytes": hw.memory_free_bytes,
            "context": context, "page_size": PAGE_SIZE[hw.backend], "rows": rows,
            "plan": pick}
