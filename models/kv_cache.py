"""The functional paged KV cache: device page pools plus per-slot block tables and lengths.

Everything here is data; the host-side `PageAllocator` (aither_jax.page_allocator) decides
which pages a sequence owns and writes its block-table row. Page 0 is the null page: it is
never handed out, padding rows write their garbage into it, and unassigned block-table
entries point at it, so every read of it is masked.

Pools are page-major, [num_pages, num_layers, page_size, num_kv_heads, head_dim], so one
page's bytes for every layer are contiguous (cheap to move between device and host).
16-bit float pools are stored as their uint16 bit patterns: XLA's CPU backend widens bf16
gathers and scatters by converting the whole pool to float32 on every step, while integer
gathers/scatters stay in place; only the pages read and the values written are bitcast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from models.config import ModelConfig

NULL_PAGE = 0


@struct.dataclass
class PagedKVCache:
    k: jax.Array  # [P, L, S, Hkv, Dh] keys after RoPE, page-major, storage dtype
    v: jax.Array  # [P, L, S, Hkv, Dh]
    block_tables: jax.Array  # [max_seqs, max_pages_per_seq] int32, page ids per slot (NULL_PAGE = none)
    seq_lens: jax.Array  # [max_seqs] int32, tokens stored per slot
    dtype: str = struct.field(pytree_node=False, default="bfloat16")  # logical element type of K and V

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def max_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.block_tables.shape[1]

    def read(self, page_table: jax.Array, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values of one layer for the pages of each row.

        Args:
            page_table: [B, NP] page ids.
            layer: [] int32.

        Returns:
            k, v: [B, NP * S, Hkv, Dh] in the logical dtype.
        """
        b, num_pages = page_table.shape
        shape = (b, num_pages * self.page_size, *self.k.shape[3:])
        return (
            _from_storage(self.k[page_table, layer], self.dtype).reshape(shape),
            _from_storage(self.v[page_table, layer], self.dtype).reshape(shape),
        )

    def write(self, pages: jax.Array, offsets: jax.Array, k: jax.Array, v: jax.Array) -> PagedKVCache:
        """Stores new keys/values of every layer.

        Args:
            pages, offsets: [B, T] page id and slot within the page of each new token.
            k, v: [L, B, T, Hkv, Dh].
        """
        # [L, B, T, ...] -> [B, T, L, ...] to match the pool's [page, layer, offset] index order.
        k = jnp.moveaxis(k, 0, 2)
        v = jnp.moveaxis(v, 0, 2)
        layers = jnp.arange(self.k.shape[1], dtype=jnp.int32)[None, None, :]
        index = (pages[:, :, None], layers, offsets[:, :, None])
        return self.replace(
            k=self.k.at[index].set(_to_storage(k, self.dtype)),
            v=self.v.at[index].set(_to_storage(v, self.dtype)),
        )


_STORAGE = {"bfloat16": jnp.uint16, "float32": jnp.float32}


def _to_storage(x: jax.Array, dtype: str) -> jax.Array:
    x = x.astype(dtype)
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if _STORAGE[dtype] == jnp.uint16 else x


def _from_storage(x: jax.Array, dtype: str) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.dtype(dtype)) if x.dtype == jnp.uint16 else x


def init_cache(
    cfg: ModelConfig,
    *,
    num_pages: int,
    max_seqs: int,
    max_pages_per_seq: int,
    page_size: int = 16,
    dtype: str = "bfloat16",
    fill_value: float = 0.0,
) -> PagedKVCache:
    """An empty cache. Tests pass `fill_value=nan` so any unmasked read of a stale page shows."""
    if dtype not in _STORAGE:
        raise ValueError(f"KV cache dtype must be one of {sorted(_STORAGE)}, got {dtype!r}")
    if num_pages < 2:
        raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {num_pages}")
    shape = (num_pages, cfg.num_layers, page_size, cfg.num_kv_heads, cfg.head_dim)
    pool = _to_storage(jnp.full(shape, fill_value, jnp.float32), dtype)
    return PagedKVCache(
        k=pool,
        v=pool.copy(),
        block_tables=jnp.full((max_seqs, max_pages_per_seq), NULL_PAGE, jnp.int32),
        seq_lens=jnp.zeros((max_seqs,), jnp.int32),
        dtype=dtype,
    )
