"""What a request asks of the sampler, validated on the host (`SamplingParams`).

Plain Python: the scheduler and the request state use it without jax; the device side
(`xlr_jax.model.sampling`) turns a batch of them into a `SamplingBatch`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from xlr_jax.errors import InvalidRequestError

MAX_LOGPROBS = 20  # top log-probabilities a request may ask for per token (OpenAI's cap)


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0          # 0: off
    top_p: float = 1.0      # 1: off
    min_p: float = 0.0      # 0: off
    seed: int = 0
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # end like EOS
    logprobs: int | None = None  # per token: its log-probability and this many top ones
    # called before each step that samples for the request with the token ids generated
    # so far; returns a bias [vocab] added to the logits (-inf masks a token), or None.
    # A pure function of those ids (it may be called again with the same ones)
    logits_processor: Callable[[list[int]], np.ndarray | None] | None = field(
        default=None, compare=False)

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0 (got {self.temperature}); use 0 for greedy"),
            (self.top_k >= 0, f"top_k must be >= 0 (got {self.top_k}); use 0 to turn it off"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1] (got {self.top_p}); use 1 to turn it off"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1] (got {self.min_p}); use 0 to turn it off"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1 (got {self.max_tokens})"),
            (0 <= self.seed < 2 ** 32, f"seed must be in [0, 2**32) (got {self.seed})"),
            (self.logits_processor is None or callable(self.logits_processor),
             "logits_processor must be a callable (token ids -> bias array) or None"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}] (got {self.logprobs}); None turns "
             "them off"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        """Top-k, top-p or min-p is on (the sampler must sort the vocabulary)."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0
