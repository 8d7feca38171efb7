"""What a request asks of speculative decoding (`SpecConfig`) and the drafts it names.

Drafts share one interface, `Draft.kind`:
- "tokens": proposals made on the host (n-gram prompt lookup), q a point mass;
- "self": the target's first k layers with its final norm and LM head;
- "model": a separate model sharing the target's tokenizer, its KV beside the target's.
Plain Python: the scheduler and the request state use these without jax.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from xlr_jax.errors import InvalidRequestError
from xlr_jax.model.config import ModelConfig
from xlr_jax.model.weight_formats import WEIGHTS
from xlr_jax.speculative.drafts import ngram_propose

MAX_GAMMA = 16
# SMC runs only if the draft's agreement sum_v min(p, q) with the target, measured on
# the target's own text, reaches this: on the embedded model, drafts measured at ~0.8
# kept SMC's answers within 2% of plain sampling's log-likelihood, ~0.6 lost 38%
# (experiments/speculative_decoding.py, [smc_quality])
SMC_MIN_AGREEMENT = 0.7
METHODS = ("exact", "smc")
RESAMPLERS = ("systematic", "multinomial")
FLOAT_KEYS = ("alpha", "ess_threshold", "min_agreement")


@dataclass(frozen=True)
class SpecConfig:
    """What a request asks of speculative decoding (`Model.generate(speculative=...)`).

    method: "exact" (the target's distribution exactly) or "smc" (particles proposed by
    the draft, weighted by p_target / q_draft and resampled; it targets p at the
    request's temperature, with the finite-particle bias of SMC). draft: "ngram"
    (prompt lookup; exact only), "self:K" (the target's first K layers) or a path to a
    draft model. particles: "auto" (from free KV pages, the plan's rule) or a fixed N;
    with one particle SMC is plain exact speculation. alpha: 1 only (kept as a key so
    a request that asks for p^alpha is refused rather than ignored). min_agreement: SMC
    starts with a probation of exact cycles that measure the draft's agreement with the
    target, sum_v min(p, q) per draft token; below min_agreement the request stays on
    exact speculation (metrics["smc_fallback"] says why); 0 skips the probation.
    draft_weights: a draft model's weight format (one of `model.weight_formats.WEIGHTS`, e.g.
    "int4" beside an "int8" target); default: the target's.
    """

    method: str = "exact"
    draft: str = "ngram"
    gamma: int = 4
    particles: int | str = "auto"
    ess_threshold: float = 0.5
    alpha: float = 1.0
    resampler: str = "systematic"
    min_agreement: float = SMC_MIN_AGREEMENT
    draft_weights: str | None = None

    def __post_init__(self):
        p = self.particles
        checks = [
            (self.method in METHODS, f"speculative method must be one of {METHODS} "
                                     f"(got {self.method!r})"),
            (isinstance(self.draft, str) and bool(self.draft),
             'draft must be "ngram", "self:K" or a path to a draft model'),
            (isinstance(self.gamma, int) and 1 <= self.gamma <= MAX_GAMMA,
             f"gamma must be an integer in [1, {MAX_GAMMA}] (got {self.gamma!r})"),
            (p == "auto" or (isinstance(p, int) and p >= 1),
             f'particles must be "auto" or a positive integer (got {p!r})'),
            (0 < self.ess_threshold <= 1,
             f"ess_threshold must be in (0, 1] (got {self.ess_threshold})"),
            (self.alpha == 1, f"alpha must be 1 (got {self.alpha}): SMC-SD targets the "
                              "model's own distribution; p^alpha is not supported (the first "
                              "token and one-particle cycles sample p itself); lower the "
                              "temperature to sharpen it instead"),
            (self.resampler in RESAMPLERS, f"resampler must be one of {RESAMPLERS} "
                                           f"(got {self.resampler!r})"),
            (0 <= self.min_agreement <= 1,
             f"min_agreement must be in [0, 1] (got {self.min_agreement})"),
            (self.draft_weights in (None, *WEIGHTS),
             f"draft_weights must be one of {', '.join(WEIGHTS)} (got {self.draft_weights!r})"),
            (self.method != "smc" or self.draft != "ngram",
             'SMC-SD needs a draft that can propose every token the target can: use draft '
             '"self:K" or a draft model path (n-gram lookup proposes one fixed token), or '
             "method exact"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @classmethod
    def parse(cls, spec, default_gamma: int = 4,
              default_draft: str = "ngram") -> "SpecConfig | None":
        """A SpecConfig from None, a SpecConfig or a dict with the same keys."""
        if spec is None or isinstance(spec, SpecConfig):
            return spec
        if not isinstance(spec, dict):
            raise InvalidRequestError("speculative must be a dict such as "
                                      '{"method": "exact", "draft": "ngram"} or a SpecConfig')
        known = {f.name for f in fields(cls)}
        unknown = set(spec) - known
        if unknown:
            raise InvalidRequestError(f"unknown speculative key(s) {sorted(unknown)}; "
                                      f"known: {', '.join(sorted(known))}")
        return cls(**{"gamma": default_gamma, "draft": default_draft, **spec})

    @classmethod
    def from_cli(cls, text: str) -> dict:
        """The spec dict of `--spec method[,key=value...]`, e.g.
        "smc,draft=self:8,gamma=4,particles=auto"."""
        method, *pairs = text.split(",")
        spec: dict = {"method": method.strip()}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                raise InvalidRequestError(f"speculative item {pair!r} is not key=value")
            key, value = key.strip(), value.strip()
            try:
                spec[key] = (int(value) if key == "gamma" or (key == "particles" and value != "auto")
                             else float(value) if key in FLOAT_KEYS else value)
            except ValueError:
                raise InvalidRequestError(f"speculative {key}={value}: not a number") from None
        cls.parse(spec)  # validate here: the CLI reports a bad value before loading
        return spec


@dataclass(frozen=True)
class NgramDraft:
    """Prompt lookup: propose what followed the latest earlier match of the last tokens."""

    max_n: int = 3
    # one-token matches guess wrong too often: on the code-edit workload (gamma 8)
    # min_n=1 measured 0.29 acceptance and 80 tok/s, against 0.50 and 100 tok/s
    min_n: int = 2
    kind = "tokens"

    def propose(self, tokens: list[int], gamma: int) -> list[int]:
        return ngram_propose(tokens, gamma, self.max_n, self.min_n)


@dataclass(frozen=True)
class LayerDraft:
    """Self-speculative: the target's first `layers` layers, final norm and LM head."""

    layers: int
    kind = "self"


@dataclass(eq=False)
class ModelDraft:
    """A separate draft model; its KV lives beside the target's on the same page ids."""

    name: str
    config: ModelConfig
    params: Any  # the draft's model.decoder.Params
    kind = "model"


Draft = NgramDraft | LayerDraft | ModelDraft


def resolve_draft(draft: str, target: ModelConfig, load=None) -> Draft:
    """The Draft a spec's "draft" string names; `load(path)` loads a separate model."""
    if draft == "ngram":
        return NgramDraft()
    if draft.startswith("self:"):
        k = draft[5:]
        if not k.isdigit() or not 1 <= int(k) < target.num_layers:
            raise InvalidRequestError(f'draft "{draft}": K must be an integer in '
                                      f"[1, {target.num_layers - 1}] (the target has "
                                      f"{target.num_layers} layers)")
        return LayerDraft(int(k))
    if not Path(draft).exists():
        raise InvalidRequestError(f'draft "{draft}" is not "ngram", "self:K" or an existing '
                                  "model path")
    return load(draft)
