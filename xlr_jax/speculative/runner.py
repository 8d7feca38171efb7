"""The host side of speculative decoding: page bookkeeping around `SpecSteps.cycle`.

Speculating requests live in the engine's one loop beside plain ones (see
`Engine.serve`): they prefill in its ragged steps and sample their first token
there. They verify as rows of the ragged step when it runs for other requests and
rows measured faster than a cycle of their own (`Scheduler.plan` decides; `proposals`,
`take_verified`): one target pass for all. So do an SMC request's particles, when its
population fits in the step's rows. Host proposals (n-gram) are made before the
step; a device draft (self:K, a draft model) proposes in a pass of its own
(`SpecSteps.propose`), and its drafts are judged on the step's logits with the keys
its own cycle would use (`SpecSteps.judge`, exact or SMC's). Otherwise, between
plain steps, `SpecRunner.run` gives each request one cycle.
Exact-speculation requests with the same configuration are the rows of one batched
cycle; so are the particles of SMC requests with the same configuration (`SmcRun`, one
population per request), as many populations as the largest batch holds. The
particles start as forks of the prefilled request
(sharing its pages). Before each cycle their number N follows the pages nobody else
is promised, both ways: it shrinks by resampling (re-pointing block tables: forks of
the ancestors; a shared partial last page is copied on its next write) and grows by
splitting particles, each copy taking its share of the weight. An ESS below the
threshold resamples too. With one particle a cycle is exact speculation. SMC starts
after a probation of exact cycles that measure the draft's agreement with the
target (`SmcWatch`); a draft that agrees too little (mean sum_v min(p, q) under
`SpecConfig.min_agreement`) keeps the request on exact speculation, and the metrics
say why. The answer is one particle drawn by weight; its text is released when the
request ends.

Before a cycle every row reserves pages for all gamma + 1 positions it may
write; afterwards `SequencePages.trim` gives back what the rejected tokens
used. Nothing is ever copied to undo a rejection.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from xlr_jax.errors import InvalidRequestError
from xlr_jax.planning.buckets import Buckets, draft_bucket, pick_bucket
from xlr_jax.planning.mapper import SpeculativePolicy, particles_for
from xlr_jax.speculative.acceptance import accept_by_matching
from xlr_jax.speculative.config import ModelDraft, SpecConfig
from xlr_jax.speculative.smc import (block_increment, draw_keys, ess, log_mean_weight, pick_answer,
                                     resample, split)

SMC_PROBATION = 4      # exact cycles that measure the draft's agreement before SMC starts


def start_metrics(spec: SpecConfig) -> dict:
    """A speculating request's metrics before its first cycle."""
    metrics = {"target_passes": 0, "draft_tokens": 0, "accepted_tokens": 0,
               "accepted_per_pass": 0.0, "acceptance_rate": 0.0}
    if spec.method == "smc":  # also for a request that ends at its first token
        metrics.update(SmcWatch(spec.min_agreement).metrics())
    return metrics


class SpecRunner:
    """Runs the cycles of an engine's speculating requests: pages through the scheduler's
    KV manager, device work through the model runner, results as the scheduler's events.
    `totals`: draft_tokens, accepted_tokens, target_passes and cycles over every request."""

    def __init__(self, scheduler, runner, buckets: Buckets, policy: SpeculativePolicy):
        self.scheduler, self.kv, self.runner = scheduler, scheduler.kv, runner
        self.buckets = buckets
        self.policy = policy  # the plan's: particles at most, rows or cycles
        self.totals = dict.fromkeys(("draft_tokens", "accepted_tokens", "target_passes",
                                     "cycles"), 0)

    def run(self, reqs, promised: int):
        """One cycle for each of `reqs` (decoding, speculating, running): exact ones of
        one configuration batched, and SMC populations of one configuration batched.
        `promised`: pages the other running requests may still take (SMC particles
        leave them alone). Yields the engine's (index, piece, result) events."""
        exact, smc = [], []
        for r in reqs:
            self._draft_prefill(r)
            (smc if r.spec.method == "smc" else exact).append(r)
        for group in _batches(exact, lambda r: (r.spec, r.draft), lambda r: 1, len(exact)):
            yield from self._exact(group)  # one batched cycle per (configuration, draft)
        if smc:
            yield from self._smc(smc, promised)

    def _smc(self, reqs, promised: int):
        """One cycle of each SMC request's population. Populations of one method (SMC, or
        exact while on probation or fallen back) and one (configuration, draft) are the
        rows of one batched cycle, as many as the largest batch holds. Each population
        sizes itself from the pages nobody else is promised, in turn, and takes its
        cycle's pages at once, so the next one sees what is left."""
        runs = []
        try:
            for r in reqs:
                run, free = self._population(r, promised)
                runs.append(run)
                if not run.prepared:  # (a population that ended in proposals is)
                    run.prepare(self, free)
            ready = [run for run in runs if run.rows]
            for group in _batches(ready, lambda run: run.key, lambda run: len(run.rows),
                                  self.buckets.batch[-1]):
                out = self.cycle([p for run in group for p in run.rows], group[0].method,
                                 [salt for run in group for salt in run.salts])
                start = 0
                for run in group:
                    run.absorb(out.part(start, start + len(run.rows)))
                    start += len(run.rows)
        except BaseException:
            for run in runs:
                run.release()  # idempotent: the engine then releases their requests too
            raise
        for run in runs:
            if run.ended:
                yield from run.finish(self.scheduler)

    # ------------------------------------------------------------ one cycle

    def cycle(self, rows, method: str, salts=None) -> "_Cycle":
        """Run one cycle over `rows` (requests, or one request's particles)."""
        spec, draft = rows[0].spec, rows[0].draft
        budgets = self.budgets(rows)
        guesses = None
        if draft.kind == "tokens":
            guesses = [draft.propose(r.prompt_ids + r.generated, b)
                       for r, b in zip(rows, budgets)]
            budgets = [len(g) for g in guesses]
            if not any(budgets) and salts is None:  # nothing to verify: a plain decode
                return self._decode(rows)            # step (unsalted) is cheaper
        # host proposals vary in number: verify only as many positions as the longest needs
        gamma = (draft_bucket(max(budgets), spec.gamma) if guesses
                 else spec.gamma)
        x = self._inputs(rows, budgets, salts)
        proposed = np.zeros((len(x.last), gamma), np.int32)
        for j, guess in enumerate(guesses or []):
            proposed[j, :budgets[j]] = guess
        accepted, nxt, drafts, log_p, log_q, agreement = self.runner.cycle(
            draft, x, proposed, gamma=gamma, method=method)
        self.totals["cycles"] += 1
        accepted, nxt, drafts = np.asarray(accepted), np.asarray(nxt), np.asarray(drafts)
        kept = [self._settle(r, [*map(int, drafts[j, :budgets[j]])], int(accepted[j]),
                             int(nxt[j]), int(x.positions[j])) for j, r in enumerate(rows)]
        rows_n = len(rows)
        return _Cycle(kept, x.num_draft[:rows_n], np.asarray(log_p)[:rows_n],
                      np.asarray(log_q)[:rows_n], np.asarray(agreement)[:rows_n])

    def _inputs(self, rows, budgets: list[int], salts=None) -> "_Inputs":
        """Reserve pages for every position `rows` may write (their last tokens and
        `budgets` drafts); their device inputs, padded to a batch bucket."""
        self.reserve(rows, budgets)
        n = pick_bucket(len(rows), self.buckets.batch)
        last, positions, num_draft, salt = (np.zeros(n, np.int32) for _ in range(4))
        for j, r in enumerate(rows):
            last[j], positions[j], num_draft[j] = r.generated[-1], r.seq.length, budgets[j]
            salt[j] = salts[j] if salts else 0
        sampling, sampler = self.runner.sampling([r.params for r in rows],
                                                 [len(r.generated) for r in rows], n)
        return _Inputs(last, positions, num_draft, salt, sampling, sampler,
                       self.kv.block_tables([r.seq for r in rows], n, self.buckets.pages))

    @staticmethod
    def budgets(rows) -> list[int]:
        """The draft positions each row may verify in a cycle: gamma, within max_tokens."""
        return [min(r.spec.gamma, r.limit - len(r.generated) - 1) for r in rows]

    def reserve(self, rows, budgets: list[int]) -> None:
        """Pages for every position a cycle may write: the rows' last tokens and their
        drafts (what rejected tokens used is trimmed after it)."""
        for r, b in zip(rows, budgets):
            self.kv.reserve(r.seq, r.seq.length + b + 1)

    def _settle(self, r, drafts: list[int], accepted: int, nxt: int, position: int) -> list[int]:
        """A row's verdict after its target pass (its last token at `position`): the
        tokens it keeps, its first `accepted` drafts and `nxt`; the pages of the rejected
        ones are given back and the pass is counted."""
        r.seq.trim(position + accepted + 1)
        self._count(r, len(drafts), accepted)
        return [*drafts[:accepted], nxt]

    def _count(self, r, drafted: int, accepted: int) -> None:
        """One target pass of a request's row(s): in its metrics and the engine's."""
        m = r.spec_metrics
        m["target_passes"] += 1
        m["draft_tokens"] += drafted
        m["accepted_tokens"] += accepted
        totals = self.totals
        totals["target_passes"] += 1
        totals["draft_tokens"] += drafted
        totals["accepted_tokens"] += accepted

    def _decode(self, rows) -> "_Cycle":
        """One plain step (the engine's) for rows with nothing proposed."""
        step = self.runner.execute(self.scheduler.step(rows))
        tokens = self.runner.read(step, timed=False).sampled
        for r in rows:
            self._count(r, 0, 0)
        return _Cycle.plain([[int(tokens[j])] for j in range(len(rows))])

    # ------------------------------------------------------------ rows of the ragged step

    def proposals(self, reqs, room: int, promised: int) -> tuple[list["Proposal"], list]:
        """Proposals to verify as rows of a ragged step with `room` rows for them: one for
        each exact request of `reqs` (`Scheduler.plan` chose them) and one for each live
        particle of each SMC request whose population fits (sized from the pages nobody
        else is promised, see `_smc`) and, with all its drafts, fits in the rows (fewer
        drafts would change what it generates). The rows left after those and every
        exact request's last token go to exact requests' drafts within each one's
        budget, in order (fewer drafts change how fast, never what, an exact request
        generates). Device drafts propose in one pass per (configuration, draft,
        method), which reserves the pages their rows write. Returns (proposals, the
        SMC requests left to cycles of their own)."""
        smc = [r for r in reqs if r.spec.method == "smc"]
        room -= len(reqs) - len(smc)  # every exact request's last token
        left = []
        for r in smc:
            run, free = self._population(r, promised)
            if run.prepare(self, free, max_rows=room) and run.rows:
                room -= sum(1 + b for b in self.budgets(run.rows))
            else:  # no room for it, or it ended: its own cycle, or its finish
                left.append(r)
        out, device = [], {}
        for r in reqs:
            if r in left:
                continue
            if r.spec.method == "smc":
                run = r.smc
                props = [Proposal(p, [], budget=b, salt=salt, run=run) for p, b, salt
                         in zip(run.rows, self.budgets(run.rows), run.salts)]
                method = run.method
            else:
                budget = max(0, min(self.budgets([r])[0], room))
                if r.draft.kind == "tokens":
                    drafts = r.draft.propose(r.prompt_ids + r.generated, budget) if budget else []
                    room -= len(drafts)
                    out.append(Proposal(r, drafts))
                    continue
                room -= budget
                props, method = [Proposal(r, [], budget=budget)], "exact"
            out += props
            device.setdefault((r.spec, r.draft, method), []).extend(props)
        for (_, _, method), group in device.items():
            self._propose(group, method)
        return out, left

    def _population(self, r, promised: int) -> tuple["SmcRun", int]:
        """An SMC request's population (made at its first cycle) and the pages it may
        use: free ones not promised to the other running requests."""
        self._draft_prefill(r)
        if r.smc is None:
            r.smc = SmcRun(r)
        return r.smc, self.kv.available - (promised - self.kv.owed(r))

    def _propose(self, group: list["Proposal"], method: str) -> None:
        """Run the device draft of `group` (one configuration and method) and fill in its
        drafts."""
        rows = [prop.request for prop in group]
        for r in rows:
            self._draft_prefill(r)
        x = self._inputs(rows, [prop.budget for prop in group], [prop.salt for prop in group])
        drafts, q = self.runner.propose(rows[0].draft, x, gamma=rows[0].spec.gamma)
        judged = _Judged(drafts, q, x, method)
        host = np.asarray(drafts)
        for j, prop in enumerate(group):
            prop.drafts = [int(t) for t in host[j, :prop.budget]]
            prop.judged, prop.slot = judged, j

    def take_verified(self, verify: list[tuple], drawn, logits, now: float):
        """Take what a ragged step gave each verifying request, from its rows (its last
        token at `position` in row `row`, then its drafts): (requests still running or
        just finished, the text each made visible). Gives back the rejected positions'
        pages. An SMC population weighs what its particles kept, and when it has ended
        gives its answer (the chosen particle, with all its text)."""
        for prop, _, _ in verify:
            if prop.judged is not None and prop.judged.accepted is None:
                self._judge(prop.judged, verify, logits)
        reqs, pieces, populations = [], [], {}
        for prop, row, position in verify:
            r = prop.request
            if prop.run is not None:
                if prop.run.req.finish_reason is None:  # not aborted meanwhile
                    populations.setdefault(id(prop.run), []).append((prop, position))
                continue
            if r.finish_reason is not None:
                continue
            if prop.judged is None:
                (accepted,), (nxt,) = accept_by_matching(
                    np.asarray(drawn[row:row + len(prop.drafts) + 1])[None],
                    np.asarray(prop.drafts, np.int32)[None], np.array([len(prop.drafts)]),
                    xp=np)
            else:
                accepted, nxt = prop.judged.accepted[prop.slot], prop.judged.next[prop.slot]
            reqs.append(r)
            pieces.append(self._keep(r, prop.drafts, int(accepted), int(nxt), position, now))
        for particles in populations.values():
            run = particles[0][0].run
            run.absorb(self._kept_by_particles(particles))
            if run.ended:
                chosen = run.conclude()
                reqs.append(chosen)
                pieces.append(chosen.pending)
        return reqs, pieces

    def _kept_by_particles(self, particles: list[tuple]) -> "_Cycle":
        """One population's cycle, from its particles' judged rows (proposal, position),
        all judged together."""
        judged = particles[0][0].judged
        slots = [prop.slot for prop, _ in particles]
        kept = [self._settle(prop.request, prop.drafts, int(judged.accepted[prop.slot]),
                             int(judged.next[prop.slot]), position)
                for prop, position in particles]
        return _Cycle(kept, np.array([len(prop.drafts) for prop, _ in particles]),
                      judged.log_p[slots], judged.log_q[slots], judged.agreement[slots])

    def _judge(self, judged: "_Judged", verify: list[tuple], logits) -> None:
        """Acceptance (exact, or SMC's) of one device proposal's rows in the step's
        `logits`."""
        x, gamma = judged.x, judged.drafts.shape[1]
        index = np.zeros((len(x.last), gamma + 1), np.int32)
        for prop, row, _ in verify:
            if prop.judged is judged:  # positions past a row's drafts repeat its last
                index[prop.slot] = row + np.minimum(np.arange(gamma + 1), len(prop.drafts))
        decided = self.runner.judge(logits, index, judged.drafts, judged.q, x,
                                    method=judged.method)
        (judged.accepted, judged.next, judged.log_p, judged.log_q,
         judged.agreement) = map(np.asarray, decided)

    def _keep(self, r, drafts: list[int], accepted: int, nxt: int, position: int,
              now: float) -> str:
        """Keep a request's first `accepted` drafts and `nxt` after them (see `_settle`);
        returns the visible text."""
        piece, _ = _take(r, self._settle(r, drafts, accepted, nxt, position), now)
        if r.finish_reason is not None:
            _summarize(r)
        return piece

    def _exact(self, reqs):
        kept = self.cycle(reqs, "exact").kept
        now = time.perf_counter()
        pieces = [_take(r, toks, now)[0] for r, toks in zip(reqs, kept)]
        for r in reqs:
            if r.finish_reason is not None:
                _summarize(r)
        yield from self.scheduler.finished(reqs, pieces)

    def particle_count(self, req, particles, free: int) -> int:
        """N for the next cycle from `free` pages, keeping what one particle needs to
        finish: no more than the pages hold for one cycle of every particle, and more
        than now only if they hold two (a population grown for one cycle would be cut
        back at once)."""
        spec = req.spec
        finish_one = self.kv.max_pages(req) - min(len(p.seq.pages) for p in particles) + 1
        cap = min(self.policy.particle_cap if spec.particles == "auto" else spec.particles,
                  self.buckets.batch[-1])
        fits = partial(particles_for, free - finish_one, max(p.seq.length for p in particles),
                       page_size=self.kv.page_size, cap=cap)
        now = fits(spec.gamma)
        return now if now <= len(particles) else max(len(particles), fits(2 * spec.gamma + 1))

    # ------------------------------------------------------------ draft model KV

    def _draft_prefill(self, r) -> None:
        """A separate draft model reads the prompt into its own KV (same pages) before the
        request's first cycle. It covers prefix-cached pages too: the draft's values for
        them may be missing."""
        if not isinstance(r.draft, ModelDraft) or r.draft_prefilled:
            return
        self.runner.prefill_draft(r.draft, r.prompt_ids, r.seq)
        r.draft_prefilled = True


class SmcRun:
    """One SMC request's population between cycles: its particles (forks of the request;
    at first the request itself), their log-weights, the watch, and its own random
    keys (every draw its own key)."""

    def __init__(self, req):
        self.req = req
        self.resample_key, self.answer_key = draw_keys(req.params.seed)
        self.particles, self.log_w = [req], np.zeros(1)
        self.watch = SmcWatch(req.spec.min_agreement)
        self.draws = 0  # resample keys used: every resample its own
        # this cycle's: one particle (exact)?, the live particles' indices, and they;
        # prepared for it (its N and pages taken), not yet absorbed
        self.single, self.live, self.rows = True, [], []
        self.prepared = False

    def most_pages(self) -> int:
        return max(len(p.seq.pages) for p in self.particles)

    def most_tokens(self) -> int:
        return max(p.seq.length for p in self.particles)

    def _resample(self, n: int, degenerate: bool) -> None:
        """Draw n particles by weight (forks of the ancestors), weights equal again."""
        ancestors = resample(self.resample_key(self.draws), self.log_w.astype(np.float32),
                             self.req.spec.resampler, num=n)
        self.draws += 1
        self.particles = _repoint(self.particles, np.asarray(ancestors))
        self.watch.resamples += degenerate  # a change of N alone is no ESS resample
        self.watch.log_z += float(log_mean_weight(self.log_w))
        self.log_w = np.zeros(n)

    def release(self) -> None:
        """Give every particle's pages back (idempotent)."""
        for p in self.particles:
            p.seq.release()

    @property
    def key(self) -> tuple:
        """Populations with equal keys share a batched cycle."""
        return self.single, self.req.spec, self.req.draft

    @property
    def method(self) -> str:
        """This cycle's: one particle is exact speculation, more are SMC."""
        return "exact" if self.single else "smc"

    @property
    def salts(self) -> list[int]:
        """Each live particle's salt this cycle: its index (one particle: 0, unsalted as
        an exact request's)."""
        return [0] * len(self.rows) if self.single else list(self.live)

    def prepare(self, runner: SpecRunner, free: int, max_rows: int | None = None) -> bool:
        """Before a cycle: N from `free` pages (none promised to other requests), resample
        or split to it, and take the pages the live particles (`rows`) may write. With
        `max_rows`, a population whose particles and all their drafts would take more
        rows is left as it is (False)."""
        spec, watch = self.req.spec, self.watch
        # N follows free pages both ways: shrink by resampling, grow by splitting
        n = 1 if watch.single else runner.particle_count(self.req, self.particles, free)
        if max_rows is not None:  # particles are forks of the live ones: the same budget
            live = [p for p in self.particles if p.finish_reason is None]
            if not live or n * (1 + max(runner.budgets(live))) > max_rows:
                return False
        degenerate = float(ess(self.log_w)) < spec.ess_threshold * len(self.particles)
        if degenerate or n < len(self.particles):
            self._resample(n, degenerate)
        elif n > len(self.particles):
            parents, self.log_w = split(self.log_w, n, [p.finish_reason is None
                                                        for p in self.particles])
            self.particles = _repoint(self.particles, parents)
        # with one particle a cycle is plain exact speculation, unsalted
        self.single = len(self.particles) == 1
        self.live = [j for j, p in enumerate(self.particles) if p.finish_reason is None]
        self.rows = [self.particles[j] for j in self.live]
        if self.rows:  # none: resampled onto finished particles only
            watch.particles.append(len(self.particles))
            runner.reserve(self.rows, runner.budgets(self.rows))
        self.prepared = True
        return True

    def absorb(self, out: "_Cycle") -> None:
        """After its cycle: each live particle takes its tokens, and the drafts it kept
        weigh it."""
        self.prepared = False
        now = time.perf_counter()
        taken = np.zeros(len(self.rows), np.int64)
        for j, (p, toks) in enumerate(zip(self.rows, out.kept)):
            piece, taken[j] = _take(p, toks, now)
            p.pending += piece
        # the drafts each particle kept, up to its stop (exact: up to the first
        # rejection, whose context still follows p)
        counted = np.minimum(taken, out.num_draft)
        if self.single:
            self.watch.observe_exact(out.agreement[0], int(counted[0]))
        else:  # weigh the drafts each particle kept
            increment = block_increment(out.log_p, out.log_q, counted)
            self.log_w[self.live] += increment
            self.watch.observe_smc(increment, out.agreement, counted)

    @property
    def ended(self) -> bool:
        """Every particle ended (or a resample landed only on ended ones)."""
        return not self.rows or all(p.finish_reason is not None for p in self.particles)

    def finish(self, scheduler):
        """The answer (see `conclude`), as the scheduler's events."""
        chosen = self.conclude()
        yield from scheduler.finished([chosen], [chosen.pending])

    def conclude(self):
        """The answer: one particle drawn by weight, which the request's result becomes;
        the others give their pages back."""
        req, watch = self.req, self.watch
        watch.log_z += float(log_mean_weight(self.log_w))
        chosen = self.particles[int(pick_answer(self.answer_key,
                                                self.log_w.astype(np.float32)))]
        for p in self.particles:
            if p is not chosen:
                p.seq.release()
        chosen.spec_metrics.update(watch.metrics())
        weights = self.log_w - float(np.logaddexp.reduce(self.log_w))
        chosen.particles = [{"token_ids": list(p.generated), "log_weight": float(lw)}
                            for p, lw in zip(self.particles, weights)]
        _summarize(chosen)
        req.finish_reason = chosen.finish_reason
        return chosen


class _Inputs(NamedTuple):
    """The device inputs of a cycle or a proposal over some rows (see SpecRunner._inputs)."""
    last: np.ndarray        # [B] each row's last token, not yet in the KV
    positions: np.ndarray   # [B] its position
    num_draft: np.ndarray   # [B] drafts it may verify
    salt: np.ndarray        # [B] 0, or an SMC particle's own salt
    sampling: object
    sampler: str
    block_tables: np.ndarray


@dataclass
class _Judged:
    """A device draft's proposals, kept for `SpecSteps.judge`, and its decisions."""
    drafts: object      # [B, gamma] on the device
    q: object           # [B, gamma, V] on the device
    x: _Inputs
    method: str         # "exact", or "smc" (a population's particles)
    accepted: np.ndarray | None = None
    next: np.ndarray | None = None
    log_p: np.ndarray | None = None      # [B, gamma] each draft's, for SMC's weights
    log_q: np.ndarray | None = None
    agreement: np.ndarray | None = None  # [B, gamma] sum_v min(p, q), for SmcWatch


@dataclass
class Proposal:
    """A speculating request's (or an SMC particle's) drafts to verify as rows of a
    ragged step; a device draft's are judged together (`judged`, this row's `slot` in
    it, drawn with its `salt`); a particle's population is `run`."""
    request: Any
    drafts: list[int]
    budget: int = 0
    judged: _Judged | None = None
    slot: int = 0
    salt: int = 0
    run: "SmcRun | None" = None


def _batches(items: list, key, size, cap: int):
    """`items` in groups of equal `key`, in order of first appearance, each group's total
    `size` at most `cap` (an item alone is never over it)."""
    pending = list(items)
    while pending:
        group, total = [], 0
        for item in pending:
            if key(item) == key(pending[0]) and total + size(item) <= cap:
                group.append(item)
                total += size(item)
        pending = [item for item in pending if item not in group]
        yield group


def _take(r, tokens: list[int], now: float) -> tuple[str, int]:
    """Accept tokens in order until the request finishes; (the visible text, how many
    tokens were taken)."""
    piece = ""
    for taken, t in enumerate(tokens, 1):
        piece += r.accept(t, now)
        if r.finish_reason is not None:
            return piece, taken
    return piece, len(tokens)


def check_request(spec: SpecConfig, params) -> None:
    """Refuse sampling settings the method cannot serve, with what to do instead."""
    if params.logprobs is not None:
        raise InvalidRequestError("logprobs are not reported under speculative decoding; "
                                  "drop speculative or logprobs")
    if params.logits_processor is not None:  # a mask would change what p is
        raise InvalidRequestError("a request with a logits_processor does not speculate; "
                                  "drop speculative or the processor")
    if spec.method != "smc":
        return
    if params.greedy:
        raise InvalidRequestError("SMC speculative decoding samples: set temperature "
                                  "> 0, or use method exact for greedy decoding")
    if params.filtered:  # q must cover every token p keeps
        raise InvalidRequestError("SMC speculative decoding samples at a temperature "
                                  "only: top_k, top_p and min_p would keep the draft "
                                  "from proposing tokens the target allows; drop "
                                  "them, or use method exact")


def _summarize(r) -> None:
    """Per-request speculative metrics: mean tokens kept per target pass, acceptance."""
    m = r.spec_metrics
    passes = max(m["target_passes"], 1)
    m["accepted_per_pass"] = (len(r.generated) - 1) / passes  # the first came from prefill
    m["acceptance_rate"] = m["accepted_tokens"] / m["draft_tokens"] if m["draft_tokens"] else 0.0


def _repoint(particles, parents) -> list:
    """The particles that copy `parents` (indices): forks of their block tables; the old
    particles give their pages back (shared pages stay with the forks)."""
    new = [particles[int(a)].fork() for a in parents]
    for p in particles:
        p.seq.release()
    return new


class _Cycle:
    """What one cycle gave each row: the tokens kept after its last one, and for each
    draft position log p, log q and the agreement sum_v min(p, q)."""

    def __init__(self, kept, num_draft, log_p, log_q, agreement):
        self.kept, self.num_draft = kept, num_draft
        self.log_p, self.log_q, self.agreement = log_p, log_q, agreement

    def part(self, start: int, stop: int) -> "_Cycle":
        """Rows [start, stop): one population's share of a batched cycle."""
        return _Cycle(self.kept[start:stop], self.num_draft[start:stop],
                      self.log_p[start:stop], self.log_q[start:stop],
                      self.agreement[start:stop])

    @classmethod
    def plain(cls, kept) -> "_Cycle":
        none = np.zeros((len(kept), 0))
        return cls(kept, np.zeros(len(kept), np.int32), none, none, none)


class SmcWatch:
    """One SMC request's running record: resamples and the normalizer estimate, and how
    well the draft agrees with the target, which decides whether SMC may run at all.

    Probation: the first SMC_PROBATION cycles that propose anything run as exact
    speculation (one particle, weight 1: still the target's distribution) and measure
    the draft's agreement sum_v min(p, q) (its exact acceptance probability) at the
    positions up to the first rejection, whose contexts follow p. Below min_agreement
    the request stays exact (a fallback, with its reason): SMC keeps every draft token,
    so with such a draft its answer would follow q more than p. Agreement measured on
    the particles' own drafts cannot replace this: once they degenerate into
    repetition, draft and target agree on repeating.

    Watch: a probation passed on a lucky stretch lets a poor draft through (on the
    quality benchmark, 2 of 20 requests with a draft of mean agreement 0.55 did, and
    wrote answers far less likely than plain sampling's). So under SMC the agreement
    at the particles' draft positions is watched too: when its mean over the last
    SMC_PROBATION cycles falls below min_agreement, the request falls back to exact
    speculation mid-way (the population is resampled to one particle by weight)."""

    def __init__(self, min_agreement: float):
        self.min_agreement = min_agreement
        self.particles: list[int] = []
        self.resamples, self.log_z = 0, 0.0
        self.trials, self.agreement_sum, self.positions = 0, 0.0, 0
        self.ess_fractions: list[float] = []
        self.recent: deque = deque(maxlen=SMC_PROBATION)  # SMC cycles' (agreement sum, n)
        self.fallback: str | None = None

    @property
    def single(self) -> bool:
        """The next cycle runs one particle: on probation, or fallen back."""
        return self.fallback is not None or (self.min_agreement > 0
                                             and self.trials < SMC_PROBATION)

    def observe_exact(self, agreement, positions: int) -> None:
        """A one-particle cycle's per-position agreement and how many positions count."""
        if not positions:
            return
        self.trials += 1
        self.agreement_sum += float(agreement[:positions].sum())
        self.positions += positions
        if (self.trials == SMC_PROBATION and self.fallback is None
                and self.agreement < self.min_agreement):
            self.fallback = (f"draft agreement {self.agreement:.2f} < min_agreement "
                             f"{self.min_agreement:g} over {self.positions} draft tokens")

    def observe_smc(self, increment, agreement, counted) -> None:
        """An SMC cycle's log-weight increments (how far one cycle spreads the weights)
        and the agreement at each row's first `counted` draft positions."""
        self.ess_fractions.append(float(ess(np.asarray(increment, np.float32))) /
                                  len(increment))
        n = int(np.sum(counted))
        if n:
            total = sum(float(a[:c].sum()) for a, c in zip(agreement, counted))
            self.recent.append((total, n))
        mean = sum(t for t, _ in self.recent) / max(sum(c for _, c in self.recent), 1)
        if (len(self.recent) == SMC_PROBATION and self.fallback is None
                and mean < self.min_agreement):
            self.fallback = (f"draft agreement {mean:.2f} under SMC fell below "
                             f"min_agreement {self.min_agreement:g} over the last "
                             f"{SMC_PROBATION} cycles")

    @property
    def agreement(self) -> float | None:
        return self.agreement_sum / self.positions if self.positions else None

    def metrics(self) -> dict:
        return {"particles": self.particles, "resamples": self.resamples,
                "log_normalizer": self.log_z, "smc_cycles": len(self.ess_fractions),
                "smc_fallback": self.fallback, "draft_agreement": self.agreement,
                "smc_ess_fraction": (float(np.mean(self.ess_fractions))
                                     if self.ess_fractions else None)}
