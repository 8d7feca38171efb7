"""Speculative decoding on the paged KV: the request's spec, the drafts, one jitted cycle.

A cycle, for every row (a sequence, or an SMC particle): the draft proposes up
to gamma tokens; the target scores the row's last token plus the proposals
(gamma + 1 positions) in one forward over the paged KV; then either exact
acceptance (`acceptance.accept_block`; for host proposals `accept_by_matching`, which
emits what plain sampling would) or, for SMC, a bonus token from the
target beside each draft token's log p and log q (the host adds the weights of
the tokens a particle keeps: `smc.block_increment`). The host then trims each
row's block table and length to what was kept; nothing is copied. A request (or
an SMC population's particles) beside other streams runs the cycle's two halves
around their ragged step instead: `propose` (the device draft), then `judge` (exact
acceptance or SMC's bonus token and weights, on the step's logits, with the cycle's
keys), so its rows share the step's target pass.

Drafts share one interface, `Draft.kind`:
- "tokens": proposals made on the host (n-gram prompt lookup), q a point mass;
- "self": the target's first k layers with its final norm and LM head. It
  writes those layers' KV in the target's own pages, which the verify pass then
  overwrites with identical values, so it needs no KV of its own;
- "model": a separate model sharing the target's tokenizer. Its KV is a second
  pytree over the same page ids, so one block table serves both.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache, partial
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from xlr_jax.errors import InvalidRequestError
from xlr_jax.model.config import ModelConfig
from xlr_jax.model.decoder import Params, forward, lm_head
from xlr_jax.model.sampling import SamplingBatch, draw_from, sample_rows, token_probs
from xlr_jax.speculative.acceptance import accept_block, accept_by_matching
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
    """

    method: str = "exact"
    draft: str = "ngram"
    gamma: int = 4
    particles: int | str = "auto"
    ess_threshold: float = 0.5
    alpha: float = 1.0
    resampler: str = "systematic"
    min_agreement: float = SMC_MIN_AGREEMENT

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
    params: Params
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


def _row_keys(sampling: SamplingBatch, salt):
    """Two keys per row (draft, accept) from the row's seed, token index and salt."""
    def row(seed, step, s):
        return jax.random.split(jax.random.fold_in(jax.random.fold_in(jax.random.key(seed),
                                                                      step), s))
    keys = jax.vmap(row)(sampling.seed, sampling.step, salt)
    return keys[:, 0], keys[:, 1]


def _probs(logits, sampling: SamplingBatch, sampler: str):
    return token_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p,
                       sampling.min_p, sampler=sampler)


def _draw(keys, probs):
    return jax.vmap(draw_from)(keys, probs)


def _run_draft(dparams, dkv, last, positions, num_draft, block_tables, sampling, keys, *,
               dconfig, attn_impl, steps, sampler):
    """`steps` single-token draft steps from `last`; returns tokens [B, steps],
    their draft probabilities [B, steps, V] and the draft's KV."""
    def step(carry, j):
        kv, token = carry
        hidden, kv = forward(dparams, kv, token[:, None], (positions + j)[:, None],
                             (j <= num_draft)[:, None], block_tables, config=dconfig,
                             attn_impl=attn_impl)
        q = _probs(lm_head(dparams, hidden[:, 0]), sampling, sampler)
        drawn = _draw(jax.vmap(lambda k: jax.random.fold_in(k, j))(keys), q)
        return (kv, drawn), (drawn, q)

    (dkv, _), (tokens, q) = jax.lax.scan(step, (dkv, last), jnp.arange(steps))
    return tokens.T, jnp.swapaxes(q, 0, 1), dkv


def _propose(params: Params, kv, draft_params, draft_kv, last, positions, num_draft,
             block_tables, sampling: SamplingBatch, salt, *, config: ModelConfig,
             draft_config: ModelConfig | None, attn_impl: str, gamma: int, draft_kind: str,
             draft_layers: int, sampler: str):
    """A device draft's proposals from each row's `last` token (at `positions`, not yet in
    the KV): tokens [B, gamma] drawn from the draft's q, q itself [B, gamma, V], and
    the KV the draft wrote (a self draft the target's first layers, a model its own)."""
    k_draft, _ = _row_keys(sampling, salt)
    run = partial(_run_draft, last=last, positions=positions, num_draft=num_draft,
                  block_tables=block_tables, sampling=sampling, keys=k_draft,
                  attn_impl=attn_impl, sampler=sampler)
    if draft_kind == "self":
        layer_params = params.replace(layers=params.layers[:draft_layers])
        drafts, q, kv = run(layer_params, kv, dconfig=config, steps=gamma)
        return drafts, q, kv, draft_kv
    # one extra step writes the last proposal's KV for the next cycle
    drafts, q, draft_kv = run(draft_params, draft_kv, dconfig=draft_config, steps=gamma + 1)
    return drafts[:, :gamma], q[:, :gamma], kv, draft_kv


def _per_position(sampling: SamplingBatch, gamma: int) -> SamplingBatch:
    """Each row's sampling repeated over its last token and gamma drafts."""
    return jax.tree.map(lambda a: jnp.repeat(a, gamma + 1), sampling)


def _target_probs(logits, sampling: SamplingBatch, sampler: str, gamma: int):
    """p [B, gamma + 1, V] from the target's logits [B * (gamma + 1), V] at each row's
    last token and its drafts."""
    return _probs(logits, _per_position(sampling, gamma), sampler).reshape(
        -1, gamma + 1, logits.shape[-1])


def _accept_exact(k_accept, drafts, q, p, num_draft):
    """`accept_block` row by row, each row with its own key: (accepted [B], next [B])."""
    accepted, nxt = jax.vmap(lambda k, d, qq, pp, n: accept_block(
        k, d[None], qq[None], pp[None], n[None]))(k_accept, drafts, q, p, num_draft)
    return accepted[:, 0], nxt[:, 0]


def _decide(k_accept, drafts, q, p, num_draft, method: str):
    """What a cycle keeps of device proposals scored by the target (p [B, gamma + 1, V]):
    (accepted [B], next [B], log p and log q of each draft [B, gamma], agreement
    sum_v min(p, q) at each draft position [B, gamma]). Exact: `accept_block`. SMC:
    every real draft is kept and `next` is a bonus token from p after them."""
    gamma = drafts.shape[1]
    pick = lambda probs: jnp.take_along_axis(probs, drafts[..., None], -1)[..., 0]  # noqa: E731
    log_p = jnp.log(jnp.maximum(pick(p[:, :gamma]), 1e-30))
    log_q = jnp.log(jnp.maximum(pick(q), 1e-30))
    agreement = jnp.sum(jnp.minimum(p[:, :gamma], q), axis=-1)
    if method == "exact":
        accepted, nxt = _accept_exact(k_accept, drafts, q, p, num_draft)
    else:
        accepted = num_draft
        nxt = _draw(k_accept, jnp.take_along_axis(p, num_draft[:, None, None], 1)[:, 0])
    return accepted, nxt, log_p, log_q, agreement


def _judge_rows(logits, index, drafts, q, num_draft, sampling: SamplingBatch, salt, *,
                sampler: str, method: str):
    """`_decide` for device proposals that a ragged step scored as rows: `index`
    [B, gamma + 1] picks each row's last token and drafts out of the step's logits.
    Draws what `_cycle` draws for the same proposals (the same keys)."""
    gamma = drafts.shape[1]
    p = _target_probs(logits[index.reshape(-1)], sampling, sampler, gamma)
    _, k_accept = _row_keys(sampling, salt)
    return _decide(k_accept, drafts, q, p, num_draft, method)


def _cycle(params: Params, kv, draft_params, draft_kv, last, positions, proposed, num_draft,
           block_tables, sampling: SamplingBatch, salt, *, config: ModelConfig,
           draft_config: ModelConfig | None, attn_impl: str, gamma: int, draft_kind: str,
           draft_layers: int, method: str, sampler: str):
    """One speculative cycle for rows [B] whose next position is `positions` and whose
    last sampled token `last` is not yet in the KV. `num_draft` [B] <= gamma limits
    each row's proposals (token budget, or fewer n-gram proposals in `proposed`).

    Returns (accepted [B], next token [B], drafts [B, gamma], log p and log q of each
    draft token [B, gamma], agreement sum_v min(p, q) at each draft position [B, gamma],
    kv, draft_kv): the row keeps `last`, drafts[:accepted] and then `next`. Exact:
    accepted by `accept_block`, or for host proposals by `accept_by_matching` on the
    plain sampler's draws (`sampling.step` is the index of the token after `last`; log p,
    log q and agreement are zeros then: no request weighs or watches a point mass). SMC:
    every real draft is kept and `next` is a bonus token from p; the host weighs the
    drafts a particle keeps before it stops.
    """
    batch = last.shape[0]
    _, k_accept = _row_keys(sampling, salt)
    if draft_kind == "tokens":
        drafts = proposed
    else:
        drafts, q, kv, draft_kv = _propose(
            params, kv, draft_params, draft_kv, last, positions, num_draft, block_tables,
            sampling, salt, config=config, draft_config=draft_config, attn_impl=attn_impl,
            gamma=gamma, draft_kind=draft_kind, draft_layers=draft_layers, sampler=sampler)
    offs = jnp.arange(gamma + 1, dtype=jnp.int32)
    tokens = jnp.concatenate([last[:, None], drafts], axis=1)
    hidden, kv = forward(params, kv, tokens, positions[:, None] + offs,
                         offs <= num_draft[:, None], block_tables, config=config,
                         attn_impl=attn_impl)
    logits = lm_head(params, hidden).reshape(batch * (gamma + 1), config.vocab_size)
    if draft_kind == "tokens":  # a point mass (exact only): plain sampling's draws decide
        steps = (sampling.step[:, None] + offs).reshape(-1)
        drawn = sample_rows(logits, _per_position(sampling, gamma).replace(step=steps))
        accepted, nxt = accept_by_matching(drawn.reshape(batch, gamma + 1), drafts, num_draft)
        unweighed = jnp.zeros(drafts.shape, jnp.float32)  # no q to weigh or compare with
        return accepted, nxt, drafts, unweighed, unweighed, unweighed, kv, draft_kv
    p = _target_probs(logits, sampling, sampler, gamma)
    accepted, nxt, log_p, log_q, agreement = _decide(k_accept, drafts, q, p, num_draft, method)
    return accepted, nxt, drafts, log_p, log_q, agreement, kv, draft_kv


class _Programs(NamedTuple):
    cycle: Callable
    propose: Callable
    judge: Callable


@lru_cache(maxsize=4)  # bounded: each keeps its executables (and their memory maps)
def _jitted(config: ModelConfig, attn_impl: str, compiler_options: tuple) -> _Programs:
    """The jitted cycle, proposal and judgement of every model with this config, attention
    and compile options: a second load in one process (a test's, a draft's) runs what
    the first compiled, without tracing it again."""
    draft_args = ("draft_config", "gamma", "draft_kind", "draft_layers", "sampler")
    jit = partial(jax.jit, compiler_options=dict(compiler_options) or None)
    return _Programs(
        cycle=jit(partial(_cycle, config=config, attn_impl=attn_impl),
                  donate_argnames=("kv", "draft_kv"), static_argnames=(*draft_args, "method")),
        propose=jit(partial(_propose, config=config, attn_impl=attn_impl),
                    donate_argnames=("kv", "draft_kv"), static_argnames=draft_args),
        judge=jit(_judge_rows, static_argnames=("sampler", "method")))


def _draft_inputs(draft: Draft) -> tuple:
    """A draft's params (a draft model's, or None) and the static arguments naming it."""
    model = draft if isinstance(draft, ModelDraft) else None
    return model.params if model else None, dict(
        draft_config=model.config if model else None, draft_kind=draft.kind,
        draft_layers=draft.layers if isinstance(draft, LayerDraft) else 0)


class SpecSteps:
    """The jitted speculative programs of a target model, compiled per (rows, table
    width, gamma, draft, method, sampling flags); the target's and the draft's KV are
    donated. `cycle` proposes and verifies in one program; `propose` and `judge` are
    its two halves around a ragged step that scores the proposals as rows."""

    def __init__(self, config: ModelConfig, attn_impl: str = "auto",
                 compiler_options: dict | None = None):
        self._programs = _jitted(config, attn_impl,
                                 tuple(sorted((compiler_options or {}).items())))

    def cycle(self, params, kv, draft: Draft, draft_kv, last, positions, proposed, num_draft,
              block_tables, sampling, salt, *, gamma: int, method: str, sampler: str):
        draft_params, static = _draft_inputs(draft)
        return self._programs.cycle(
            params, kv, draft_params, draft_kv, last, positions, proposed, num_draft,
            block_tables, sampling, salt, gamma=gamma, method=method, sampler=sampler, **static)

    def propose(self, params, kv, draft: Draft, draft_kv, last, positions, num_draft,
                block_tables, sampling, salt, *, gamma: int, sampler: str):
        """A device draft's proposals: (drafts [B, gamma], q, kv, draft_kv)."""
        draft_params, static = _draft_inputs(draft)
        return self._programs.propose(
            params, kv, draft_params, draft_kv, last, positions, num_draft, block_tables,
            sampling, salt, gamma=gamma, sampler=sampler, **static)

    def judge(self, logits, index, drafts, q, num_draft, sampling, salt, *, sampler: str,
              method: str):
        """What a cycle of `method` keeps of `propose`'s drafts scored in a ragged step's
        `logits` (rows `index` [B, gamma + 1]): (accepted [B], next token [B], log p
        [B, gamma], log q, agreement)."""
        return self._programs.judge(logits, index, drafts, q, num_draft, sampling, salt,
                                    sampler=sampler, method=method)

    def compilations(self) -> int:
        """Cycles compiled for every model sharing this jitted cycle (see `_jitted`)."""
        return self._programs.cycle._cache_size()
