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
from pallas_kernels.invariant import KEY_BLOCK, by_position, invariant_attention, padded_length, row_tiled


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
    stored, page_of_pos = where_written(cache, batch, t)
    depth, new_mask = (None, None) if tree is None else tree
    positions = stored if tree is None else batch.start[:, None] + depth
    rope_positions = (positions if batch.offset is None else positions + batch.offset[:, None]).reshape(n)
    table = cache.block_tables[jnp.minimum(batch.slots, cache.max_seqs - 1)][:, :num_pages]  # [B, NP]
    size = padded_length(num_pages * cache.page_size, t)
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
            k_ctx, v_ctx = cache.gather(table, idx)
            k_rows = by_position(k_ctx, k_store, batch.start, batch.num_new, size)
            v_rows = by_position(v_ctx, v_store, batch.start, batch.num_new, size)

            def decode(k_t, v_t, idx=idx):  # a tile of positions' storage -> float32 keys, values
                return tuple(a.astype(jnp.float32) for a in cache.decode(k_t, v_t, idx))

            if cache.quantized(idx):  # decoding is arithmetic (a rotation): in fixed tiles
                flat = jax.tree.map(lambda a: a.reshape(b * size, *a.shape[2:]), (k_rows, v_rows))
                k_pos, v_pos = (a.reshape(b, size, *a.shape[1:]) for a in row_tiled(decode, *flat, tile=KEY_BLOCK))
            else:  # a conversion, exact in any shape
                k_pos, v_pos = decode(k_rows, v_rows)
            if num_sinks and cache.quantized(idx):
                # Sink positions attend to bf16 values: the slot's stored ones, the new ones.
                fresh = jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)  # [B, T, 2, Hkv, Dh]
                stored_k, stored_v = cache.sinks(batch.slots, idx)
                on_sink = (jnp.arange(size) < num_sinks)[None, :, None, None]
                sink_k_pos = by_position(stored_k, fresh[:, :, 0], batch.start, batch.num_new, size)
                sink_v_pos = by_position(stored_v, fresh[:, :, 1], batch.start, batch.num_new, size)
                k_pos, v_pos = jnp.where(on_sink, sink_k_pos, k_pos), jnp.where(on_sink, sink_v_pos, v_pos)
            attn = invariant_attention(
                q, k_pos, v_pos, batch.start, batch.num_new, new_mask=new_mask, window=cfg.window(idx),
                positions=positions,
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
    update = kv_update(cache, batch, page_of_pos, new_k, new_v, sink_k, sink_v, masses, queries)
    return logits, update, jnp.concatenate(tapped, axis=-1) if taps else None
