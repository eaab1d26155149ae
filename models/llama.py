"""The llama decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) over a paged cache,
and Gemma 3 beside it (query/key norms, post-norms, GeGLU, sliding-window layers with their own
RoPE base, scaled embeddings: the `ModelConfig` fields past the llama set).

One function serves prefill chunks and decode steps: each row of the batch brings T new
tokens (T = 1 for decode) that start at a given position and attend to the row's stored
cache plus themselves (causally), so a chunk sees the earlier chunks exactly as they were
stored. The forward pass only reads the cache and returns the new keys/values as a
`KVUpdate`; `aither_jax.device.steps` applies it in a separate donated call (see there for why).
Layers are unrolled over per-layer weight pytrees.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from models.config import ModelConfig
from models.kv_cache import NULL_PAGE, PagedKVCache
from models.weights import LayerWeights, ModelWeights
from pallas_kernels.paged_attention import (
    dot_precision,
    merge_attention,
    page_attention_mass,
    paged_attention_reference,
    shared_prefix_attention,
)
from pallas_kernels.tq_attention import Sinks, tq_paged_attention, tq_paged_attention_xla, tq_shared_prefix_attention
from pallas_kernels.turboquant import TurboQuant

ATTENTION_IMPLS = ("reference", "pallas", "xla", "invariant")


@struct.dataclass
class StepBatch:
    """Per-step metadata: which cache slot each row uses and which positions it fills."""

    slots: jax.Array  # [B] int32 cache slot per row; padding rows use max_seqs (writes dropped)
    start: jax.Array  # [B] int32 position of the row's first new token
    num_new: jax.Array  # [B] int32 valid new tokens in the row (0 for padding rows)
    # [B] int32 or None: tokens of each row held off the device before its block table
    # (bounded residency, aither_jax/core/bounded.py). Table entries, `start` and every mask
    # count only the pages the table holds; RoPE takes `start + offset`, the true position.
    offset: jax.Array | None = None


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, axis: int = -1) -> jax.Array:
    """RMSNorm of the vectors laid along `axis` (the last, or 0 for a transposed stream [D, N])."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axis, keepdims=True) + eps)
    return (x32 * jnp.expand_dims(weight, tuple(range(1, x.ndim - axis % x.ndim)))).astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, base: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin [B, T, Dh/2] in float32 for rotate-half RoPE."""
    inv_freq = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, H, Dh]; pairs dimension i with i + Dh/2 (rotate-half form)."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


# Token counts (rows x tokens per row) up to which a step runs its layers on the transposed
# residual stream [D, N]. XLA's CPU matmul is much faster as W [out, in] @ h^T [in, N] with few
# columns: SmolLM2's 30 layers' products take ~40 ms for 16 rows this way against ~62 ms as
# h @ W^T (docs/BENCHMARKS.md, decode section). From 128 rows up the transposed form is the
# slower one, so larger calls (prefill chunks) keep the usual [N, D] rows and h @ W^T.
TRANSPOSED_MAX_TOKENS = 64


def linear(h: jax.Array, w: jax.Array, *, transposed: bool) -> jax.Array:
    """h [N, in] times a weight stored [out, in] -> [N, out]; with `transposed`, h [in, N] -> [out, N]."""
    n = h.shape[1] if transposed else h.shape[0]
    h = _pad_bf16_operand(h, axis=1 if transposed else 0, column_major=transposed)
    a, b, dims = (w, h, ((1,), (0,))) if transposed else (h, w, ((1,), (1,)))
    out = jax.lax.dot_general(
        a, b, (dims, ((), ())), precision=dot_precision(h.dtype), preferred_element_type=jnp.float32
    )
    out = out[:, :n] if transposed else out[:n]
    return out.astype(h.dtype)


def _pad_bf16_operand(h: jax.Array, *, axis: int, column_major: bool) -> jax.Array:
    """The activations of a product, with one zero row (or column, along `axis`) added when the
    product is bfloat16 on CPU and would otherwise miss the matmul library: a single row, or
    (`column_major`) a transposed-stream operand of any width. Callers slice the result back.

    XLA's CPU backend hands bf16 products to its matmul library (YNNPACK, AMX or
    AVX512-BF16 where the CPU has them) only when both operands are row-major matrices of at
    least two rows; otherwise it runs a generic loop or converts the whole weight to float32
    first, both several times slower (docs/BENCHMARKS.md, decode section). A single row is a
    vector, and on the transposed stream XLA lays a norm's output out column-major for its
    reduction; the padded copy is a fresh row-major buffer of at least two rows."""
    if h.dtype != jnp.bfloat16 or not (column_major or h.shape[axis] == 1) or jax.default_backend() != "cpu":
        return h
    return jnp.pad(h, [(0, 1) if i == axis else (0, 0) for i in range(h.ndim)])


def vocab_logits(x: jax.Array, head: jax.Array) -> jax.Array:
    """Float32 logits [..., V] of hidden states x [..., D] under an LM head stored [V, D].

    The product is taken as head @ x^T ([V, N]) and transposed. The [V, D] layout is the
    embedding's, so a tied head needs no second copy. It also suits XLA's CPU matmul: with
    4-32 rows, SmolLM2's 49,152 x 576 head runs ~1.7x faster this way than as x @ [D, V], and
    one row takes the same time (docs/BENCHMARKS.md, decode section). Written as
    x @ head.T instead, XLA copies the transposed head on every call.
    """
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1]).astype(head.dtype)
    n = rows.shape[0]
    rows = _pad_bf16_operand(rows, axis=0, column_major=False)
    out = jax.lax.dot_general(
        head,
        rows,
        (((1,), (1,)), ((), ())),
        precision=dot_precision(rows.dtype),
        preferred_element_type=jnp.float32,
    )
    if jax.default_backend() == "cpu":
        # Fused into the product, the transpose makes XLA's CPU matmul write [N, V] directly,
        # which takes ~1.6x as long as the product plus a separate transpose with 2-16 rows.
        out = jax.lax.optimization_barrier(out)
    return out[:, :n].T.reshape(*lead, head.shape[0])


@struct.dataclass
class KVUpdate:
    """What a step adds to the cache; `aither_jax.device.steps.write_step` applies it in a separate call."""

    pages: jax.Array  # [B, T] int32 page of each new token (NULL_PAGE for padding)
    offsets: jax.Array  # [B, T] int32 slot within the page
    k: tuple[Any, ...]  # per layer group storage pytrees (see PagedKVCache), leaves [Lg, B, T, Hkv, ...]
    v: tuple[Any, ...]
    slots: jax.Array  # [B] int32
    start: jax.Array  # [B] int32 position of each row's first new token
    num_new: jax.Array  # [B] int32
    seq_lens: jax.Array  # [B] int32 tokens stored per row after the update
    # With sink tokens: bf16 bits [L, B, min(T, n), Hkv, Dh] of each row's first new tokens.
    sink_k: jax.Array | None = None
    sink_v: jax.Array | None = None
    # With `mass_layers`: [B, pages read] the softmax mass the new tokens put on each page
    # (`page_attention_mass`, averaged over those layers); not written anywhere.
    attention_mass: jax.Array | None = None
    # With `mass_layers`: [B, len(mass_layers) * Hkv * Dh] float32 each row's last new query
    # at each of them, averaged over the query heads of each KV head (the residency `qk`
    # scorer's queries).
    query_summary: jax.Array | None = None


def forward(
    weights: ModelWeights,
    cache: PagedKVCache,
    tokens: jax.Array,  # [B, T] int32
    batch: StepBatch,
    *,
    cfg: ModelConfig,
    num_pages: int,
    all_logits: bool,
    attention: str = "reference",
    taps: tuple[int, ...] = (),
    shared_pages: int = 0,
    tree: tuple[jax.Array, jax.Array] | None = None,
    mass_layers: tuple[int, ...] = (),
) -> tuple[jax.Array, KVUpdate, jax.Array | None]:
    """Runs T new tokens per row through the model; reads the cache, returns what to write.

    Args:
        num_pages: how many block-table entries attention reads per row after the shared
            ones (a shape bucket that must cover every row's final length).
        shared_pages: leading block-table entries that every row holds (the same pages, all
            fully stored: a prefix-cache hit such as a common system prompt). Attention reads
            them once for the whole batch (`shared_prefix_attention`) and merges the result
            with each row's attention over its own pages. 0 = none. With sink tokens the
            shared part leaves out the sink positions and each row's stored sinks (which
            must lie inside the shared pages) are merged as a third part.
        all_logits: return logits for every position ([B, T, V]); otherwise only for each
            row's last valid token ([B, V]).
        attention: "pallas" quantizes new keys/values with the Pallas encoder and reads
            TurboQuant layers with the rotated-domain kernel (other layers, and every layer of
            unquantized or QJL formats, use the reference); "xla" reads the same layers with
            the rotated-domain algorithm in jnp (for backends without the kernels); "reference"
            encodes with the jnp codec, decodes the pages and runs the jnp reference everywhere;
            "invariant" is `models.llama_invariant.invariant_forward`'s (the step functions pick it).
        tree: a draft tree per row (speculative verification), as (depth [B, T], ancestor
            mask [B, T, T]) from `tree_depth_and_mask`: new token i sits at position start +
            depth[i] and attends to its ancestors and itself instead of every earlier new
            token. The update still stores entry j at position start + j, so the caller
            reorders its entries into the accepted path (`compact_update`) before writing.
            None: a chain, as usual.
        mass_layers: layers whose attention mass per page the update carries
            (`KVUpdate.attention_mass`, for the eviction advisor): computed beside the
            layer's attention from its decoded keys over every page the row holds, by
            `page_attention_mass`, whichever path the attention itself takes.

    Returns:
        (logits float32, the new tokens' keys/values and where they go).
    """
    b, t = tokens.shape
    page_size = cache.page_size
    if shared_pages and cfg.window_layers:
        raise ValueError("shared-prefix attention does not apply sliding windows; run windowed models without it")
    if shared_pages and shared_pages * page_size < cache.num_sinks:
        raise ValueError(f"shared pages must hold the {cache.num_sinks} sink tokens, got {shared_pages} pages")
    if attention == "invariant":
        raise ValueError("batch-invariant steps run models.llama_invariant.invariant_forward, not forward")
    table, stored, page_of_pos = where_written(cache, batch, t)  # [B, MP]; [B, T] where each entry is written
    depth, new_mask = (None, None) if tree is None else tree
    positions = stored if tree is None else batch.start[:, None] + depth  # for masks (table coordinates)
    rope_positions = positions if batch.offset is None else positions + batch.offset[:, None]
    read_table = table[:, shared_pages : shared_pages + num_pages]  # [B, NP]
    shared = table[0, :shared_pages]  # row 0 is never padding
    shared_len = shared_pages * page_size
    ctx_lens = batch.start - shared_len  # stored tokens per row past the shared pages
    rope = {base: rope_tables(rope_positions, cfg.head_dim, base) for base in cfg.rope_bases}
    # Sliding-window layers read only the pages their window reaches (see `_window_reads`).
    windowed = None
    if cfg.window_layers and not cache.num_sinks:
        windowed = _window_reads(read_table, ctx_lens, positions, cfg.sliding_window, page_size)

    transposed = _transposed_stream(b * t)
    x = _to_stream(embed(weights, tokens, cfg).reshape(b * t, -1), transposed)  # [N, D], or [D, N] transposed
    new_k, new_v, sink_k, sink_v, tapped, masses, queries = [], [], [], [], [], [], []
    for idx, lw in enumerate(weights.layers):
        with jax.named_scope(f"layer{idx}"):
            window = cfg.window(idx)
            layer_table, layer_ctx, layer_pos = read_table, ctx_lens, positions
            if window is not None and windowed is not None:
                layer_table, layer_ctx, layer_pos = windowed
            q, k, v = _attention_inputs(x, lw, cfg, *rope[cfg.layer_rope_base(idx)], b, transposed)
            if cache.key_transform is not None:  # the -pc formats: q . k unchanged, keys reshaped
                q, k = _transform_query_key(q, k, cache.query_transform[idx], cache.key_transform[idx])
            k_store, v_store = cache.encode(k, v, idx, kernel=attention == "pallas")
            if idx in mass_layers:
                held = table[:, : shared_pages + num_pages]
                mass, query = attention_mass(q, k_store, v_store, cache, idx, held, batch, cfg, new_mask, positions)
                masses.append(mass)
                queries.append(query)
            sinks = None
            if cache.num_sinks:
                # Sink positions are kept in bf16: the bits go to the per-slot buffer, and a
                # quantized layer attends to the bf16 values instead of the decoded ones.
                k16, v16 = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
                n = min(t, cache.num_sinks)
                sink_k.append(jax.lax.bitcast_convert_type(k16[:, :n], jnp.uint16))
                sink_v.append(jax.lax.bitcast_convert_type(v16[:, :n], jnp.uint16))
                if cache.quantized(idx):
                    stored_k, stored_v = cache.sinks(batch.slots, idx)
                    sinks = Sinks(stored_k, stored_v, k16.astype(jnp.float32), v16.astype(jnp.float32))
            # With shared pages the row's own part starts past the sinks: they become a part
            # of their own, and the shared part leaves out their quantized copies.
            row_sinks = None if shared_pages else sinks
            skip = cache.num_sinks if sinks is not None else 0
            if attention != "reference" and _kernel_reads(cache, idx):
                k_pool, v_pool, ki, vi = cache.layer_pools(idx)
                rotated = tq_paged_attention if attention == "pallas" else tq_paged_attention_xla
                codecs = dict(k_codec=cache.k_groups.codec(idx), v_codec=cache.v_groups.codec(idx), v_layer=vi)
                attn = rotated(
                    q,
                    k_store,
                    v_store,
                    k_pool,
                    v_pool,
                    layer_table,
                    ki,
                    layer_ctx,
                    batch.num_new,
                    sinks=row_sinks,
                    return_lse=bool(shared_pages),
                    new_mask=new_mask,
                    window=window,
                    positions=layer_pos,
                    **codecs,
                )
                if shared_pages:
                    kernel = attention == "pallas"
                    prefix = tq_shared_prefix_attention(
                        q, k_pool, v_pool, shared, ki, shared_len, skip_first=skip, kernel=kernel, **codecs
                    )
            else:
                # Every position attends to keys/values as stored, the new ones included.
                k, v = cache.decode(k_store, v_store, idx)
                k_ctx, v_ctx = cache.read(layer_table, idx)
                if row_sinks is not None:
                    k, v = row_sinks.apply_new(k, v, batch.start)
                    k_ctx, v_ctx = row_sinks.apply_ctx(k_ctx, v_ctx)
                attn = paged_attention_reference(
                    q,
                    k.astype(q.dtype),
                    v.astype(q.dtype),
                    k_ctx,
                    v_ctx,
                    layer_ctx,
                    batch.num_new,
                    return_lse=bool(shared_pages),
                    new_mask=new_mask,
                    window=window,
                    positions=layer_pos,
                )
                if shared_pages:
                    k_sh, v_sh = cache.read(shared[None], idx)
                    prefix = shared_prefix_attention(q, k_sh[0, skip:], v_sh[0, skip:], shared_len - skip)
            if shared_pages:
                attn = merge_attention([attn, prefix] + ([sinks.attend(q)] if sinks is not None else []))
            x = _mlp_block(_attention_output(x, attn, lw, cfg, transposed), lw, cfg, transposed)
            new_k.append(k_store)
            new_v.append(v_store)
            if idx in taps:
                tapped.append(_to_stream(x, transposed).reshape(b, t, -1))

    x = _to_stream(rms_norm(x, weights.final_norm, cfg.rms_norm_eps, axis=0 if transposed else -1), transposed)
    x = x.reshape(b, t, -1)
    if not all_logits:
        last = jnp.maximum(batch.num_new - 1, 0)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]  # [B, D]
    logits = vocab_logits(x, weights.lm_head)
    update = kv_update(cache, batch, stored, page_of_pos, new_k, new_v, sink_k, sink_v, masses, queries)
    return logits, update, jnp.concatenate(tapped, axis=-1) if taps else None


def where_written(cache: PagedKVCache, batch: StepBatch, t: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(each row's block table [B, MP], the position each new token is written at [B, T], its
    page [B, T])."""
    stored = batch.start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    table = cache.block_tables[jnp.minimum(batch.slots, cache.max_seqs - 1)]
    index = jnp.minimum(stored // cache.page_size, cache.max_pages_per_seq - 1)
    return table, stored, jnp.take_along_axis(table, index, axis=1)


def kv_update(cache, batch, stored, page_of_pos, new_k, new_v, sink_k, sink_v, masses, queries) -> KVUpdate:
    """A step's `KVUpdate` from where its tokens go (`where_written`), its per-layer storage
    pytrees (leaves [B, T, Hkv, ...]), sink bits, and the attention masses and query summaries
    of the `mass_layers`."""
    valid = jnp.arange(stored.shape[1], dtype=jnp.int32)[None, :] < batch.num_new[:, None]  # [B, T]
    k_groups, v_groups = cache.stack_layers(new_k, new_v)
    return KVUpdate(
        pages=jnp.where(valid, page_of_pos, NULL_PAGE),
        offsets=stored % cache.page_size,
        k=k_groups,
        v=v_groups,
        slots=batch.slots,
        start=batch.start,
        num_new=batch.num_new,
        seq_lens=batch.start + batch.num_new,
        sink_k=jnp.stack(sink_k) if sink_k else None,
        sink_v=jnp.stack(sink_v) if sink_v else None,
        attention_mass=sum(masses) / len(masses) if masses else None,
        query_summary=jnp.concatenate(queries, axis=-1) if queries else None,
    )


def attention_mass(q, k_store, v_store, cache, layer, held, batch, cfg, new_mask, positions):
    """For a `mass_layers` layer: ([B, pages held] the softmax mass the new tokens put on each
    page of `held` [B, NP], [B, Hkv * Dh] the row's last new query averaged over the query
    heads of each KV head)."""
    k_held, _ = cache.read(held, layer)
    new_k = cache.decode(k_store, v_store, layer)[0]
    window = cfg.window(layer)
    mass = page_attention_mass(
        q, new_k, k_held, batch.start, batch.num_new, cache.page_size, new_mask=new_mask, window=window,
        positions=positions,
    )  # fmt: skip
    b = q.shape[0]
    last = jnp.maximum(batch.num_new - 1, 0)
    q_last = jnp.take_along_axis(q, last[:, None, None, None], axis=1)[:, 0].astype(jnp.float32)
    return mass, q_last.reshape(b, cfg.num_kv_heads, -1, cfg.head_dim).mean(axis=2).reshape(b, -1)


def tree_depth_and_mask(parents: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Draft trees [B, T] of parent indices (-1 for the root; parents[i] < i) -> each node's
    depth [B, T] int32 and the ancestor mask [B, T(node), T(other)]: whether `other` is the
    node itself or one of its ancestors. A chain (parents[i] = i - 1) gives depth i and the
    causal mask."""
    b, t = parents.shape
    node = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = node[:, :, None] == node[:, None, :]
    depth = jnp.zeros((b, t), jnp.int32)
    cur = node
    for _ in range(t - 1):  # walk every node up to the root, one parent a step
        cur = jnp.where(cur >= 0, jnp.take_along_axis(parents, jnp.maximum(cur, 0), axis=1), -1)
        depth += (cur >= 0).astype(jnp.int32)
        mask |= (cur[:, :, None] == node[:, None, :]) & (cur[:, :, None] >= 0)
    return depth, mask


def compact_update(update: KVUpdate, path: jax.Array) -> KVUpdate:
    """Reorders a tree step's new keys/values into the accepted path: path [B, T] lists which
    new token goes to entry j (position start + j): the accepted path first, then anything
    (those positions lie past the new length and are overwritten later)."""

    def take(leaf, order=path):  # [Lg, B, T, ...]: tokens in path order
        index = order.reshape(1, *order.shape, *([1] * (leaf.ndim - 3)))
        return jnp.take_along_axis(leaf, index, axis=2)

    sink = {}
    if update.sink_k is not None:
        # Sink positions are the first n; a row that reaches them verifies a chain (path i = i).
        n = update.sink_k.shape[2]
        order = jnp.minimum(path[:, :n], n - 1)
        sink = {"sink_k": take(update.sink_k, order), "sink_v": take(update.sink_v, order)}
    return update.replace(k=jax.tree_util.tree_map(take, update.k), v=jax.tree_util.tree_map(take, update.v), **sink)


def embed(weights: ModelWeights, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Token embeddings [..., D]; Gemma scales them by sqrt(D), rounded to the weights' dtype
    first as its reference implementation does."""
    x = weights.embed[tokens]
    return x if cfg.embed_scale == 1.0 else x * jnp.asarray(cfg.embed_scale, x.dtype)


def _transposed_stream(num_tokens: int) -> bool:
    """Whether a call runs its layers on the transposed stream: calls of at most
    TRANSPOSED_MAX_TOKENS tokens on CPU (bfloat16 products there pad their activations,
    `_pad_bf16_operand`). GPU matmuls read either operand transposed in place, so there the
    layout buys nothing."""
    return num_tokens <= TRANSPOSED_MAX_TOKENS and jax.default_backend() == "cpu"


def _to_stream(x: jax.Array, transposed: bool) -> jax.Array:
    """Rows [N, D] to the residual stream's layout, or back (the same transpose)."""
    return x.T if transposed else x


def _attention_inputs(
    x: jax.Array, lw: LayerWeights, cfg: ModelConfig, cos: jax.Array, sin: jax.Array, b: int, transposed: bool
):
    """One layer's q [B, T, Hq, Dh] and k [B, T, Hkv, Dh] after RoPE, and v [B, T, Hkv, Dh],
    from the residual stream x ([B T, D], or [D, B T] when `transposed`)."""
    h = rms_norm(x, lw.attn_norm, cfg.rms_norm_eps, axis=0 if transposed else -1)
    qkv = linear(h, lw.wqkv, transposed=transposed)
    if transposed:
        # Keeps the product [out, N]. Otherwise XLA folds the transpose below into it, and the
        # resulting [N, out] product misses the CPU matmul library for a generic loop that
        # took ~260 against ~90 us per layer with 8 rows (docs/BENCHMARKS.md, decode section).
        qkv = jax.lax.optimization_barrier(qkv)
    qkv = _to_stream(qkv, transposed).reshape(b, -1, lw.wqkv.shape[0])
    q, k, v = jnp.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
    t = qkv.shape[1]
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q, k = rms_norm(q, lw.q_norm, cfg.rms_norm_eps), rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)


def _attention_output(x: jax.Array, attn: jax.Array, lw: LayerWeights, cfg: ModelConfig, transposed: bool) -> jax.Array:
    """The residual stream plus the output projection of attention [B, T, Hq, Dh] (normed first
    with post-norms)."""
    rows = attn.reshape(-1, lw.wo.shape[1])
    out = linear(_to_stream(rows, transposed), lw.wo, transposed=transposed)
    if cfg.post_norms:
        out = rms_norm(out, lw.post_attn_norm, cfg.rms_norm_eps, axis=0 if transposed else -1)
    return x + out


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def _mlp_block(x: jax.Array, lw: LayerWeights, cfg: ModelConfig, transposed: bool) -> jax.Array:
    """The residual stream after one layer's gated MLP block (SwiGLU, or GeGLU for Gemma)."""
    axis = 0 if transposed else -1
    h = rms_norm(x, lw.mlp_norm, cfg.rms_norm_eps, axis=axis)
    gate, up = jnp.split(linear(h, lw.w_gate_up, transposed=transposed), 2, axis=axis)
    out = linear(ACTIVATIONS[cfg.activation](gate) * up, lw.w_down, transposed=transposed)
    if cfg.post_norms:
        out = rms_norm(out, lw.post_mlp_norm, cfg.rms_norm_eps, axis=axis)
    return x + out


def _transform_query_key(q: jax.Array, k: jax.Array, q_mat: jax.Array, k_mat: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q [B, T, Hq, Dh] @ q_mat[kv head of each query head], k [B, T, Hkv, Dh] @ k_mat [Hkv, Dh, Dh]."""
    b, t, hq, dh = q.shape
    hkv = k.shape[2]
    hi = jax.lax.Precision.HIGHEST
    qg = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, dh)
    q = jnp.einsum("bthgd,hde->bthge", qg, q_mat, precision=hi).reshape(b, t, hq, dh).astype(q.dtype)
    k = jnp.einsum("bthd,hde->bthe", k.astype(jnp.float32), k_mat, precision=hi).astype(k.dtype)
    return q, k


def window_pages(window: int, page_size: int) -> int:
    """The most pages a row's stored keys within a window of its queries can span: the first
    new token at position p sees stored keys p - window + 1 .. p - 1, and later ones fewer."""
    return -(-(window - 1) // page_size) + 1


def _window_reads(read_table, ctx_lens, positions, window: int, page_size: int):
    """What a sliding-window layer reads: each row's block table from the page holding the
    first key its first new token sees, `window_pages` pages of it (fewer when the bucket
    holds fewer), with the stored-length and query positions moved to that page's start.
    The window mask depends on position differences only, so attention over the shifted read
    equals attention over the whole table; the pages behind the window are never read.

    Returns:
        (table [B, NW], ctx_lens [B], positions [B, T]) for the layer's attention.
    """
    num_pages = read_table.shape[1]
    count = min(num_pages, window_pages(window, page_size))
    first = jnp.clip((jnp.min(positions, axis=1) - window + 1) // page_size, 0, num_pages - count)  # [B]
    table = jnp.take_along_axis(read_table, first[:, None] + jnp.arange(count, dtype=jnp.int32)[None, :], axis=1)
    shift = first * page_size
    return table, ctx_lens - shift, positions - shift[:, None]


def _kernel_reads(cache: PagedKVCache, layer: int) -> bool:
    """Whether the rotated-domain kernel can read this layer's pages (TurboQuant keys and
    values, no QJL residual, not split-group)."""
    codecs = cache.k_groups.codec(layer), cache.v_groups.codec(layer)
    return all(isinstance(c, TurboQuant) and not c.qjl for c in codecs)


def queries_and_keys(weights: ModelWeights, tokens: jax.Array, *, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Post-RoPE queries [L, T, Hq, Dh] and keys [L, T, Hkv, Dh] of every layer for one sequence
    of tokens [T], with plain causal attention and no cache (for fitting key transforms), in
    the weights' dtype."""
    t = tokens.shape[0]
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    rope = {base: rope_tables(positions, cfg.head_dim, base) for base in cfg.rope_bases}
    zero, length = jnp.zeros((1,), jnp.int32), jnp.full((1,), t, jnp.int32)
    transposed = _transposed_stream(t)
    x = _to_stream(embed(weights, tokens, cfg), transposed)
    empty = jnp.zeros((1, 0, cfg.num_kv_heads, cfg.head_dim), x.dtype)
    queries, keys = [], []
    for idx, lw in enumerate(weights.layers):
        q, k, v = _attention_inputs(x, lw, cfg, *rope[cfg.layer_rope_base(idx)], 1, transposed)
        attn = paged_attention_reference(q, k, v, empty, empty, zero, length, window=cfg.window(idx))
        x = _mlp_block(_attention_output(x, attn, lw, cfg, transposed), lw, cfg, transposed)
        queries.append(q[0])
        keys.append(k[0])
    return jnp.stack(queries), jnp.stack(keys)
