"""An SMC request's population: per-request state, held on the request the scheduler holds
(`Request.smc`), made at its first pass.

Its particles start as forks of the prefilled request (sharing its pages). Before each
pass their number N follows the pages nobody else is promised, both ways: it shrinks by
resampling (re-pointing block tables: forks of the ancestors; a shared partial last page
is copied on its next write) and grows by splitting particles, each copy taking its share
of the weight. An ESS below the threshold resamples too. With one particle a pass is
exact speculation. SMC starts after a probation of exact passes that measure the draft's
agreement with the target (`SmcWatch`); a draft that agrees too little (mean
sum_v min(p, q) under `SpecConfig.min_agreement`) keeps the request on exact
speculation, and the metrics say why. The answer is one particle drawn by weight; its
text is released when the request ends. The math is in `speculative.smc`.
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np

from xlr_jax.planning.mapper import particles_for
from xlr_jax.speculative.config import SpecConfig
from xlr_jax.speculative.outcome import Kept, draft_budgets, summarize, take_tokens
from xlr_jax.speculative.smc import (block_increment, draw_keys, ess, log_mean_weight, pick_answer,
                                     resample, split)

SMC_PROBATION = 4      # exact passes that measure the draft's agreement before SMC starts


def start_metrics(spec: SpecConfig) -> dict:
    """A speculating request's metrics before its first pass."""
    metrics = {"target_passes": 0, "draft_tokens": 0, "accepted_tokens": 0,
               "accepted_per_pass": 0.0, "acceptance_rate": 0.0}
    if spec.method == "smc":  # also for a request that ends at its first token
        metrics.update(SmcWatch(spec.min_agreement).metrics())
    return metrics


class SmcRun:
    """One SMC request's population between passes: its particles (forks of the request;
    at first the request itself), their log-weights, the watch, and its own random
    keys (every draw its own key). `cap`: the most particles it may have (the request's
    N, or the plan's cap for "auto"; within the largest batch)."""

    def __init__(self, req, cap: int):
        self.req, self.cap = req, cap
        self.resample_key, self.answer_key = draw_keys(req.params.seed)
        self.particles, self.log_w = [req], np.zeros(1)
        self.watch = SmcWatch(req.spec.min_agreement)
        self.draws = 0  # resample keys used: every resample its own
        # this pass's: one particle (exact)?, the live particles' indices, and they;
        # prepared for it (its N and pages taken), not yet absorbed
        self.single, self.live, self.rows = True, [], []
        self.prepared = False

    def most_pages(self) -> int:
        return max(len(p.seq.pages) for p in self.particles)

    def most_tokens(self) -> int:
        return max(p.seq.length for p in self.particles)

    def particle_count(self, kv, free: int) -> int:
        """N for the next pass from `free` pages, keeping what one particle needs to
        finish: no more than the pages hold for one pass of every particle, and more
        than now only if they hold two (a population grown for one pass would be cut
        back at once)."""
        particles, gamma = self.particles, self.req.spec.gamma
        finish_one = kv.max_pages(self.req) - min(len(p.seq.pages) for p in particles) + 1

        def fits(g: int) -> int:
            return particles_for(free - finish_one, self.most_tokens(), g,
                                 page_size=kv.page_size, cap=self.cap)
        now = fits(gamma)
        return now if now <= len(particles) else max(len(particles), fits(2 * gamma + 1))

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
        """Populations with equal keys share a batched pass."""
        return self.single, self.req.spec, self.req.draft

    @property
    def method(self) -> str:
        """This pass's: one particle is exact speculation, more are SMC."""
        return "exact" if self.single else "smc"

    @property
    def salts(self) -> list[int]:
        """Each live particle's salt this pass: its index (one particle: 0, unsalted as
        an exact request's)."""
        return [0] * len(self.rows) if self.single else list(self.live)

    def prepare(self, kv, free: int, max_rows: int | None = None) -> bool:
        """Before a pass: N from `free` pages (none promised to other requests), resample
        or split to it, and take from `kv` the pages the live particles (`rows`) may
        write. With `max_rows`, a population whose particles and all their drafts would
        take more rows is left as it is (False)."""
        spec, watch = self.req.spec, self.watch
        # N follows free pages both ways: shrink by resampling, grow by splitting
        n = 1 if watch.single else self.particle_count(kv, free)
        if max_rows is not None:  # particles are forks of the live ones: the same budget
            live = [p for p in self.particles if p.finish_reason is None]
            if not live or n * (1 + max(draft_budgets(live))) > max_rows:
                return False
        ess_fraction = float(ess(self.log_w)) / len(self.particles)
        degenerate = ess_fraction < spec.ess_threshold
        weights = np.exp(self.log_w - self.log_w.max())
        if degenerate or n < len(self.particles):
            self._resample(n, degenerate)
        elif n > len(self.particles):
            parents, self.log_w = split(self.log_w, n, [p.finish_reason is None
                                                        for p in self.particles])
            self.particles = _repoint(self.particles, parents)
        # with one particle a pass is plain exact speculation, unsalted
        self.single = len(self.particles) == 1
        self.live = [j for j, p in enumerate(self.particles) if p.finish_reason is None]
        self.rows = [self.particles[j] for j in self.live]
        if self.rows:  # none: resampled onto finished particles only
            watch.record_pass(len(self.particles), (weights / weights.sum()).tolist(),
                              ess_fraction, degenerate)
            for p, b in zip(self.rows, draft_budgets(self.rows)):
                kv.reserve(p.seq, p.seq.length + b + 1)
        self.prepared = True
        return True

    def absorb(self, out: Kept) -> None:
        """After its pass: each live particle takes its tokens, and the drafts it kept
        weigh it."""
        self.prepared = False
        now = time.perf_counter()
        taken = np.zeros(len(self.rows), np.int64)
        for j, (p, toks) in enumerate(zip(self.rows, out.kept)):
            piece, taken[j] = take_tokens(p, toks, now)
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
        summarize(chosen)
        req.finish_reason = chosen.finish_reason
        return chosen


def _repoint(particles, parents) -> list:
    """The particles that copy `parents` (indices): forks of their block tables; the old
    particles give their pages back (shared pages stay with the forks)."""
    new = [particles[int(a)].fork() for a in parents]
    for p in particles:
        p.seq.release()
    return new


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
        # per pass: the particles it ran; the normalized weights it found (the last pass's
        # outcome; at first the request alone, weight 1), their ESS / N, and whether they
        # were resampled for being degenerate
        self.particles: list[int] = []
        self.weights: list[list[float]] = []
        self.ess_before: list[float] = []
        self.resampled: list[bool] = []
        self.resamples, self.log_z = 0, 0.0
        self.trials, self.agreement_sum, self.positions = 0, 0.0, 0
        self.ess_fractions: list[float] = []
        self.recent: deque = deque(maxlen=SMC_PROBATION)  # SMC cycles' (agreement sum, n)
        self.fallback: str | None = None

    @property
    def single(self) -> bool:
        """The next pass runs one particle: on probation, or fallen back."""
        return self.fallback is not None or (self.min_agreement > 0
                                             and self.trials < SMC_PROBATION)

    def record_pass(self, particles: int, weights: list[float], ess_fraction: float,
                    resampled: bool) -> None:
        self.particles.append(particles)
        self.weights.append(weights)
        self.ess_before.append(ess_fraction)
        self.resampled.append(resampled)

    def observe_exact(self, agreement, positions: int) -> None:
        """A one-particle pass's per-position agreement and how many positions count."""
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
        """An SMC pass's log-weight increments (how far one pass spreads the weights)
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
        return {"particles": self.particles, "smc_weights": self.weights,
                "smc_ess_before": self.ess_before, "smc_resampled": self.resampled,
                "resamples": self.resamples,
                "log_normalizer": self.log_z, "smc_cycles": len(self.ess_fractions),
                "smc_fallback": self.fallback, "draft_agreement": self.agreement,
                "smc_ess_fraction": (float(np.mean(self.ess_fractions))
                                     if self.ess_fractions else None)}
