"""The decoder's forward pass computed batch-invariantly (`attention="invariant"`): every
token's keys, values and logits are the same bits whatever shares its step (other rows, a
longer context bucket) and however its row's tokens were split into steps (prefill chunks,
one decode token, a speculative verify chunk). `pallas_kernels/invariant.py` explains how.

Each layer is three programs of fixed shapes: the token-wise part before attention (norm,
q/k/v projections, RoPE, the key transform, quantization) over tiles of ROW_TILE tokens,
`invariant_attention` over each row's keys by position, and the token-wise part after it
(output projection, MLP) over tiles again. The final norm and the logits are a fourth.
Same inputs and outputs as `models.llama.forward`, without shared-prefix attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.kv_cache import PagedKVCache
from models.llama import (
    KVUpdate,
    StepBatch,
    _attention_inputs,
    _attention_output,
    _mlp_block,
    _transform_query_key,
    attention_mass,
    embed,
    kv_update,
    rms_norm,
    rope_tables,
    vocab_logits,
    where_written,
)
from models.weights import ModelWeights
from pallas_kernels.invariant import KEY_BLOCK, invariant_attention, row_tiled


def invariant_forward(
    weights: ModelWeights,
    cache: PagedKVCache,
    tokens: jax.Array,  # [B, T] int32
    batch: StepBatch,
    *,
    cfg: ModelConfig,
    num_pages: int,
    all_logits: bool,
    taps: tuple[int, ...] = (),
    tree: tuple[jax.Array, jax.Array] | None = None,
    mass_layers: tuple[int, ...] = (),
) -> tuple[jax.Array, KVUpdate, jax.Array | None]:
    """`models.llama.forward` (its arguments, without `shared_pages`), batch-invariant."""
    b, t = tokens.shape
    n = b * t
    table, stored, page_of_pos = where_written(cache, batch, t)
    table = table[:, :num_pages]  # [B, NP]
    depth, new_mask = (None, None) if tree is None else tree
    positions = stored if tree is None else batch.start[:, None] + depth
    rope_positions = (positions if batch.offset is None else positions + batch.offset[:, None]).reshape(n)
    num_sinks = cache.num_sinks

    def rows(tree_):  # leaves [N, ...] -> [B, T, ...]
        return jax.tree.map(lambda a: a.reshape(b, t, *a.shape[1:]), tree_)

    x = embed(weights, tokens, cfg).reshape(n, -1)
    new_k, new_v, sink_k, sink_v, tapped, masses, queries = [], [], [], [], [], [], []
    for idx, lw in enumerate(weights.layers):
        with jax.named_scope(f"layer{idx}"):
            base = cfg.layer_rope_base(idx)

            def before(x_t, pos_t, lw=lw, idx=idx, base=base):  # [RT, D], [RT]
                cos, sin = rope_tables(pos_t[None], cfg.head_dim, base)
                q, k, v = _attention_inputs(x_t, lw, cfg, cos, sin, 1, False)
                if cache.key_transform is not None:
                    q, k = _transform_query_key(q, k, cache.query_transform[idx], cache.key_transform[idx])
                k_store, v_store = cache.encode(k[0], v[0], idx)
                bits = None  # bf16 bits [RT, 2, Hkv, Dh] of the keys and values, for sink positions
                if num_sinks:
                    bits = jax.lax.bitcast_convert_type(jnp.stack([k[0], v[0]], 1).astype(jnp.bfloat16), jnp.uint16)
                return q[0], k_store, v_store, bits

            q, k_store, v_store, bits = rows(row_tiled(before, x, rope_positions))
            if num_sinks:
                m = min(t, num_sinks)
                sink_k.append(bits[:, :m, 0])
                sink_v.append(bits[:, :m, 1])
            k_ctx, v_ctx = cache.gather(table, idx)  # storage [B, NP * S, Hkv, ...]
            k_ctx, v_ctx, k_new, v_new = _decoded(cache, idx, (k_ctx, v_ctx), (k_store, v_store))
            if num_sinks and cache.quantized(idx):
                # Sink positions attend to bf16 values: the slot's stored ones, the new ones.
                fresh = jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)  # [B, T, 2, Hkv, Dh]
                on_sink = (stored < num_sinks)[:, :, None, None]
                k_new, v_new = jnp.where(on_sink, fresh[:, :, 0], k_new), jnp.where(on_sink, fresh[:, :, 1], v_new)
                if num_pages:
                    stored_k, stored_v = cache.sinks(batch.slots, idx)
                    k_ctx, v_ctx = k_ctx.at[:, :num_sinks].set(stored_k), v_ctx.at[:, :num_sinks].set(stored_v)
            attn = invariant_attention(
                q, k_new, v_new, k_ctx, v_ctx, batch.start, batch.num_new, new_mask=new_mask,
                window=cfg.window(idx), positions=positions,
            ).astype(x.dtype)  # fmt: skip
            if idx in mass_layers:
                mass, query = attention_mass(q, k_store, v_store, cache, idx, table, batch, cfg, new_mask, positions)
                masses.append(mass)
                queries.append(query)

            def after(x_t, a_t, lw=lw):  # [RT, D], [RT, Hq * Dh]
                return _mlp_block(_attention_output(x_t, a_t, lw, cfg, False), lw, cfg, False)

            x = row_tiled(after, x, attn.reshape(n, -1))
            new_k.append(k_store)
            new_v.append(v_store)
            if idx in taps:
                tapped.append(x.reshape(b, t, -1))

    x = x.reshape(b, t, -1)
    if not all_logits:
        last = jnp.maximum(batch.num_new - 1, 0)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]  # [B, D]

    def head(x_t):
        return vocab_logits(rms_norm(x_t, weights.final_norm, cfg.rms_norm_eps), weights.lm_head)

    logits = row_tiled(head, x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
    update = kv_update(cache, batch, stored, page_of_pos, new_k, new_v, sink_k, sink_v, masses, queries)
    return logits, update, jnp.concatenate(tapped, axis=-1) if taps else None


def _decoded(cache: PagedKVCache, layer: int, stored, new) -> tuple[jax.Array, ...]:
    """Keys and values of `layer` as float32 from storage: the stored ones [B, S, ...] and the
    new ones [B, T, ...], decoded by one program (tiles of KEY_BLOCK vectors) when decoding is
    arithmetic, converted otherwise. Returns (k_ctx, v_ctx, k_new, v_new)."""

    def decode(k, v):
        return tuple(a.astype(jnp.float32) for a in cache.decode(k, v, layer))

    if not cache.quantized(layer):  # a conversion: exact in any shape
        return *decode(*stored), *decode(*new)
    b, s = jax.tree.leaves(stored)[0].shape[:2]
    t = jax.tree.leaves(new)[0].shape[1]
    flat = jax.tree.map(lambda a, n: jnp.concatenate([a.reshape(b * s, *a.shape[2:]), n.reshape(b * t, *n.shape[2:])]),
                        stored, new)  # fmt: skip
    k, v = row_tiled(decode, *flat, tile=KEY_BLOCK)
    return k[: b * s].reshape(b, s, *k.shape[1:]), v[: b * s].reshape(b, s, *v.shape[1:]), \
        k[b * s :].reshape(b, t, *k.shape[1:]), v[b * s :].reshape(b, t, *v.shape[1:])  # fmt: skip
