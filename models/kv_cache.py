"""The functional paged KV cache: device page pools plus per-slot block tables and lengths.

Everything here is data; the host-side `PageAllocator` (aither_jax.page_allocator) decides
which pages a sequence owns and writes its block-table row. Page 0 is the null page: it is
never handed out, padding rows write their garbage into it, and unassigned block-table
entries point at it, so every read of it is masked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from models.config import ModelConfig

NULL_PAGE = 0


@struct.dataclass
class PagedKVCache:
    k: jax.Array  # [P, L, S, Hkv, Dh] keys after RoPE, page-major
    v: jax.Array  # [P, L, S, Hkv, Dh]
    block_tables: jax.Array  # [max_seqs, max_pages_per_seq] int32, page ids per slot (NULL_PAGE = none)
    seq_lens: jax.Array  # [max_seqs] int32, tokens stored per slot

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

    def write(self, layer: jax.Array, pages: jax.Array, offsets: jax.Array, k: jax.Array, v: jax.Array) -> PagedKVCache:
        """Stores new keys/values of one layer; `pages`/`offsets` are [B, T], `k`/`v` [B, T, Hkv, Dh]."""
        return self.replace(
            k=self.k.at[pages, layer, offsets].set(k.astype(self.k.dtype)),
            v=self.v.at[pages, layer, offsets].set(v.astype(self.v.dtype)),
        )


def init_cache(
    cfg: ModelConfig,
    *,
    num_pages: int,
    max_seqs: int,
    max_pages_per_seq: int,
    page_size: int = 16,
    dtype=jnp.bfloat16,
    fill_value: float = 0.0,
) -> PagedKVCache:
    """An empty cache. Tests pass `fill_value=nan` so any unmasked read of a stale page shows."""
    if num_pages < 2:
        raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {num_pages}")
    shape = (num_pages, cfg.num_layers, page_size, cfg.num_kv_heads, cfg.head_dim)
    return PagedKVCache(
        k=jnp.full(shape, fill_value, dtype),
        v=jnp.full(shape, fill_value, dtype),
        block_tables=jnp.full((max_seqs, max_pages_per_seq), NULL_PAGE, jnp.int32),
        seq_lens=jnp.zeros((max_seqs,), jnp.int32),
    )
