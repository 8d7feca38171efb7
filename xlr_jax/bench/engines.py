"""What `xlr_jax.bench.run` measures: engines behind one `generate`, bandwidth, the decode roofline.

Every engine (xlr-jax on a real or a random-weight model, transformers) is a
runner with `generate(ids, n) -> Run`; `measure` times any of them the same way.
"""
from __future__ import annotations

import dataclasses
import inspect
import random
import statistics
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
from tqdm import tqdm

from xlr_jax.api import load_model
from xlr_jax.errors import XlrError
from xlr_jax.kv.pages import pages_for
from xlr_jax.loading.registry import resolve_model
from xlr_jax.model.config import ModelConfig
from xlr_jax.model.decoder import LayerParams, Params
from xlr_jax.model.sampling_params import SamplingParams
from xlr_jax.model.tensor_parallel import TensorParallel, kv_heads, make_mesh
from xlr_jax.planning.hardware import probe
from xlr_jax.planning.mapper import Workload, plan
from xlr_jax.runtime.engine import Engine


class BenchError(XlrError):
    """The config cannot be read, or needs hardware this machine lacks."""


class Run(NamedTuple):
    tokens: list[int]
    ttft_s: float
    decode_tokens_per_s: float


class StreamsRun(NamedTuple):
    decode_tokens_per_s: float  # the sum of each stream's own decode speed
    span_tokens_per_s: float    # every stream's tokens after its first / the whole span
    tokens: list[list[int]]


class XlrRunner:
    """An xlr-jax `Engine`, greedy with EOS ignored so every run decodes exactly n tokens."""

    kind = "xlr"

    def __init__(self, label: str, engine: Engine, info: dict):
        self.label, self.engine = label, engine
        self.info = {**info, "method": "Engine.run() of one prompt per run: ttft_s = first "
                                        "token - run start (prefill), decode_tokens_per_s = "
                                        "(n - 1) / (last token - first token)"}
        self.vocab_size = engine.config.vocab_size
        params, c = engine.runner.params, engine.config
        # An untied embedding is only gathered (one row per token); the LM head is read whole;
        # a MoE layer's token reads its chosen experts only
        unread = sum((lp.w_experts_gate_up.nbytes + lp.w_experts_down.nbytes)
                     * (1 - c.experts_per_token / c.num_experts)
                     for lp in params.layers if lp.router is not None)
        self.weight_bytes_per_token = params.nbytes() - unread - (
            0 if params.lm_head is None else params.embed.nbytes)
        self.kv_bytes_per_position = c.kv_bytes_per_token(engine.runner.kv.k.dtype.itemsize)
        # two a weight multiplied (attention's share is small at these contexts)
        self.flops_per_token = 2 * c.active_matmul_params()

    def encode(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)

    def generate(self, ids: list[int], n: int) -> Run:
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        done = next(d for _, _, d in self.engine.run([ids], [params]) if d is not None)
        return Run(done.token_ids, done.metrics["ttft_s"], done.metrics["decode_tokens_per_s"])

    def generate_streams(self, prompts: list[list[int]], n: int) -> StreamsRun:
        """All `prompts` at once, n tokens each (continuously batched)."""
        params = [SamplingParams(max_tokens=n, ignore_eos=True)] * len(prompts)
        done = [d for _, _, d in self.engine.run(prompts, params) if d is not None]
        # every request's clock starts when run() queues them all: one time origin
        span = (max(d.metrics["total_s"] for d in done)
                - min(d.metrics["ttft_s"] for d in done))
        return StreamsRun(sum(d.metrics["decode_tokens_per_s"] for d in done),
                          sum(len(d.token_ids) - 1 for d in done) / span,
                          [d.token_ids for d in done])


SPEC_KEYS = ("kind", "label", "model", "check_targets")  # what an engine spec says of itself
LOAD_OPTIONS = tuple(inspect.signature(load_model).parameters)[1:]


def load_options(spec: dict, own: tuple[str, ...] = ()) -> dict:
    """An xlr engine spec's `load_model` arguments: every key but the spec's own and
    `own` (a measurement's); a key load_model does not take is refused by name."""
    options = {k: v for k, v in spec.items() if k not in SPEC_KEYS + own}
    unknown = sorted(set(options) - set(LOAD_OPTIONS))
    if unknown:
        raise BenchError(f"unknown engine option(s) {', '.join(unknown)}: an xlr engine takes "
                         f"load_model's ({', '.join(LOAD_OPTIONS)})"
                         + (f" and {', '.join(own)}" if own else ""))
    return options


def load_xlr(spec: dict) -> XlrRunner:
    # prefix cache off by default: every run then prefills its whole prompt, as
    # transformers does, so TTFT compares prefill with prefill
    model = load_model(spec["model"], **{"prefix_cache": False, **load_options(spec)})
    info = {"model": spec["model"], "dtype": model.dtype, "weights": model.plan.weights,
            "param_bytes": model.engine.runner.params.nbytes(),
            "attn_impl": model.plan.attn_impl, "linear_impl": model.plan.linear_impl,
            "max_step_tokens": model.plan.max_step_tokens, "mesh": model.plan.mesh,
            "compiler_options": model.plan.compiler_options,
            "prefix_cache": model.prefix_cache is not None,
            "check_targets": spec.get("check_targets", True)}
    return XlrRunner(spec.get("label", "xlr-jax"), model.engine, info)


def random_params(config: ModelConfig, dtype, seed: int) -> Params:
    """Random weights, built per layer on the device (decode speed does not depend on values;
    a MoE's routing does, and random routers spread tokens over the experts)."""
    keys = iter(jax.random.split(jax.random.key(seed), 8 * config.num_layers + 2))
    d, ffn = config.hidden_size, config.intermediate_size
    qkv = config.q_size + 2 * config.kv_size

    def w(*shape):
        return jax.random.normal(next(keys), shape, dtype) * jnp.asarray(0.02, dtype)

    def feed_forward() -> dict:
        if not config.num_experts:
            return dict(w_gate_up=w(2 * ffn, d), w_down=w(d, ffn))
        e, width, shared = config.num_experts, config.moe_intermediate_size, config.shared_width
        out = dict(router=w(e, d), w_experts_gate_up=w(e, d, 2 * width),
                   w_experts_down=w(e, width, d))
        if shared:
            out.update(w_gate_up=w(2 * shared, d), w_down=w(d, shared))
        if config.shared_expert_gate:
            out["w_shared_gate"] = w(1, d)
        return out

    layers = tuple(LayerParams(attn_norm=jnp.ones(d, dtype), wqkv=w(qkv, d), bqkv=None,
                               wo=w(d, config.q_size), mlp_norm=jnp.ones(d, dtype),
                               **feed_forward())
                   for _ in range(config.num_layers))
    return Params(embed=w(config.vocab_size, d), layers=layers, final_norm=jnp.ones(d, dtype),
                  lm_head=None if config.tie_embeddings else w(config.vocab_size, d))


def random_xlr(spec: dict) -> XlrRunner:
    """Random weights of `spec["shape"]`; with `tensor_parallel` N, split over a 1 x N mesh
    (N = 1 too: the split code on one device)."""
    dtype = jnp.dtype(spec.get("dtype", "bfloat16"))
    config = ModelConfig(**spec["shape"])
    page_size = spec.get("page_size", 64)
    n = spec.get("tensor_parallel")
    p = plan(probe(), config, Workload(max_batch=1, prefill_chunk=spec.get("prefill_chunk", 512),
                                       max_context=config.max_context),
             dtype=dtype.name, page_size=page_size,
             num_pages=2 * pages_for(config.max_context, page_size) + 1, tensor_parallel=n)
    tp = None if n is None else TensorParallel(make_mesh(n), p.expert_parallel)
    # KV heads repeated where fewer than the devices: random weights of that many
    params = random_params(config if tp is None else
                           dataclasses.replace(config, num_kv_heads=kv_heads(config, n)),
                           dtype, spec.get("seed", 0))
    if tp is not None:
        params = tp.place(params, tp.param_specs(params))
    engine = Engine(config, params, None, p, prefix_cache=False, tp=tp)
    info = {"model": f"random {config.architecture} weights", "dtype": dtype.name,
            "shape": spec["shape"], "param_bytes": engine.runner.params.nbytes(),
            "attn_impl": p.attn_impl, "mesh": p.mesh}
    return XlrRunner(spec.get("label", "xlr-jax-random"), engine, info)


class TransformersRunner:
    """transformers' greedy `generate` on the CPU in f32, timed per token through a streamer."""

    kind = "transformers"

    def __init__(self, spec: dict):
        import torch
        from transformers import AutoModelForCausalLM

        path = resolve_model(spec["model"])
        self._source = ((str(path.parent), {"gguf_file": path.name}) if path.is_file()
                        else (str(path), {}))
        self.model = AutoModelForCausalLM.from_pretrained(
            self._source[0], dtype=torch.float32, **self._source[1]).eval()
        self.label = spec.get("label", "transformers")
        self.vocab_size = self.model.config.vocab_size
        c = self.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        embed = self.model.get_input_embeddings().weight
        tied = embed is self.model.get_output_embeddings().weight
        # parameters() lists a tied weight once; an untied embedding is only gathered
        self.weight_bytes_per_token = sum(p.nbytes for p in self.model.parameters()) - (
            0 if tied else embed.nbytes)
        self.kv_bytes_per_position = c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 4
        self.info = {"model": spec["model"], "dtype": "float32", "threads": torch.get_num_threads(),
                     "method": "one greedy generate() with a KV cache per run; a streamer "
                               "stamps each new token: ttft_s = first token - call start "
                               "(prefill of the prompt), decode_tokens_per_s = (n - 1) / "
                               "(last token - first token)"}

    def encode(self, text: str) -> list[int]:
        from transformers import AutoTokenizer

        # loaded only here: configs usually take their prompt ids from the xlr-jax engine
        return AutoTokenizer.from_pretrained(self._source[0], **self._source[1]).encode(text)

    def generate(self, ids: list[int], n: int) -> Run:
        import torch

        stamps = _TokenTimes()
        inputs = torch.tensor([ids])
        start = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(inputs, attention_mask=torch.ones_like(inputs),
                                      max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      pad_token_id=self.model.generation_config.eos_token_id,
                                      streamer=stamps)
        first, last = stamps.times[0], stamps.times[-1]
        return Run(out[0, len(ids):].tolist(), first - start,
                   (n - 1) / (last - first) if n > 1 else 0.0)


class _TokenTimes:
    """A generate() streamer that records when each new token reaches the host."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False  # generate() puts the prompt first

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


class LlamaCppRunner:
    """llama.cpp (llama-cpp-python) on a GGUF file, greedy by the argmax of its logits, on
    `threads` threads (default 2) for prefill and decode alike."""

    kind = "llama.cpp"

    def __init__(self, spec: dict):
        import llama_cpp

        from xlr_jax.loading.gguf_file import GGUFFile

        path = resolve_model(spec["model"])
        threads = spec.get("threads", 2)
        self.llm = llama_cpp.Llama(str(path), n_threads=threads, n_threads_batch=threads,
                                   n_ctx=spec.get("n_ctx", 4096), verbose=False)
        self.label = spec.get("label", "llama.cpp")
        self.vocab_size = self.llm.n_vocab()
        tensors = {t.name: t.data.nbytes for t in GGUFFile(path).tensors}
        # an untied input embedding is only gathered (as for the other runners)
        self.weight_bytes_per_token = sum(tensors.values()) - (
            tensors["token_embd.weight"] if "output.weight" in tensors else 0)
        c = self.llm.metadata
        arch = c["general.architecture"]
        layers, kv_heads = int(c[f"{arch}.block_count"]), int(c[f"{arch}.attention.head_count_kv"])
        head_dim = int(c[f"{arch}.embedding_length"]) // int(c[f"{arch}.attention.head_count"])
        self.kv_bytes_per_position = layers * 2 * kv_heads * head_dim * 2  # f16 KV
        self.info = {"model": spec["model"], "file": path.name, "threads": threads,
                     "llama_cpp_python": llama_cpp.__version__,
                     "method": "eval() of the prompt, then one eval() a token, the next "
                               "token the argmax of the last logits: ttft_s = the prompt's "
                               "eval and its argmax, decode_tokens_per_s = (n - 1) / (last "
                               "token - first token)"}

    def encode(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)

    def _next(self) -> int:
        import llama_cpp
        import numpy as np

        logits = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.vocab_size,))))

    def generate(self, ids: list[int], n: int) -> Run:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(ids)
        tokens, times = [self._next()], [time.perf_counter()]
        while len(tokens) < n:
            self.llm.eval(tokens[-1:])
            tokens.append(self._next())
            times.append(time.perf_counter())
        return Run(tokens, times[0] - start,
                   (n - 1) / (times[-1] - times[0]) if n > 1 else 0.0)


RUNNERS = {"xlr": load_xlr, "xlr-random": random_xlr, "transformers": TransformersRunner,
           "llama.cpp": LlamaCppRunner}


def prompt_ids(spec: dict, n: int, runner) -> list[int]:
    """`n` prompt ids: a passage with its sentences shuffled by a fixed seed, or random ids."""
    rng = random.Random(spec.get("seed", 0))
    if spec["kind"] == "random":
        return [rng.randrange(runner.vocab_size) for _ in range(n)]
    sentences = [s.strip() + "." for s in spec["passage"].split(".") if s.strip()]
    text, ids = "", []
    while len(ids) < n:
        rng.shuffle(sentences)
        text += " ".join(sentences) + "\n\n"
        ids = runner.encode(text)
    return ids[:n]


def measure(runner, ids: list[int], n: int, repeats: int, warmup: int) -> dict:
    """Median TTFT and decode speed over `repeats` runs, after `warmup` runs of the same shapes."""
    warm = [runner.generate(ids, n) for _ in range(warmup)]
    runs = [runner.generate(ids, n) for _ in tqdm(range(repeats), desc=runner.label, unit="run")]
    return {
        "ttft_s": statistics.median(r.ttft_s for r in runs),
        "decode_tokens_per_s": statistics.median(r.decode_tokens_per_s for r in runs),
        "ttft_s_runs": [r.ttft_s for r in runs],
        "decode_tokens_per_s_runs": [r.decode_tokens_per_s for r in runs],
        "warmup_ttft_s": [r.ttft_s for r in warm],  # includes compilation for xlr-jax
        "completion_tokens": len(runs[0].tokens),
        "tokens_identical_across_runs": all(r.tokens == runs[0].tokens for r in runs + warm),
        "token_ids": runs[0].tokens,
    }


def measure_streams(runner, prompts: list[list[int]], n: int, counts: list[int], repeats: int,
                    warmup: int) -> dict:
    """Aggregate decode speed of each count of concurrent streams (1 among them; the first
    `count` prompts each time), median over `repeats` runs after `warmup` runs of each
    count; `batching_speedup` = the most streams' aggregate over one stream's."""
    runs: dict[int, list[StreamsRun]] = {}
    for count in counts:
        for _ in range(warmup):
            runner.generate_streams(prompts[:count], n)
    for _ in tqdm(range(repeats), desc=runner.label, unit="round"):
        for count in counts:  # interleaved: a slower minute slows every count alike
            runs.setdefault(count, []).append(runner.generate_streams(prompts[:count], n))
    streams = {str(count): {
        "decode_tokens_per_s": statistics.median(r.decode_tokens_per_s for r in rs),
        "decode_tokens_per_s_runs": [r.decode_tokens_per_s for r in rs],
        "span_tokens_per_s": statistics.median(r.span_tokens_per_s for r in rs),
        "tokens_identical_across_runs": all(r.tokens == rs[0].tokens for r in rs),
    } for count, rs in runs.items()}
    return {"method": "all prompts submitted at once; decode_tokens_per_s = the sum over "
                      "streams of (n - 1) / (its last token - its first token): the streams' "
                      "aggregate while they decode side by side (a stream's span also holds "
                      "the steps that prefilled later streams, so it is low, if anything); "
                      "span_tokens_per_s = all streams' n - 1 tokens / (the last token of "
                      "any - the first token of any), prefill steps included",
            "streams": streams,
            "batching_speedup": (streams[str(max(counts))]["decode_tokens_per_s"]
                                 / streams["1"]["decode_tokens_per_s"])}


def roofline(runner, prompt_tokens: int, decode_tokens: int, bandwidth_gb_per_s: float,
             measured_tokens_per_s: float) -> dict:
    """Bytes one decode step must read (weights + KV at the mean context) against bandwidth."""
    # decode step j (1..n-1) attends over prompt + j positions: mean prompt + n/2
    context = prompt_tokens + decode_tokens / 2
    kv = runner.kv_bytes_per_position * context
    per_token = runner.weight_bytes_per_token + kv
    best = bandwidth_gb_per_s * 1e9 / per_token
    return {"method": "bytes_per_token = weights read per token (all params, less an untied "
                      "input embedding, which is only gathered) + KV bytes per position x the "
                      "mean decode context; roofline = bandwidth / bytes_per_token",
            "weight_bytes_per_token": runner.weight_bytes_per_token,
            "kv_bytes_per_position": runner.kv_bytes_per_position,
            "mean_decode_context_tokens": context, "kv_bytes_per_token": kv,
            "bytes_per_token": per_token,
            "decode_bytes_total": per_token * (decode_tokens - 1),
            "roofline_decode_tokens_per_s": best,
            "roofline_fraction": measured_tokens_per_s / best}


def leading_agreement(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy runs share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

