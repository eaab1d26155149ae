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
from jax.experimental.pallas import triton as plt

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
    """Pallas kernel twin of `confidence_unmask_reference`: one program per row. Triton's
    tiles are powers of two, so a row is padded with positions that are not masked (never
    revealed, never ranked) and cut back after."""
    _check(tokens, pred, conf, count)
    b, t = tokens.shape
    padded = pl.next_power_of_2(t)

    def pad(x, dtype):
        return jnp.pad(x.astype(dtype), ((0, 0), (0, padded - t)))

    spec = pl.BlockSpec((1, padded), lambda i: (i, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, count=count),
        grid=(b,),
        in_specs=[spec, spec, spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct((b, padded), jnp.int32),
        interpret=interpret,
        # The Triton lowering: Mosaic GPU (the default on GPU) copies blocks to shared memory in
        # multiples of 128 bytes, more than a 16-token row holds.
        compiler_params=plt.CompilerParams(num_warps=1, num_stages=1),
    )(pad(tokens, jnp.int32), pad(pred, jnp.int32), pad(conf, jnp.float32))
    return out[:, :t]
