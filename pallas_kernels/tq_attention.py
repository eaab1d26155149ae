"""Attention over TurboQuant-packed KV pages, computed in the rotated domain.

A stored key is k = n_k * c_k[idx] @ R_k (codes idx, norm n_k, codebook c_k, rotation R_k), so
<q, k> = n_k * <q @ R_k^T, c_k[idx]>: the query is rotated once and every score is a lookup
of codebook values times the key's norm. Values likewise: sum_j p_j v_j = (sum_j p_j n_vj
c_v[idx_j]) @ R_v, accumulated in the rotated domain and rotated back once. No page is ever
decoded into a buffer.

`tq_paged_attention` runs the stored context through a Pallas kernel, one program per (row,
KV head, split of the row's pages): it walks its pages through the block table a tile of
pages at a time, gathers each tile's codes straight from the byte planes with per-column
offsets and shifts (pallas_kernels/turboquant.py documents the planar layout), scores all
query heads of the group at once with a `dot` and keeps an online softmax. The
loop bound is the static page bucket and masking does the rest: no data-dependent control
flow. The new tokens of the step (already encoded, not yet written) and the combination of
the splits are small and done in jnp, also in the rotated domain.

`tq_paged_attention_reference` takes the same arguments, gathers and decodes the pages and
runs `paged_attention_reference`: the kernel must match it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.paged_attention import (
    DOT_PRECISIONS as TILE_DOT_PRECISIONS,
)
from pallas_kernels.paged_attention import (
    MASK_VALUE,
    causal_mask,
    context_scores,
    context_sum,
    paged_attention_reference,
    tile_dot,
)
from pallas_kernels.turboquant import TurboQuant, unpack_bits, unpack_planes

# Triton's dot wants every dimension >= 16: query blocks are padded to at least this.
_MIN_DOT = 16
# A kernel loop step reads up to this many pages, in code tiles of at most this many elements.
TILE_PAGES = 4
TILE_ELEMENTS = 4096
# ... and with the "rows" products, whose tiles stay in registers through every row's
# multiply-reduce: built for sm_90 at 32 rows x 64 pages (a pipelined 16-step loop), tiles of
# 4 pages spilled 1.6 KB a thread, 2 pages took 229 registers and 1 page 128.
ROWS_TILE_ELEMENTS = 1024
# How the kernel loads a tile's codes: "gather" reads each coordinate's byte(s) at its own
# offset; "planes" loads each byte plane contiguously, unpacks the 8 code chunks and joins them
# into one tile whose columns are in `joined_order` (the queries and outputs are permuted to it).
CODE_LOADS = ("gather", "planes")
# How the kernel's two products per tile (scores, then weights x values) are computed: one of
# `DOT_PRECISIONS` (pallas_kernels/paged_attention.py: `tile_dot`). The default, float32, was the
# faster on an H200 (2026-11-26, docs/BENCHMARKS.md "The tile kernel on an H200"): 536 against
# 1,290 us at 32 x 8192 (6:5) and 45 against 84 us at 1 x 512. Built for sm_90 a float32 tile
# step is ~1,040 FMAs against bf16x3's 48 MMAs (scripts/kernel_resources.py), but decode's 3
# query rows per KV head fill 3/16 of an MMA, and the hi/lo splits cost more than they save.
DOT_PRECISION = "float32"
# `tile_dot`'s precisions, and "rows": no matrix product at all. Each query row of the program
# multiplies the [T, Dh] key tile elementwise and sums along Dh (its scores), then sums its
# weights times the value tile along T, in float32. A decode program holds 3 query rows per KV
# head (SmolLM2), which the float32 dot pads to 16: 5.3x the FMAs, and its operands go through
# shared memory. Per row it is 2 x T x Dh FMAs on the tiles as loaded, reductions within warps.
DOT_PRECISIONS = (*TILE_DOT_PRECISIONS, "rows")
# The split sizes `default_pages_per_split` chooses from, and the programs (rows x KV heads x
# splits) a grid needs before a larger split pays. On an H200 (132 SMs, 2026-11-26,
# docs/BENCHMARKS.md "The tile kernel on an H200"): at 1 x 512 tokens (3 programs with a split
# of 64) splits of 4 were 1.6x (gathers) and 4.8x (planes) faster than splits of 64; at 32 x
# 8192 (768 programs with 64) splits of 64 were 2% and 16% faster than splits of 4.
SPLIT_SIZES = (4, 8, 16, 32, 64)
MIN_PROGRAMS = 512
# Query rows one program holds by default at head_dim 64, by `DOT_PRECISIONS` entry; wider
# heads hold proportionally fewer (`default_query_rows`).
QUERY_ROWS = {"float32": 16, "bf16x3": 64, "bf16": 64, "rows": 4}
# Query rows one kernel program of `tq_shared_prefix_attention` holds.
SHARED_QUERY_ROWS = 64


@struct.dataclass
class Sinks:
    """Unquantized values for the first n positions of each row ("sink" tokens): they replace
    the quantized copies in the pages, and the new tokens' decoded values where a new token
    falls on a sink position."""

    k: jax.Array  # [B, n, Hkv, Dh] float32 keys of positions 0..n-1 (valid below each row's ctx_len)
    v: jax.Array
    new_k: jax.Array  # [B, T, Hkv, Dh] float32 unquantized keys of the new tokens
    new_v: jax.Array

    @property
    def count(self) -> int:
        return self.k.shape[1]

    def new_mask(self, ctx_lens: jax.Array, t: int) -> jax.Array:
        """[B, T, 1, 1]: which new tokens sit on sink positions."""
        pos = ctx_lens[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        return (pos < self.count)[:, :, None, None]

    def apply_new(self, k: jax.Array, v: jax.Array, ctx_lens: jax.Array) -> tuple[jax.Array, jax.Array]:
        sink = self.new_mask(ctx_lens, k.shape[1])
        return jnp.where(sink, self.new_k.astype(k.dtype), k), jnp.where(sink, self.new_v.astype(v.dtype), v)

    def apply_ctx(self, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        n = min(self.count, k.shape[1])
        return k.at[:, :n].set(self.k[:, :n].astype(k.dtype)), v.at[:, :n].set(self.v[:, :n].astype(v.dtype))

    def attend(self, q: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Attention of queries [B, T, Hq, Dh] that all sit past the sinks over the stored
        sinks alone, with its log-sum-exp for `merge_attention` (the sinks' part when the rest
        of the context is read in other parts, as in shared-prefix attention)."""
        b, t = q.shape[:2]
        none = jnp.zeros((b, t, *self.k.shape[2:]), q.dtype)
        count = jnp.full((b,), self.count, jnp.int32)
        k, v = self.k.astype(q.dtype), self.v.astype(q.dtype)
        return paged_attention_reference(q, none, none, k, v, count, count * 0, return_lse=True)


def tq_paged_attention_reference(
    q: jax.Array,  # [B, T, Hq, Dh] queries of the new tokens (RoPE applied)
    k_new: dict[str, jax.Array],  # encoded keys of the new tokens, leaves [B, T, Hkv, ...]
    v_new: dict[str, jax.Array],
    k_pool: dict[str, jax.Array],  # the cache's key pool, leaves [P, L, S, Hkv, ...]
    v_pool: dict[str, jax.Array],
    block_table: jax.Array,  # [B, NP] int32 pages of each row, in order
    layer: jax.Array | int,  # which layer of the key pool to read (and of the value pool, unless v_layer)
    ctx_lens: jax.Array,  # [B] int32 tokens stored per row before this step
    num_new: jax.Array,  # [B] int32 valid new tokens per row
    *,
    k_codec: TurboQuant,
    v_codec: TurboQuant,
    v_layer: jax.Array | int | None = None,
    sinks: Sinks | None = None,
    pages_per_split: int = 16,
    interpret: bool | None = None,
    return_lse: bool = False,
    new_mask: jax.Array | None = None,
    window: int | None = None,
    positions: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:  # [B, T, Hq, Dh] (and [B, T, Hq])
    """Decodes the row's pages and the new tokens (sink positions from `sinks` instead), then
    plain causal GQA attention (`new_mask` [B, T, T]: another mask among the new tokens;
    `window` and `positions`: a sliding window, as in `paged_attention_reference`).
    `pages_per_split` and `interpret` are accepted for signature parity and ignored."""
    del pages_per_split, interpret
    b, num_pages = block_table.shape
    v_layer = layer if v_layer is None else v_layer

    def gather(tree, index):
        return {
            name: a[block_table, index].reshape(b, num_pages * a.shape[2], *a.shape[3:]) for name, a in tree.items()
        }

    k_ctx, v_ctx = k_codec.decode_tree(gather(k_pool, layer)), v_codec.decode_tree(gather(v_pool, v_layer))
    k, v = k_codec.decode_tree(k_new), v_codec.decode_tree(v_new)
    if sinks is not None:
        k, v = sinks.apply_new(k, v, ctx_lens)
        k_ctx, v_ctx = sinks.apply_ctx(k_ctx, v_ctx)
    return paged_attention_reference(
        q, k.astype(q.dtype), v.astype(q.dtype), k_ctx, v_ctx, ctx_lens, num_new, return_lse=return_lse,
        new_mask=new_mask, window=window, positions=positions,
    )  # fmt: skip


def tq_paged_attention(
    q: jax.Array,
    k_new: dict[str, jax.Array],
    v_new: dict[str, jax.Array],
    k_pool: dict[str, jax.Array],
    v_pool: dict[str, jax.Array],
    block_table: jax.Array,
    layer: jax.Array | int,
    ctx_lens: jax.Array,
    num_new: jax.Array,
    *,
    k_codec: TurboQuant,
    v_codec: TurboQuant,
    v_layer: jax.Array | int | None = None,
    sinks: Sinks | None = None,
    pages_per_split: int | None = None,
    pages_per_step: int | None = None,
    code_loads: str | None = None,
    dot_precision: str = DOT_PRECISION,
    query_rows: int | None = None,
    interpret: bool | None = None,
    return_lse: bool = False,
    new_mask: jax.Array | None = None,
    window: int | None = None,
    positions: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Causal GQA attention of the new tokens over the packed pages plus themselves (see the
    module doc). Same arguments and result as `tq_paged_attention_reference`; with
    `return_lse` also the log-sum-exp [B, T, Hq] for `paged_attention.merge_attention`.
    `new_mask` [B, T, T] replaces the causal mask among the new tokens (a draft tree).
    `window`: a sliding window, keys at most window - 1 positions behind their query (stored
    key j at position j, new token t at `positions[b, t]`, default ctx_lens[b] + t).

    Args:
        pages_per_split: pages one kernel program walks (split-K: a row's pages are shared
            among ceil(NP / pages_per_split) programs whose partial softmaxes are merged);
            default: `default_pages_per_split`.
        pages_per_step: pages one loop step of a program reads as one tile; must divide
            `pages_per_split` (default: `default_pages_per_step`).
        code_loads: how a tile's codes are loaded, one of `CODE_LOADS` (same result); default:
            `default_code_loads`.
        dot_precision: how the kernel multiplies its tiles, one of `DOT_PRECISIONS`.
        query_rows: the most query rows (new tokens x query heads of a KV head) one program
            holds, a power of two (>= 16 for the products `tile_dot` computes); more go to
            further programs, which read the same pages (default: `default_query_rows`).
        interpret: run the kernel in the Pallas interpreter (default: on CPU).
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    args = (q, k_new, v_new, k_pool, v_pool, block_table, layer, ctx_lens, num_new)
    return _checked_call(
        args,
        k_codec,
        v_codec,
        v_layer,
        sinks,
        pages_per_split,
        True,
        interpret,
        return_lse,
        pages_per_step=pages_per_step,
        code_loads=code_loads,
        dot_precision=dot_precision,
        query_rows=query_rows,
        new_mask=new_mask,
        window=window,
        positions=positions,
    )


def tq_paged_attention_xla(
    q: jax.Array,
    k_new: dict[str, jax.Array],
    v_new: dict[str, jax.Array],
    k_pool: dict[str, jax.Array],
    v_pool: dict[str, jax.Array],
    block_table: jax.Array,
    layer: jax.Array | int,
    ctx_lens: jax.Array,
    num_new: jax.Array,
    *,
    k_codec: TurboQuant,
    v_codec: TurboQuant,
    v_layer: jax.Array | int | None = None,
    sinks: Sinks | None = None,
    pages_per_split: int = 16,
    interpret: bool | None = None,
    return_lse: bool = False,
    new_mask: jax.Array | None = None,
    window: int | None = None,
    positions: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The rotated-domain algorithm of `tq_paged_attention` in plain jnp, for backends without
    a Pallas lowering (the CPU serving path): the gathered codes become codebook values, never
    rotated back, so each stored key costs a lookup and a dot with the rotated query instead
    of the reference's d x d rotation. Same arguments and result as the reference, sliding
    `window` included; `pages_per_split` and `interpret` are accepted for signature parity
    and ignored."""
    del interpret
    args = (q, k_new, v_new, k_pool, v_pool, block_table, layer, ctx_lens, num_new)
    return _checked_call(
        args, k_codec, v_codec, v_layer, sinks, pages_per_split, False, False, return_lse, new_mask=new_mask,
        window=window, positions=positions,
    )  # fmt: skip


def tq_shared_prefix_attention(
    q: jax.Array,  # [B, T, Hq, Dh] queries of every row (RoPE applied)
    k_pool: dict[str, jax.Array],
    v_pool: dict[str, jax.Array],
    pages: jax.Array,  # [NP] int32 pages of a prefix every row shares
    layer: jax.Array | int,
    length: int,  # valid prefix positions
    *,
    k_codec: TurboQuant,
    v_codec: TurboQuant,
    v_layer: jax.Array | int | None = None,
    skip_first: int = 0,
    kernel: bool = False,
    pages_per_split: int = 16,
    interpret: bool | None = None,
    rows_per_program: int | None = None,
) -> tuple[jax.Array, jax.Array]:  # [B, T, Hq, Dh], [B, T, Hq] float32
    """Every query of every row over one shared run of packed pages, in the rotated domain.

    The jnp path reads the pages once for the whole batch, as one row holding all rows'
    queries. The kernel (`kernel`) holds a program's queries in registers, so there the
    (row, token) pairs go `rows_per_program` at a time (default: as many as make
    SHARED_QUERY_ROWS query rows with the group's heads) and the pages are read once per
    such chunk. Positions below `skip_first` are left out (sink tokens, which every row
    reads unquantized from its own buffer). Returns the output and its log-sum-exp for
    `paged_attention.merge_attention`.
    """
    b, t, hq, dh = q.shape
    hkv = k_pool["codes"].shape[3]
    if not 0 <= skip_first <= length:
        raise ValueError(f"skip_first must be in [0, length={length}], got {skip_first}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    n = b * t
    per = n if not kernel else min(n, rows_per_program or max(1, SHARED_QUERY_ROWS // (hq // hkv)))
    r = -(-n // per)
    qs = jnp.pad(q.reshape(n, hq, dh), ((0, r * per - n), (0, 0), (0, 0))).reshape(r, per, hq, dh)
    none = {name: jnp.zeros((r, per, hkv, *a.shape[4:]), a.dtype) for name, a in k_pool.items()}
    none_v = {name: jnp.zeros((r, per, hkv, *a.shape[4:]), a.dtype) for name, a in v_pool.items()}
    zero = jnp.zeros((r,), jnp.int32)
    table = jnp.broadcast_to(pages[None], (r, pages.shape[0]))
    args = (qs, none, none_v, k_pool, v_pool, table, layer, zero + length, zero)
    out, lse = _checked_call(
        args, k_codec, v_codec, v_layer, None, pages_per_split, kernel, interpret, True, skip_first
    )
    return out.reshape(r * per, hq, dh)[:n].reshape(b, t, hq, dh), lse.reshape(r * per, hq)[:n].reshape(b, t, hq)


def _checked_call(
    args,
    k_codec,
    v_codec,
    v_layer,
    sinks,
    pages_per_split,
    kernel,
    interpret,
    return_lse=False,
    skip_first=0,
    pages_per_step=None,
    code_loads="gather",
    dot_precision=DOT_PRECISION,
    query_rows=None,
    new_mask=None,
    window=None,
    positions=None,
):
    """Validates the public arguments and runs the jitted body: the stored context through the
    kernel (`kernel`) or the jnp path; stored positions below `skip_first` (or the sinks'
    count) are left out, and with a `window` those too far behind each query.
    `pages_per_split`, `code_loads` and `query_rows` None take `default_pages_per_split`,
    `default_code_loads` and `default_query_rows`."""
    q, k_new, v_new, k_pool, v_pool, block_table, layer, ctx_lens, num_new = args
    _check_args(q, k_new, v_new, k_pool, v_pool, block_table, ctx_lens, num_new, k_codec, v_codec, pages_per_split)
    if code_loads is None:
        code_loads = default_code_loads(k_codec.bits, v_codec.bits)
    if code_loads not in CODE_LOADS:
        raise ValueError(f"code_loads must be one of {CODE_LOADS}, got {code_loads!r}")
    if dot_precision not in DOT_PRECISIONS:
        raise ValueError(f"dot_precision must be one of {DOT_PRECISIONS}, got {dot_precision!r}")
    if query_rows is None:
        query_rows = default_query_rows(dot_precision, q.shape[3])
    least = _min_rows(dot_precision)
    if not isinstance(query_rows, int) or query_rows < least or query_rows & (query_rows - 1):
        raise ValueError(f"query_rows must be a power of two >= {least}, got {query_rows!r}")
    hkv = k_pool["codes"].shape[3]
    if pages_per_split is None:  # a program per (row, KV head, query block, split)
        _, q_blocks = _query_blocks(q.shape[1] * (q.shape[2] // hkv), query_rows, dot_precision)
        pages_per_split = default_pages_per_split(q.shape[0] * q_blocks, hkv, block_table.shape[1])
    if pages_per_step is not None and (
        not isinstance(pages_per_step, int) or pages_per_step < 1 or pages_per_split % pages_per_step
    ):
        raise ValueError(f"pages_per_step must be a positive divisor of pages_per_split, got {pages_per_step!r}")
    layers = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.asarray(layer if v_layer is None else v_layer, jnp.int32)])
    b, t = q.shape[:2]
    if new_mask is not None and new_mask.shape != (b, t, t):
        raise ValueError(f"new_mask must be [B={b}, T={t}, T={t}], got {new_mask.shape}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        if positions is None:
            positions = ctx_lens[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        if positions.shape != (b, t):
            raise ValueError(f"positions must be [B={b}, T={t}], got {positions.shape}")
    return _tq_paged_attention(
        *args[:6],
        layers,
        ctx_lens,
        num_new,
        sinks,
        new_mask=new_mask,
        positions=positions if window is not None else None,
        window=window,
        k_codec=k_codec,
        v_codec=v_codec,
        pages_per_split=pages_per_split if kernel else None,
        pages_per_step=pages_per_step,
        code_loads=code_loads,
        dot_precision=dot_precision,
        query_rows=query_rows,
        interpret=interpret,
        return_lse=return_lse,
        skip_first=skip_first,
    )


def _check_args(q, k_new, v_new, k_pool, v_pool, block_table, ctx_lens, num_new, k_codec, v_codec, pps) -> None:
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, Hq, Dh], got shape {q.shape}")
    b, t, hq, dh = q.shape
    for name, codec in (("k_codec", k_codec), ("v_codec", v_codec)):
        if not isinstance(codec, TurboQuant):
            raise ValueError(f"{name} must be a TurboQuant codec, got {type(codec).__name__}")
        if codec.head_dim != dh:
            raise ValueError(f"{name} has head_dim {codec.head_dim} but q has head_dim {dh}")
        if codec.qjl:
            raise ValueError(f"{name} uses QJL, which the rotated-domain kernel does not read; use the reference")
    for name, tree in (("k_pool", k_pool), ("v_pool", v_pool), ("k_new", k_new), ("v_new", v_new)):
        if not isinstance(tree, dict) or "codes" not in tree or "norms" not in tree:
            raise ValueError(f"{name} must be a TurboQuant storage dict with 'codes' and 'norms'")
    hkv = k_pool["codes"].shape[3]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if k_new["codes"].shape[:3] != (b, t, hkv) or v_new["codes"].shape[:3] != (b, t, hkv):
        raise ValueError(f"k_new/v_new codes must start with [B, T, Hkv] = {(b, t, hkv)}")
    if block_table.ndim != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table must be [B={b}, NP], got shape {block_table.shape}")
    if ctx_lens.shape != (b,) or num_new.shape != (b,):
        raise ValueError(f"ctx_lens and num_new must be [B={b}], got {ctx_lens.shape} and {num_new.shape}")
    if pps is not None and (not isinstance(pps, int) or pps < 1):
        raise ValueError(f"pages_per_split must be a positive int, got {pps!r}")


_STATIC = (
    "k_codec",
    "v_codec",
    "pages_per_split",
    "pages_per_step",
    "code_loads",
    "dot_precision",
    "query_rows",
    "interpret",
    "return_lse",
    "skip_first",
    "window",
)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _tq_paged_attention(
    q,
    k_new,
    v_new,
    k_pool,
    v_pool,
    block_table,
    layer,
    ctx_lens,
    num_new,
    sinks,
    *,
    k_codec,
    v_codec,
    pages_per_split,
    interpret,
    return_lse=False,
    skip_first=0,
    pages_per_step=None,
    code_loads="gather",
    dot_precision=DOT_PRECISION,
    query_rows=None,
    new_mask=None,
    positions=None,
    window=None,
):
    b, t, hq, dh = q.shape
    hkv = k_pool["codes"].shape[3]
    group = hq // hkv
    # With a window: [B, T, K] which of K keys at `key_pos` [B or 1, K] each new token sees.
    in_window = None if window is None else (lambda key_pos: positions[:, :, None] - key_pos[:, None, :] < window)
    # Each query row's position, (token, head) pairs in order, for the stored context's window.
    q_pos = None if window is None else jnp.repeat(positions, group, axis=1)  # [B, T x G]
    scale = dh**-0.5
    rk, rv = jnp.asarray(k_codec.rotation_matrix), jnp.asarray(v_codec.rotation_matrix)
    hi = jax.lax.Precision.HIGHEST

    # Rotate the queries into the keys' domain once, scale folded in: [B, T, Hkv, G, Dh].
    q_rot = jnp.einsum("bthd,ed->bthe", q.astype(jnp.float32), rk, precision=hi) * scale
    q_rot = q_rot.reshape(b, t, hkv, group, dh)

    # Stored context: one query block per (row, KV head) holding its T x G queries.
    num_q = t * group
    q_blocks = jnp.moveaxis(q_rot, 2, 1).reshape(b, hkv, num_q, dh)
    num_sinks = skip_first if sinks is None else sinks.count
    if block_table.shape[1] == 0:  # nothing stored (a fresh prompt's first chunk): no context part
        acc = jnp.zeros((b, hkv, 0, num_q, dh), jnp.float32)
        m = sums = jnp.zeros((b, hkv, 0, num_q), jnp.float32)
    elif pages_per_split is None:  # the jnp path: the whole context as one split
        acc, m, sums = _context_partials_jnp(
            q_blocks, k_pool, v_pool, block_table, layer, ctx_lens, k_codec, v_codec, num_sinks, q_pos, window
        )
    else:
        rows, num_blocks = _query_blocks(num_q, query_rows or default_query_rows(dot_precision, dh), dot_precision)
        padded_q = num_blocks * rows
        q_blocks = jnp.pad(q_blocks, ((0, 0), (0, 0), (0, padded_q - num_q), (0, 0)))
        num_pages = block_table.shape[1]
        num_splits = -(-num_pages // pages_per_split)
        table = jnp.pad(block_table, ((0, 0), (0, num_splits * pages_per_split - num_pages)))
        q_pos = jnp.zeros((b, num_q), jnp.int32) if q_pos is None else q_pos  # the kernel reads it with a window
        acc, m, sums = _context_partials(
            q_blocks,
            k_pool,
            v_pool,
            table,
            layer,
            ctx_lens,
            k_codec,
            v_codec,
            pages_per_split,
            num_sinks,
            interpret,
            pages_per_step,
            code_loads,
            dot_precision,
            rows,
            jnp.pad(q_pos, ((0, 0), (0, padded_q - num_q))),
            window,
        )  # [B, Hkv, NS, Qp, Dh], [B, Hkv, NS, Qp] x 2
    num_splits = acc.shape[2]
    acc, m, sums = (x[:, :, :, :num_q].reshape(b, hkv, num_splits, t, group, *x.shape[4:]) for x in (acc, m, sums))

    # New tokens: causal among themselves (or as `new_mask` says), in the rotated domain.
    k_vals = _rotated_values(k_new, k_codec)  # [B, T, Hkv, Dh]
    v_vals = _rotated_values(v_new, v_codec)
    if sinks is not None:
        on_sink = sinks.new_mask(ctx_lens, t)
        k_vals = jnp.where(on_sink, jnp.einsum("bthd,ed->bthe", sinks.new_k, rk, precision=hi), k_vals)
        v_vals = jnp.where(on_sink, jnp.einsum("bthd,ed->bthe", sinks.new_v, rv, precision=hi), v_vals)
    s_new = jnp.einsum("bthgd,buhd->bhtgu", q_rot, k_vals, precision=hi)  # [B, Hkv, T, G, T]
    new_valid = jnp.arange(t)[None, :] < num_new[:, None]  # [B, T]
    among_new = causal_mask(t)[None] if new_mask is None else new_mask  # [B or 1, T(query), T(key)]
    among_new = among_new & new_valid[:, None, :]
    if window is not None:
        among_new = among_new & in_window(positions)
    mask = among_new[:, :, None, :][:, None]  # [B, 1, T, 1, T]
    s_new = jnp.where(mask, s_new, MASK_VALUE)
    m_new = jnp.max(s_new, axis=-1)
    p_new = jnp.where(mask, jnp.exp(s_new - m_new[..., None]), 0.0)
    sums_new = jnp.sum(p_new, axis=-1)
    v_vals = jnp.where(new_valid[:, :, None, None], v_vals, 0.0)
    acc_new = jnp.einsum("bhtgu,buhd->bhtgd", p_new, v_vals, precision=hi)

    parts = [(m, sums, acc), (m_new[:, :, None], sums_new[:, :, None], acc_new[:, :, None])]
    if sinks is not None:  # the stored sinks, unquantized: seen by every new token of the row
        sk = jnp.einsum("bshd,ed->bshe", sinks.k, rk, precision=hi)
        sv = jnp.einsum("bshd,ed->bshe", sinks.v, rv, precision=hi)
        stored = jnp.arange(num_sinks)[None, :] < ctx_lens[:, None]  # [B, n]
        seen = stored[:, None, None, None, :]  # [B, 1, 1, 1, n]
        if window is not None:
            seen = seen & in_window(jnp.arange(num_sinks, dtype=jnp.int32)[None])[:, None, :, None, :]
        s_sink = jnp.where(seen, jnp.einsum("bthgd,bshd->bhtgs", q_rot, sk, precision=hi), MASK_VALUE)
        m_sink = jnp.max(s_sink, axis=-1)
        p_sink = jnp.where(seen, jnp.exp(s_sink - m_sink[..., None]), 0.0)
        sv = jnp.where(stored[:, :, None, None], sv, 0.0)
        acc_sink = jnp.einsum("bhtgs,bshd->bhtgd", p_sink, sv, precision=hi)
        parts.append((m_sink[:, :, None], jnp.sum(p_sink, axis=-1)[:, :, None], acc_sink[:, :, None]))

    # Merge the splits, the new tokens' part and the sinks, normalize, rotate back once.
    # Elementwise over the few parts (not a reduction over a stacked axis): XLA's CPU backend
    # hands small reductions to a library call that costs more than the attention around it.
    pieces = [(x[:, :, i], s[:, :, i], a[:, :, i]) for x, s, a in parts for i in range(x.shape[2])]
    m_max = functools.reduce(jnp.maximum, [x for x, _, _ in pieces])  # [B, Hkv, T, G]
    w = [jnp.exp(x - m_max) for x, _, _ in pieces]
    denom = sum(wi * s for wi, (_, s, _) in zip(w, pieces, strict=True))
    out_rot = sum(wi[..., None] * a for wi, (_, _, a) in zip(w, pieces, strict=True))
    out_rot = out_rot / jnp.maximum(denom, 1e-30)[..., None]
    out = jnp.einsum("bhtgd,de->bthge", out_rot, rv, precision=hi)  # [B, T, Hkv, G, Dh]
    out = out.reshape(b, t, hq, dh).astype(q.dtype)
    if not return_lse:
        return out
    lse = m_max + jnp.log(jnp.maximum(denom, 1e-30))  # [B, Hkv, T, G]
    return out, jnp.moveaxis(lse, 2, 1).reshape(b, t, hq)


def _rotated_values(enc: dict[str, jax.Array], codec: TurboQuant) -> jax.Array:
    """Encoded vectors in the codec's rotated domain: codebook values times norms."""
    idx = unpack_bits(enc["codes"], codec.bits, codec.head_dim)
    return jnp.asarray(codec.centroids)[idx] * enc["norms"].astype(jnp.float32)[..., None]


def _context_partials_jnp(
    q_blocks, k_pool, v_pool, table, layer, ctx_lens, k_codec, v_codec, num_sinks, q_pos=None, window=None
):
    """`_context_partials` over all of each row's pages at once, in jnp: [B, Hkv, 1, Q, Dh],
    [B, Hkv, 1, Q] x 2. Norms scale the scores and the softmax weights, not the codebook
    values, so the per-coordinate work is the unpacking and the lookup. With a `window`, each
    query row sees only the stored keys at most window - 1 positions behind its `q_pos` [B, Q]."""
    b, num_pages = table.shape
    hi = jax.lax.Precision.HIGHEST

    def gather(pool, index, codec):  # -> rotated-domain unit vectors [B, Hkv, C, Dh], norms [B, Hkv, C]
        # Heads go in front while still packed (a few bytes per vector), so the codebook
        # values come out in the layout the products read: no copy of them is transposed.
        codes = jnp.moveaxis(pool["codes"][table, index], 3, 1)  # [B, Hkv, NP, S, bytes]
        codes = codes.reshape(b, codes.shape[1], -1, codes.shape[4])
        norms = jnp.moveaxis(pool["norms"][table, index], 3, 1).reshape(codes.shape[:3]).astype(jnp.float32)
        return jnp.asarray(codec.centroids)[unpack_bits(codes, codec.bits, codec.head_dim)], norms

    k_vals, k_norms = gather(k_pool, layer[0], k_codec)
    pos = jnp.arange(k_vals.shape[2], dtype=jnp.int32)
    valid = ((pos >= num_sinks)[None, :] & (pos[None, :] < ctx_lens[:, None]))[:, None, None, :]  # [B, 1, 1, C]
    if window is not None:
        valid = valid & (q_pos[:, None, :, None] - pos[None, None, None, :] < window)  # [B, 1, Q, C]
    scores = context_scores(q_blocks, k_vals, hi, heads_first=True) * k_norms[:, :, None]
    # Replace (not add): garbage in unused pages may be NaN.
    scores = jnp.where(valid, scores, MASK_VALUE)
    m = jnp.max(scores, axis=-1)
    p = jnp.where(valid, jnp.exp(scores - m[..., None]), 0.0)
    v_vals, v_norms = gather(v_pool, layer[1], v_codec)
    weights = p * jnp.where(valid, v_norms[:, :, None], 0.0)
    acc = context_sum(weights, v_vals, hi, heads_first=True)
    return acc[:, :, None], m[:, :, None], jnp.sum(p, axis=-1)[:, :, None]


def _context_partials(
    q_blocks,
    k_pool,
    v_pool,
    table,
    layer,
    ctx_lens,
    k_codec,
    v_codec,
    pages_per_split,
    num_sinks,
    interpret,
    pages_per_step,
    code_loads,
    dot_precision,
    query_rows,
    q_pos,
    window,
):
    """Runs the kernel: per (row, KV head, block of `query_rows` queries, split) the
    unnormalized rotated-domain output, the running max and the softmax denominator over that
    split's stored keys (with a `window`, those at most window - 1 positions behind each query
    row's position in `q_pos` [B, Qp])."""
    b, hkv, padded_q, dh = q_blocks.shape
    num_q_blocks = padded_q // query_rows
    joined = code_loads == "planes"
    if joined:  # the tiles' columns come in the joined order: the queries follow it
        order = joined_order(dh)
        q_blocks = q_blocks[..., order]
    num_splits = table.shape[1] // pages_per_split
    page_size = k_pool["codes"].shape[2]
    kernel = functools.partial(
        _context_kernel,
        k_bits=k_codec.bits,
        v_bits=v_codec.bits,
        head_dim=dh,
        page_size=page_size,
        pages_per_split=pages_per_split,
        pages_per_step=pages_per_step or default_pages_per_step(pages_per_split, page_size, dh, dot_precision),
        num_sinks=num_sinks,
        joined=joined,
        dot_precision=dot_precision,
        window=window,
    )
    full = lambda shape: pl.BlockSpec(shape, lambda i, j, r, s: (0,) * len(shape))  # noqa: E731
    in_specs = [
        pl.BlockSpec((None, None, query_rows, dh), lambda i, j, r, s: (i, j, r, 0)),  # a query block of (row, head)
        pl.BlockSpec((None, query_rows), lambda i, j, r, s: (i, r)),  # its rows' positions
        full(table.shape),
        full((2,)),  # key and value pool layers
        full(ctx_lens.shape),
        full(k_pool["codes"].shape),
        full(k_pool["norms"].shape),
        full(v_pool["codes"].shape),
        full(v_pool["norms"].shape),
        full(k_codec.centroids.shape),
        full(v_codec.centroids.shape),
    ]
    part = (b, hkv, num_splits, padded_q)
    out_specs = [
        pl.BlockSpec((None, None, None, query_rows, dh), lambda i, j, r, s: (i, j, s, r, 0)),
        pl.BlockSpec((None, None, None, query_rows), lambda i, j, r, s: (i, j, s, r)),
        pl.BlockSpec((None, None, None, query_rows), lambda i, j, r, s: (i, j, s, r)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((*part, dh), jnp.float32),
        jax.ShapeDtypeStruct(part, jnp.float32),
        jax.ShapeDtypeStruct(part, jnp.float32),
    ]
    acc, m, sums = pl.pallas_call(
        kernel,
        grid=(b, hkv, num_q_blocks, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        # Triton parameters select the Triton lowering on GPU (Mosaic GPU is the default there).
        # 4 warps measured best on an H100 (2 and 8 were 1.3-1.6x slower).
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
        name=f"tq_paged_attention_{dot_precision}",  # one name per variant in a profiler's summary
    )(
        q_blocks,
        q_pos,
        table,
        layer,
        ctx_lens,
        k_pool["codes"],
        k_pool["norms"],
        v_pool["codes"],
        v_pool["norms"],
        jnp.asarray(k_codec.centroids),
        jnp.asarray(v_codec.centroids),
    )
    return (acc[..., np.argsort(order)] if joined else acc), m, sums


def default_pages_per_split(batch: int, kv_heads: int, num_pages: int) -> int:
    """The largest of `SPLIT_SIZES` that divides `num_pages` (no padded pages to walk) and still
    gives the grid `MIN_PROGRAMS` programs; the smallest when none does (a short or narrow
    batch: more, shorter programs fill the GPU)."""
    for size in reversed(SPLIT_SIZES):
        if num_pages % size == 0 and batch * kv_heads * (num_pages // size) >= MIN_PROGRAMS:
            return size
    return SPLIT_SIZES[0]


def _min_rows(dot_precision: str) -> int:
    """The fewest query rows a program holds: Triton's smallest dot, or 1 without a dot."""
    return 1 if dot_precision == "rows" else _MIN_DOT


def _query_blocks(num_q: int, query_rows: int, dot_precision: str) -> tuple[int, int]:
    """Rows per program and programs for `num_q` query rows: one block padded to a power of
    two (at least Triton's 16 for a dot) while they fit in `query_rows`, else blocks of
    `query_rows`."""
    rows = min(max(_min_rows(dot_precision), pl.next_power_of_2(num_q)), query_rows)
    return rows, -(-num_q // rows)


def default_query_rows(dot_precision: str, head_dim: int = 64) -> int:
    """Query rows per program: as many as a program holds without spilling registers to
    memory (scripts/kernel_resources.py builds the kernel for sm_90 without a GPU and reads
    ptxas's report). The accumulator is rows x head_dim, so wider heads get fewer rows: in
    bf16x3, 64 rows at head_dim 128 spilled and 32 did not; at 256, 64 spilled 1 KB and 16
    did not. At least 16, Triton's smallest dot ("rows" has no dot: its rows are unrolled
    loops, so a few per program, whatever the width)."""
    if dot_precision == "rows":
        return QUERY_ROWS["rows"]
    return max(_MIN_DOT, QUERY_ROWS[dot_precision] * 64 // head_dim)


def default_code_loads(k_bits: int, v_bits: int) -> str:
    """Whole byte planes where no code straddles two bytes (widths 1, 2, 4 and 8): at 4:4 they
    beat the per-coordinate gathers on an H200 (37.9 against 85.9 us at 1 x 512, 530 against 547
    at 32 x 8192, each at its best split). Gathers for the other widths, which are unmeasured
    side by side (the `attention` GPU stage times both)."""
    return "planes" if k_bits in (1, 2, 4, 8) and v_bits in (1, 2, 4, 8) else "gather"


def default_pages_per_step(pages_per_split: int, page_size: int, head_dim: int, dot_precision: str = "float32") -> int:
    """Pages one loop step of the kernel reads: up to `TILE_PAGES`, a divisor of the split,
    and a code tile of at most `TILE_ELEMENTS` (`ROWS_TILE_ELEMENTS` with the "rows"
    products; past that the tiles spill out of registers)."""
    elements = ROWS_TILE_ELEMENTS if dot_precision == "rows" else TILE_ELEMENTS
    most = max(1, min(TILE_PAGES, elements // (page_size * head_dim)))
    return math.gcd(pages_per_split, 1 << (most.bit_length() - 1))


def _context_kernel(
    q_ref,  # [Qp, Dh] rotated, scaled queries of this (row, KV head)
    qpos_ref,  # [Qp] their positions (read with a window only)
    table_ref,  # [B, NS * pages_per_split] page ids
    layer_ref,  # [2] layer in the key pool, in the value pool
    ctx_ref,  # [B] stored tokens per row
    kc_ref,  # [P, L, S, Hkv, Dh * kb / 8] uint8 key codes (planar)
    kn_ref,  # [P, L, S, Hkv] float16 key norms
    vc_ref,
    vn_ref,
    kcb_ref,  # [2^kb] key codebook
    vcb_ref,  # [2^vb] value codebook
    acc_ref,  # [Qp, Dh] out: sum_j p_j n_vj c_v[idx_j] (unnormalized)
    m_ref,  # [Qp] out: running max score
    sum_ref,  # [Qp] out: sum_j p_j
    *,
    k_bits: int,
    v_bits: int,
    head_dim: int,
    page_size: int,
    pages_per_split: int,
    pages_per_step: int,
    num_sinks: int,
    joined: bool,
    dot_precision: str,
    window: int | None,
):
    row, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(3)
    tokens = pages_per_step * page_size
    ctx_len = ctx_ref[row]
    t = jax.lax.broadcasted_iota(jnp.int32, (tokens, 1), 0)  # token of the step's tile
    slot = t % page_size
    dim = jax.lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)

    def tile(codes_ref, norms_ref, codebook_ref, bits, pages, side):
        """Codebook values [T, Dh] and norms [T] of the step's tokens. In the planar layout
        coordinate d's code starts `shift` bits into its column's byte of byte plane `plane`
        (and may run into the next plane), so one gather of [T, Dh] bytes, two where codes
        straddle planes, builds the whole tile. Joined: the `bits` planes are loaded whole
        ([T, Dh / 8] each) and their 8 code chunks joined, in `joined_order`."""
        layer = layer_ref[side]
        chunk = head_dim // 8
        norms = norms_ref[pages[:, 0], layer, slot[:, 0], head].astype(jnp.float32)
        if joined:  # each byte plane loaded whole, its chunks unpacked and joined
            planes = [
                codes_ref[pages[:, 0], layer, slot[:, 0], head, pl.ds(r * chunk, chunk)].astype(jnp.int32)
                for r in range(bits)
            ]
            return codebook_ref[_join(unpack_planes(planes, bits))], norms
        start = (dim // chunk) * bits
        plane, shift, column = start // 8, start % 8, dim % chunk
        code = codes_ref[pages, layer, slot, head, plane * chunk + column].astype(jnp.int32) >> shift
        if 8 % bits:  # some codes straddle two planes (the last plane never does)
            nxt = jnp.minimum(plane + 1, bits - 1) * chunk + column
            code = code | (codes_ref[pages, layer, slot, head, nxt].astype(jnp.int32) << (8 - shift))
        code = code & ((1 << bits) - 1)
        return codebook_ref[code], norms

    def step_tokens(i):
        """The pages [T, 1] of loop step i's tokens, which of them are stored and past the
        sinks (which are read unquantized outside) [T], and their positions [T]."""
        first = split * pages_per_split + i * pages_per_step
        pos = first * page_size + t[:, 0]
        return table_ref[row, first + t // page_size], (pos >= num_sinks) & (pos < ctx_len), pos

    def visible(stored, pos, row=None):
        """`stored` narrowed to the keys at `pos` within the window of the query rows (all of
        the program's, or row `row` alone); `stored` itself without a window."""
        if window is None:
            return stored
        q_pos = qpos_ref[...][:, None] if row is None else qpos_ref[row]
        return stored & (q_pos - pos < window)

    key_tile = functools.partial(tile, kc_ref, kn_ref, kcb_ref, k_bits, side=0)
    value_tile = functools.partial(tile, vc_ref, vn_ref, vcb_ref, v_bits, side=1)
    num_steps = pages_per_split // pages_per_step
    if dot_precision == "rows":
        _rows_loop(q_ref, (acc_ref, m_ref, sum_ref), step_tokens, visible, key_tile, value_tile, num_steps)
        return

    q = q_ref[...]

    def body(i, carry):
        m, sums, acc = carry
        pages, stored, pos = step_tokens(i)
        stored = stored[None, :]  # [1, T]
        valid = visible(stored, pos[None, :])  # [Qp or 1, T]
        k_vals, k_norms = key_tile(pages)
        scores = tile_dot(q, k_vals, ((1,), (1,)), dot_precision) * k_norms[None, :]  # [Qp, T]
        # Replace (not add): garbage in unused pages may be NaN.
        scores = jnp.where(valid, scores, MASK_VALUE)
        m_next = jnp.maximum(m, jnp.max(scores, axis=1))
        alpha = jnp.exp(m - m_next)
        p = jnp.where(valid, jnp.exp(scores - m_next[:, None]), 0.0)
        v_vals, v_norms = value_tile(pages)
        weights = p * jnp.where(stored, v_norms[None, :], 0.0)
        acc = acc * alpha[:, None] + tile_dot(weights, v_vals, ((1,), (0,)), dot_precision)
        return m_next, sums * alpha + jnp.sum(p, axis=1), acc

    padded_q = q_ref.shape[0]
    init = (
        jnp.full((padded_q,), MASK_VALUE, jnp.float32),
        jnp.zeros((padded_q,), jnp.float32),
        jnp.zeros((padded_q, head_dim), jnp.float32),
    )
    m, sums, acc = jax.lax.fori_loop(0, num_steps, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    sum_ref[...] = sums


def _rows_loop(q_ref, outs, step_tokens, visible, key_tile, value_tile, num_steps):
    """`_context_kernel`'s walk over the split with the "rows" products: every query row keeps
    its own running max, denominator and [Dh] accumulator, and meets the step's key and value
    tiles in multiply-reduce loops (the comment at `DOT_PRECISIONS`). Triton cannot slice a
    loaded value, so each row's query is loaded from its ref, and the rows' results are put
    back together with selects before the stores."""
    acc_ref, m_ref, sum_ref = outs
    num_rows, head_dim = q_ref.shape
    queries = [q_ref[r, :] for r in range(num_rows)]  # [Dh] each

    def body(i, carry):
        pages, stored, pos = step_tokens(i)  # [T, 1], [T], [T]
        # Every row's scores first, then the value tile: the key tile is dead by then.
        k_vals, k_norms = key_tile(pages)
        softmax = []
        for r, (q, (m, sums, _)) in enumerate(zip(queries, carry, strict=True)):
            valid = visible(stored, pos, r)
            scores = jnp.sum(k_vals * q[None, :], axis=1) * k_norms  # [T]
            scores = jnp.where(valid, scores, MASK_VALUE)  # replace: unused pages may hold NaN
            m_next = jnp.maximum(m, jnp.max(scores))
            alpha = jnp.exp(m - m_next)
            p = jnp.where(valid, jnp.exp(scores - m_next), 0.0)
            softmax.append((m_next, alpha, p, sums * alpha + jnp.sum(p)))
        v_vals, v_norms = value_tile(pages)
        v_norms = jnp.where(stored, v_norms, 0.0)
        out = []
        for (m_next, alpha, p, sums), (_, _, acc) in zip(softmax, carry, strict=True):
            acc = acc * alpha + jnp.sum((p * v_norms)[:, None] * v_vals, axis=0)  # [Dh]
            out.append((m_next, sums, acc))
        return tuple(out)

    init = tuple(
        (jnp.float32(MASK_VALUE), jnp.float32(0.0), jnp.zeros((head_dim,), jnp.float32)) for _ in range(num_rows)
    )
    final = jax.lax.fori_loop(0, num_steps, body, init)
    which = jax.lax.broadcasted_iota(jnp.int32, (num_rows, 1), 0)
    acc_ref[...] = sum(jnp.where(which == r, acc[None, :], 0.0) for r, (_, _, acc) in enumerate(final))
    m_ref[...] = sum(jnp.where(which[:, 0] == r, m, 0.0) for r, (m, _, _) in enumerate(final))
    sum_ref[...] = sum(jnp.where(which[:, 0] == r, sums, 0.0) for r, (_, sums, _) in enumerate(final))


def _join(chunks: list, xp=jnp):
    """Joins equal [T, c] tiles pairwise along the last axis (Triton's join: stack, then merge
    the new axis) until one [T, c * len(chunks)] tile is left; `joined_order` gives its columns."""
    while len(chunks) > 1:
        pairs = zip(chunks[0::2], chunks[1::2], strict=True)
        chunks = [xp.stack([a, b], axis=-1).reshape(a.shape[0], 2 * a.shape[1]) for a, b in pairs]
    return chunks[0]


def joined_order(head_dim: int) -> np.ndarray:
    """The coordinates of `_join`'s columns for the 8 code chunks of the planar layout: column
    j of the joined tile holds coordinate order[j]."""
    chunk = head_dim // 8
    return _join([np.arange(m * chunk, (m + 1) * chunk)[None, :] for m in range(8)], np)[0]
