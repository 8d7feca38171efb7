"""The scheduler: which requests run, which wait, and what each step carries. Host policy
only; it imports no jax and owns no device state.

`schedule()` decides the next step (`SchedulerOutput`): one token of each running plain
request (a decode row), at most one prefill chunk (of the oldest request still
prefilling), the rows of speculating requests verifying their drafts
(`xlr_jax.speculative.proposals` makes them), and the speculating requests that run a
cycle of their own after it instead (`plan`, by the plan's rule).
Before that, the scheduler accepts forced tokens, admits waiting requests in order while
their pages fit (`KVManager.admit`), finds every running request its next page, preempting
the most recently admitted plain request when the pool runs short, and asks the requests'
logits processors for their masks. After a step, `update` takes what the model runner read
back (`RunnerOutput`): a token for each decode row still running, the first token of a
request whose prompt the chunk completed; it publishes prompts to the prefix cache and
turns finished requests into results.

The scheduler is tested without a model (`tests/test_scheduler.py`): hand-made runner
outputs, milliseconds a test.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from xlr_jax.errors import InvalidRequestError, OutOfPagesError
from xlr_jax.kv.manager import KVManager
from xlr_jax.model.sampling_params import SamplingParams
from xlr_jax.planning.buckets import Buckets, chunk_room, step_shape
from xlr_jax.runtime.request import Request

# (request index, new text, GenerationResult or None): what the engine hands its callers
Event = tuple[int, str, Any]


@dataclass
class SchedulerOutput:
    """One step, decided: its rows and its chunk, as the model runner builds them.

    Rows: one per running plain request (`decode`), then each verifying request's last
    token and drafts at consecutive positions (`verify`: (proposal, its first row, its
    last token's position)), then the chunk's row when there is a chunk."""
    decode: list[Request]
    chunk: Request | None = None
    verify: list[tuple] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)      # each row's token fed
    positions: list[int] = field(default_factory=list)   # ... at this position
    tables: list[np.ndarray] = field(default_factory=list)  # ... over these pages
    params: list[SamplingParams] = field(default_factory=list)
    draws: list[int] = field(default_factory=list)       # ... drawing its n-th token
    biases: dict[int, np.ndarray] = field(default_factory=dict)  # row -> logits bias
    chunk_tokens: list[int] = field(default_factory=list)
    chunk_start: int = 0
    chunk_table: np.ndarray | None = None
    chunk_bias: np.ndarray | None = None
    # the decode rows' biases come after the dispatch (the engine's run-ahead)
    late_bias: bool = False
    # from `schedule`: what ended before the step (forced tokens reaching a stop, a logits
    # processor failing, a request nothing could make room for), the speculating requests
    # that run a cycle of their own after it, and the pages the running requests may
    # still take (SMC populations leave them alone)
    events: list = field(default_factory=list)
    cycles: list[Request] = field(default_factory=list)
    promised: int = 0
    # where prefill has devices of its own: the chunk's step, run there beside this one
    prefill: SchedulerOutput | None = None

    @property
    def rows(self) -> int:
        """Rows before the chunk's."""
        return len(self.tokens)

    @property
    def runs(self) -> bool:
        """Whether a ragged step runs (else only cycles, or nothing)."""
        return bool(self.tokens) or self.chunk is not None

    def wants_logprobs(self) -> bool:
        asked = self.decode + ([self.chunk] if self.chunk is not None else [])
        return any(r.params.logprobs is not None for r in asked)


@dataclass
class StepPlan:
    """What runs next, by kind: the plain requests' decode rows, the request whose prompt
    is prefilled, and the speculating requests that have their first token, of which
    `rows` verify as rows of the step (the others, and those rows have no room for, run a
    cycle of their own after it)."""
    running: list[Request]  # every running request (what they are owed holds pages back)
    plain: list[Request]
    chunk: Request | None
    speculating: list[Request]
    rows: list[Request]

    @property
    def steps(self) -> bool:
        """Whether a ragged step runs (else only cycles)."""
        return bool(self.plain or self.chunk)

    def cycles(self, left: list[Request] = ()) -> list[Request]:
        """The speculating requests that run a cycle of their own after the step, in
        order: those not verifying as rows, and `left` (rows of which had no room)."""
        return [r for r in self.speculating if r not in self.rows or r in left]


@dataclass
class RunnerOutput:
    """What the model runner read back of a step: each row's sampled token, where the
    step's requests asked each row's (chosen, top ids, top values) log-probabilities, and
    a verdict for each of the step's `verify` entries (what it keeps of its drafts:
    `speculative.outcome.Verdict`)."""
    sampled: np.ndarray
    logprobs: list | None = None
    verdicts: list = field(default_factory=list)


class Scheduler:
    """Admission, preemption, chunking and the step's rows for one engine (see the module
    docstring). `waiting` and `running` are its own; callers use `add`, `abort`, `force`."""

    def __init__(self, kv: KVManager, buckets: Buckets, *, max_batch: int,
                 max_step_tokens: int, step_cost_tokens: int, max_preemptions: int,
                 vocab_size: int, rows_from_streams: int, rows_up_to_context: int,
                 separate_prefill: bool = False):
        self.kv, self.buckets = kv, buckets
        # a speculating request verifies as rows of the step (else a cycle of its own)
        # beside this many plain streams, or up to this context (the plan's policy)
        self.rows_from_streams, self.rows_up_to_context = rows_from_streams, rows_up_to_context
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens  # decode rows + the chunk beside them
        self.step_cost_tokens = step_cost_tokens  # splits a prompt's tail (first_chunk)
        self.max_preemptions = max_preemptions
        self.vocab_size = vocab_size
        # prompts prefill on devices of their own: a chunk is a step of its own
        # (`SchedulerOutput.prefill`), one at a time (`prefilling`, until its `update`)
        self.separate_prefill = separate_prefill
        self.prefilling: Request | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self._admissions = itertools.count(1)

    # ------------------------------------------------------------ requests in and out

    def add(self, req: Request) -> None:
        """Queue a request (admitted in order, between steps)."""
        self.waiting.append(req)

    def abort(self, req: Request):
        """End a waiting or running request now ("abort"), its pages given back; returns
        its GenerationResult."""
        result = req.abort()
        self.kv.release(req)
        if req in self.waiting:
            self.waiting.remove(req)
        return result

    def force(self, req: Request, token_ids: list[int]) -> None:
        """Queue tokens to append to a plain request's output at the next step boundary,
        as if it had generated them (e.g. to close a thought); generation goes on after
        them. Their KV is written by prefill, like a resumed request's."""
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad or not token_ids:
            raise InvalidRequestError(
                f"forced token id {bad[0]} is outside the vocabulary [0, "
                f"{self.vocab_size})" if bad else "no token ids to force")
        req.forced += token_ids

    def set_budget(self, max_step_tokens: int | None = None,
                   step_cost_tokens: int | None = None) -> None:
        """From the next step on: the tokens a step carries while requests decode, and a
        step's cost in tokens beyond its chunk's (an experiment's knobs; the plan's
        otherwise)."""
        for name, value, least in (("max_step_tokens", max_step_tokens, 1),
                                   ("step_cost_tokens", step_cost_tokens, 0)):
            if value is not None and (not isinstance(value, int) or value < least):
                raise InvalidRequestError(f"{name} must be an integer >= {least} (got "
                                          f"{value!r})")
        self.max_step_tokens = max_step_tokens or self.max_step_tokens
        if step_cost_tokens is not None:
            self.step_cost_tokens = step_cost_tokens

    def drop_ended(self) -> None:
        """Remove ended requests from `running`, giving back the pages of any ended from
        outside the loop (aborted; a no-op for the others)."""
        for r in self.running:
            if r.finish_reason is not None:
                self.kv.release(r)
        self.running = [r for r in self.running if r.finish_reason is None]

    def release_all(self) -> None:
        """Give back every page of every request (the loop is being left); the requests
        stay queued until `forget`."""
        for r in [*self.waiting, *self.running]:
            self.kv.release(r)

    def forget(self) -> tuple[list[Request], list[Request]]:
        """Empty the queues (after `release_all`); returns what was waiting, in order, and
        what was running."""
        waiting, running = list(self.waiting), self.running
        self.waiting, self.running, self.prefilling = deque(), [], None
        return waiting, running

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running)

    def finished(self, reqs, pieces) -> list[Event]:
        """Events for requests that made text visible: a finished one publishes what it
        wrote to the prefix cache, gives its pages back and carries its result."""
        events = []
        for r, piece in zip(reqs, pieces):
            if r.finish_reason is not None:
                self.kv.publish(r, finished=True)
                self.kv.release(r)
                events.append((r.index, piece, r.result()))
            elif piece:
                events.append((r.index, piece, None))
        return events

    # ------------------------------------------------------------ between steps

    def prepare(self) -> list[Event]:
        """Between steps: accept forced tokens, admit what fits, find every running
        request its next page (preempting if need be) and ask the logits processors of
        the requests the step draws for."""
        events = self._append_forced()
        self.running += self._admit()
        events += self._make_room()
        return events + self.process_logits(self.running)

    def schedule(self, verify_rows: Callable[[StepPlan], tuple[list, list]] | None = None
                 ) -> SchedulerOutput:
        """The next step, decided (after the last one's `update`): `prepare`, then `plan`,
        then the step's rows (`step`). `verify_rows(plan)` proposes the drafts of the
        speculating requests the plan verifies as rows (`SpecRunner.proposals`): it
        returns their proposals and the requests it left to cycles; without it they all
        run cycles. The output's `events`, `cycles` and `promised` say what ended
        before the step, who runs a cycle after it, and what the running requests are
        owed; `runs` whether a ragged step runs at all."""
        events = self.prepare()
        plan = self.plan()
        verify, left = [], list(plan.rows)
        if plan.rows and verify_rows is not None:
            verify, left = verify_rows(plan)
        beside = None if self.separate_prefill else plan.chunk  # the chunk in this step
        out = self.step(plan.plain, beside, verify) if plan.steps else SchedulerOutput([])
        if self.separate_prefill and plan.chunk is not None:
            out.prefill, self.prefilling = self.step([], plan.chunk), plan.chunk
        out.events, out.cycles = events, plan.cycles(left)
        if out.cycles:  # (counted after the step's reservations; only cycles read it)
            out.promised = self.kv.owed_to(plan.running)
        return out

    def plan(self) -> StepPlan:
        """After `prepare`: what runs next. A speculating request verifies as rows of the
        step where rows measured faster than its own cycle: beside a prefill chunk (whose
        step pads its rows to the largest bucket anyway), beside enough plain streams, or
        at a short enough context (a decode row walks its context's pages alone)."""
        running = [r for r in self.running if r.finish_reason is None]
        plain = [r for r in running if self._takes_rows(r) and r.spec is None]
        speculating = [r for r in running if self._takes_rows(r) and r.spec is not None]
        chunk = next((r for r in running if not r.decoding), None)
        if self.prefilling is not None:  # its chunk runs: the next waits for its update
            chunk = None
        rows = []
        if plain or chunk:
            rows = [r for r in speculating
                    if chunk is not None or len(plain) >= self.rows_from_streams
                    or self._context(r) <= self.rows_up_to_context]
        return StepPlan(running, plain, chunk, speculating, rows)

    def _takes_rows(self, r: Request) -> bool:
        """Whether a request takes decode rows: decoding, and not prefilling apart (a
        resumed request's last chunk makes it decoding as it is dispatched, before its
        step is read back and its pages moved to the decode devices)."""
        return r.decoding and r is not self.prefilling

    def has_decode_rows(self) -> bool:
        """Whether a running request takes decode rows now (`_takes_rows`)."""
        return any(self._takes_rows(r) for r in self.running)

    @staticmethod
    def _context(r: Request) -> int:
        """The tokens a request's rows attend to (an SMC request's: its longest particle's)."""
        return r.smc.most_tokens() if r.smc is not None else r.seq.length

    def can_run_ahead(self, last: SchedulerOutput) -> bool:
        """Whether the next step may be dispatched before `last`'s tokens are read back:
        decode rows only, the same requests (but one prefilling on devices of its own),
        nobody joining, no forced tokens, no row
        drawing past its token limit (an EOS in flight only wastes one row of one step)
        and every row's page found."""
        joinable = bool(self.waiting) and len(self.running) < self.max_batch
        decoding = (self.running if self.prefilling is None
                    else [r for r in self.running if r is not self.prefilling])
        return (last.chunk is None and last.decode == decoding and not last.verify
                and not joinable
                and all(len(r.generated) + 2 <= r.limit for r in self.running)
                and not any(r.forced for r in self.running)
                and self.kv.room_for_a_step(self.running))

    def _admit(self) -> list[Request]:
        """Admit waiting requests, in order, while they fit beside the running ones (see
        `KVManager`'s budgets): what running requests are owed is taken, pinned or
        restored by no newcomer; one that does not fit waits."""
        admitted: list[Request] = []
        while self.waiting and len(self.running) + len(admitted) < self.max_batch:
            req = self.waiting[0]
            if self.kv.tier_in_flight(req, self.running + admitted):
                break  # it shares the tier once that is written, instead of writing it too
            if not self.kv.admit(req, self.kv.owed_to(self.running + admitted)):
                if not self.running and not admitted:  # nothing running will free a page
                    if self.kv.free_pinned():
                        continue  # its pages are evictable now: try again
                    raise OutOfPagesError(
                        f"a request needs {self.kv.need(req)} KV pages but only "
                        f"{self.kv.available} are free or evictable; lower max_tokens "
                        "or load the model with more num_pages")
                break  # wait for running sequences to finish and free pages
            req.admitted_at = next(self._admissions)
            req.first_admitted = req.first_admitted or time.perf_counter()
            admitted.append(self.waiting.popleft())
        return admitted

    def _make_room(self) -> list[Event]:
        """Before a decode step, find every running request the page its next token
        needs. (SMC populations leave these pages alone: their size follows the pages
        nobody else is promised, at every cycle.) While the pool is short: first pinned
        stable tiers are unpinned, least recently used first (their idle pages become
        evictable); then the most recently admitted plain request that is not protected
        is preempted: it gives its pages back (its prompt's stay cached) and waits at the
        head of the queue, to resume by prefilling what it had. A request nothing can
        make room for ends at "length"."""
        events = []
        running = self.running
        while running and not self.kv.room_for_a_step(running):
            if self.kv.free_pinned():
                continue  # first, pinned tiers become evictable, least recently used first
            plain = [r for r in running if r.spec is None]  # the others hold their worst case
            if not plain:
                break
            victims = [r for r in plain if not r.protected] if len(running) > 1 else []
            if not victims:
                last = max(plain, key=lambda r: r.admitted_at)
                running.remove(last)
                events += self.finished([last], [last.end("length")])
                continue
            victim = max(victims, key=lambda r: r.admitted_at)
            running.remove(victim)
            self.kv.release(victim)
            victim.preemptions += 1
            victim.protected = victim.preemptions >= self.max_preemptions
            self.preemptions += 1
            self.waiting.appendleft(victim)
        return events

    def _append_forced(self) -> list[Event]:
        """Accept each running request's forced tokens (stop rules apply to them)."""
        now, events = time.perf_counter(), []
        for r in self.running:
            if r.forced and r.finish_reason is None:
                tokens, r.forced, piece = r.forced, [], ""
                for t in tokens:
                    piece += r.accept(t, now)
                    if r.finish_reason is not None:
                        break
                events += self.finished([r], [piece])
        return events

    def _drawing(self, running: list[Request]) -> list[Request]:
        """The requests the next step draws a token for: those decoding, and the one
        prefilling next if its prompt can end in this chunk (earlier chunks draw none)."""
        prefilling = next((r for r in running if not r.decoding), None)
        return [r for r in running if r.decoding or (
            r is prefilling and r.context_len - r.prefilled <= self.buckets.chunk[-1])]

    def process_logits(self, running: list[Request], late: bool = False) -> list[Event]:
        """Ask the logits processor of each running request the next step draws a token
        for (`_drawing`; `late`: a run-ahead step's rows, all drawing) for its bias; a
        processor that fails, or returns no [vocab] array, ends its request alone
        ("abort", with metrics["error"] saying why)."""
        asking = [r for r in running if r.params.logits_processor is not None]
        if not asking:  # the usual step: nothing to ask, nothing built
            return []
        events = []
        drawing = running if late else self._drawing(running)
        for r in asking:
            r.step_bias = None  # only a processor's request ever holds one
            if r.finish_reason is not None or r not in drawing:
                continue
            try:
                bias = r.params.logits_processor(list(r.generated))
                if bias is not None:
                    bias = np.asarray(bias, np.float32)
                    if bias.shape != (self.vocab_size,):
                        raise ValueError(f"it returned shape {bias.shape}, not "
                                         f"({self.vocab_size},)")
                r.step_bias = bias
            except Exception as e:  # noqa: BLE001 - the caller's code fails its request only
                r.error = f"logits_processor failed: {e}"
                events += self.finished([r], [r.end("abort")])
        return events

    # ------------------------------------------------------------ the step

    def step(self, decoding: list[Request], chunk: Request | None = None,
             verify: list = (), late_bias: bool = False) -> SchedulerOutput:
        """The next step: a token for each request of `decoding` and the next chunk of
        `chunk`'s prompt, and `verify`'s proposals (SpecRunner.proposals), each its last
        token and its drafts as rows at consecutive positions (a row sees the KV the rows
        before it write). Pages are reserved for every position it writes.
        `late_bias`: the decode rows' biases come after the dispatch."""
        out = SchedulerOutput(list(decoding), chunk, late_bias=late_bias)
        width = self.buckets.table_width
        for r in decoding:
            self.kv.reserve(r.seq, r.seq.length + 1)
            if r.step_bias is not None and not late_bias:
                out.biases[out.rows] = r.step_bias
            # the token drawn after position p is the (p + 1 - prompt)-th of its sequence
            self._row(out, r, r.generated[-1], r.seq.length, width)
            r.seq.length += 1
        for p in verify:  # pages for every position (SpecRunner.take_verified trims)
            r, drafts, start = p.request, p.drafts, p.request.seq.length
            self.kv.reserve(r.seq, start + len(drafts) + 1)
            out.verify.append((p, out.rows, start))
            for i, token in enumerate([r.generated[-1], *drafts]):
                self._row(out, r, token, start + i, width)
            r.seq.length += len(drafts) + 1
        if chunk is not None:  # pages reserved at admission; forced tokens grow them here
            room = chunk_room(self.buckets, out.rows, chunk.prefill_left(),
                              self.max_step_tokens, self.step_cost_tokens)
            out.chunk_tokens = chunk.context_ids[chunk.prefilled:chunk.chunk_end(room)]
            out.chunk_start = chunk.prefilled
            self.kv.reserve(chunk.seq, chunk.context_len)
            out.chunk_table = chunk.seq.block_table(width)
            out.chunk_bias = chunk.step_bias
            chunk.seq.length += len(out.chunk_tokens)
        return out

    @staticmethod
    def _row(out: SchedulerOutput, r: Request, token: int, position: int, width: int) -> None:
        out.tokens.append(token)
        out.positions.append(position)
        out.tables.append(r.seq.block_table(width))
        out.params.append(r.params)
        out.draws.append(position + 1 - len(r.prompt_ids))

    def update(self, out: SchedulerOutput, result: RunnerOutput,
               verified: tuple[list, list] = ([], [])) -> list[Event]:
        """Take a step's sampled tokens: a token for each decode row still running, the
        speculating requests' `verified` (requests, texts: SpecRunner.take_verified), and
        the first token of a request whose prompt the chunk completed (its prompt is
        published, its stable tier persisted, its cache hits counted)."""
        if out.chunk is not None and out.chunk is self.prefilling:
            self.prefilling = None  # (its chunk's step is read back: the next may run)
        now = time.perf_counter()
        logprobs = result.logprobs or itertools.repeat(None)
        reqs, pieces = [], []
        for j, (r, lp) in enumerate(zip(out.decode, logprobs)):
            if r.finish_reason is None:
                reqs.append(r)
                pieces.append(r.accept(int(result.sampled[j]), now, lp))
        reqs += verified[0]
        pieces += verified[1]
        r = out.chunk
        if r is not None and r.finish_reason is None and r.prefilled == r.stable_end:
            self.kv.publish(r, finished=False)  # its stable tier: requests waiting share it
        # a resumed request (preempted) knows its next token already
        if (r is not None and r.finish_reason is None and not r.generated
                and r.prefilled == len(r.prompt_ids)):
            self.kv.publish(r, finished=False)
            self.kv.persist_tier(r)
            self.kv.count(r)
            # its row: after every (padded) decode row of the step's shape
            row, _ = step_shape(self.buckets, out.rows, len(out.chunk_tokens))
            reqs.append(r)
            pieces.append(r.accept(int(result.sampled[row]), now,
                                   result.logprobs[row] if result.logprobs else None))
        return self.finished(reqs, pieces)
