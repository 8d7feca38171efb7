"""Speculative decoding on the paged KV: one jitted cycle, and its two halves.

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

from functools import lru_cache, partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from xlr_jax.model.config import ModelConfig
from xlr_jax.model.decoder import Params, RowProducts, forward, lm_head
from xlr_jax.model.sampling import SamplingBatch, draw_from, sample_rows, token_probs
from xlr_jax.model.tensor_parallel import TensorParallel
from xlr_jax.speculative.acceptance import accept_block, accept_by_matching
from xlr_jax.speculative.config import Draft, LayerDraft, ModelDraft

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
               dconfig, attn_impl, products, tp, steps, sampler):
    """`steps` single-token draft steps from `last`; returns tokens [B, steps],
    their draft probabilities [B, steps, V] and the draft's KV."""
    def step(carry, j):
        kv, token = carry
        hidden, kv = forward(dparams, kv, token[:, None], (positions + j)[:, None],
                             (j <= num_draft)[:, None], block_tables, config=dconfig,
                             attn_impl=attn_impl, products=products, tp=tp)
        q = _probs(lm_head(dparams, hidden[:, 0], dconfig, products, tp), sampling, sampler)
        drawn = _draw(jax.vmap(lambda k: jax.random.fold_in(k, j))(keys), q)
        return (kv, drawn), (drawn, q)

    (dkv, _), (tokens, q) = jax.lax.scan(step, (dkv, last), jnp.arange(steps))
    return tokens.T, jnp.swapaxes(q, 0, 1), dkv


def _propose(params: Params, kv, draft_params, draft_kv, last, positions, num_draft,
             block_tables, sampling: SamplingBatch, salt, *, config: ModelConfig,
             draft_config: ModelConfig | None, attn_impl: str, products: RowProducts,
             tp: TensorParallel | None, gamma: int, draft_kind: str, draft_layers: int,
             sampler: str):
    """A device draft's proposals from each row's `last` token (at `positions`, not yet in
    the KV): tokens [B, gamma] drawn from the draft's q, q itself [B, gamma, V], and
    the KV the draft wrote (a self draft the target's first layers, a model its own)."""
    k_draft, _ = _row_keys(sampling, salt)
    run = partial(_run_draft, last=last, positions=positions, num_draft=num_draft,
                  block_tables=block_tables, sampling=sampling, keys=k_draft,
                  attn_impl=attn_impl, products=products, tp=tp, sampler=sampler)
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
           draft_config: ModelConfig | None, attn_impl: str, products: RowProducts,
           tp: TensorParallel | None, gamma: int, draft_kind: str, draft_layers: int,
           method: str, sampler: str):
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
            products=products, tp=tp, gamma=gamma, draft_kind=draft_kind,
            draft_layers=draft_layers, sampler=sampler)
    offs = jnp.arange(gamma + 1, dtype=jnp.int32)
    tokens = jnp.concatenate([last[:, None], drafts], axis=1)
    hidden, kv = forward(params, kv, tokens, positions[:, None] + offs,
                         offs <= num_draft[:, None], block_tables, config=config,
                         attn_impl=attn_impl, products=products, tp=tp)
    logits = lm_head(params, hidden, config, products, tp).reshape(batch * (gamma + 1),
                                                                config.vocab_size)
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
def _jitted(config: ModelConfig, attn_impl: str, compiler_options: tuple,
            products: RowProducts, tp: TensorParallel | None) -> _Programs:
    """The jitted cycle, proposal and judgement of every model with this config, attention,
    compile options, products and mesh: a second load in one process (a test's, a
    draft's) runs what the first compiled, without tracing it again."""
    draft_args = ("draft_config", "gamma", "draft_kind", "draft_layers", "sampler")
    jit = partial(jax.jit, compiler_options=dict(compiler_options) or None)
    return _Programs(
        cycle=jit(partial(_cycle, config=config, attn_impl=attn_impl, products=products,
                          tp=tp),
                  donate_argnames=("kv", "draft_kv"), static_argnames=(*draft_args, "method")),
        propose=jit(partial(_propose, config=config, attn_impl=attn_impl, products=products,
                            tp=tp),
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
    its two halves around a ragged step that scores the proposals as rows. `products`:
    how their weight products of a few rows run (`decoder.linear`; the steps' own); `tp`:
    the target's mesh (a draft model's weights split over it too)."""

    def __init__(self, config: ModelConfig, attn_impl: str = "auto",
                 compiler_options: dict | None = None, products: RowProducts = RowProducts(),
                 tp: TensorParallel | None = None):
        self._programs = _jitted(config, attn_impl,
                                 tuple(sorted((compiler_options or {}).items())), products, tp)

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
