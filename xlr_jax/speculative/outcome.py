"""What a target pass gave speculating rows, and how a request takes it: host only.

A verdict (`Verdict`) is one row's decision, made where the target's logits are, inside
the model runner's output step or the jitted cycle: how many drafts it keeps, the token
after them and, for SMC's weights and the watch, each draft's log p, log q and the
agreement sum_v min(p, q). `Kept` gathers what the rows of one pass keep; `take_tokens`
lets a request accept them in order until it stops.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Verdict(NamedTuple):
    """One verifying row's decision on its drafts (see the module docstring)."""
    accepted: int
    next: int
    log_p: np.ndarray | None = None       # [gamma] (device drafts only)
    log_q: np.ndarray | None = None
    agreement: np.ndarray | None = None


class Kept:
    """What one pass gave each row: the tokens kept after its last one, and for each
    draft position log p, log q and the agreement sum_v min(p, q)."""

    def __init__(self, kept, num_draft, log_p, log_q, agreement):
        self.kept, self.num_draft = kept, num_draft
        self.log_p, self.log_q, self.agreement = log_p, log_q, agreement

    def part(self, start: int, stop: int) -> "Kept":
        """Rows [start, stop): one population's share of a batched cycle."""
        return Kept(self.kept[start:stop], self.num_draft[start:stop],
                    self.log_p[start:stop], self.log_q[start:stop], self.agreement[start:stop])

    @classmethod
    def plain(cls, kept) -> "Kept":
        """Rows that proposed nothing: one token each, no draft positions."""
        none = np.zeros((len(kept), 0))
        return cls(kept, np.zeros(len(kept), np.int32), none, none, none)


def take_tokens(r, tokens: list[int], now: float) -> tuple[str, int]:
    """Accept tokens in order until the request finishes; (the visible text, how many
    tokens were taken)."""
    piece = ""
    for taken, t in enumerate(tokens, 1):
        piece += r.accept(t, now)
        if r.finish_reason is not None:
            return piece, taken
    return piece, len(tokens)


def count_pass(r, drafted: int, accepted: int, totals: dict) -> None:
    """One target pass of a request's row(s): in its metrics and in `totals` (an
    engine's)."""
    for m in (r.spec_metrics, totals):
        m["target_passes"] += 1
        m["draft_tokens"] += drafted
        m["accepted_tokens"] += accepted


def summarize(r) -> None:
    """Per-request speculative metrics: mean tokens kept per target pass, acceptance."""
    m = r.spec_metrics
    passes = max(m["target_passes"], 1)
    m["accepted_per_pass"] = (len(r.generated) - 1) / passes  # the first came from prefill
    m["acceptance_rate"] = m["accepted_tokens"] / m["draft_tokens"] if m["draft_tokens"] else 0.0


def draft_budgets(rows) -> list[int]:
    """The draft positions each row may verify in a pass: gamma, within max_tokens."""
    return [min(r.spec.gamma, r.limit - len(r.generated) - 1) for r in rows]
