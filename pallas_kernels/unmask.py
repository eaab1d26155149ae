"""One confidence-ordered unmasking step of a block-diffusion draft.

Given a block's tokens (MASK = -1 where still masked), the draft's prediction and confidence
at every position, reveal the `count` masked positions with the highest confidence (ties go
to the earlier position) by writing their predictions; other positions keep their tokens.
The selection is a rank count (how many masked positions beat this one), not a sort, so the
kernel has no data-dependent control flow. `confidence_unmask_reference` is the jnp twin.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MASK = -1


def _check(tokens, pred, conf, count) -> None:
    if tokens.ndim != 2 or pred.shape != tokens.shape or conf.shape != tokens.shape:
        raise ValueError(f"tokens {tokens.shape}, pred {pred.shape} and conf {conf.shape} must be equal [B, T]")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be a non-negative integer, got {count!r}")


def _reveal(tokens: jax.Array, pred: jax.Array, conf: jax.Array, count: int) -> jax.Array:
    """The rule on one block or a batch of them ([..., T])."""
    t = tokens.shape[-1]
    masked = tokens == MASK
    c = jnp.where(masked, conf.astype(jnp.float32), -jnp.inf)
    idx = jnp.arange(t)
    ci, cj = c[..., :, None], c[..., None, :]
    beats = (cj > ci) | ((cj == ci) & (idx[None, :] < idx[:, None]))  # position j outranks i
    rank = jnp.sum(beats & masked[..., None, :], axis=-1)
    return jnp.where(masked & (rank < count), pred, tokens)


def confidence_unmask_reference(
    tokens: jax.Array, pred: jax.Array, conf: jax.Array, count: int, *, interpret: bool = False
) -> jax.Array:
    """tokens, pred [B, T] int32, conf [B, T] float -> tokens with `count` more revealed per row."""
    _check(tokens, pred, conf, count)
    return _reveal(tokens, pred, conf, count)


def _kernel(tok_ref, pred_ref, conf_ref, out_ref, *, count):
    out_ref[...] = _reveal(tok_ref[...], pred_ref[...], conf_ref[...], count)


@functools.partial(jax.jit, static_argnames=("count", "interpret"))
def confidence_unmask(
    tokens: jax.Array, pred: jax.Array, conf: jax.Array, count: int, *, interpret: bool = False
) -> jax.Array:
    """Pallas kernel twin of `confidence_unmask_reference`: one program per row."""
    _check(tokens, pred, conf, count)
    b, t = tokens.shape
    spec = pl.BlockSpec((1, t), lambda i: (i, 0))
    return pl.pallas_call(
        functools.partial(_kernel, count=count),
        grid=(b,),
        in_specs=[spec, spec, spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct((b, t), jnp.int32),
        interpret=interpret,
    )(tokens.astype(jnp.int32), pred.astype(jnp.int32), conf.astype(jnp.float32))
