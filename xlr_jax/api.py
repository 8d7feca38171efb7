"""The public Python API: `load_model` and `Model` (generate, chat, stream)."""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import threading
import time
from pathlib import Path
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from xlr_jax.errors import InvalidRequestError, PlanError
from xlr_jax.kv.tier_store import DEFAULT_QUOTA, TierStore
from xlr_jax.loading.prompts import PromptEncoder
from xlr_jax.loading.registry import default_cache_dir, resolve_model
from xlr_jax.loading.weights import ModelSource, load_weights, open_source
from xlr_jax.model.decoder import params_from_arrays
from xlr_jax.model.tensor_parallel import TensorParallel, expert_parallel_for, make_mesh
from xlr_jax.model.executables import ExecutableStore, fingerprint
from xlr_jax.model.sampling_params import SamplingParams
from xlr_jax.ops import cpu_kernels
from xlr_jax.planning.hardware import HardwareProfile, probe
from xlr_jax.planning.mapper import ExecutionPlan, Workload, draft_bytes, plan
from xlr_jax.runtime.engine import Engine
from xlr_jax.runtime.loop import EngineLoop, RequestHandle
from xlr_jax.runtime.mirror import Mirror
from xlr_jax.speculative.config import Draft, ModelDraft, SpecConfig, resolve_draft


def load_model(name_or_path: str | os.PathLike | ModelSource = "smollm2", *,
               dtype: str | None = None,
               page_size: int | None = None, num_pages: int | None = None,
               max_batch: int | None = None, prefill_chunk: int | None = None,
               max_waiting: int | None = None, max_step_tokens: int | None = None,
               max_context: int | None = None, attn_impl: str = "auto",
               linear_impl: str = "auto",
               kv_dtype: str | None = None, hardware: HardwareProfile | None = None,
               prefix_cache: bool = True, cache_dir: str | os.PathLike | None = None,
               params_cache: bool = True, compile_cache: bool = True,
               compiler_options: dict | None = None, weights: str | None = None,
               tensor_parallel: int | None = None, expert_parallel: bool | None = None,
               prefill_devices: int | None = None,
               prefix_disk_quota: int = DEFAULT_QUOTA) -> "Model":
    """Load a model: "smollm2" (embedded), a .gguf file, a Hugging Face directory, or a
    source `xlr_jax.loading.weights.open_source` opened (with the same cache_dir).

    The Capability Mapper (`xlr_jax.plan`) chooses everything not given, from the
    probed hardware (`hardware`, default `xlr_jax.probe()`); `model.plan` says
    what it chose and why. Overrides that cannot fit raise PlanError.
    dtype: compute/weight dtype ("float32" or "bfloat16").
    weights: the weight matrices' format: "float" (in dtype), "native" (a GGUF's Q4_0,
    Q4_1, Q8_0, Q4_K and Q6_K matrices kept quantized), "int8" or "int4" (quantized at
    load, in groups of 32) or "fp8" (e4m3, a scale a row); default: the plan's
    (`model.plan.reasons["weights"]` says why).
    tensor_parallel: devices each layer is split over (a JAX mesh's "model" axis: heads
    and FFN columns per device, two all-reduces a layer; model.tensor_parallel); default:
    the plan's (one device where the weights fit one). expert_parallel: split that way,
    a MoE's experts go whole to the devices (E / N each) instead of each split by its FFN
    width; default: wherever they divide evenly.
    prefill_devices: prompts prefill on this many devices of their own (after the
    tensor_parallel decode devices; each layer split over them), their KV pages moved to
    the decode devices when a prompt is whole, so running streams never wait for a
    prefill chunk (prefill/decode disaggregation); the prefix cache is then off and
    speculative decoding refused. Default: none (chunks ride in the decode steps).
    page_size, num_pages: the KV page pool.
    max_batch: sequences decoded together; prefill_chunk: tokens per prefill call.
    max_waiting: requests queued beyond the running batch before `submit` raises
    QueueFullError.
    max_step_tokens: the step budget, tokens one step carries while requests decode (its
    decode rows and the prefill chunk beside them): smaller keeps the running streams'
    inter-token latency down while a new prompt prefills, larger gives that prompt its
    first token sooner. A prompt with nothing else running prefills in whole chunks.
    attn_impl: "auto" (the plan's: Pallas on GPU; on the CPU its attention kernel where it
    builds, else XLA), "pallas", "xla" or "cpu".
    linear_impl: a step's weight products of a few rows: "auto" (the plan's: on the CPU
    with f32 weights its few-row kernel where it builds, else XLA), "xla" or "cpu".
    kv_dtype: KV page dtype (default: dtype); "int8" or "fp8" store quantized
    pages with per-token-per-head scales.
    compiler_options: XLA options for every step ({} for XLA's defaults; default: the
    plan's, e.g. 512-bit vectors on an AVX-512 CPU).
    prefix_cache: share the KV of repeated prompt prefixes (False: off, for ablations).
    cache_dir: where the model file's config and tokenizer (source/), converted params
    (params/), stable-tier KV (prefix/) and, with compile_cache, compiled steps
    (executables/, jax-compile/) are kept (default ~/.cache/xlr-jax); a second process
    parses no model file, converts nothing, skips the stable tiers' prefill and compiles
    nothing. `model.load_info` says what came from the cache and what the load took.
    prefix_disk_quota: bytes of stable-tier snapshots kept under cache_dir/prefix (the
    least recently used go first; default 4 GiB).

    Across processes (after `jax.distributed.initialize`; `xlr ... --coordinator`), every
    process loads the same model, split over every device of every process; process 0
    (`model.leads`) takes requests and the others call `model.follow()`. Stable tiers
    stay in memory and compiled steps in JAX's own cache there, and speculative decoding
    is refused.
    """
    for name, value in (("page_size", page_size), ("num_pages", num_pages),
                        ("max_batch", max_batch), ("prefill_chunk", prefill_chunk),
                        ("max_context", max_context), ("max_waiting", max_waiting),
                        ("max_step_tokens", max_step_tokens)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise InvalidRequestError(f"{name} must be a positive integer (got {value!r})")
    start = time.perf_counter()
    kernels = attn_impl != "xla" or linear_impl != "xla"
    if kernels:
        cpu_kernels.build_error()  # a build the CPU kernels need runs beside the parsing
    cache_root = Path(cache_dir or default_cache_dir())
    cache = cache_root if params_cache else None
    # the model opened once: a GGUF is parsed at most once, and not at all when cached
    source = (name_or_path if isinstance(name_or_path, ModelSource)
              else open_source(resolve_model(name_or_path), cache))
    hw = hardware or probe()
    mirror = Mirror() if Mirror.needed() else None
    if mirror and tensor_parallel not in (None, jax.device_count()):
        raise PlanError(f"across {jax.process_count()} processes a model splits over all "
                        f"{jax.device_count()} devices (got tensor_parallel "
                        f"{tensor_parallel}); leave it out")
    if mirror:
        tensor_parallel = jax.device_count()
        if prefill_devices:
            raise PlanError("prefill_devices splits one process's devices; across processes "
                            "every device runs every step: leave it out")

    def make_plan(formats: str | None = weights) -> ExecutionPlan:
        return plan(hw, source.config,
                    Workload(max_context=max_context, max_batch=max_batch,
                             prefill_chunk=prefill_chunk, max_waiting=max_waiting,
                             max_step_tokens=max_step_tokens),
                    dtype=dtype, kv_dtype=kv_dtype, page_size=page_size, num_pages=num_pages,
                    attn_impl=attn_impl, linear_impl=linear_impl,
                    compiler_options=compiler_options, weights=formats,
                    tensor_parallel=tensor_parallel, expert_parallel=expert_parallel,
                    prefill_devices=prefill_devices)

    execution = make_plan()
    compute = jnp.dtype(execution.compute_dtype)
    loaded = load_weights(source, dtype=np.dtype(compute), cache_dir=cache,
                          weights=execution.weights)
    # what is left of a kernel build, at most a while (see cpu_kernels); the plan then
    # takes the kernels it may use, before anything is compiled (its dtypes stay)
    if (kernels and "cpu" not in (execution.attn_impl, execution.linear_impl)
            and cpu_kernels.build_error(wait_s=cpu_kernels.wait_s_for_load()) is None):
        # (the weights stay in the format they were read in, and the reason for it)
        remade = make_plan(execution.weights)
        execution = dataclasses.replace(remade, reasons={
            **remade.reasons, "weights": execution.reasons["weights"]})
    # the mesh the plan splits each layer over (model.tensor_parallel), if more than one
    tp = (TensorParallel(make_mesh(execution.tensor_parallel), execution.expert_parallel)
          if execution.tensor_parallel > 1 else None)
    # prefill on devices of its own: a copy of the params split over them (see Engine)
    ptp = prefill_params = None
    if (n := execution.prefill_devices):
        ptp = TensorParallel(make_mesh(n, first=execution.tensor_parallel),
                             expert_parallel_for(source.config, n))
        prefill_params = params_from_arrays(loaded.params, compute, source.config, ptp)
        prefix_cache = False  # (the plan's reason says why)
    # per-layer device params straight from the host arrays, which are then let go
    params, loaded.params = params_from_arrays(loaded.params, compute, source.config, tp), None
    store = None
    if compile_cache:
        _use_compilation_cache(cache_root)
    if compile_cache and not mirror:  # (its executables are one process's)
        store = ExecutableStore(cache_root / "executables" / _steps_fingerprint(
            source.config, execution, params), tp and list(tp.mesh.devices.flat))
        store.preload()  # read on other threads while the KV pool is allocated
    # cached KV is only valid for the same weights, dtype and page layout
    namespace = (f"{loaded.source_hash}-{execution.compute_dtype}-{execution.kv_dtype}"
                 f"-{execution.page_size}" + (f"-tp{tp.size}" if tp else ""))
    # a stable tier's pages on disk are read and written whole by one process: not across
    tiers = (None if mirror or ptp
             else TierStore(cache_root / "prefix", namespace, prefix_disk_quota))
    engine = Engine(source.config, params, source.tokenizer, execution,
                    prefix_cache=prefix_cache, cache_namespace=namespace, tier_store=tiers,
                    tp=tp, mirror=mirror, prefill_params=prefill_params, prefill_tp=ptp)
    preloaded = engine.runner.use_step_store(store) if store else 0
    load_info = {"load_s": time.perf_counter() - start, "params_s": loaded.load_s,
                 "params_from_cache": loaded.from_cache,
                 "metadata_from_cache": source.from_cache, "steps_preloaded": preloaded,
                 "source": str(loaded.source), "source_hash": loaded.source_hash,
                 "cpu_kernels_off": cpu_kernels.status() if kernels else None}
    return Model(engine, execution, load_info=load_info)


def _steps_fingerprint(config, execution: ExecutionPlan, params) -> str:
    """What the compiled steps depend on beyond their shapes: the model, the plan's
    dtypes, KV pool, block tables, attention, few-row products and compile options, and
    the params' layout."""
    e = execution
    return fingerprint([config.to_json(), e.compute_dtype, e.kv_dtype, e.page_size,
                        e.num_pages, e.buckets.table_width, e.attn_block_pages, e.attn_impl,
                        e.reduce_rows, e.linear_impl, e.kernel_rows,
                        sorted(e.compiler_options.items()), sorted(e.mesh.items()),
                        e.expert_parallel], params)


def _use_compilation_cache(cache_root: Path) -> None:
    """JAX's persistent cache for every executable, however small or quick to compile
    (steps also have their own store; this covers speculative cycles, page copies...)."""
    if not jax.config.jax_compilation_cache_dir:  # the first load of a process picks it
        jax.config.update("jax_compilation_cache_dir", str(cache_root / "jax-compile"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


# Model.submit's arguments that make a request's SamplingParams, in Model._sampling's order
SAMPLING_ARGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "ignore_eos", "stop_token_ids", "logprobs", "logits_processor")


class Model:
    """A loaded model with its tokenizer and KV cache, served by an always-on loop.

    Any number of threads may call it at once: each call submits requests to the
    model's loop thread (`xlr_jax.runtime.loop`), which batches them with whatever
    else is running and hands back results as they come.
    """

    def __init__(self, engine: Engine, plan: ExecutionPlan, *, load_info: dict):
        self.engine, self.plan = engine, plan
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.prompts = PromptEncoder(self.tokenizer, self.config.vocab_size, plan.max_context)
        self.dtype = plan.compute_dtype
        self.load_info = load_info
        # separate draft models by (path, weight format), and the memory each takes from
        # the plan's budget
        self._drafts: dict[tuple[str, str], ModelDraft] = {}
        self._draft_bytes: dict[tuple[str, str], int] = {}
        self._draft_lock = threading.Lock()
        self._loop = EngineLoop(engine, plan.max_waiting)

    # ------------------------------------------------------------ generation

    def submit(self, prompt_or_messages, max_tokens: int = 256, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int = 0,
               stop: str | Sequence[str] | None = None, ignore_eos: bool = False,
               tools: list | None = None, stop_token_ids: Sequence[int] | None = None,
               speculative: dict | SpecConfig | None = None,
               logprobs: int | None = None, logits_processor=None) -> RequestHandle:
        """Queue one request and return at once: a prompt (string, token ids or a tiered
        dict, as for `generate`) or chat messages (a list of {"role", "content"}).
        Iterate the handle for text pieces, `.tokens()` for token ids; `.result()` waits
        for the GenerationResult; `.cancel()` stops it. Past the plan's max_waiting
        queued requests, QueueFullError. `logprobs=k` (0-20): the result's `logprobs`
        give each token's log-probability and the k most likely tokens'.
        `logits_processor(generated_ids) -> bias [vocab] or None`: added to the logits
        before each sampled token (-inf masks a token: constrained output); it runs on
        the loop thread, so keep it quick; if it raises, the request alone ends
        ("abort", metrics["error"])."""
        params = self._sampling(max_tokens, temperature, top_p, top_k, min_p, seed, stop,
                                ignore_eos, stop_token_ids, logprobs, logits_processor)
        return self._submit([self.prompts.encode(prompt_or_messages, tools)], params,
                            speculative)[0]

    async def agenerate(self, prompt_or_messages, **kwargs):
        """`submit` for asyncio: await the GenerationResult."""
        return await self._asubmit(prompt_or_messages, kwargs).aresult()

    async def astream(self, prompt_or_messages, **kwargs):
        """`submit` for asyncio: `async for piece in model.astream(...)`."""
        async for piece in self._asubmit(prompt_or_messages, kwargs):
            yield piece

    def asubmit(self, prompt_or_messages, **kwargs) -> RequestHandle:
        """`submit` for asyncio, from a coroutine: the handle's `async for` and
        `aresult()` wake the running event loop (a server's handlers use it)."""
        return self._asubmit(prompt_or_messages, kwargs)

    def encode(self, prompt_or_messages, tools: list | None = None
               ) -> tuple[list[int], tuple[int, int]]:
        """What `submit` makes of a prompt or conversation: its token ids and (stable end,
        context end) tier boundaries. For callers that tokenize on their own worker
        threads and then submit `{"stable": ids[:s], "context": ids[s:c], "volatile":
        ids[c:]}` (the server). Raises as `submit` does (PromptTooLongError...)."""
        return self.prompts.encode(prompt_or_messages, tools)

    def _asubmit(self, prompt_or_messages, kwargs) -> RequestHandle:
        """`submit` with the caller's event loop attached (its arguments, checked the same)."""
        try:
            bound = inspect.signature(Model.submit).bind(self, prompt_or_messages, **kwargs)
        except TypeError as e:
            raise InvalidRequestError(f"{e}; a request takes the arguments of Model.submit") \
                from e
        bound.apply_defaults()
        a = bound.arguments
        params = self._sampling(*(a[n] for n in SAMPLING_ARGS))
        return self._submit([self.prompts.encode(prompt_or_messages, a["tools"])], params,
                            a["speculative"], aio_loop=asyncio.get_running_loop())[0]

    def generate(self, prompt_or_prompts, max_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int = 0,
                 stop: str | Sequence[str] | None = None, ignore_eos: bool = False,
                 speculative: dict | SpecConfig | None = None,
                 stop_token_ids: Sequence[int] | None = None, logprobs: int | None = None,
                 logits_processor=None):
        """Complete one prompt or a list of them (results in order).

        A prompt is a string, token ids, or a tiered dict {"stable": ..., "context": ...,
        "volatile": ...} of strings or ids: the stable tier is pinned in the prefix
        cache, so every later request that starts with it skips its prefill.
        speculative: {"method": "exact"|"smc", "draft": "ngram"|"self:K"|PATH,
        "gamma": G, "particles": "auto"|N, "ess_threshold": T, "min_agreement": A} (see
        SpecConfig); exact speculation returns the target's own distribution
        (greedy: the same tokens); SMC (temperature only, a self:K or model draft)
        returns one particle drawn by weight, targeting the same distribution with
        SMC's finite-particle bias, and falls back to exact speculation when the draft
        agrees too little with the target (metrics["smc_fallback"] says why).
        """
        single = (isinstance(prompt_or_prompts, (str, dict))
                  or _is_token_list(prompt_or_prompts))
        prompts = [prompt_or_prompts] if single else list(prompt_or_prompts)
        if not prompts:
            raise InvalidRequestError("no prompts given; pass a string or a list of strings")
        params = self._sampling(max_tokens, temperature, top_p, top_k, min_p, seed, stop,
                                ignore_eos, stop_token_ids, logprobs, logits_processor)
        results = [h.result() for h in self._submit([self.prompts.encode(p) for p in prompts],
                                                     params, speculative)]
        return results[0] if single else results

    def chat(self, messages, max_tokens: int = 256, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int = 0,
             stop: str | Sequence[str] | None = None, tools: list | None = None,
             speculative: dict | SpecConfig | None = None,
             stop_token_ids: Sequence[int] | None = None, logprobs: int | None = None):
        """Reply to a conversation ([{"role", "content"}, ...]) or a list of conversations."""
        single = bool(messages) and isinstance(messages[0], dict)
        encoded = [self.prompts.encode_chat(m, tools) for m in ([messages] if single else messages)]
        params = self._sampling(max_tokens, temperature, top_p, top_k, min_p, seed, stop,
                                False, stop_token_ids, logprobs)
        results = [h.result() for h in self._submit(encoded, params, speculative)]
        return results[0] if single else results

    def stream(self, prompt, max_tokens: int = 256, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int = 0,
               stop: str | Sequence[str] | None = None, chat: bool = False,
               ignore_eos: bool = False, result: list | None = None,
               speculative: dict | SpecConfig | None = None,
               stop_token_ids: Sequence[int] | None = None) -> Iterator[str]:
        """Yield text pieces as they are generated; `result`, if a list, receives the result.
        Closing the iterator early cancels the request. (SMC speculation releases its
        text at the end: particles change until then.)"""
        params = self._sampling(max_tokens, temperature, top_p, top_k, min_p, seed, stop,
                                ignore_eos, stop_token_ids)
        encoded = self.prompts.encode_chat(prompt) if chat else self.prompts.encode(prompt)
        handle = self._submit([encoded], params, speculative)[0]
        yield from handle
        if result is not None:
            result.append(handle.result())

    def stats(self) -> dict:
        """One snapshot, taken between steps: requests running and waiting, and the
        engine's counters (see Engine.stats: KV pages, preemptions, steps and their
        time, speculative totals, prefix-cache queries and hits per tier)."""
        return self._loop.call(lambda: {**self._loop.counts(),
                                             **self.engine.stats()})

    def shutdown(self) -> None:
        """Stop the model's loop: requests in flight end with finish_reason "abort" and
        give their pages back; later calls raise. (Interpreter exit does this too.)
        Across processes, the leader's also ends the followers' `follow`."""
        self._loop.shutdown()
        if self.engine.runner.mirror and self.leads:  # after the loop's last step
            self.engine.runner.stop_followers()

    @property
    def leads(self) -> bool:
        """Whether this process takes requests: always, but for the followers of a model
        loaded across processes (see load_model)."""
        return self.engine.runner.mirror is None or self.engine.runner.mirror.leads

    def follow(self) -> None:
        """A follower process's part: run the leader's steps on this process's devices
        until the leader's model shuts down."""
        if self.leads:
            raise InvalidRequestError("process 0 leads: it takes requests, not follows")
        self.engine.runner.follow()

    def chat_prompt(self, messages, tools: list | None = None) -> str:
        """The conversation rendered by the chat template, ready for the assistant's turn."""
        return self.prompts.chat_prompt(messages, tools)

    def logits(self, prompt) -> np.ndarray:
        """Next-token logits [prompt_tokens, vocab] (f32) at every prompt position."""
        ids = self.prompts.ids(prompt)
        return self._loop.call(lambda: self.engine.logits(ids))

    # ------------------------------------------------------------ helpers

    @staticmethod
    def _sampling(max_tokens, temperature, top_p, top_k, min_p, seed, stop, ignore_eos,
                  stop_token_ids=None, logprobs=None, logits_processor=None):
        try:
            stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
            return SamplingParams(temperature=float(temperature), top_k=int(top_k),
                                  top_p=float(top_p), min_p=float(min_p), seed=int(seed),
                                  max_tokens=int(max_tokens), stop=stops,
                                  ignore_eos=bool(ignore_eos),
                                  stop_token_ids=tuple(int(t) for t in stop_token_ids or ()),
                                  logprobs=None if logprobs is None else int(logprobs),
                                  logits_processor=logits_processor)
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(f"invalid sampling value: {e}") from e

    def _speculation(self, speculative) -> tuple[SpecConfig | None, Draft | None]:
        """The validated spec and its draft (a draft model is loaded once, then kept)."""
        policy = self.plan.speculative
        spec = SpecConfig.parse(speculative, policy.gamma, policy.draft or "ngram")
        if spec is None:
            return None, None
        if self.engine.runner.mirror:
            raise InvalidRequestError("speculative decoding runs in one process only; this "
                                      "model spans several: send the request without it")
        if self.engine.prefill_runner is not None:
            raise InvalidRequestError("speculative decoding runs where prefill and decode "
                                      "share devices; this model prefills on devices of "
                                      "its own (prefill_devices): send the request without it")
        weights = spec.draft_weights or self.plan.weights
        return spec, resolve_draft(spec.draft, self.config,
                                   lambda path: self._load_draft(path, weights))

    def _load_draft(self, path: str, weights: str) -> ModelDraft:
        """A separate draft model with its matrices in `weights`, checked against the
        target's vocabulary and the memory the plan left (its weights and its KV over the
        same pages) before it is read."""
        key = (path, weights)
        with self._draft_lock:
            if key not in self._drafts:
                self._drafts[key], self._draft_bytes[key] = self._read_draft(path, weights)
            return self._drafts[key]

    def _read_draft(self, path: str, weights: str) -> tuple[ModelDraft, int]:
        source = open_source(path)  # parsed once: its config, then its weights
        config = source.config
        if config.vocab_size != self.config.vocab_size:
            raise InvalidRequestError(
                f"draft model {path} has a vocabulary of {config.vocab_size} but the "
                f"target's is {self.config.vocab_size}; a draft must share the tokenizer")
        size = draft_bytes(self.plan, config, path, taken=sum(self._draft_bytes.values()),
                           weights=weights)
        tp = self.engine.runner.tp  # a draft splits over the target's mesh
        if tp is not None:
            tp.check(config)
        loaded = load_weights(source, dtype=np.dtype(self.dtype), weights=weights)
        params = params_from_arrays(loaded.params, jnp.dtype(self.dtype), config, tp)
        return ModelDraft(str(path), config, params), size

    def _submit(self, encoded, params: SamplingParams, speculative,
                aio_loop=None) -> list[RequestHandle]:
        """Queue encoded prompts as requests, speculating as `speculative` says; refusals
        raise here, in the caller's thread."""
        spec, draft = self._speculation(speculative)
        requests = [self.engine.request(self._loop.new_id(), ids, params, tiers,
                                        spec, draft)
                    for ids, tiers in encoded]
        return self._loop.submit(requests, aio_loop)

    @property
    def prefix_cache(self):
        """The engine's PrefixCache (`.stats()`, `.register_stable()`...), None when off."""
        return self.engine.kv.cache

    def warmup(self, progress: bool = True) -> list[dict]:
        """Compile every bucket of the plan now (see Steps.warmup); returns compile times."""
        return self._loop.call(lambda: self.engine.warmup(progress))

    def info(self) -> dict:
        c, e = self.config, self.engine
        return {
            "architecture": c.architecture, "layers": c.num_layers, "hidden_size": c.hidden_size,
            "heads": c.num_heads, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "ffn_size": c.intermediate_size, "vocab_size": c.vocab_size,
            "max_context": e.max_context, "tied_embeddings": c.tie_embeddings,
            "parameters": c.num_params(), "param_bytes": e.runner.params.nbytes(),
            **({"experts": {"total": c.num_experts, "active": c.experts_per_token,
                            "shared": c.shared_experts}} if c.num_experts else {}),
            # the Execution Plan, plus the KV actually allocated
            "plan": {**self.plan.to_dict(), "dtype": self.dtype,
                     "kv_bytes": e.runner.kv.nbytes()},
            "load": self.load_info,
        }


def _is_token_list(x) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(t, (int, np.integer)) for t in x)



