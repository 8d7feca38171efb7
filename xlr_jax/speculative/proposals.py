"""The proposers: what speculating rows verify, and the device inputs of their pass.

Three drafts propose (`speculative.config`): n-gram lookup on the host, and two device
drafts, the target's first K layers and a separate draft model, in a pass of their own
through the model runner (`SpecSteps.propose`). A `Proposal` is one row's drafts (a
request's, or an SMC particle's); a device draft's proposals over several rows share one
`DeviceDrafts`, which the model runner judges on the verifying step's logits
(`ModelRunner.read`). Before anything proposes, every row's pages for all the positions
it may write are reserved; afterwards the rejected ones are trimmed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from xlr_jax.planning.buckets import Buckets, pick_bucket
from xlr_jax.speculative.config import ModelDraft


class PassInputs(NamedTuple):
    """The device inputs of a cycle or a device proposal over some rows, padded to a batch
    bucket (see `Proposer.inputs`)."""
    last: np.ndarray        # [B] each row's last token, not yet in the KV
    positions: np.ndarray   # [B] its position
    num_draft: np.ndarray   # [B] drafts it may verify
    salt: np.ndarray        # [B] 0, or an SMC particle's own salt
    sampling: object
    sampler: str
    block_tables: np.ndarray


@dataclass(eq=False)
class DeviceDrafts:
    """A device draft's proposals over some rows, on the device, kept to be judged on the
    verifying step's logits: exact acceptance, or SMC's weights (`method`)."""
    drafts: object      # [B, gamma]
    q: object           # [B, gamma, V]
    x: PassInputs
    method: str         # "exact", or "smc" (a population's particles)


@dataclass
class Proposal:
    """A speculating request's (or an SMC particle's) drafts to verify as rows of a ragged
    step; a device draft's (`device`, this row's `slot` in it, drawn with its `salt`) are
    judged together; a particle's population is `run`."""
    request: Any
    drafts: list[int]
    budget: int = 0
    device: DeviceDrafts | None = None
    slot: int = 0
    salt: int = 0
    run: Any = None  # population.SmcRun


class Proposer:
    """Makes the drafts of speculating rows and the inputs of their device passes: pages
    through the KV manager, device work through the model runner."""

    def __init__(self, kv, runner, buckets: Buckets):
        self.kv, self.runner, self.buckets = kv, runner, buckets

    def inputs(self, rows, budgets: list[int], salts=None) -> PassInputs:
        """Reserve pages for every position `rows` may write (their last tokens and
        `budgets` drafts); their device inputs, padded to a batch bucket."""
        for r, b in zip(rows, budgets):
            self.kv.reserve(r.seq, r.seq.length + b + 1)
        n = pick_bucket(len(rows), self.buckets.batch)
        last, positions, num_draft, salt = (np.zeros(n, np.int32) for _ in range(4))
        for j, r in enumerate(rows):
            last[j], positions[j], num_draft[j] = r.generated[-1], r.seq.length, budgets[j]
            salt[j] = salts[j] if salts else 0
        sampling, sampler = self.runner.sampling([r.params for r in rows],
                                                 [len(r.generated) for r in rows], n)
        return PassInputs(last, positions, num_draft, salt, sampling, sampler,
                          self.kv.block_tables([r.seq for r in rows], n, self.buckets.pages))

    @staticmethod
    def host(r, budget: int) -> list[int]:
        """A host draft's (n-gram) proposal of at most `budget` tokens for request `r`."""
        return r.draft.propose(r.prompt_ids + r.generated, budget) if budget else []

    def device(self, group: list[Proposal], method: str) -> None:
        """Run the device draft of `group` (one configuration and method) in one pass and
        fill in its drafts."""
        rows = [prop.request for prop in group]
        for r in rows:
            self.draft_prefill(r)
        x = self.inputs(rows, [prop.budget for prop in group], [prop.salt for prop in group])
        drafts, q = self.runner.propose(rows[0].draft, x, gamma=rows[0].spec.gamma)
        shared = DeviceDrafts(drafts, q, x, method)
        host = np.asarray(drafts)
        for j, prop in enumerate(group):
            prop.drafts = [int(t) for t in host[j, :prop.budget]]
            prop.device, prop.slot = shared, j

    def draft_prefill(self, r) -> None:
        """A separate draft model reads the prompt into its own KV (same pages) before the
        request's first pass. It covers prefix-cached pages too: the draft's values for
        them may be missing."""
        if not isinstance(r.draft, ModelDraft) or r.draft_prefilled:
            return
        self.runner.prefill_draft(r.draft, r.prompt_ids, r.seq)
        r.draft_prefilled = True
