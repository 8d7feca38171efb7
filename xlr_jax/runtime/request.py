"""A request's host state, from its prompt to its GenerationResult.

`Request` is what the scheduler admits, preempts and finishes: the prompt with its tier
boundaries, the tokens generated and the text they make visible (through the stop rules
of `StopText`), its pages (`SequencePages`), and its metrics. Speculating requests carry
their configuration and, under SMC, their population. Plain Python: no jax.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import numpy as np

from xlr_jax.kv.pages import SequencePages
from xlr_jax.loading.tokenizer import Tokenizer
from xlr_jax.model.sampling_params import SamplingParams
from xlr_jax.speculative.config import Draft, SpecConfig


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str          # "stop" (EOS or a stop string), "length" or "abort"
    metrics: dict = field(default_factory=dict)
    # SMC-SD: every final particle, {"token_ids", "log_weight" (normalized)}; with
    # metrics["log_normalizer"] they give unbiased weighted estimates (see smc.py)
    particles: list[dict] | None = None
    # with logprobs=k: per generated token {"token_id", "logprob", "top_logprobs": the k
    # most likely [{"token_id", "logprob"}]}, under the model's raw distribution
    logprobs: list[dict] | None = None


class StopText:
    """Accumulates text; finds stop strings; holds back a tail that may start one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.emitted = 0

    def add(self, piece: str) -> tuple[str, bool]:
        """Append a piece; return (text safe to emit now, whether a stop string was hit)."""
        search_from = max(0, len(self.text) - self.hold)
        self.text += piece
        hits = [i for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return self._emit(len(self.text)), True
        return self._emit(len(self.text) - self.hold), False

    def finish(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out, self.emitted = self.text[self.emitted:upto], upto
        return out


class Request:
    """One request's host state: its prompt and tiers, what it generated, its pages
    (`seq`), its stop rules, its place in admission and preemption, and its metrics."""

    def __init__(self, index: int, prompt_ids: list[int], params: SamplingParams,
                 seq: SequencePages, tokenizer: Tokenizer | None, max_context: int,
                 start: float, tiers: tuple[int, int] = (0, 0), spec: SpecConfig | None = None,
                 draft: Draft | None = None, spec_metrics: dict | None = None):
        self.index = index
        self.prompt_ids = prompt_ids
        # tier boundaries: [0, stable) stable, [stable, context) context, the rest volatile
        self.stable_end, self.context_end = tiers
        self.cached_tokens = 0
        self.cache_metrics: dict = {}
        # speculative decoding: its configuration and resolved draft (None: plain), its
        # metrics (speculative.population.start_metrics), an SMC request's population while it
        # runs, a draft model's KV written yet
        self.spec, self.draft = spec, draft
        self.spec_metrics: dict = spec_metrics or {}
        self.smc = None
        self.draft_prefilled = False
        self.pending = ""  # an SMC particle's text, released when it is chosen
        self.particles: list[dict] | None = None  # an SMC answer's final population
        self.params = params
        self.seq = seq
        self.decoder = tokenizer.incremental_decoder() if tokenizer else None
        self.stop_text = StopText(params.stop)
        eos = frozenset() if params.ignore_eos or not tokenizer else tokenizer.eos_token_ids
        self.eos = eos | frozenset(params.stop_token_ids)
        self.limit = token_budget(len(prompt_ids), max_context, params.max_tokens)
        self.generated: list[int] = []
        self.forced: list[int] = []  # tokens to append at the next step boundary
        self.step_bias: np.ndarray | None = None  # its logits processor's, for the next step
        self.error: str | None = None  # why it was ended early, when it was its own fault
        # per generated token, when asked: {"token_id", "logprob", "top_logprobs"}
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.preemptions = 0
        self.protected = False  # preempted too often: admitted for its worst case, kept
        self.admitted_at = 0  # admission order: the newest running request is preempted first
        self.start, self.first_token_at, self.last_token_at = start, None, None
        self.first_admitted: float | None = None  # when it first joined the running batch

    @property
    def prefilled(self) -> int:
        return self.seq.length

    @property
    def context_ids(self) -> list[int]:
        """What the KV must hold before the next decode step: the prompt and every
        generated token but the last (not fed yet). A preempted request prefills these
        again when it resumes."""
        return self.prompt_ids + self.generated[:-1] if self.generated else self.prompt_ids

    @property
    def decoding(self) -> bool:
        """Prefilled and holding a token to feed: the request takes decode rows now. An
        SMC request is, once its particles carry it (its own pages went to them)."""
        return self.smc is not None or (bool(self.generated)
                                        and self.prefilled == self.context_len)

    @property
    def context_len(self) -> int:
        """len(context_ids), without building the list (the decode loop asks every step)."""
        return len(self.prompt_ids) + max(len(self.generated) - 1, 0)

    def prefill_left(self) -> int:
        """Tokens to prefill before the next place a chunk must end (`chunk_end`)."""
        end = self.stable_end if self.prefilled < self.stable_end else self.context_len
        return end - self.prefilled

    def chunk_end(self, chunk_max: int) -> int:
        """Where the next prefill chunk ends: after `chunk_max` tokens, or at the stable
        tier's end, so a later process that restores the tier from disk prefills the same
        last chunk as this one did, with the same compiled step."""
        end = self.prefilled + chunk_max
        return self.stable_end if self.prefilled < self.stable_end < end else end

    def fork(self) -> "Request":
        """An SMC particle: the same request continuing independently from here, sharing
        every KV page written so far (copy-on-write)."""
        twin = copy.copy(self)
        twin.seq = self.seq.fork()
        twin.generated = list(self.generated)
        twin.decoder = self.decoder.fork() if self.decoder else None
        twin.stop_text = copy.copy(self.stop_text)
        twin.spec_metrics = dict(self.spec_metrics)
        twin.smc = None  # a particle of the population, not one
        return twin

    def accept(self, token: int, now: float, logprobs=None) -> str:
        """Record a sampled token (with its step's (chosen, top ids, top values) when the
        request asked for log-probabilities); return the text it makes visible."""
        self.generated.append(token)
        if self.logprobs is not None and logprobs is not None:
            chosen, ids, values = logprobs
            k = self.params.logprobs
            self.logprobs.append({"token_id": token, "logprob": float(chosen),
                                  "top_logprobs": [{"token_id": int(i), "logprob": float(v)}
                                                   for i, v in zip(ids[:k], values[:k])]})
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now
        piece, hit = "", False
        if token in self.eos:
            self.finish_reason = "stop"
        else:
            piece, hit = self.stop_text.add(self.decoder.push(token) if self.decoder else "")
            if hit:
                self.finish_reason = "stop"
        if self.finish_reason is None and len(self.generated) >= self.limit:
            self.finish_reason = "length"
        if self.finish_reason is not None and not hit:  # release held-back text
            tail, hit = self.stop_text.add(self.decoder.flush() if self.decoder else "")
            piece += tail if hit else tail + self.stop_text.finish()
            self.finish_reason = "stop" if hit else self.finish_reason
        return piece

    def end(self, reason: str) -> str:
        """End the request before its stop rules do; returns the text still held back."""
        self.finish_reason = reason
        piece, _ = self.stop_text.add(self.decoder.flush() if self.decoder else "")
        return piece + self.stop_text.finish()

    def abort(self) -> GenerationResult:
        """End the request from outside the loop ("abort"), with what it has so far; the
        loop gives its pages back before its next step."""
        self.end("abort")
        return self.result()

    def result(self) -> GenerationResult:
        n = len(self.generated)
        first = self.first_token_at or time.perf_counter()  # aborted before a token
        last = self.last_token_at or first
        decode_s = last - first
        metrics = {
            "ttft_s": first - self.start if self.first_token_at else None,
            "decode_tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            "itl_s": decode_s / (n - 1) if n > 1 else 0.0,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": n,
            "total_s": last - self.start,
            # waiting before it first joined the running batch (None: it never did)
            "queue_s": (self.first_admitted - self.start) if self.first_admitted else None,
            "cached_tokens": self.cached_tokens,
            "preemptions": self.preemptions,
            "prefilled_tokens": len(self.prompt_ids) - self.cached_tokens,
            **self.cache_metrics,
            **self.spec_metrics,
            **({"error": self.error} if self.error else {}),
        }
        return GenerationResult(self.stop_text.text, list(self.generated),
                                self.finish_reason, metrics, self.particles,
                                None if self.logprobs is None else list(self.logprobs))


def token_budget(prompt_tokens: int, max_context: int, asked: int | None = None,
                 cap: int | None = None) -> int:
    """The tokens a request may generate: what it `asked` for, at most `cap` (a server's
    default), within what the context holds after its prompt (all of that when neither
    is given)."""
    return min([max_context - prompt_tokens] + [n for n in (asked, cap) if n])
