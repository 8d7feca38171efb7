"""The host side of speculative decoding: which rows verify what, and what they keep.

Speculating requests live in the engine's one loop beside plain ones: they prefill in
its ragged steps and sample their first token there. After that, each step the
scheduler picks how each one verifies (`Scheduler.plan`, by the plan's rows-or-cycle
rule), and this runner carries it out:

- **as rows of the ragged step** (`proposals`, then `take_verified`): the proposers
  (`speculative.proposals`) make its drafts, the step scores them beside the plain rows
  (one target pass for all), and the model runner's output step judges them (exact
  acceptance, or SMC's weights: `ModelRunner.read` returns a `Verdict` per row);
- **in a cycle of its own** (`run`): one jitted pass that proposes, scores and judges
  (`SpecSteps.cycle`). Exact requests of one configuration are the rows of one batched
  cycle; so are the particles of SMC populations of one configuration, as many as the
  largest batch holds.

An SMC request's population (`speculative.population.SmcRun`) is its own state, held on
the request; this runner sizes it from the pages nobody else is promised before each
pass and feeds it what its particles kept. Before a pass every row reserves pages for
all gamma + 1 positions it may write; afterwards `SequencePages.trim` gives back what
the rejected tokens used. Nothing is ever copied to undo a rejection.
"""
from __future__ import annotations

import time

import numpy as np

from xlr_jax.errors import InvalidRequestError
from xlr_jax.planning.buckets import Buckets, draft_bucket
from xlr_jax.planning.mapper import SpeculativePolicy
from xlr_jax.speculative.config import SpecConfig
from xlr_jax.speculative.outcome import (Kept, Verdict, count_pass, draft_budgets, summarize,
                                         take_tokens)
from xlr_jax.speculative.population import SmcRun
from xlr_jax.speculative.proposals import Proposal, Proposer


class SpecRunner:
    """Carries out the passes of an engine's speculating requests: pages through the
    scheduler's KV manager, device work through the model runner, results as the
    scheduler's events. `totals`: draft_tokens, accepted_tokens, target_passes and cycles
    over every request."""

    def __init__(self, scheduler, runner, buckets: Buckets, policy: SpeculativePolicy):
        self.scheduler, self.kv, self.runner = scheduler, scheduler.kv, runner
        self.buckets = buckets
        self.policy = policy  # the plan's: particles at most
        self.proposer = Proposer(self.kv, runner, buckets)
        self.totals = dict.fromkeys(("draft_tokens", "accepted_tokens", "target_passes",
                                     "cycles"), 0)

    # ------------------------------------------------------------ cycles of their own

    def run(self, reqs, promised: int):
        """One cycle for each of `reqs` (decoding, speculating, running): exact ones of
        one configuration batched, and SMC populations of one configuration batched.
        `promised`: pages the other running requests may still take (SMC particles
        leave them alone). Yields the engine's (index, piece, result) events."""
        exact, smc = [], []
        for r in reqs:
            self.proposer.draft_prefill(r)
            (smc if r.spec.method == "smc" else exact).append(r)
        for group in _batches(exact, lambda r: (r.spec, r.draft), lambda r: 1, len(exact)):
            yield from self._exact(group)  # one batched cycle per (configuration, draft)
        if smc:
            yield from self._smc(smc, promised)

    def _exact(self, reqs):
        kept = self.cycle(reqs, "exact").kept
        now = time.perf_counter()
        pieces = [take_tokens(r, toks, now)[0] for r, toks in zip(reqs, kept)]
        for r in reqs:
            if r.finish_reason is not None:
                summarize(r)
        yield from self.scheduler.finished(reqs, pieces)

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
                    run.prepare(self.kv, free)
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
                chosen = run.conclude()
                yield from self.scheduler.finished([chosen], [chosen.pending])

    def cycle(self, rows, method: str, salts=None) -> Kept:
        """Run one cycle over `rows` (requests, or one request's particles)."""
        spec, draft = rows[0].spec, rows[0].draft
        budgets = draft_budgets(rows)
        guesses = None
        if draft.kind == "tokens":
            guesses = [self.proposer.host(r, b) for r, b in zip(rows, budgets)]
            budgets = [len(g) for g in guesses]
            if not any(budgets) and salts is None:  # nothing to verify: a plain decode
                return self._decode(rows)            # step (unsalted) is cheaper
        # host proposals vary in number: verify only as many positions as the longest needs
        gamma = (draft_bucket(max(budgets), spec.gamma) if guesses
                 else spec.gamma)
        x = self.proposer.inputs(rows, budgets, salts)
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
        return Kept(kept, x.num_draft[:rows_n], np.asarray(log_p)[:rows_n],
                    np.asarray(log_q)[:rows_n], np.asarray(agreement)[:rows_n])

    def _decode(self, rows) -> Kept:
        """One plain step (the engine's) for rows with nothing proposed."""
        step = self.runner.execute(self.scheduler.step(rows))
        tokens = self.runner.read(step, timed=False).sampled
        for r in rows:
            count_pass(r, 0, 0, self.totals)
        return Kept.plain([[int(tokens[j])] for j in range(len(rows))])

    def _settle(self, r, drafts: list[int], accepted: int, nxt: int, position: int) -> list[int]:
        """A row's verdict after its target pass (its last token at `position`): the
        tokens it keeps, its first `accepted` drafts and `nxt`; the pages of the rejected
        ones are given back and the pass is counted."""
        r.seq.trim(position + accepted + 1)
        count_pass(r, len(drafts), accepted, self.totals)
        return [*drafts[:accepted], nxt]

    # ------------------------------------------------------------ rows of the ragged step

    def proposals(self, reqs, room: int, promised: int) -> tuple[list[Proposal], list]:
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
            if run.prepare(self.kv, free, max_rows=room) and run.rows:
                room -= sum(1 + b for b in draft_budgets(run.rows))
            else:  # no room for it, or it ended: its own cycle, or its finish
                left.append(r)
        out, device = [], {}
        for r in reqs:
            if r in left:
                continue
            if r.spec.method == "smc":
                run = r.smc
                props = [Proposal(p, [], budget=b, salt=salt, run=run) for p, b, salt
                         in zip(run.rows, draft_budgets(run.rows), run.salts)]
                method = run.method
            else:
                budget = max(0, min(draft_budgets([r])[0], room))
                if r.draft.kind == "tokens":
                    drafts = self.proposer.host(r, budget)
                    room -= len(drafts)
                    out.append(Proposal(r, drafts))
                    continue
                room -= budget
                props, method = [Proposal(r, [], budget=budget)], "exact"
            out += props
            device.setdefault((r.spec, r.draft, method), []).extend(props)
        for (_, _, method), group in device.items():
            self.proposer.device(group, method)
        return out, left

    def _population(self, r, promised: int) -> tuple[SmcRun, int]:
        """An SMC request's population (made at its first pass) and the pages it may use:
        free ones not promised to the other running requests."""
        self.proposer.draft_prefill(r)
        if r.smc is None:
            spec = r.spec
            cap = self.policy.particle_cap if spec.particles == "auto" else spec.particles
            r.smc = SmcRun(r, cap=min(cap, self.buckets.batch[-1]))
        return r.smc, self.kv.available - (promised - self.kv.owed(r))

    def take_verified(self, verify: list[tuple], verdicts: list[Verdict], now: float):
        """Take what a ragged step's verdicts (one per verifying row group of `verify`:
        a request's last token at `position`, then its drafts) gave each request:
        (requests still running or just finished, the text each made visible). Gives
        back the rejected positions' pages. An SMC population weighs what its particles
        kept, and when it has ended gives its answer (the chosen particle, with all its
        text)."""
        reqs, pieces, populations = [], [], {}
        for (prop, _, position), verdict in zip(verify, verdicts):
            r = prop.request
            if prop.run is not None:
                if prop.run.req.finish_reason is None:  # not aborted meanwhile
                    populations.setdefault(id(prop.run), []).append((prop, position, verdict))
                continue
            if r.finish_reason is not None:
                continue
            kept = self._settle(r, prop.drafts, verdict.accepted, verdict.next, position)
            piece, _ = take_tokens(r, kept, now)
            if r.finish_reason is not None:
                summarize(r)
            reqs.append(r)
            pieces.append(piece)
        for particles in populations.values():
            run = particles[0][0].run
            run.absorb(Kept([self._settle(prop.request, prop.drafts, v.accepted, v.next, position)
                             for prop, position, v in particles],
                            np.array([len(prop.drafts) for prop, _, _ in particles]),
                            *(np.stack(field) for field in zip(
                                *[(v.log_p, v.log_q, v.agreement) for _, _, v in particles]))))
            if run.ended:
                chosen = run.conclude()
                reqs.append(chosen)
                pieces.append(chosen.pending)
        return reqs, pieces


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
