"""The model runner: the only owner of the device state and the only caller of the
compiled programs.

It holds the params, the paged KV, separate draft models' KV and the compiled steps
(`model.steps.Steps`, `speculative.cycle.SpecSteps`). `execute` turns a scheduler's
decision (`SchedulerOutput`) into one `StepBatch` and dispatches the jitted step, the KV
donated; `read` reads its tokens back (one step late, while the next one runs, when the
engine runs ahead). Before any program touches the KV, the page operations the KV
manager queued (copy-on-write copies, stable tiers written in or read out) are applied,
in order. Nothing else assigns device state: benchmarks and experiments read `params`
and `kv`, and time single steps through `run_step`.

Across processes (`jax.distributed`), the leader's runner sends each program's host
inputs to the followers' runners before running it, and theirs run the same
(`follow`; see mirror.py). Speculative decoding (its own programs) runs in one process
only: `Model` refuses it across processes.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from xlr_jax.kv.manager import PageCopy, PageOp, PageRead, PageWrite
from xlr_jax.kv.pages import SequencePages
from xlr_jax.kv.paged_kv import (PagedKV, copy_pages, leaves, read_pages, restore_lowering,
                                 write_pages)
from xlr_jax.model.config import ModelConfig
from xlr_jax.model.decoder import Params
from xlr_jax.model.executables import ExecutableStore, compile_for_later
from xlr_jax.model.sampling import SamplingBatch, sampler_for
from xlr_jax.model.step_batch import StepBatch, place
from xlr_jax.model.steps import Steps
from xlr_jax.model.tensor_parallel import TensorParallel, kv_heads
from xlr_jax.planning.buckets import Buckets, pick_bucket
from xlr_jax.runtime.mirror import Mirror
from xlr_jax.runtime.scheduler import RunnerOutput, SchedulerOutput
from xlr_jax.speculative.config import Draft, ModelDraft
from xlr_jax.speculative.acceptance import accept_by_matching
from xlr_jax.speculative.cycle import SpecSteps
from xlr_jax.speculative.outcome import Verdict
from xlr_jax.speculative.proposals import DeviceDrafts


@dataclass
class InFlight:
    """A dispatched step: its decision and its results on the device, not read back."""
    out: SchedulerOutput
    tokens: object      # [rows] sampled
    logits: object      # [rows, V] (device drafts are judged on them)
    logprobs: tuple     # chosen [rows], top ids and values [rows, k]
    sampling: SamplingBatch  # the rows' (a late bias draws again with it)
    started: float      # when it was dispatched

    def done(self) -> bool:
        """Whether its tokens are ready: reading them back would not wait."""
        return self.tokens.is_ready()


class ModelRunner:
    """Params, the paged KV, draft models' KV and the compiled steps of one model (see the
    module docstring). `page_ops()` gives the page operations to apply before the next
    program reads the KV (the KV manager's queue)."""

    def __init__(self, config: ModelConfig, params: Params, *, num_pages: int,
                 page_size: int, kv_dtype, buckets: Buckets, attn_impl: str,
                 compiler_options: dict | None, page_ops: Callable[[], list[PageOp]],
                 tp: TensorParallel | None = None, mirror: Mirror | None = None):
        self.config, self.buckets, self.tp, self.mirror = config, buckets, tp, mirror
        self._followers_stopped = False
        self._params = params.per_layer()
        self._kv = self._new_kv(config, num_pages, page_size, kv_dtype)
        self.steps = Steps(config, buckets, attn_impl, compiler_options, tp)
        self.spec_steps = SpecSteps(config, attn_impl, compiler_options, self.steps.products,
                                    tp)
        self._draft_kvs: dict[str, PagedKV] = {}  # separate draft models' KV, by name
        self._draft_steps: dict[str, Steps] = {}
        self._page_ops = page_ops
        self.steps_run = 0
        self._step_times: deque = deque(maxlen=256)  # seconds of the last plain steps
        self._last_read = 0.0

    def _new_kv(self, config: ModelConfig, num_pages: int, page_size: int, dtype) -> PagedKV:
        """A zeroed pool for `config`'s layers (split by KV head over the mesh, if any)."""
        heads = config.num_kv_heads if self.tp is None else kv_heads(config, self.tp.size)
        sharding = self.tp and self.tp.kv_sharding()
        return PagedKV.create(num_layers=config.num_layers, num_kv_heads=heads,
                              head_dim=config.head_dim, num_pages=num_pages,
                              page_size=page_size, dtype=dtype, sharding=sharding)

    @property
    def params(self) -> Params:
        return self._params

    @property
    def kv(self) -> PagedKV:
        """The paged KV as of the last dispatched program (read it, never keep it: the
        next program donates it)."""
        return self._kv

    def kv_layout(self) -> dict:
        """Each KV leaf's (dtype, shape): what a stable tier restored from disk must
        match."""
        return {name: (x.dtype, x.shape) for name, x in leaves(self._kv).items()}

    # ------------------------------------------------------------ page operations

    def apply_page_ops(self) -> None:
        """Apply the queued page operations, in order (see the module docstring)."""
        ops = self._page_ops()
        if ops and self.mirror:
            self.mirror.send("pages", ops)
        self._apply(ops)

    def _apply(self, ops: list[PageOp]) -> None:
        for op in ops:
            if isinstance(op, PageCopy):
                src, dst = (np.asarray(ids, np.int32) for ids in (op.src, op.dst))
                self._kv = copy_pages(self._kv, src, dst)
                for name, kv in self._draft_kvs.items():  # a draft's KV on the same pages
                    self._draft_kvs[name] = copy_pages(kv, src, dst)
            elif isinstance(op, PageWrite):
                self._kv = write_pages(self._kv, jnp.asarray(op.pages, jnp.int32), op.arrays)
            elif isinstance(op, PageRead):
                # then, on the reader's thread, what a process restoring them runs
                op.deliver(read_pages(self._kv, op.pages),
                           partial(compile_for_later, restore_lowering(self._kv, len(op.pages))))

    def export_pages(self, pages) -> dict:
        """Each KV leaf's `pages`, on this runner's devices (dispatched, not waited for):
        a prompt's KV leaving the prefill devices."""
        return read_pages(self._kv, np.asarray(pages, np.int32))

    def import_pages(self, pages, arrays: dict) -> None:
        """Write `arrays` (another runner's `export_pages`) into `pages`, moved onto this
        runner's devices (jax.device_put to each leaf's sharding) first."""
        self.apply_page_ops()
        moved = {name: jax.device_put(arrays[name], leaf.sharding)
                 for name, leaf in leaves(self._kv).items()}
        self._kv = write_pages(self._kv, jnp.asarray(pages, jnp.int32), moved)

    # ------------------------------------------------------------ the ragged step

    def execute(self, out: SchedulerOutput, feed=None) -> InFlight:
        """Dispatch the step `out` decides; its tokens stay on the device. `feed`: the
        previous step's device tokens (the same decode rows, run ahead) instead of the
        tokens `out` holds."""
        self.apply_page_ops()
        build = self.steps.builder(out.rows, len(out.chunk_tokens))
        for j in range(out.rows):
            if j in out.biases:
                build.bias(j, out.biases[j])
            build.decode(out.tokens[j], out.positions[j], out.tables[j], out.params[j],
                         out.draws[j])
        if out.chunk is not None:
            build.prefill(out.chunk_tokens, out.chunk_start, out.chunk_table,
                          out.chunk.params, 0)
            if out.chunk_bias is not None:
                build.bias(build.batch.decode_rows, out.chunk_bias)
        started = time.perf_counter()
        host = build.host()
        if self.mirror:
            self.mirror.send("step", host, feed is not None)
        return InFlight(out, *self._run_step(host, feed), started)

    def _run_step(self, host: StepBatch, feed) -> tuple:
        """Run the step of `host` (StepBuilder.host), its decode tokens replaced by `feed`
        (device tokens) where given: (tokens, logits, logprobs, sampling), on the device."""
        batch = place(host, self.steps.zero_bias(host.decode_rows, host.chunk), feed)
        tokens, logits, logprobs, self._kv = self.steps.step(self._params, self._kv, batch)
        return tokens, logits, logprobs, batch.sampling

    def read(self, step: InFlight, timed: bool = True) -> RunnerOutput:
        """Read a dispatched step's tokens (and log-probabilities, where its requests asked)
        back. `timed`: count it in the step times (`stats`)."""
        sampled = np.asarray(step.tokens)
        logprobs = None
        if step.out.wants_logprobs():
            chosen, ids, values = (np.asarray(x) for x in step.logprobs)
            logprobs = list(zip(chosen, ids, values))
        verdicts = self._verdicts(step, sampled) if step.out.verify else []
        if timed:
            now = time.perf_counter()
            # the step ran from its dispatch, or from the end of the one ahead of it
            self._step_times.append(now - max(step.started, self._last_read))
            self._last_read = now
            self.steps_run += 1
        return RunnerOutput(sampled, logprobs, verdicts)

    def _verdicts(self, step: InFlight, sampled: np.ndarray) -> list[Verdict]:
        """What each verifying request (or particle) of a step keeps of its drafts, decided
        on the step's own output: host drafts (point masses) by matching the tokens the
        step drew (`accept_by_matching`), a device draft's by judging them on the step's
        logits, once per proposal pass (exact acceptance, or SMC's weights)."""
        judged: dict[int, tuple] = {}
        verdicts = []
        for prop, row, _ in step.out.verify:
            if prop.device is None:
                (accepted,), (nxt,) = accept_by_matching(
                    sampled[row:row + len(prop.drafts) + 1][None],
                    np.asarray(prop.drafts, np.int32)[None], np.array([len(prop.drafts)]),
                    xp=np)
                verdicts.append(Verdict(int(accepted), int(nxt)))
                continue
            if id(prop.device) not in judged:
                judged[id(prop.device)] = self._judge(prop.device, step)
            accepted, nxt, log_p, log_q, agreement = judged[id(prop.device)]
            j = prop.slot
            verdicts.append(Verdict(int(accepted[j]), int(nxt[j]), log_p[j], log_q[j],
                                    agreement[j]))
        return verdicts

    def _judge(self, device: DeviceDrafts, step: InFlight) -> tuple:
        """Exact acceptance (or SMC's bonus tokens and weights) of one device proposal
        pass's rows, on the step's logits: (accepted, next, log p, log q, agreement),
        read back."""
        x, gamma = device.x, device.drafts.shape[1]
        index = np.zeros((len(x.last), gamma + 1), np.int32)
        for prop, row, _ in step.out.verify:
            if prop.device is device:  # positions past a row's drafts repeat its last
                index[prop.slot] = row + np.minimum(np.arange(gamma + 1), len(prop.drafts))
        return tuple(map(np.asarray, self.judge(step.logits, index, device.drafts, device.q,
                                                x, method=device.method)))

    def redraw(self, step: InFlight, biased: list[tuple[int, np.ndarray]]) -> None:
        """Draw rows again from a dispatched step's logits plus their bias (`biased`: (row,
        bias [V])), the others' tokens kept: the draw a bias inside the step makes."""
        bias = np.zeros(step.logits.shape, np.float32)
        masked = np.zeros(len(bias), bool)
        for j, values in biased:
            bias[j], masked[j] = values, True
        if self.mirror:
            self.mirror.send("redraw", bias, masked)
        step.tokens, step.logprobs = self.steps.redraw(step.logits, step.tokens, bias,
                                                       masked, step.sampling)

    def run_step(self, batch: StepBatch, steps: Steps | None = None):
        """One step of a hand-made `batch` (experiments time steps alone); returns its
        sampled tokens and logits, on the device. `steps`: other compiled steps over these
        params."""
        tokens, logits, _, self._kv = (steps or self.steps).step(self._params, self._kv,
                                                                 batch)
        return tokens, logits

    def stats(self) -> dict:
        times = self._step_times
        return {"steps": self.steps_run,
                "step_time_s": sum(times) / len(times) if times else None}

    # ------------------------------------------------------------ scoring and drafts

    def logits(self, ids: list[int], seq: SequencePages) -> np.ndarray:
        """Logits [len(ids), vocab] of `ids` written from position 0 into `seq`'s pages."""
        self.apply_page_ops()
        table = self._table(seq)
        if self.mirror:
            self.mirror.send("logits", ids, table)
        chunks, self._kv = self._prefill_all(self.steps, self._params, self._kv, ids, table)
        return np.concatenate([np.asarray(c) for c in chunks])

    def _table(self, seq: SequencePages) -> np.ndarray:
        return seq.block_table(pick_bucket(len(seq.pages), self.buckets.pages))[None]

    def _prefill_all(self, steps: Steps, params, kv: PagedKV, ids: list[int],
                     table: np.ndarray) -> tuple[list, PagedKV]:
        """Write `ids` from position 0 into the pages of `table` [1, W] of `kv`, chunk by
        chunk, with `steps`/`params` (the target's, or a draft model's for its own KV);
        returns each chunk's logits on the device and the new KV."""
        chunk = self.buckets.chunk[-1]
        out = []
        for s in range(0, len(ids), chunk):
            part = ids[s:s + chunk]
            tokens = np.zeros((1, pick_bucket(len(part), self.buckets.chunk)), np.int32)
            tokens[0, :len(part)] = part
            logits, kv = steps.all_logits(params, kv, tokens, np.array([s], np.int32),
                                          np.array([len(part)], np.int32), table)
            out.append(logits[0, :len(part)])
        return out, kv

    def prefill_draft(self, draft: ModelDraft, ids: list[int], seq: SequencePages) -> None:
        """A separate draft model reads `ids` into its own KV (the same page ids as the
        target's), made on its first use."""
        self.apply_page_ops()
        if draft.name not in self._draft_kvs:
            kv = self._kv
            self._draft_kvs[draft.name] = self._new_kv(draft.config, kv.num_pages,
                                                       kv.page_size, kv.k.dtype)
            self._draft_steps[draft.name] = Steps(draft.config, self.buckets,
                                                  self.steps.attn_impl,
                                                  self.steps.compiler_options, self.tp)
        _, self._draft_kvs[draft.name] = self._prefill_all(
            self._draft_steps[draft.name], draft.params, self._draft_kvs[draft.name], ids,
            self._table(seq))

    def cycle(self, draft: Draft, x, proposed, *, gamma: int, method: str):
        """One speculative cycle over rows `x` (`PassInputs`) with host proposals
        `proposed` [B, gamma] (device drafts propose their own): (accepted, next, drafts,
        log p, log q, agreement), on the device."""
        self.apply_page_ops()
        name = draft.name if isinstance(draft, ModelDraft) else None
        *decided, self._kv, draft_kv = self.spec_steps.cycle(
            self._params, self._kv, draft, self._draft_kvs.get(name), x.last, x.positions,
            proposed, x.num_draft, x.block_tables, x.sampling, x.salt, gamma=gamma,
            method=method, sampler=x.sampler)
        if name:
            self._draft_kvs[name] = draft_kv
        return decided

    def propose(self, draft: Draft, x, *, gamma: int):
        """A device draft's proposals for rows `x`: (drafts [B, gamma], q), on the device."""
        self.apply_page_ops()
        name = draft.name if isinstance(draft, ModelDraft) else None
        drafts, q, self._kv, draft_kv = self.spec_steps.propose(
            self._params, self._kv, draft, self._draft_kvs.get(name), x.last, x.positions,
            x.num_draft, x.block_tables, x.sampling, x.salt, gamma=gamma, sampler=x.sampler)
        if name:
            self._draft_kvs[name] = draft_kv
        return drafts, q

    def judge(self, logits, index, drafts, q, x, *, method: str):
        """What a cycle of `method` keeps of `propose`'s drafts scored at rows `index` of a
        ragged step's `logits` (see SpecSteps.judge), on the device."""
        return self.spec_steps.judge(logits, index, drafts, q, x.num_draft, x.sampling,
                                     x.salt, sampler=x.sampler, method=method)

    @staticmethod
    def sampling(params: list, draws: list[int], rows: int) -> tuple[SamplingBatch, str]:
        """The rows' SamplingBatch (padded to `rows`) and the sampler they need."""
        return SamplingBatch.build(params, draws, rows), sampler_for(params)

    # ------------------------------------------------------------ compiled steps

    def use_step_store(self, store: ExecutableStore) -> int:
        """Keep compiled steps in `store` across processes; take (and run once, on the
        scratch page) those it preloaded; returns how many."""
        self._kv, taken = self.steps.use_store(store, self._params, self._kv)
        return taken

    def warmup(self, progress: bool = True, only: str | None = None) -> list[dict]:
        """Compile every step shape serving may run (see Steps.warmup); `only`: "decode"
        (decode rows alone) or "prefill" (a chunk alone), where prefill has devices of
        its own."""
        keep = {None: lambda rows, chunk: True, "decode": lambda rows, chunk: not chunk,
                "prefill": lambda rows, chunk: not rows}[only]
        return self.steps.warmup(self._params, self._kv, progress,
                                 [key for key in self.steps.keys() if keep(*key[1:])])

    # ------------------------------------------------------------ across processes

    def stop_followers(self) -> None:
        """The leader's last message (once): the followers' `follow` returns."""
        if not self._followers_stopped:
            self._followers_stopped = True
            self.mirror.send("stop")

    def follow(self) -> None:
        """A follower's part: run what the leader's runner sends, in order, until it
        stops (see the module docstring). A step fed by the previous one's tokens takes
        this process's copy of them."""
        last = None  # the last step's (tokens, logits, sampling), on the device
        while True:
            kind, *args = self.mirror.receive()
            if kind == "stop":
                return
            if kind == "pages":
                self._apply(args[0])
            elif kind == "step":  # fed: by the tokens of the step before (run-ahead)
                host, fed = args
                tokens, logits, _, sampling = self._run_step(host, last[0] if fed else None)
                last = (tokens, logits, sampling)
            elif kind == "redraw":
                tokens, logits, sampling = last
                tokens, _ = self.steps.redraw(logits, tokens, *args, sampling)
                last = (tokens, logits, sampling)
            elif kind == "logits":
                _, self._kv = self._prefill_all(self.steps, self._params, self._kv, *args)
