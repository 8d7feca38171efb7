"""The host-side engine: requests, continuous batching, stop rules, metrics.

Host state (page pool, block tables, queues) lives here in plain Python; the
device sees only the jitted steps of `xlr_jax.model.steps`. One loop (`serve`) runs
every request: each step carries a token of every running plain request and a
prefill chunk of the oldest one still prefilling, and exact speculating requests
verify their drafts as rows of it; between steps, requests join and leave, and
the other speculating requests run their cycles (`speculative.runner`). Plain
requests take pages as they grow, and the newest is preempted when the pool
runs short; speculating ones are budgeted their worst case up front.

Decode-only steps run one step ahead: while step n executes, step n+1 is already
dispatched on step n's tokens (still on the device), so the host's bookkeeping
and dispatch stay off the critical path (+3-4% tokens/s on the CPU, measured).
A row that finishes meanwhile only wastes its slot in that one step.
"""
from __future__ import annotations

import copy
import itertools
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Iterator

import jax.numpy as jnp
import numpy as np

from xlr_jax.errors import InvalidRequestError, OutOfPagesError, PromptTooLongError
from xlr_jax.kv.paged_kv import (PagedKV, PagePool, SequencePages, copy_pages, leaves, read_pages,
                                 restore_lowering, write_pages)
from xlr_jax.kv.prefix_cache import PrefixCache, tier_counts
from xlr_jax.kv.tier_store import TierStore
from xlr_jax.loading.tokenizer import Tokenizer
from xlr_jax.model.config import ModelConfig
from xlr_jax.model.decoder import Params
from xlr_jax.model.executables import ExecutableStore, compile_for_later
from xlr_jax.model.sampling import SamplingBatch, SamplingParams, sampler_for
from xlr_jax.model.steps import Steps
from xlr_jax.planning.mapper import (MAX_PINNED_SHARE, MAX_PREEMPTIONS, Buckets, ExecutionPlan,
                                     buckets_for, first_chunk, pick_bucket)
from xlr_jax.speculative.cycle import Draft, SpecConfig, SpecSteps
from xlr_jax.speculative.runner import SpecRunner, check_request, start_metrics


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str          # "stop" (EOS or a stop string), "length" or "abort"
    metrics: dict = field(default_factory=dict)
    # SMC-SD: every final particle, {"token_ids", "log_weight" (normalized)}; with
    # metrics["log_normalizer"] they give unbiased weighted estimates (see smc.py)
    particles: list[dict] | None = None
    # with logprobs=k: per generated token {"token_id", "logprob", "top_logprobs": the k
    # most likely [{"token_id", "logprob"}]}, under the model's raw distribution
    logprobs: list[dict] | None = None


class _StopText:
    """Accumulates text; finds stop strings; holds back a tail that may start one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.emitted = 0

    def add(self, piece: str) -> tuple[str, bool]:
        """Append a piece; return (text safe to emit now, whether a stop string was hit)."""
        search_from = max(0, len(self.text) - self.hold)
        self.text += piece
        hits = [i for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return self._emit(len(self.text)), True
        return self._emit(len(self.text) - self.hold), False

    def finish(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out, self.emitted = self.text[self.emitted:upto], upto
        return out


class _Request:
    def __init__(self, index: int, prompt_ids: list[int], params: SamplingParams,
                 pool: PagePool, tokenizer: Tokenizer | None, max_context: int, start: float,
                 tiers: tuple[int, int] = (0, 0), spec: SpecConfig | None = None,
                 draft: Draft | None = None):
        self.index = index
        self.prompt_ids = prompt_ids
        # tier boundaries: [0, stable) stable, [stable, context) context, the rest volatile
        self.stable_end, self.context_end = tiers
        self.cached_tokens = 0
        self.cache_metrics: dict = {}
        # speculative decoding: its configuration and resolved draft (None: plain), an
        # SMC request's population while it runs, a draft model's KV written yet
        self.spec, self.draft = spec, draft
        self.spec_metrics: dict = start_metrics(spec) if spec else {}
        self.smc = None
        self.draft_prefilled = False
        self.pending = ""  # an SMC particle's text, released when it is chosen
        self.particles: list[dict] | None = None  # an SMC answer's final population
        self.params = params
        self.seq = SequencePages(pool)
        self.decoder = tokenizer.incremental_decoder() if tokenizer else None
        self.stop_text = _StopText(params.stop)
        eos = frozenset() if params.ignore_eos or not tokenizer else tokenizer.eos_token_ids
        self.eos = eos | frozenset(params.stop_token_ids)
        self.limit = min(params.max_tokens, max_context - len(prompt_ids))
        # pages this request may ever hold: prompt plus every token it may generate
        self.max_pages = -(-(len(prompt_ids) + self.limit) // pool.page_size)
        self.generated: list[int] = []
        self.forced: list[int] = []  # tokens to append at the next step boundary
        self.step_bias: np.ndarray | None = None  # its logits processor's, for the next step
        self.error: str | None = None  # why it was ended early, when it was its own fault
        # per generated token, when asked: {"token_id", "logprob", "top_logprobs"}
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.preemptions = 0
        self.protected = False  # preempted too often: admitted for its worst case, kept
        self.admitted_at = 0  # admission order: the newest running request is preempted first
        self.start, self.first_token_at, self.last_token_at = start, None, None
        self.first_admitted: float | None = None  # when it first joined the running batch

    @property
    def prefilled(self) -> int:
        return self.seq.length

    @property
    def context_ids(self) -> list[int]:
        """What the KV must hold before the next decode step: the prompt and every
        generated token but the last (not fed yet). A preempted request prefills these
        again when it resumes."""
        return self.prompt_ids + self.generated[:-1] if self.generated else self.prompt_ids

    @property
    def decoding(self) -> bool:
        """Prefilled and holding a token to feed: the request takes decode rows now. An
        SMC request is, once its particles carry it (its own pages went to them)."""
        return self.smc is not None or (bool(self.generated)
                                        and self.prefilled == self.context_len)

    @property
    def context_len(self) -> int:
        """len(context_ids), without building the list (the decode loop asks every step)."""
        return len(self.prompt_ids) + max(len(self.generated) - 1, 0)

    def prefill_left(self) -> int:
        """Tokens to prefill before the next place a chunk must end (`chunk_end`)."""
        end = self.stable_end if self.prefilled < self.stable_end else self.context_len
        return end - self.prefilled

    def chunk_end(self, chunk_max: int) -> int:
        """Where the next prefill chunk ends: after `chunk_max` tokens, or at the stable
        tier's end, so a later process that restores the tier from disk prefills the same
        last chunk as this one did, with the same compiled step."""
        end = self.prefilled + chunk_max
        return self.stable_end if self.prefilled < self.stable_end < end else end

    def fork(self) -> "_Request":
        """An SMC particle: the same request continuing independently from here, sharing
        every KV page written so far (copy-on-write)."""
        twin = copy.copy(self)
        twin.seq = self.seq.fork()
        twin.generated = list(self.generated)
        twin.decoder = self.decoder.fork() if self.decoder else None
        twin.stop_text = copy.copy(self.stop_text)
        twin.spec_metrics = dict(self.spec_metrics)
        twin.smc = None  # a particle of the population, not one
        return twin

    def accept(self, token: int, now: float, logprobs=None) -> str:
        """Record a sampled token (with its step's (chosen, top ids, top values) when the
        request asked for log-probabilities); return the text it makes visible."""
        self.generated.append(token)
        if self.logprobs is not None and logprobs is not None:
            chosen, ids, values = logprobs
            k = self.params.logprobs
            self.logprobs.append({"token_id": token, "logprob": float(chosen),
                                  "top_logprobs": [{"token_id": int(i), "logprob": float(v)}
                                                   for i, v in zip(ids[:k], values[:k])]})
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now
        piece, hit = "", False
        if token in self.eos:
            self.finish_reason = "stop"
        else:
            piece, hit = self.stop_text.add(self.decoder.push(token) if self.decoder else "")
            if hit:
                self.finish_reason = "stop"
        if self.finish_reason is None and len(self.generated) >= self.limit:
            self.finish_reason = "length"
        if self.finish_reason is not None and not hit:  # release held-back text
            tail, hit = self.stop_text.add(self.decoder.flush() if self.decoder else "")
            piece += tail if hit else tail + self.stop_text.finish()
            self.finish_reason = "stop" if hit else self.finish_reason
        return piece

    def end(self, reason: str) -> str:
        """End the request before its stop rules do; returns the text still held back."""
        self.finish_reason = reason
        piece, _ = self.stop_text.add(self.decoder.flush() if self.decoder else "")
        return piece + self.stop_text.finish()

    def abort(self) -> GenerationResult:
        """End the request from outside the loop ("abort"), with what it has so far; the
        loop gives its pages back before its next step."""
        self.end("abort")
        return self.result()

    def result(self) -> GenerationResult:
        n = len(self.generated)
        first = self.first_token_at or time.perf_counter()  # aborted before a token
        last = self.last_token_at or first
        decode_s = last - first
        metrics = {
            "ttft_s": first - self.start if self.first_token_at else None,
            "decode_tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            "itl_s": decode_s / (n - 1) if n > 1 else 0.0,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": n,
            "total_s": last - self.start,
            # waiting before it first joined the running batch (None: it never did)
            "queue_s": (self.first_admitted - self.start) if self.first_admitted else None,
            "cached_tokens": self.cached_tokens,
            "preemptions": self.preemptions,
            "prefilled_tokens": len(self.prompt_ids) - self.cached_tokens,
            **self.cache_metrics,
            **self.spec_metrics,
            **({"error": self.error} if self.error else {}),
        }
        return GenerationResult(self.stop_text.text, list(self.generated),
                                self.finish_reason, metrics, self.particles,
                                None if self.logprobs is None else list(self.logprobs))


@dataclass
class _Step:
    """A dispatched step: its decode rows, its chunk's request and the device tokens."""
    rows: list[_Request]
    chunk: _Request | None
    chunk_row: int  # the chunk's row in the tokens: after every (padded) decode row
    tokens: object
    logprobs: tuple  # chosen [rows], top ids and values [rows, k], on the device
    started: float   # when it was dispatched
    # speculating requests verifying drafts in rows after `rows`: (SpecRunner's
    # Proposal, first row, its last token's position)
    verify: list[tuple] = field(default_factory=list)
    logits: object = None  # [rows, V] on the device (device drafts are judged on them)
    sampling: object = None  # the rows' SamplingBatch (a late bias draws again with it)

    def logprob_rows(self) -> list | None:
        """Each row's (chosen, top ids, top values) on the host, if any row asked."""
        asked = [r for r in self.rows + [self.chunk] if r is not None]
        if not any(r.params.logprobs is not None for r in asked):
            return None
        chosen, ids, values = (np.asarray(x) for x in self.logprobs)
        return list(zip(chosen, ids, values))


class Engine:
    """Owns the device params and KV plus the host page pool; runs batches of requests."""

    def __init__(self, config: ModelConfig, params: Params, tokenizer: Tokenizer | None, *,
                 page_size: int, num_pages: int, max_batch: int, prefill_chunk: int,
                 max_context: int, attn_impl: str = "auto", kv_dtype=jnp.float32,
                 buckets: Buckets | None = None, prefix_cache: bool = True,
                 cache_namespace: str = "", tier_store: TierStore | None = None,
                 particle_cap: int = 4, compiler_options: dict | None = None,
                 max_preemptions: int = MAX_PREEMPTIONS,
                 max_pinned_share: float = MAX_PINNED_SHARE, max_step_tokens: int = 0,
                 step_cost_tokens: int = 0):
        self.config, self.params, self.tokenizer = config, params.per_layer(), tokenizer
        self.max_context = max_context
        self.max_batch = max_batch
        self.pool = PagePool(num_pages, page_size)
        # full prompt pages shared across requests; the namespace keeps models apart
        self.prefix_cache = (PrefixCache(self.pool, cache_namespace, max_pinned_share)
                             if prefix_cache else None)
        self.max_preemptions = max_preemptions
        self.tier_store = tier_store if prefix_cache else None  # stable tiers on disk
        self._persisted: set[tuple] = set()
        self.kv = PagedKV.create(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                                 head_dim=config.head_dim, num_pages=num_pages,
                                 page_size=page_size, dtype=kv_dtype)
        # shapes every step is compiled for (the plan's; CPU-style defaults otherwise)
        self.buckets = buckets or buckets_for(max_batch, prefill_chunk,
                                              -(-max_context // page_size), dense=True)
        # tokens one step may carry: every decode row and one prefill chunk
        self.max_step_tokens = max_step_tokens or max_batch + prefill_chunk
        self.step_cost_tokens = step_cost_tokens  # splits a prompt's tail (first_chunk)
        self.steps = Steps(config, self.buckets, attn_impl, compiler_options)
        self.spec_steps = SpecSteps(config, attn_impl, compiler_options)
        self.particle_cap = particle_cap  # SMC particles at most (the plan's policy)
        self.draft_kvs: dict[str, PagedKV] = {}  # separate draft models' KV, by name
        self.draft_steps: dict[str, Steps] = {}
        self._spec_runner = SpecRunner(self)
        self._lock = threading.RLock()  # one driver at a time; logits may run inside serve
        self._admissions = itertools.count(1)
        self.preemptions = 0
        self.steps_run = 0
        self._step_times: deque = deque(maxlen=256)  # seconds of the last plain steps
        self._last_accept = 0.0
        # speculative totals over every request: draft_tokens, accepted_tokens, target_passes
        self.speculation = dict.fromkeys(
            ("draft_tokens", "accepted_tokens", "target_passes", "cycles"), 0)
        # check the page pool's invariants after every step (slow; tests turn it on)
        self.debug_checks = os.environ.get("XLR_DEBUG_CHECKS") == "1"

    @classmethod
    def from_plan(cls, config: ModelConfig, params: Params, tokenizer: Tokenizer | None,
                  plan: ExecutionPlan, prefix_cache: bool = True,
                  cache_namespace: str = "", tier_store: TierStore | None = None) -> "Engine":
        """An engine with every size, dtype and bucket the Execution Plan fixed."""
        return cls(config, params, tokenizer, page_size=plan.page_size,
                   num_pages=plan.num_pages, max_batch=plan.max_batch,
                   prefill_chunk=plan.prefill_chunk, max_context=plan.max_context,
                   attn_impl=plan.attn_impl, kv_dtype=jnp.dtype(plan.kv_dtype),
                   buckets=plan.buckets, prefix_cache=prefix_cache,
                   cache_namespace=cache_namespace, tier_store=tier_store,
                   particle_cap=plan.speculative.particle_cap,
                   compiler_options=plan.compiler_options,
                   max_preemptions=plan.max_preemptions,
                   max_pinned_share=plan.max_pinned_share,
                   max_step_tokens=plan.max_step_tokens,
                   step_cost_tokens=plan.step_cost_tokens)

    def use_step_store(self, store: ExecutableStore) -> int:
        """Keep compiled steps in `store` across processes; take (and run once, on the
        scratch page) those it preloaded; returns how many."""
        self.kv, taken = self.steps.use_store(store, self.params, self.kv)
        return taken

    # ------------------------------------------------------------ validation

    def encode_prompt(self, prompt, bos: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer (no tokenizer.json); "
                                          "pass a list of token ids as the prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=bos)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary "
                                          f"[0, {self.config.vocab_size})")
        else:
            raise InvalidRequestError("a prompt is a string or a list of token ids; "
                                      f"got {type(prompt).__name__}")
        return self.check_prompt(ids) if bos else ids

    def check_prompt(self, ids: list[int]) -> list[int]:
        if not ids:
            raise InvalidRequestError("the prompt is empty; pass at least one token of text")
        if len(ids) >= self.max_context:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens but the context holds {self.max_context}; "
                "shorten the prompt or load the model with a larger max_context")
        return ids

    # ------------------------------------------------------------ running

    def request(self, index: int, ids: list[int], params: SamplingParams,
                tiers: tuple[int, int] = (0, 0), spec: SpecConfig | None = None,
                draft: Draft | None = None) -> "_Request":
        """A request ready to queue; refused now if it can never fit the pool: its prompt
        and first token, or with `spec` (speculative decoding with its resolved `draft`,
        which is budgeted every page up front) its prompt plus max_tokens; or if `spec`
        cannot serve its sampling settings."""
        if spec is not None:
            check_request(spec, params)
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InvalidRequestError(f"stop token id {bad[0]} is outside the vocabulary "
                                      f"[0, {self.config.vocab_size})")
        r = _Request(index, ids, params, self.pool, self.tokenizer, self.max_context,
                     time.perf_counter(), tiers, spec, draft)
        usable = self.pool.num_pages - 1
        if spec is not None and r.max_pages > usable:
            raise PromptTooLongError(
                f"{len(r.prompt_ids)} prompt tokens plus up to {r.limit} new ones need "
                f"{r.max_pages} KV pages but the pool has {usable}; lower max_tokens "
                "or load the model with more num_pages")
        if -(-(len(ids) + 1) // self.pool.page_size) > usable:
            raise PromptTooLongError(
                f"the prompt's {len(ids)} tokens need more KV pages than the pool's "
                f"{usable}; shorten it or load the model with more num_pages")
        return r

    def run(self, prompts: list[list[int]], params: list[SamplingParams],
            tiers: list[tuple[int, int]] | None = None, spec: SpecConfig | None = None,
            draft: Draft | None = None
            ) -> Iterator[tuple[int, str, GenerationResult | None]]:
        """Yield (request index, new text, result-or-None); a result marks the request done.

        `tiers` gives each prompt's (stable end, context end) token boundaries; the
        stable tier is pinned in the prefix cache. Default: the whole prompt volatile.
        `spec` with its resolved `draft` decodes speculatively (see spec_runner).
        """
        tiers = tiers or [(0, 0)] * len(prompts)
        # refused before any work starts: nothing else is lost
        waiting = deque(self.request(i, ids, p, t, spec, draft)
                        for i, (ids, p, t) in enumerate(zip(prompts, params, tiers)))
        yield from self.serve(waiting)

    def serve(self, waiting: deque, poll=None
              ) -> Iterator[tuple[int, str, GenerationResult | None]]:
        """Run the requests of `waiting` (plain and speculating alike) until none is left,
        like `run`. `poll(waiting, active)` is called before every step: it may queue
        more requests on `waiting` and end requests of either with `_Request.abort`
        (the loop drops them and gives their pages back)."""
        poll = poll or (lambda waiting, active: None)
        with self._lock:
            active: list[_Request] = []  # updated in place: the cleanup below sees it
            try:
                yield from self._loop(waiting, active, poll)
            finally:  # also when the caller abandons a stream: give every page back
                for r in list(waiting) + active:
                    self.release(r)

    def count_cycle(self) -> None:
        """Add one batched speculative cycle (one target pass over all its rows)."""
        self.speculation["cycles"] += 1

    def count_speculation(self, draft_tokens: int, accepted_tokens: int) -> None:
        """Add one speculative target pass of a row to the engine's totals."""
        totals = self.speculation
        totals["target_passes"] += 1
        totals["draft_tokens"] += draft_tokens
        totals["accepted_tokens"] += accepted_tokens

    def stats(self) -> dict:
        """Counters for metrics (call between steps): KV pages (usable, free, held by
        requests, cached at refcount 0, pinned by stable tiers), preemptions, plain steps
        run and their mean time over the last 256, speculative totals, and the prefix
        cache's queries and hits per tier (`prefix_cache.*`)."""
        pool, cache = self.pool, self.prefix_cache
        held = int((pool.refcounts[1:] > 0).sum())
        times = self._step_times
        return {"pages_total": pool.num_pages - 1, "pages_free": pool.num_free,
                "pages_held": held, "pages_cached": pool.num_pages - 1 - pool.num_free - held,
                "pages_pinned": cache.pinned_pages if cache else 0,
                "preemptions": self.preemptions, "steps": self.steps_run,
                "step_time_s": sum(times) / len(times) if times else None,
                "speculative": dict(self.speculation),
                "prefix_cache": cache.stats() if cache else None}

    def drop_ended(self, active: list["_Request"]) -> None:
        """Remove ended requests from `active`, giving back the pages of any ended from
        outside the loop (aborted; release is a no-op for the others)."""
        for r in active:
            if r.finish_reason is not None:
                self.release(r)
        active[:] = [r for r in active if r.finish_reason is None]

    @staticmethod
    def release(r: _Request) -> None:
        """Give back every page a request holds: its own, or its SMC particles'."""
        r.seq.release()
        if r.smc is not None:
            r.smc.release()

    @staticmethod
    def _holders(active: list[_Request]) -> list[SequencePages]:
        """Every sequence holding pages for `active` (an SMC request's are its particles)."""
        return [s for r in active for s in
                ([p.seq for p in r.smc.particles] if r.smc is not None else [r.seq])]

    def _loop(self, waiting: deque, active: list[_Request], poll):
        """Every step carries one token of each running plain request, a chunk of the
        oldest request still prefilling (plain or speculating) and, when it runs, the
        drafts of speculating requests (an SMC request's particles') as rows where rows
        pay; between steps, every other speculating request that has its first token
        runs one cycle (`SpecRunner.run`).
        Requests of every kind join and leave between steps."""
        inflight: _Step | None = None  # dispatched, its tokens not read back yet
        while True:
            poll(waiting, active)
            self.drop_ended(active)  # finished in the last step, or aborted by poll
            if self.debug_checks:
                self.pool.check(self._holders(active))
            if not (waiting or active or inflight):
                return
            joinable = bool(waiting) and len(active) < self.max_batch
            if (inflight and inflight.chunk is None and inflight.rows == active
                    and not inflight.verify and not joinable and self._can_run_ahead(active)
                    and not any(r.forced for r in active) and self._room_for_a_step(active)):
                # decode only: dispatch the next step on the device tokens before reading
                # them back, so host work and dispatch overlap the step in flight; logits
                # processors answer for it meanwhile, from the tokens read back, and their
                # rows are drawn again with that bias (`_bias_late`)
                ahead = self.dispatch(list(active), feed=inflight.tokens, late_bias=True)
                yield from self.finished(*self._accept(inflight))
                yield from self._bias_late(ahead)
                inflight = ahead
                continue
            if inflight:
                yield from self.finished(*self._accept(inflight))
                inflight = None
            yield from self._append_forced(active)
            active += self._admit(waiting, active)
            yield from self._make_room(waiting, active)
            yield from self._process_logits(active)
            running = [r for r in active if r.finish_reason is None]
            plain = [r for r in running if r.decoding and r.spec is None]
            speculating = [r for r in running if r.decoding and r.spec is not None]
            chunk = next((r for r in running if not r.decoding), None)
            if plain or chunk:  # speculation verifies as rows of this step where it pays
                rows = [r for r in speculating if self._spec_runner.verifies_in_rows(
                    r, len(plain), chunk is not None)]
                verify = []
                if rows:
                    verify, left = self._spec_runner.proposals(
                        rows, self.buckets.batch[-1] - len(plain),
                        sum(self.owed_pages(r) for r in running))
                    speculating = [r for r in speculating if r not in rows or r in left]
                inflight = self.dispatch(plain, chunk, verify=verify)
            if speculating:  # after the plain step: the cycles read its KV
                promised = sum(self.owed_pages(r) for r in running)
                yield from self._spec_runner.run(speculating, promised)

    @staticmethod
    def _can_run_ahead(active: list[_Request]) -> bool:
        """A step ahead must not draw past any request's token limit (an EOS in
        flight only wastes one row of one step; pages are budgeted at admission)."""
        return all(len(r.generated) + 2 <= r.limit for r in active)

    def _admit(self, waiting: deque, active: list) -> list[_Request]:
        """Admit waiting requests, in order, while they fit beside the running ones.

        Worst case (speculating requests, and plain ones preempted too often): a
        request is budgeted its prompt plus max_tokens up front, so it never runs out
        of pages. On need (plain requests): its prompt plus one token's page, beside
        one page for each running request's next token; requests then grow as they
        decode and `_make_room` preempts when the pool runs short. Either way, what
        running requests are owed is taken, pinned or restored by no newcomer: one
        that does not fit waits.
        """
        admitted: list[_Request] = []
        while waiting and len(active) + len(admitted) < self.max_batch:
            req = waiting[0]
            if self._tier_in_flight(req, active + admitted):
                break  # it shares the tier once that is written, instead of writing it too
            owed = sum(self.owed_pages(r) for r in active + admitted)
            if not self._take_cached_prefix(req, owed, self._need(req)):
                if not active and not admitted:  # nothing running will free a page
                    if self.prefix_cache and self.prefix_cache.unpin_lru():
                        continue  # its pages are evictable now: try again
                    raise OutOfPagesError(
                        f"a request needs {self._need(req)} KV pages but only "
                        f"{self.pool.num_available} are free or evictable; lower max_tokens "
                        "or load the model with more num_pages")
                break  # wait for running sequences to finish and free pages
            self.apply_copies(req.seq.reserve(req.context_len))
            req.admitted_at = next(self._admissions)
            req.first_admitted = req.first_admitted or time.perf_counter()
            admitted.append(waiting.popleft())
        return admitted

    def _tier_in_flight(self, req: _Request, running: list[_Request]) -> bool:
        """Whether a running request is still prefilling `req`'s stable tier (agents
        starting together on one system prompt): `req` then waits until that tier is
        published (at its end, see `_accept`) and shares it. Prefill runs one request at
        a time, so waiting costs `req` nothing."""
        n = req.stable_end
        return self.prefix_cache is not None and n > 0 and any(
            r.prefilled < r.stable_end == n and r.prompt_ids[:n] == req.prompt_ids[:n]
            for r in running)

    @staticmethod
    def _on_need(req: _Request) -> bool:
        """Whether the request grows its pages as it decodes (see `_admit`)."""
        return req.spec is None and not req.protected

    def _need(self, req: _Request) -> int:
        """The pages a request must be able to hold when it is admitted."""
        usable = self.pool.num_pages - 1
        if self._on_need(req):
            return -(-(req.context_len + 1) // self.pool.page_size)
        return min(req.max_pages, usable)

    def owed_pages(self, req: _Request) -> int:
        """Pages a running request may still take that no newcomer may use (an SMC
        request: what one particle needs to finish)."""
        if self._on_need(req):
            return 1  # its next token's page
        held = len(req.seq.pages) if req.smc is None else req.smc.most_pages()
        return max(0, min(req.max_pages, self.pool.num_pages - 1) - held)

    def _room_for_a_step(self, active: list[_Request]) -> bool:
        """Whether every running plain request finds its next step's pages (a decode
        token's, or, with forced tokens, what its context has grown to) beside what the
        speculating ones are owed."""
        need = sum(r.seq.pages_to_reserve(max(r.seq.length + 1, r.context_len))
                   for r in active if r.spec is None)
        owed = sum(self.owed_pages(r) for r in active if r.spec is not None)
        return need <= self.pool.num_available - owed

    def force(self, req: _Request, token_ids: list[int]) -> None:
        """Queue tokens to append to a plain request's output at the next step boundary,
        as if it had generated them (e.g. to close a thought); generation goes on after
        them. Their KV is written by prefill, like a resumed request's."""
        bad = [t for t in token_ids if not 0 <= t < self.config.vocab_size]
        if bad or not token_ids:
            raise InvalidRequestError(
                f"forced token id {bad[0]} is outside the vocabulary [0, "
                f"{self.config.vocab_size})" if bad else "no token ids to force")
        req.forced += token_ids

    def _bias_late(self, step: "_Step"):
        """A run-ahead step's logits processing: each processor answers from the tokens
        just accepted while the step runs on the device; rows with a bias are then drawn
        again from the step's logits (Steps.redraw), before anything reads its tokens."""
        yield from self._process_logits(step.rows, late=True)
        rows = [(j, r.step_bias) for j, r in enumerate(step.rows)
                if r.finish_reason is None and r.step_bias is not None]
        if not rows:
            return
        bias = np.zeros(step.logits.shape, np.float32)
        masked = np.zeros(len(bias), bool)
        for j, values in rows:
            bias[j], masked[j] = values, True
        step.tokens, step.logprobs = self.steps.redraw(step.logits, step.tokens, bias,
                                                       masked, step.sampling)

    def _drawing(self, active: list[_Request]) -> list[_Request]:
        """The requests the next step draws a token for: those decoding, and the one
        prefilling next if its prompt can end in this chunk (earlier chunks draw none)."""
        prefilling = next((r for r in active if not r.decoding), None)
        return [r for r in active if r.decoding or (
            r is prefilling and r.context_len - r.prefilled <= self.buckets.chunk[-1])]

    def _process_logits(self, active: list[_Request], late: bool = False):
        """Ask the logits processor of each running request the next step draws a token
        for (`_drawing`; a run-ahead step's rows are all drawing) for its bias; a
        processor that fails, or returns no [vocab] array, ends its request alone
        ("abort", with metrics["error"] saying why)."""
        asking = [r for r in active if r.params.logits_processor is not None]
        if not asking:  # the usual step: nothing to ask, nothing built
            return
        vocab = self.config.vocab_size
        drawing = active if late else self._drawing(active)
        for r in asking:
            r.step_bias = None  # only a processor's request ever holds one
            if r.finish_reason is not None or r not in drawing:
                continue
            try:
                bias = r.params.logits_processor(list(r.generated))
                if bias is not None:
                    bias = np.asarray(bias, np.float32)
                    if bias.shape != (vocab,):
                        raise ValueError(f"it returned shape {bias.shape}, not ({vocab},)")
                r.step_bias = bias
            except Exception as e:  # noqa: BLE001 - the caller's code fails its request only
                r.error = f"logits_processor failed: {e}"
                yield from self.finished([r], [r.end("abort")])

    def _append_forced(self, active: list[_Request]):
        """Accept each running request's forced tokens (stop rules apply to them)."""
        now = time.perf_counter()
        for r in active:
            if r.forced and r.finish_reason is None:
                tokens, r.forced, piece = r.forced, [], ""
                for t in tokens:
                    piece += r.accept(t, now)
                    if r.finish_reason is not None:
                        break
                yield from self.finished([r], [piece])

    def _make_room(self, waiting: deque, active: list[_Request]):
        """Before a decode step, find every running request the page its next token
        needs. (SMC populations leave these pages alone: their size follows the pages
        nobody else is promised, at every cycle.) While the pool is short: first pinned
        stable tiers are unpinned, least recently used first (their idle pages become
        evictable); then the most recently admitted plain request that is not protected
        is preempted: it gives its pages back (its prompt's stay cached) and waits at the
        head of the queue, to resume by prefilling what it had. A request nothing can
        make room for ends at "length"."""
        while active and not self._room_for_a_step(active):
            if self.prefix_cache and self.prefix_cache.unpin_lru():
                continue  # first, pinned tiers become evictable, least recently used first
            plain = [r for r in active if r.spec is None]  # the others hold their worst case
            if not plain:
                break
            victims = [r for r in plain if not r.protected] if len(active) > 1 else []
            if not victims:
                last = max(plain, key=lambda r: r.admitted_at)
                active.remove(last)
                yield from self.finished([last], [last.end("length")])
                continue
            victim = max(victims, key=lambda r: r.admitted_at)
            active.remove(victim)
            victim.seq.release()
            victim.preemptions += 1
            victim.protected = victim.preemptions >= self.max_preemptions
            self.preemptions += 1
            waiting.appendleft(victim)

    def apply_copies(self, copies: list[tuple[int, int]]) -> None:
        """Run the copy-on-write page copies `SequencePages.reserve` asked for."""
        if copies:
            src, dst = (np.asarray(ids, np.int32) for ids in zip(*copies))
            self.kv = copy_pages(self.kv, src, dst)
            for name, kv in self.draft_kvs.items():  # a draft model's KV on the same pages
                self.draft_kvs[name] = copy_pages(kv, src, dst)

    def _take_cached_prefix(self, req: _Request, owed: int, need: int) -> bool:
        """Share the longest cached run of the prompt's pages (at least one token is left
        to prefill: its logits give the first sampled token), pinning the stable tier and
        restoring it from disk, if the request's `need` of pages then fits beside the
        `owed` ones. Otherwise undo all of it (pinning takes cached pages out of the
        evictable LRU) and return False."""
        cache = self.prefix_cache
        stable = req.prompt_ids[:req.stable_end] if cache is not None else []
        pinned_here = bool(stable) and tuple(stable) not in cache.registered()
        if stable:  # registers it, or marks it the most recently used
            cache.register_stable(stable)
        if stable and self.tier_store and \
                cache.match(stable, len(stable), take=False)[1] < len(stable):
            self._restore_tier(stable, owed)
        if cache is not None:
            ids = req.context_ids
            req.seq.pages, req.seq.length = cache.match(ids, len(ids) - 1)
        shared_tail = bool(req.seq.length % self.pool.page_size)  # copied on write
        if need - len(req.seq.pages) + shared_tail <= self.pool.num_available - owed:
            if not req.generated:  # a resumed request keeps its first admission's count
                req.cached_tokens = req.seq.length
            return True
        req.seq.release()
        if pinned_here:  # its pages (restored ones too) become evictable again
            cache.unregister_stable(stable)
        return False

    def _restore_tier(self, stable: list[int], owed: int) -> None:
        """Load a stable tier's pages saved by an earlier process into the pool (pinned),
        if they fit beside the `owed` pages."""
        n = -(-len(stable) // self.pool.page_size)
        if n > self.pool.num_available - owed:
            return
        expect = {name: (x.dtype, (x.shape[0], n, *x.shape[2:]))
                  for name, x in leaves(self.kv).items()}
        arrays = self.tier_store.load(stable, expect)
        if arrays is None:
            return
        pages = self.pool.allocate(n)
        self.kv = write_pages(self.kv, jnp.asarray(pages, jnp.int32), arrays)
        self.prefix_cache.publish(stable, pages, partial_at=len(stable))
        self.pool.decref(pages)  # cached and pinned: the tier is registered
        self._persisted.add(tuple(stable))

    def _persist_tier(self, req: _Request) -> None:
        """Snapshot a freshly prefilled stable tier to disk, off the decode loop's path."""
        stable = tuple(req.prompt_ids[:req.stable_end])
        if not self.tier_store or not stable or stable in self._persisted:
            return
        self._persisted.add(stable)
        n = -(-len(stable) // self.pool.page_size)
        # then what the process restoring it will run, into JAX's cache
        self.tier_store.save_async(stable, read_pages(self.kv, req.seq.pages[:n]),
                                   then=partial(compile_for_later, restore_lowering(self.kv, n)))

    def _publish(self, req: _Request, finished: bool) -> None:
        """Index what the request has written: its prompt once prefilled (with the stable
        tier's partial last page when the prompt runs past that page), and at the end
        every page of prompt + generated tokens, the last one partial."""
        cache = self.prefix_cache
        if cache is None:
            return
        ps = self.pool.page_size
        if not finished:  # the prompt as far as it is written
            boundary = req.stable_end if req.stable_end and (
                len(req.prompt_ids) >= -(-req.stable_end // ps) * ps) else None
            cache.publish(req.prompt_ids[:req.prefilled], req.seq.pages, partial_at=boundary)
            return
        # the last token was never fed; a request ended mid-prefill wrote less. Its last,
        # partial page too: the next turn of a conversation starts with all of it
        written = (req.prompt_ids + req.generated[:-1])[:req.seq.length]
        cache.publish(written, req.seq.pages, partial_at=len(written))
        # tight (few pages free or evictable, not only few free: a warm pool is full of
        # cached pages): keep volatile pages out
        if self.pool.num_available < self.pool.num_pages // 4:
            cache.forget(req.seq.pages[max(req.context_end, req.stable_end) // ps + 1:])

    def finished(self, reqs, pieces):
        for r, piece in zip(reqs, pieces):
            if r.finish_reason is not None:
                self._publish(r, finished=True)
                r.seq.release()
                yield r.index, piece, r.result()
            elif piece:
                yield r.index, piece, None

    def sampling(self, reqs, rows, steps):
        params = [r.params for r in reqs]
        return SamplingBatch.build(params, steps, rows), sampler_for(params)

    def block_tables(self, reqs, rows):
        width = pick_bucket(max(len(r.seq.pages) for r in reqs), self.buckets.pages)
        tables = np.zeros((rows, width), np.int32)
        for i, r in enumerate(reqs):
            tables[i] = r.seq.block_table(width)
        return tables

    def _count(self, req: _Request) -> None:
        bounds = (req.stable_end, max(req.context_end, req.stable_end), len(req.prompt_ids))
        req.cache_metrics = tier_counts(bounds, req.cached_tokens)
        if self.prefix_cache is not None:
            self.prefix_cache.record(req.cache_metrics)

    def chunk_room(self, rows: int, left: int | None = None) -> int:
        """Prompt tokens a step with `rows` decode rows carries: when nothing decodes, a
        whole chunk, or for `left` tokens short of one the bucket `first_chunk` picks;
        beside decode rows, the largest chunk bucket within the step budget
        (max_step_tokens; the smallest bucket if none fits, so a prompt always moves): a
        chunk costs its bucket's step, full or not."""
        if rows == 0:
            return first_chunk(left or self.buckets.chunk[-1], self.buckets.chunk,
                               self.step_cost_tokens)
        fits = [c for c in self.buckets.chunk if c <= self.max_step_tokens - rows]
        return fits[-1] if fits else self.buckets.chunk[0]

    def dispatch(self, decoding: list[_Request], chunk: _Request | None = None,
                 feed=None, verify: list[tuple] = (), late_bias: bool = False) -> "_Step":
        """Launch one step: a token for each request of `decoding` and the next chunk of
        `chunk`'s prompt; returns it with its device tokens unread.

        `feed` is the previous step's device tokens (same decode rows, no chunk) or None
        to feed each request's last accepted token from the host. `verify`: proposals
        of speculating requests (SpecRunner.proposals), each fed its last token and its
        drafts as rows at consecutive positions (a row sees the KV the rows before it
        write); SpecRunner.take_verified decides from the rows' draws or logits.
        `late_bias`: the decode rows' biases come after the dispatch (`_bias_late`).
        """
        rows = len(decoding) + sum(1 + len(p.drafts) for p in verify)
        part = []
        if chunk is not None:
            room = self.chunk_room(rows, chunk.prefill_left())
            part = chunk.context_ids[chunk.prefilled:chunk.chunk_end(room)]
        build = self.steps.builder(rows, len(part))
        width = self.steps.buckets.table_width
        for r in decoding:
            self.apply_copies(r.seq.reserve(r.seq.length + 1))
            # the token drawn after position p is the (p + 1 - prompt)-th of its sequence
            if r.step_bias is not None and not late_bias:
                build.bias(build.decoded, r.step_bias)
            build.decode(r.generated[-1], r.seq.length, r.seq.block_table(width), r.params,
                         r.seq.length + 1 - len(r.prompt_ids))
            r.seq.length += 1
        verifying = []
        for p in verify:  # pages for every position (SpecRunner.take_verified trims)
            r, drafts, start = p.request, p.drafts, p.request.seq.length
            self.apply_copies(r.seq.reserve(start + len(drafts) + 1))
            verifying.append((p, build.decoded, start))
            for i, token in enumerate([r.generated[-1], *drafts]):
                build.decode(token, start + i, r.seq.block_table(width), r.params,
                             start + i + 1 - len(r.prompt_ids))
            r.seq.length += len(drafts) + 1
        if chunk is not None:  # pages reserved at admission; forced tokens grow them here
            self.apply_copies(chunk.seq.reserve(chunk.context_len))
            build.prefill(part, chunk.prefilled, chunk.seq.block_table(width), chunk.params, 0)
            if chunk.step_bias is not None:
                build.bias(build.batch.decode_rows, chunk.step_bias)
            chunk.seq.length += len(part)
        started = time.perf_counter()
        batch = build.build(feed)
        tokens, logits, logprobs, self.kv = self.steps.step(self.params, self.kv, batch)
        return _Step(decoding, chunk, build.batch.decode_rows, tokens, logprobs, started,
                     verifying, logits, batch.sampling)

    def _accept(self, step: "_Step") -> tuple[list[_Request], list[str]]:
        """Read a step's tokens back and accept them: a token for each decode row that
        is still running, and the first token of a request whose prompt the chunk
        completed. Returns those requests and the text each made visible."""
        sampled = np.asarray(step.tokens)
        rows_logprobs = step.logprob_rows()
        logprobs = rows_logprobs or itertools.repeat(None)
        now = time.perf_counter()
        # the step ran from its dispatch, or from the end of the one ahead of it
        self._step_times.append(now - max(step.started, self._last_accept))
        self._last_accept = now
        self.steps_run += 1
        reqs, pieces = [], []
        for j, (r, lp) in enumerate(zip(step.rows, logprobs)):
            if r.finish_reason is None:
                reqs.append(r)
                pieces.append(r.accept(int(sampled[j]), now, lp))
        if step.verify:
            verified, texts = self._spec_runner.take_verified(step.verify, sampled,
                                                              step.logits, now)
            reqs += verified
            pieces += texts
        r = step.chunk
        if r is not None and r.finish_reason is None and r.prefilled == r.stable_end:
            self._publish(r, finished=False)  # its stable tier: requests waiting share it
        # a resumed request (preempted) knows its next token already
        if (r is not None and r.finish_reason is None and not r.generated
                and r.prefilled == len(r.prompt_ids)):
            self._publish(r, finished=False)
            self._persist_tier(r)
            self._count(r)
            reqs.append(r)
            pieces.append(r.accept(int(sampled[step.chunk_row]), now,
                                   rows_logprobs[step.chunk_row] if rows_logprobs else None))
        return reqs, pieces

    def logits(self, ids: list[int]) -> np.ndarray:
        """Logits [len(ids), vocab] of a prompt, prefilled in chunks on a scratch sequence."""
        with self._lock:
            seq = SequencePages(self.pool)
            try:
                seq.reserve(len(ids))
                chunks, self.kv = self.prefill_all(self.steps, self.params, self.kv, ids, seq)
                return np.concatenate([np.asarray(c) for c in chunks])
            finally:
                seq.release()

    def prefill_all(self, steps: Steps, params, kv: PagedKV, ids: list[int],
                    seq: SequencePages) -> tuple[list, PagedKV]:
        """Write `ids` from position 0 into `seq`'s pages of `kv`, chunk by chunk, with
        `steps`/`params` (the target's, or a draft model's for its own KV); returns
        each chunk's logits on the device and the new KV."""
        chunk = self.buckets.chunk[-1]
        table = seq.block_table(pick_bucket(len(seq.pages), self.buckets.pages))[None]
        out = []
        for s in range(0, len(ids), chunk):
            part = ids[s:s + chunk]
            tokens = np.zeros((1, pick_bucket(len(part), self.buckets.chunk)), np.int32)
            tokens[0, :len(part)] = part
            logits, kv = steps.all_logits(params, kv, tokens, np.array([s], np.int32),
                                          np.array([len(part)], np.int32), table)
            out.append(logits[0, :len(part)])
        return out, kv
