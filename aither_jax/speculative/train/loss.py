"""Stage 3 of draft training: the loss (cross-entropy with the target's greedy token mixed with its
stored distribution, weighted along the block)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.draft import (
    MASK,
    DraftConfig,
    DraftParams,
    block_forward,
    context_features,
    context_kv,
)
from models.llama import vocab_logits
from pallas_kernels.draft_attention import draft_attention_dense

# -- stage 3: training ----------------------------------------------------------------------


def position_weights(block_size: int, gamma: float) -> np.ndarray:
    """Loss weight of block positions 1..B-1: exp(-(i-1)/gamma) (early positions gate the rest)."""
    return np.exp(-np.arange(block_size - 1) / gamma).astype(np.float32)


def loss_fn(params: DraftParams, batch, *, cfg: DraftConfig, embed, lm_head, weights, inverse=None, soft_weight=0.0):
    """Weighted cross-entropy at masked positions, plus metrics (accuracy, expected tau).

    `lm_head` [Vd, D] holds the draft's rows; `inverse` [V] maps a token id to its row (-1 when
    the draft cannot produce it: such labels count as wrong and carry no loss). With
    `soft_weight` w > 0 the per-position loss is (1 - w) x cross-entropy with the target's greedy
    token + w x cross-entropy with the target's own next-token distribution (its top-k, within
    the draft's head, renormalized; the batch's `top_ids` and `top_log_probs`)."""
    tokens, hidden, anchors, reveal = batch["tokens"], batch["hidden"], batch["anchors"], batch["reveal"]
    n, length = tokens.shape
    a, b = anchors.shape[1], cfg.block_size
    feats = context_features(params, cfg, hidden)
    k_ctx, v_ctx = context_kv(params, cfg, feats, jnp.broadcast_to(jnp.arange(length), (n, length)))
    pos = anchors[..., None] + jnp.arange(b)  # [N, A, B]
    labels = jnp.take_along_axis(batch["labels"][:, None, :], pos, axis=2)  # [N, A, B]
    # The anchor is the committed token as written; the rest are the target's greedy choices.
    labels = labels.at[..., 0].set(jnp.take_along_axis(tokens, anchors, axis=1))
    inputs = jnp.where(reveal, labels, MASK).reshape(n * a, b)
    seq_of_row = jnp.repeat(jnp.arange(n), a)
    ctx_lens = anchors.reshape(n * a)

    def attend(i, q, k, v):
        return draft_attention_dense(q, k, v, k_ctx[i][seq_of_row], v_ctx[i][seq_of_row], ctx_lens)

    h = block_forward(params, cfg, embed, inputs, pos.reshape(n * a, b), attend)[:, 1:]
    logits = vocab_logits(h, lm_head)  # [R, B-1, V]
    target = labels.reshape(n * a, b)[:, 1:]
    if inverse is not None:
        target = inverse[target]
    known = target >= 0
    target = jnp.maximum(target, 0)
    lse = jax.nn.logsumexp(logits, axis=-1)
    ce = lse - jnp.take_along_axis(logits, target[..., None], axis=-1)[..., 0]
    if soft_weight:
        ids = batch["top_ids"].reshape(n * a, b - 1, -1)
        if inverse is not None:
            ids = inverse[ids]
        usable = ids >= 0
        teacher = jax.nn.softmax(jnp.where(usable, batch["top_log_probs"].reshape(ids.shape), -1e30), axis=-1)
        student = jnp.take_along_axis(logits, jnp.maximum(ids, 0), axis=-1) - lse[..., None]
        soft = -(teacher * jnp.where(usable, student, 0.0)).sum(axis=-1)
        ce = (1.0 - soft_weight) * ce + soft_weight * jnp.where(usable.any(axis=-1), soft, ce)
    masked = ~reveal.reshape(n * a, b)[:, 1:]
    w = weights[None, :] * masked * known
    loss = (ce * w).sum() / jnp.maximum(w.sum(), 1e-6)
    correct = (jnp.argmax(logits, axis=-1) == target) & known
    full = masked.all(axis=1)  # blocks with every position masked: what greedy drafting sees
    tau = 1.0 + jnp.cumprod(correct, axis=1).sum(axis=1)
    metrics = {
        "loss": loss,
        "accuracy": (correct * masked).sum() / jnp.maximum(masked.sum(), 1),
        "tau": (tau * full).sum() / jnp.maximum(full.sum(), 1),
    }
    return loss, metrics
