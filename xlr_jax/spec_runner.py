"""The host side of speculative decoding: page bookkeeping around `SpecSteps.cycle`.

Exact speculation runs every active request as one row of a batched cycle and
streams what each cycle accepts. SMC-SD takes one request at a time: its
particles are the rows. They start as forks of the prefilled request (sharing
its pages). Before each cycle their number N follows free pages, both ways: it
shrinks by resampling (re-pointing block tables: forks of the ancestors; a
shared partial last page is copied on its next write) and grows by splitting
particles, each copy taking its share of the weight. An ESS below the threshold
resamples too. With one particle a cycle is exact speculation. SMC starts after
a probation of exact cycles that measure the draft's agreement with the target
(`SmcWatch`); a draft that agrees too little (mean sum_v min(p, q) under
`SpecConfig.min_agreement`) keeps the request on exact speculation, and the
metrics say why. The answer is one particle drawn by weight; its text is
released when the request ends.

Before a cycle every row reserves pages for all gamma + 1 positions it may
write; afterwards `SequencePages.trim` gives back what the rejected tokens
used. Nothing is ever copied to undo a rejection.
"""
from __future__ import annotations

import time
from collections import deque
from functools import partial

import numpy as np

from xlr_jax.errors import InvalidRequestError
from xlr_jax.mapper import particles_for, powers_of_two_upto
from xlr_jax.paged_kv import PagedKV
from xlr_jax.smc import (block_increment, draw_keys, ess, log_mean_weight, pick_answer,
                         resample, split)
from xlr_jax.speculative import Draft, ModelDraft, SpecConfig
from xlr_jax.steps import Steps, pick_bucket

SMC_PROBATION = 4      # exact cycles that measure the draft's agreement before SMC starts


class SpecRunner:
    """Runs one `Engine.run` call's requests with speculative decoding."""

    def __init__(self, engine, spec: SpecConfig, draft: Draft):
        self.engine, self.spec, self.draft = engine, spec, draft
        if isinstance(draft, ModelDraft) and draft.name not in engine.draft_kvs:
            c, kv = draft.config, engine.kv
            engine.draft_kvs[draft.name] = PagedKV.create(
                num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                num_pages=engine.pool.num_pages, page_size=engine.pool.page_size,
                dtype=kv.k.dtype)
            engine.draft_steps[draft.name] = Steps(c, engine.buckets, engine.steps.attn_impl,
                                                  engine.steps.compiler_options)

    def loop(self, waiting, active, poll):
        e, smc = self.engine, self.spec.method == "smc"
        while True:
            poll(waiting, active)
            e.drop_ended(active)
            if not (waiting or active):
                return
            for r in waiting:
                if not r.spec_metrics:  # new in this loop
                    self.prepare(r)
            yield from e._admit_and_prefill(waiting, active, 1 if smc else None,
                                            after_prefill=self._draft_prefill)
            if active:
                yield from (self._smc(active[0], poll) if smc else self._exact(active))

    def prepare(self, r) -> None:
        """Check a request against the method (refusals raise) and start its metrics."""
        check_request(self.spec, r.params)
        r.spec_metrics = {"target_passes": 0, "draft_tokens": 0, "accepted_tokens": 0,
                          "accepted_per_pass": 0.0, "acceptance_rate": 0.0}
        if self.spec.method == "smc":  # also for a request that ends at its first token
            r.spec_metrics.update(SmcWatch(self.spec.min_agreement).metrics())

    # ------------------------------------------------------------ one cycle

    def _cycle(self, rows, method: str, salts=None) -> "_Cycle":
        """Run one cycle over `rows` (requests or particles)."""
        e, spec = self.engine, self.spec
        budgets = [min(spec.gamma, r.limit - len(r.generated) - 1) for r in rows]  # max_tokens
        guesses = None
        if self.draft.kind == "tokens":
            guesses = [self.draft.propose(r.prompt_ids + r.generated, b)
                       for r, b in zip(rows, budgets)]
            budgets = [len(g) for g in guesses]
            if not any(budgets) and salts is None:  # nothing to verify: a plain decode
                return self._decode(rows)            # step (unsalted) is cheaper
        # host proposals vary in number: verify only as many positions as the longest needs
        gamma = (pick_bucket(max(*budgets, 1), powers_of_two_upto(spec.gamma)) if guesses
                 else spec.gamma)
        n = pick_bucket(len(rows), e.buckets.batch)
        last = np.zeros(n, np.int32)
        positions = np.zeros(n, np.int32)
        proposed = np.zeros((n, gamma), np.int32)
        num_draft = np.zeros(n, np.int32)
        salt = np.zeros(n, np.int32)
        for j, r in enumerate(rows):
            if guesses:
                proposed[j, :budgets[j]] = guesses[j]
            num_draft[j] = budgets[j]
            e._apply_copies(r.seq.reserve(r.seq.length + budgets[j] + 1))
            positions[j], last[j] = r.seq.length, r.generated[-1]
            salt[j] = salts[j] if salts else 0
        sampling, sampler = e._sampling(rows, n, [len(r.generated) for r in rows])
        name = self.draft.name if isinstance(self.draft, ModelDraft) else None
        accepted, nxt, drafts, log_p, log_q, agreement, e.kv, draft_kv = e.spec_steps.cycle(
            e.params, e.kv, self.draft, e.draft_kvs.get(name), last, positions, proposed,
            num_draft, e._block_tables(rows, n), sampling, salt, gamma=gamma, method=method,
            sampler=sampler)
        if name:
            e.draft_kvs[name] = draft_kv
        accepted, nxt, drafts = np.asarray(accepted), np.asarray(nxt), np.asarray(drafts)
        kept = []
        for j, r in enumerate(rows):
            a = int(accepted[j])
            r.seq.trim(int(positions[j]) + a + 1)  # `last` and the accepted drafts stay
            m = r.spec_metrics
            m["target_passes"] += 1
            m["draft_tokens"] += int(num_draft[j])
            m["accepted_tokens"] += a
            e.count_speculation(int(num_draft[j]), a)
            kept.append([*map(int, drafts[j, :a]), int(nxt[j])])
        rows_n = len(rows)
        return _Cycle(kept, num_draft[:rows_n], np.asarray(log_p)[:rows_n],
                      np.asarray(log_q)[:rows_n], np.asarray(agreement)[:rows_n])

    def _decode(self, rows) -> "_Cycle":
        """One plain decode step (the engine's) for rows with nothing proposed."""
        tokens = np.asarray(self.engine._dispatch(rows).tokens)
        for r in rows:
            r.spec_metrics["target_passes"] += 1
            self.engine.count_speculation(0, 0)
        return _Cycle.plain([[int(tokens[j])] for j in range(len(rows))])

    @staticmethod
    def _take(r, tokens: list[int], now: float) -> tuple[str, int]:
        """Accept tokens in order until the request finishes; (the visible text, how many
        tokens were taken)."""
        piece = ""
        for taken, t in enumerate(tokens, 1):
            piece += r.accept(t, now)
            if r.finish_reason is not None:
                return piece, taken
        return piece, len(tokens)

    def _exact(self, reqs):
        kept = self._cycle(reqs, "exact").kept
        now = time.perf_counter()
        pieces = [self._take(r, toks, now)[0] for r, toks in zip(reqs, kept)]
        for r in reqs:
            if r.finish_reason is not None:
                _summarize(r)
        yield from self.engine._finish_done(reqs, pieces)

    # ------------------------------------------------------------ SMC

    def _particle_count(self, req, particles) -> int:
        """N for the next cycle from free pages, keeping what one particle needs to finish:
        no more than the pages hold for one cycle of every particle, and more than now only
        if they hold two (a population grown for one cycle would be cut back at once)."""
        e, spec = self.engine, self.spec
        finish_one = req.max_pages - min(len(p.seq.pages) for p in particles) + 1
        free = e.pool.num_available - finish_one
        cap = min(e.particle_cap if spec.particles == "auto" else spec.particles,
                  e.buckets.batch[-1])
        fits = partial(particles_for, free, max(p.seq.length for p in particles),
                       page_size=e.pool.page_size, cap=cap)
        now = fits(spec.gamma)
        return now if now <= len(particles) else max(len(particles), fits(2 * spec.gamma + 1))

    def _smc(self, req, poll):
        """Run one request's particles to the end, then release the chosen one's text.
        `poll` runs between cycles; a request it aborts ends at once."""
        spec = self.spec
        resample_key, answer_key = draw_keys(req.params.seed)
        particles, log_w = [req], np.zeros(1)
        watch = SmcWatch(spec.min_agreement)
        try:
            cycle = 0
            while any(p.finish_reason is None for p in particles):
                if cycle:
                    poll(None, [req])  # cancellations only: nothing joins an SMC loop
                if req.finish_reason == "abort":
                    for p in particles:
                        p.seq.release()
                    return
                # N follows free pages both ways: shrink by resampling, grow by splitting
                n = 1 if watch.single else self._particle_count(req, particles)
                degenerate = float(ess(log_w)) < spec.ess_threshold * len(particles)
                if degenerate or n < len(particles):
                    ancestors = resample(resample_key(cycle),
                                         log_w.astype(np.float32), spec.resampler, num=n)
                    particles = _repoint(particles, np.asarray(ancestors))
                    watch.resamples += degenerate  # a change of N alone is no ESS resample
                    watch.log_z += float(log_mean_weight(log_w))
                    log_w = np.zeros(n)
                elif n > len(particles):
                    parents, log_w = split(log_w, n, [p.finish_reason is None
                                                      for p in particles])
                    particles = _repoint(particles, parents)
                live = [j for j, p in enumerate(particles) if p.finish_reason is None]
                if not live:  # resampled onto finished particles only
                    break
                rows = [particles[j] for j in live]
                watch.particles.append(len(particles))
                single = len(particles) == 1  # plain exact speculation, unsalted
                out = self._cycle(rows, "exact" if single else "smc",
                                  salts=None if single else live)
                now = time.perf_counter()
                taken = np.zeros(len(rows), np.int64)
                for j, (p, toks) in enumerate(zip(rows, out.kept)):
                    piece, taken[j] = self._take(p, toks, now)
                    p.pending += piece
                # the drafts each particle kept, up to its stop (exact: up to the first
                # rejection, whose context still follows p)
                counted = np.minimum(taken, out.num_draft)
                if single:
                    watch.observe_exact(out.agreement[0], int(counted[0]))
                else:  # weigh the drafts each particle kept
                    increment = block_increment(out.log_p, out.log_q, counted)
                    log_w[live] += increment
                    watch.observe_smc(increment, out.agreement, counted)
                cycle += 1
            watch.log_z += float(log_mean_weight(log_w))
            chosen = particles[int(pick_answer(answer_key, log_w.astype(np.float32)))]
        except BaseException:
            for p in particles:  # idempotent: the engine then releases `req` too
                p.seq.release()
            raise
        for p in particles:
            if p is not chosen:
                p.seq.release()
        chosen.spec_metrics.update(watch.metrics())
        weights = log_w - float(np.logaddexp.reduce(log_w))
        chosen.particles = [{"token_ids": list(p.generated), "log_weight": float(lw)}
                            for p, lw in zip(particles, weights)]
        _summarize(chosen)
        req.finish_reason = chosen.finish_reason
        yield from self.engine._finish_done([chosen], [chosen.pending])

    # ------------------------------------------------------------ draft model KV

    def _draft_prefill(self, reqs) -> None:
        """A separate draft model reads the prompt into its own KV (same pages). It
        covers prefix-cached pages too: the draft's values for them may be missing."""
        if not isinstance(self.draft, ModelDraft):
            return
        e, name = self.engine, self.draft.name
        for r in reqs:
            _, e.draft_kvs[name] = e.prefill_all(e.draft_steps[name], self.draft.params,
                                                 e.draft_kvs[name], r.prompt_ids, r.seq)


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
