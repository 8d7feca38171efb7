"""Thinking: a model's thought between its markers (`<think>` ... `</think>` by default)
is returned as `reasoning_content`, apart from the answer, and held to a token budget.

- **Where a thought is.** It is open from the start when the prompt ends with the start
  marker (a chat template that opens one), or when the output begins with it; it ends
  at the end marker. Text outside it is the answer (parsed for tool calls; a thought
  never is).
- **The budget** (`reasoning_effort` none / low / medium / high, a request's
  `thinking_token_budget`, `xlr serve --reasoning-budget N`): a `ThoughtBudget`, the
  request's logits_processor, counts the thought's tokens; once they reach the budget
  it masks each step to the next token of the end marker (and of an optional
  transition text) until they are written, so the answer starts. A budget of 0 closes
  the thought at once. After the thought it hands the answer's ids to the request's
  constraint, if any (response_format, tool_choice).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# reasoning_effort -> thought tokens (documented in the README and /openapi.json)
EFFORT_BUDGETS = {"none": 0, "minimal": 64, "low": 256, "medium": 1024, "high": 4096}
TAIL_TOKENS = 8  # decoded to spot a marker at the end of the output


@dataclass(frozen=True)
class Markers:
    start: str = "<think>"
    end: str = "</think>"
    transition: str = ""  # written after a forced end marker, before the answer


def opens_thought(tokenizer, prompt_ids: list[int], markers: Markers) -> bool:
    """Whether the prompt leaves a thought open (its template ends with the marker)."""
    tail = tokenizer.decode(prompt_ids[-TAIL_TOKENS:])
    return tail.rstrip().endswith(markers.start)


def split_reasoning(text: str, markers: Markers, opened: bool) -> tuple[str | None, str]:
    """(the thought's text or None, the answer's text) of a whole output."""
    splitter = ReasoningSplitter(markers, opened)
    parts = splitter.feed(text) + splitter.finish()
    thought = "".join(t for kind, t in parts if kind == "reasoning")
    answer = "".join(t for kind, t in parts if kind == "content")
    return (thought if splitter.thought_seen else None), answer


class ReasoningSplitter:
    """Streamed text pieces -> ("reasoning" | "content", text) events, holding back a
    tail that may be the start of a marker until the next piece says."""

    def __init__(self, markers: Markers, opened: bool):
        self._markers = markers
        self._state = "thought" if opened else "start"  # start: before any text
        self.thought_seen = opened
        self._held = ""
        self._trim = False  # newlines right after a marker are the marker's

    def feed(self, piece: str) -> list[tuple[str, str]]:
        self._held += piece
        out: list[tuple[str, str]] = []
        while True:
            if self._trim:
                self._held = self._held.lstrip("\n")
                if not self._held:
                    return out
                self._trim = False
            if self._state == "start":
                lead = self._held.lstrip()
                if self._markers.start.startswith(lead) and lead != self._markers.start:
                    return out  # still maybe the start marker
                if lead.startswith(self._markers.start):
                    self._held = lead[len(self._markers.start):]
                    self._state, self.thought_seen, self._trim = "thought", True, True
                else:
                    self._state = "answer"
            elif self._state == "thought":
                at = self._held.find(self._markers.end)
                if at < 0:
                    keep = _partial_suffix(self._held, self._markers.end)
                    text, self._held = self._held[:len(self._held) - keep], \
                        self._held[len(self._held) - keep:]
                    return out + ([("reasoning", text)] if text else [])
                if at:
                    out.append(("reasoning", self._held[:at]))
                self._held = self._held[at + len(self._markers.end):]
                self._state, self._trim = "answer", True
            else:
                text, self._held = self._held, ""
                return out + ([("content", text)] if text else [])

    def finish(self) -> list[tuple[str, str]]:
        """What is held at the end (a thought never closed stays reasoning)."""
        text, self._held = self._held, ""
        if not text:
            return []
        return [("reasoning" if self._state == "thought" else "content", text)]


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ThoughtBudget:
    """A logits_processor holding a thought to `budget` tokens (None: unlimited); `inner`
    (a constraint) then takes over for the answer's ids. `feed` alone counts a finished
    output's thought tokens."""

    def __init__(self, tokenizer, vocab_size: int, markers: Markers, budget: int | None,
                 opened: bool, max_tokens: int, inner=None):
        self._tokenizer, self._vocab, self._markers = tokenizer, vocab_size, markers
        self._close = tokenizer.encode(markers.end + markers.transition,
                                       add_special_tokens=False)
        self.budget, self._opened, self._inner = budget, opened, inner
        self._max_tokens = max_tokens
        self._reset()

    def _reset(self) -> None:
        self._state = "thought" if self._opened else "start"
        self._thought_from = 0  # the first thought token's index
        self._force_from: int | None = None  # where the forced end marker starts
        self.answer_from: int | None = None  # the answer's first index
        self._seen: list[int] = []

    @property
    def thought_tokens(self) -> int:
        """Tokens of the thought so far (its end marker included)."""
        if self._state == "start":
            return 0
        end = self.answer_from if self.answer_from is not None else len(self._seen)
        return end - self._thought_from

    def feed(self, generated: list[int]) -> None:
        """Bring the state to `generated` (from the start if it is not an extension of
        the ids seen before)."""
        if generated[:len(self._seen)] != self._seen:
            self._reset()
        for i in range(len(self._seen), len(generated)):
            self._seen.append(generated[i])
            self._advance(i)

    def __call__(self, generated: list[int]) -> np.ndarray | None:
        self.feed(generated)
        if self._state == "answer":
            if self._inner is None:
                return None
            self._inner.max_tokens = self._max_tokens - self.answer_from
            return self._inner(generated[self.answer_from:])
        if self._state == "thought" and self._force_from is None and self.budget is not None \
                and len(generated) - self._thought_from >= self.budget:
            self._force_from = len(generated)
        if self._force_from is not None:
            bias = np.full(self._vocab, -np.inf, np.float32)
            bias[self._close[len(generated) - self._force_from]] = 0.0
            return bias
        return None

    def _advance(self, i: int) -> None:
        """Take the token at index i into the state (the answer's tokens need nothing)."""
        if self._state == "answer":
            return
        if self._force_from is not None:
            if i + 1 - self._force_from == len(self._close):
                self._state, self.answer_from = "answer", i + 1
        elif self._state == "start":
            lead = self._tokenizer.decode(self._seen).lstrip()
            if lead.startswith(self._markers.start):
                self._state, self._thought_from = "thought", i + 1
            elif not self._markers.start.startswith(lead):
                self._state, self.answer_from = "answer", 0
        elif self._markers.end in self._tokenizer.decode(self._seen[-TAIL_TOKENS:]):
            self._state, self.answer_from = "answer", i + 1


def request_budget(effort: str | None, budget: int | None, default: int | None) -> int | None:
    """The thought budget a request gets: its thinking_token_budget, else its
    reasoning_effort's, else the server's; None: unlimited."""
    if budget is not None:
        return budget
    if effort is not None:
        return EFFORT_BUDGETS[effort]
    return default
