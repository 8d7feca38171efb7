"""The host side of speculative decoding: page bookkeeping around `SpecSteps.cycle`.

Exact speculation runs every active request as one row of a batched cycle and
streams what each cycle accepts. SMC-SD takes one request at a time: its
particles are the rows. They start as forks of the prefilled request (sharing
its pages), are resampled by re-pointing block tables (forks of the ancestors;
a shared partial last page is copied on its next write), and their number is
set before each cycle from free pages by the plan's rule. With one particle a
cycle is exact speculation. The answer is one particle drawn by weight; its
text is released when the request ends.

Before a cycle every row reserves pages for all gamma + 1 positions it may
write; afterwards `SequencePages.trim` gives back what the rejected tokens
used. Nothing is ever copied to undo a rejection.
"""
from __future__ import annotations

import time

import jax
import numpy as np

from xlr_jax.errors import InvalidRequestError
from xlr_jax.mapper import particles_for, powers_of_two_upto
from xlr_jax.paged_kv import PagedKV
from xlr_jax.smc import ess, log_mean_weight, pick_answer, resample
from xlr_jax.speculative import Draft, ModelDraft, SpecConfig
from xlr_jax.steps import Steps, pick_bucket

SMC_STREAM = 0x534D43  # folded into a request's seed for resampling and the answer draw


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
            engine.draft_steps[draft.name] = Steps(c, engine.steps.attn_impl,
                                                  engine.steps.compiler_options)

    def loop(self, waiting, active):
        e, smc = self.engine, self.spec.method == "smc"
        for r in waiting:
            r.spec_metrics = {"target_passes": 0, "draft_tokens": 0, "accepted_tokens": 0,
                              "accepted_per_pass": 0.0, "acceptance_rate": 0.0}
            if smc and r.params.greedy:
                raise InvalidRequestError("SMC speculative decoding samples: set temperature "
                                          "> 0, or use method exact for greedy decoding")
        while waiting or active:
            yield from e._admit_and_prefill(waiting, active, 1 if smc else None,
                                            after_prefill=self._draft_prefill)
            if active:
                yield from (self._smc(active[0]) if smc else self._exact(active))
            active[:] = [r for r in active if r.finish_reason is None]

    # ------------------------------------------------------------ one cycle

    def _cycle(self, rows, method: str, salts=None):
        """Run one cycle over `rows` (requests or particles); returns per row the tokens
        kept after its last one and its log-weight increment."""
        e, spec = self.engine, self.spec
        budgets = [min(spec.gamma, r.limit - len(r.generated) - 1) for r in rows]  # max_tokens
        guesses = None
        if self.draft.kind == "tokens":
            guesses = [self.draft.propose(r.prompt_ids + r.generated, b)
                       for r, b in zip(rows, budgets)]
            budgets = [len(g) for g in guesses]
            if not any(budgets) and salts is None:  # nothing to verify: a plain decode
                return self._decode(rows), np.zeros(len(rows))  # step (unsalted) is cheaper
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
        accepted, nxt, drafts, increment, e.kv, draft_kv = e.spec_steps.cycle(
            e.params, e.kv, self.draft, e.draft_kvs.get(name), last, positions, proposed,
            num_draft, e._block_tables(rows, n), sampling, salt, gamma=gamma, method=method,
            alpha=spec.alpha, sampler=sampler)
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
            kept.append([*map(int, drafts[j, :a]), int(nxt[j])])
        return kept, np.asarray(increment)[:len(rows)]

    def _decode(self, rows) -> list[list[int]]:
        """One plain decode step (the engine's) for rows with nothing proposed."""
        tokens = np.asarray(self.engine._dispatch_decode(rows))
        for r in rows:
            r.spec_metrics["target_passes"] += 1
        return [[int(tokens[j])] for j in range(len(rows))]

    @staticmethod
    def _take(r, tokens: list[int], now: float) -> str:
        """Accept tokens in order until the request finishes; the visible text."""
        piece = ""
        for t in tokens:
            piece += r.accept(t, now)
            if r.finish_reason is not None:
                break
        return piece

    def _exact(self, reqs):
        kept, _ = self._cycle(reqs, "exact")
        now = time.perf_counter()
        pieces = [self._take(r, toks, now) for r, toks in zip(reqs, kept)]
        for r in reqs:
            if r.finish_reason is not None:
                _summarize(r)
        yield from self.engine._finish_done(reqs, pieces)

    # ------------------------------------------------------------ SMC

    def _particle_count(self, req, particles) -> int:
        """N for the next cycle from free pages, keeping what one particle needs to finish."""
        e, spec = self.engine, self.spec
        finish_one = req.max_pages - min(len(p.seq.pages) for p in particles) + 1
        free = e.pool.num_available - finish_one
        cap = min(e.particle_cap if spec.particles == "auto" else spec.particles,
                  e.buckets.batch[-1])
        return particles_for(free, max(p.seq.length for p in particles), spec.gamma,
                             page_size=e.pool.page_size, cap=cap)

    def _smc(self, req):
        """Run one request's particles to the end, then release the chosen one's text."""
        spec = self.spec
        key = jax.random.fold_in(jax.random.key(req.params.seed), SMC_STREAM)
        particles, log_w = [req], np.zeros(1, np.float32)
        counts, resamples, log_z = [], 0, 0.0
        try:
            cycle = 0
            while any(p.finish_reason is None for p in particles):
                # grow only when resampling anyway (or at the start): shrinking is what
                # memory needs, and growing alone would force a resample every cycle
                degenerate = float(ess(log_w)) < spec.ess_threshold * len(particles)
                n = self._particle_count(req, particles)
                if not (degenerate or cycle == 0):
                    n = min(n, len(particles))
                if degenerate or n != len(particles):  # re-point block tables: fork
                    ancestors = resample(jax.random.fold_in(key, cycle), log_w, spec.resampler,
                                         num=n)
                    old = particles
                    particles = [old[a].fork() for a in np.asarray(ancestors)]
                    for p in old:
                        p.seq.release()
                    resamples += degenerate  # a change of N alone is not an ESS resample
                    log_z += float(log_mean_weight(log_w))
                    log_w = np.zeros(n, np.float32)
                live = [j for j, p in enumerate(particles) if p.finish_reason is None]
                if not live:  # resampled onto finished particles only
                    break
                rows = [particles[j] for j in live]
                counts.append(len(particles))
                single = len(particles) == 1  # plain exact speculation, unsalted
                kept, increment = self._cycle(rows, "exact" if single else "smc",
                                              salts=None if single else live)
                log_w[live] += increment
                now = time.perf_counter()
                for p, toks in zip(rows, kept):
                    p.pending += self._take(p, toks, now)
                cycle += 1
            log_z += float(log_mean_weight(log_w))
            chosen = particles[int(pick_answer(jax.random.fold_in(key, cycle), log_w))]
        except BaseException:
            for p in particles:  # idempotent: the engine then releases `req` too
                p.seq.release()
            raise
        for p in particles:
            if p is not chosen:
                p.seq.release()
        chosen.spec_metrics.update(resamples=resamples, log_normalizer=log_z,
                                   particles=counts)
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


def _summarize(r) -> None:
    """Per-request speculative metrics: mean tokens kept per target pass, acceptance."""
    m = r.spec_metrics
    passes = max(m["target_passes"], 1)
    m["accepted_per_pass"] = (len(r.generated) - 1) / passes  # the first came from prefill
    m["acceptance_rate"] = m["accepted_tokens"] / m["draft_tokens"] if m["draft_tokens"] else 0.0
