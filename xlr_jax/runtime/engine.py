"""The engine: one model's loop of steps, each decided, run and taken back.

An engine wires the scheduler (host policy: `runtime.scheduler`), the KV manager (pages:
`kv.manager`), the model runner (the device: `runtime.model_runner`) and speculation
(`speculative.runner`). One loop (`serve`) runs every request: each step carries a token
of every running plain request and a prefill chunk of the oldest one still prefilling,
and speculating requests verify their drafts as rows of it where rows pay; between steps,
requests join and leave, and the other speculating requests run their cycles.

A step is three calls: the scheduler decides it (`Scheduler.schedule`, which asks
speculation for the drafts of the rows that verify), the runner dispatches it
(`ModelRunner.execute`), and after reading it back (`ModelRunner.read`, which also judges
the verifying rows' drafts) the scheduler takes its tokens (`Scheduler.update`). The
speculating requests the schedule leaves to cycles of their own run them after it
(`SpecRunner.run`). Decode-only steps run one step ahead: while step n executes, step
n+1 is already dispatched on step n's tokens (still on the device), so the host's
bookkeeping and dispatch stay off the critical path (+3-4% tokens/s on the CPU,
measured). A row that finishes meanwhile only wastes its slot in that one step.

Where prefill has devices of its own (the plan's `prefill_devices`), a second runner
holds the params and a KV pool of the same page ids there: each chunk is a step of its
own on those devices (`SchedulerOutput.prefill`), dispatched beside the decode steps and
read back once it is done, so the decode steps never wait for one. The chunk that makes a
prompt whole is followed by its pages' move to the decode devices (`export_pages`, then
`import_pages`: jax.device_put to the decode KV's sharding), dispatched before the
request's first decode step. The prefix cache is off there: a page's KV lives on the
slice that wrote it, and a cached page would have to be on both.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable, Iterator

import jax.numpy as jnp
import numpy as np

from xlr_jax.errors import InvalidRequestError
from xlr_jax.kv.manager import KVManager
from xlr_jax.kv.pages import SCRATCH_PAGE, pages_for
from xlr_jax.kv.tier_store import TierStore
from xlr_jax.loading.tokenizer import Tokenizer
from xlr_jax.model.config import ModelConfig
from xlr_jax.model.decoder import Params
from xlr_jax.model.sampling_params import SamplingParams
from xlr_jax.model.tensor_parallel import TensorParallel
from xlr_jax.planning.buckets import pick_bucket
from xlr_jax.planning.mapper import ExecutionPlan
from xlr_jax.runtime.mirror import Mirror
from xlr_jax.runtime.model_runner import InFlight, ModelRunner
from xlr_jax.runtime.request import GenerationResult, Request
from xlr_jax.runtime.scheduler import Event, Scheduler, SchedulerOutput, StepPlan
from xlr_jax.speculative.config import Draft, SpecConfig
from xlr_jax.speculative.population import start_metrics
from xlr_jax.speculative.runner import SpecRunner, check_request


class Engine:
    """One model's scheduler, KV manager, model runner and speculation, and the loop that
    drives them (see the module docstring)."""

    def __init__(self, config: ModelConfig, params: Params, tokenizer: Tokenizer | None,
                 plan: ExecutionPlan, *, prefix_cache: bool = True, cache_namespace: str = "",
                 tier_store: TierStore | None = None, tp: TensorParallel | None = None,
                 mirror: Mirror | None = None, prefill_params: Params | None = None,
                 prefill_tp: TensorParallel | None = None):
        """An engine with every size, dtype, bucket and kernel the Execution Plan fixed.
        `prefix_cache`: share repeated prompt prefixes (`cache_namespace` keeps models
        apart in it) and keep stable tiers on disk (`tier_store`). `tp`: the mesh the
        params are split over (model.tensor_parallel; the plan's `tensor_parallel`).
        `mirror`: across processes, the leader's runner sends its programs' inputs to the
        followers' (runtime/mirror.py). `prefill_params`, split over `prefill_tp`'s devices:
        prompts prefill there (see the module docstring; the prefix cache must be off)."""
        if prefill_params is not None and prefix_cache:
            raise InvalidRequestError("prefill on devices of its own needs prefix_cache=False: "
                                      "a page's KV lives on the slice that wrote it")
        self.config, self.tokenizer, self.plan = config, tokenizer, plan
        self.max_context = plan.max_context
        self.buckets = plan.buckets  # the shapes every step is compiled for
        # the runner applies the page operations the KV manager queues (made next, from
        # the runner's pool layout)
        self.runner = ModelRunner(config, params, num_pages=plan.num_pages,
                                  page_size=plan.page_size, kv_dtype=jnp.dtype(plan.kv_dtype),
                                  buckets=self.buckets, attn_impl=plan.attn_impl,
                                  compiler_options=plan.compiler_options,
                                  page_ops=lambda: self.kv.take_ops(), tp=tp, mirror=mirror)
        self.prefill_runner = None
        if prefill_params is not None:
            # without the prefix cache the KV manager queues no page operations (no shared
            # page is copied, no stable tier written or read): the decode runner's are none
            self.prefill_runner = ModelRunner(
                config, prefill_params, num_pages=plan.num_pages, page_size=plan.page_size,
                kv_dtype=jnp.dtype(plan.kv_dtype), buckets=self.buckets,
                attn_impl=plan.attn_impl, compiler_options=plan.compiler_options,
                page_ops=lambda: [], tp=prefill_tp)
        self._prefill: InFlight | None = None  # the prefill devices' step, not read back
        self.kv = KVManager(plan.num_pages, plan.page_size, self.runner.kv_layout(),
                            prefix_cache=prefix_cache, namespace=cache_namespace,
                            max_pinned_share=plan.max_pinned_share, tier_store=tier_store)
        self.scheduler = Scheduler(self.kv, self.buckets, max_batch=plan.max_batch,
                                   max_step_tokens=plan.max_step_tokens,
                                   step_cost_tokens=plan.step_cost_tokens,
                                   max_preemptions=plan.max_preemptions,
                                   vocab_size=config.vocab_size,
                                   rows_from_streams=plan.speculative.rows_from_streams,
                                   rows_up_to_context=plan.speculative.rows_up_to_context,
                                   separate_prefill=self.prefill_runner is not None)
        self.spec = SpecRunner(self.scheduler, self.runner, self.buckets, plan.speculative)
        self._lock = threading.RLock()  # one driver at a time; logits may run inside serve
        # check the page pool's invariants after every step (slow; tests turn it on)
        self.debug_checks = os.environ.get("XLR_DEBUG_CHECKS") == "1"

    # ------------------------------------------------------------ requests

    def request(self, index: int, ids: list[int], params: SamplingParams,
                tiers: tuple[int, int] = (0, 0), spec: SpecConfig | None = None,
                draft: Draft | None = None) -> Request:
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
        r = Request(index, ids, params, self.kv.new_sequence(), self.tokenizer,
                    self.max_context, time.perf_counter(), tiers, spec, draft,
                    start_metrics(spec) if spec else None)
        self.kv.check_fits(r)
        return r

    def run(self, prompts: list[list[int]], params: list[SamplingParams],
            tiers: list[tuple[int, int]] | None = None, spec: SpecConfig | None = None,
            draft: Draft | None = None
            ) -> Iterator[tuple[int, str, GenerationResult | None]]:
        """Yield (request index, new text, result-or-None); a result marks the request done.

        `tiers` gives each prompt's (stable end, context end) token boundaries; the
        stable tier is pinned in the prefix cache. Default: the whole prompt volatile.
        `spec` with its resolved `draft` decodes speculatively (see speculative.runner).
        """
        tiers = tiers or [(0, 0)] * len(prompts)
        # refused before any work starts: nothing else is lost
        reqs = [self.request(i, ids, p, t, spec, draft)
                for i, (ids, p, t) in enumerate(zip(prompts, params, tiers))]
        for r in reqs:
            self.scheduler.add(r)
        try:
            yield from self.serve()
        finally:  # a caller that stops early leaves nothing queued
            self.scheduler.forget()

    def serve(self, poll: Callable[[Scheduler], None] | None = None
              ) -> Iterator[tuple[int, str, GenerationResult | None]]:
        """Run the scheduler's requests (plain and speculating alike) until none is left,
        like `run`. `poll(scheduler)` is called before every step: it may add requests
        and abort waiting or running ones (the loop drops them). Left early (the caller
        stops, or a step fails), every page is given back and the requests stay queued
        for the caller to end (`Scheduler.forget`)."""
        with self._lock:
            try:
                yield from self._loop(poll or (lambda scheduler: None))
            finally:  # also when the caller abandons a stream: give every page back
                self.scheduler.release_all()
                self._prefill = None

    def stats(self) -> dict:
        """Counters for metrics (call between steps): KV pages (usable, free, held by
        requests, cached at refcount 0, pinned by stable tiers), preemptions, plain steps
        run and their mean time over the last 256, speculative totals, and the prefix
        cache's queries and hits per tier (`prefix_cache.*`)."""
        prefill = self.prefill_runner and {"prefill_steps": self.prefill_runner.steps_run}
        return {**self.kv.stats(), "preemptions": self.scheduler.preemptions,
                **self.runner.stats(), **(prefill or {}),
                "speculative": dict(self.spec.totals)}

    def warmup(self, progress: bool = True) -> list[dict]:
        """Compile every step shape serving may run (ModelRunner.warmup): where prefill has
        devices of its own, decode rows alone here and a chunk alone there."""
        if self.prefill_runner is None:
            return self.runner.warmup(progress)
        for n in self.buckets.pages:  # and each bucket's move, run once on the scratch page
            self._move_pages([SCRATCH_PAGE] * n)
        return (self.runner.warmup(progress, only="decode")
                + self.prefill_runner.warmup(progress, only="prefill"))

    def logits(self, ids: list[int]) -> np.ndarray:
        """Logits [len(ids), vocab] of a prompt, prefilled in chunks on a scratch sequence."""
        with self._lock:
            seq = self.kv.new_sequence()
            try:
                self.kv.reserve(seq, len(ids))
                return self.runner.logits(ids, seq)
            finally:
                seq.release()

    # ------------------------------------------------------------ the loop

    def _loop(self, poll):
        """Every step carries one token of each running plain request, a chunk of the
        oldest request still prefilling (plain or speculating) and, when it runs, the
        drafts of speculating requests (an SMC request's particles') as rows where rows
        pay; between steps, every other speculating request that has its first token
        runs one cycle (`SpecRunner.run`). Requests of every kind join and leave
        between steps."""
        s = self.scheduler
        inflight: InFlight | None = None  # dispatched, its tokens not read back yet
        while True:
            poll(s)
            s.drop_ended()  # finished in the last step, or aborted by poll
            if self.debug_checks:
                self.kv.check(s.running)
            # the prefill devices' step, once done (or waited for, with nothing to decode)
            if self._prefill and (self._prefill.done()
                                  or not (inflight or s.has_decode_rows())):
                yield from self._take_prefill()
            if s.idle and not inflight and not self._prefill:
                return
            if inflight and s.can_run_ahead(inflight.out):
                # decode only: dispatch the next step on the device tokens before reading
                # them back, so host work and dispatch overlap the step in flight; logits
                # processors answer for it meanwhile, from the tokens read back, and their
                # rows are drawn again with that bias (`_bias_late`)
                ahead = self.runner.execute(s.step(list(inflight.out.decode), late_bias=True),
                                            feed=inflight.tokens)
                yield from self._update(inflight)
                yield from self._bias_late(ahead)
                inflight = ahead
                continue
            if inflight:
                yield from self._update(inflight)
                inflight = None
            out = s.schedule(self._verify_rows)
            yield from out.events
            if out.runs:
                inflight = self.runner.execute(out)
            if out.prefill is not None:
                self._prefill = self.prefill_runner.execute(out.prefill)
            if out.cycles:  # after the step (what it reserved counted): cycles read its KV
                yield from self.spec.run(out.cycles, out.promised)

    def _verify_rows(self, plan: StepPlan) -> tuple[list, list]:
        """The drafts of the speculating requests `plan` verifies as rows of its step, in
        the rows the plain ones leave (see `SpecRunner.proposals`)."""
        return self.spec.proposals(plan.rows, self.buckets.batch[-1] - len(plan.plain),
                                   self.kv.owed_to(plan.running))

    def _update(self, step: InFlight) -> list:
        """Read a step back and let the scheduler take its tokens (and speculation its
        verified rows); then the page operations that taking queued (a stable tier's
        snapshot) run."""
        out: SchedulerOutput = step.out
        result = self.runner.read(step)
        verified = ([], [])
        if out.verify:
            verified = self.spec.take_verified(out.verify, result.verdicts,
                                               time.perf_counter())
        events = self.scheduler.update(out, result, verified)
        self.runner.apply_page_ops()
        return events

    def _take_prefill(self) -> list[Event]:
        """Read the prefill devices' step back and let the scheduler take it; a prompt it
        made whole has its pages moved to the decode devices, dispatched before its first
        decode step."""
        step, self._prefill = self._prefill, None
        r = step.out.chunk
        events = self.scheduler.update(step.out, self.prefill_runner.read(step))
        if r.finish_reason is None and r.decoding:  # (not preempted meanwhile)
            self._move_pages(r.seq.pages[:pages_for(r.context_len, self.plan.page_size)])
        return events

    def _move_pages(self, pages: list[int]) -> None:
        """Move `pages`' KV from the prefill devices to the decode ones, padded with the
        scratch page to a page bucket (one compiled gather and write a bucket)."""
        padded = np.full(pick_bucket(len(pages), self.buckets.pages), SCRATCH_PAGE, np.int32)
        padded[:len(pages)] = pages
        self.runner.import_pages(padded, self.prefill_runner.export_pages(padded))

    def _bias_late(self, step: InFlight) -> list[Event]:
        """A run-ahead step's logits processing: each processor answers from the tokens
        just accepted while the step runs on the device; rows with a bias are then drawn
        again from the step's logits, before anything reads its tokens."""
        events = self.scheduler.process_logits(step.out.decode, late=True)
        biased = [(j, r.step_bias) for j, r in enumerate(step.out.decode)
                  if r.finish_reason is None and r.step_bias is not None]
        if biased:
            self.runner.redraw(step, biased)
        return events
