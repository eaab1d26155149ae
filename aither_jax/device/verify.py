"""Lossless verification of speculative drafts (the proposers are in aither_jax/speculative/).

A decoding step runs the target once over [last token, d_1 .. d_k] for every row and keeps
the longest accepted prefix of the drafts plus one token of the target's own (the bonus
token). Rejected positions are rolled back by the length pointer: the sequence's cached
length (`Sequence.num_cached`) only counts accepted tokens, so whatever the verify pass wrote
past it is overwritten by the next step and never read (attention masks by that length). The
draft's context cache follows the same pointer.

Verification (`verify`):
- greedy rows accept d_j while it equals the target's argmax after d_1 .. d_{j-1}; the bonus
  token is the argmax at the first mismatch (or after the last draft);
- sampled rows use the rule for a deterministic proposal (every proposer here is a
  deterministic function of the context, a DFlash draft that unmasks out of order included):
  accept d_j with probability p_j(d_j), where p_j is the distribution the target samples from
  (temperature, top-k, top-p applied); on rejection sample from p_j with d_j removed and
  renormalized; after the last accepted draft sample from p. Each emitted token is then
  distributed exactly as p_j: p(x) [accepted] + (1 - p(x)) p(y)/(1 - p(x)) [y != x].
  Min(1, p/q) with the draft's per-position marginals q is not exact for out-of-order drafts.
  The rule is run as a coupling: the target draws y_j from p_j with the key plain decoding
  uses at that position (seed, position), and d_j is accepted when y_j == d_j, else y_j is
  the next token. That has exactly the probabilities above, and every emitted token is the
  token plain decoding with the same seed samples from the same logits, whatever was drafted
  and however many drafts a step carries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from aither_jax.compile.step_jit import step_jit
from aither_jax.device.sampling import SamplingBatch, draw_tokens, greedy_tokens

# -- verification ---------------------------------------------------------------------------


def verify(
    logits: jax.Array,  # [B, T, V] float32, the target at [last, d_1 .. d_{T-1}]
    drafts: jax.Array,  # [B, T-1] int32
    num_drafts: jax.Array,  # [B] int32 valid drafts per row
    sampling: SamplingBatch,
    start: jax.Array,  # [B] int32 position of each row's last committed token
    *,
    greedy_only: bool,
) -> tuple[jax.Array, jax.Array]:
    """Returns (accepted drafts [B] int32, the token after them [B] int32)."""
    t = logits.shape[1]
    j = jnp.arange(t - 1)[None, :]
    valid = j < num_drafts[:, None]
    target = greedy_tokens(logits)  # [B, T]
    greedy_ok = (drafts == target[:, :-1]) & valid
    greedy_acc = jnp.cumprod(greedy_ok, axis=1).sum(axis=1).astype(jnp.int32)
    greedy_next = jnp.take_along_axis(target, greedy_acc[:, None], axis=1)[:, 0]
    if greedy_only:
        return greedy_acc, greedy_next

    # Sampled rows: the target's own draw at every position, with the key plain decoding uses
    # there (seed, position); d_j is accepted while it equals that draw, and the draw at the
    # first mismatch is the next token. So d_j is accepted with probability p_j(d_j), and on
    # rejection the token comes from p_j without d_j, renormalized: the deterministic-proposal
    # rule, and every emitted token is the one plain decoding with that seed would sample.
    drawn = _draws(logits, sampling, start[:, None] + 1 + jnp.arange(t)[None, :])
    acc = jnp.cumprod((drafts == drawn[:, :-1]) & valid, axis=1).sum(axis=1).astype(jnp.int32)
    sampled_next = jnp.take_along_axis(drawn, acc[:, None], axis=1)[:, 0]
    is_sampled = sampling.temperature > 0
    return jnp.where(is_sampled, acc, greedy_acc), jnp.where(is_sampled, sampled_next, greedy_next)


def _draws(logits: jax.Array, sampling: SamplingBatch, positions: jax.Array) -> jax.Array:
    """The target's sampled token [B, T] at every entry of logits [B, T, V], each with plain
    decoding's key for the position [B, T] of the token it chooses."""
    b, t, v = logits.shape
    rep = lambda x: jnp.repeat(x, t, axis=0)  # noqa: E731  per-row settings for every entry
    flat = SamplingBatch(rep(sampling.temperature), rep(sampling.top_k), rep(sampling.top_p), rep(sampling.seeds))
    return draw_tokens(logits.reshape(b * t, v), flat, positions.reshape(-1)).reshape(b, t)


def verify_tree(
    logits: jax.Array,  # [B, T, V] float32, the target at every node of each row's tree
    tokens: jax.Array,  # [B, T] int32 node tokens; node 0 is the last committed token
    parents: jax.Array,  # [B, T] int32 parent of each node (-1 for node 0)
    depth: jax.Array,  # [B, T] int32 each node's depth (node 0: 0)
    num_new: jax.Array,  # [B] int32 valid nodes per row
    sampling: SamplingBatch,
    start: jax.Array,  # [B] int32 position of each row's last committed token
    *,
    greedy_only: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Verifies a tree of drafts per row: from node 0, the target's choice at the current node
    (its argmax, or for sampled rows its draw with plain decoding's key for that position, as
    in `verify`) is accepted if a child of the node carries it, and the walk moves there; the
    choice where no child matches is the next token. Along the accepted path this is `verify`
    on that path's chain, so the emitted tokens are the ones plain decoding gives.

    Returns (accepted drafts [B], the token after them [B], path [B, T]: the node at each depth
    of the accepted path, then index j at depths j past its end)."""
    b, t = tokens.shape
    node = jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = (node < num_new[:, None]) & (node > 0)
    choice = greedy_tokens(logits)  # [B, T]
    if not greedy_only:
        drawn = _draws(logits, sampling, start[:, None] + 1 + depth)
        choice = jnp.where((sampling.temperature > 0)[:, None], drawn, choice)
    cur = jnp.zeros(b, jnp.int32)
    alive = jnp.ones(b, bool)
    accepted = jnp.zeros(b, jnp.int32)
    path = [cur]
    for j in range(1, t):
        want = jnp.take_along_axis(choice, cur[:, None], axis=1)  # [B, 1]
        match = valid & (parents == cur[:, None]) & (tokens == want)
        alive &= match.any(axis=1)
        cur = jnp.where(alive, jnp.argmax(match, axis=1).astype(jnp.int32), cur)
        accepted += alive
        path.append(jnp.where(alive, cur, j))
    next_tokens = jnp.take_along_axis(choice, cur[:, None], axis=1)[:, 0]
    return accepted, next_tokens, jnp.stack(path, axis=1)


verify_jit = step_jit(verify, static_argnames=("greedy_only",))
