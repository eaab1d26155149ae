"""The functional paged KV cache: device page pools plus per-slot block tables and lengths.

Everything here is data; the host-side `PageAllocator` (aither_jax.page_allocator) decides
which pages a sequence owns and writes its block-table row. Page 0 is the null page: it is
never handed out, padding rows write their garbage into it, and unassigned block-table
entries point at it, so every read of it is masked.

Pools are page-major, [num_pages, num_layers, page_size, num_kv_heads, ...], so one page's
bytes for every layer are contiguous (cheap to move between device and host). The storage
format is named by a `KVSpec` (models/kv_spec.py): bf16 pools hold uint16 bit patterns (XLA's
CPU backend widens bf16 gathers and scatters by converting the whole pool to float32 every
step, while integer ones stay in place); TurboQuant pools hold packed codes and norms
(pallas_kernels/turboquant.py). The reference read path decodes the gathered pages into a
buffer; kernels read the packed pages directly.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from models.config import ModelConfig
from models.kv_spec import KVSpec, parse_kv_spec
from pallas_kernels.turboquant import TurboQuant

NULL_PAGE = 0


@struct.dataclass
class PagedKVCache:
    """Page pools for keys and values plus the per-slot tables.

    `k` and `v` are storage pytrees whose leaves all start with [P, L, S, Hkv]: one array
    [P, L, S, Hkv, Dh] for unquantized formats; for TurboQuant formats a dict with "codes"
    uint8 [P, L, S, Hkv, Dh*b/8] and "norms" float32 [P, L, S, Hkv] (and with QJL "qjl_signs"
    uint8 [P, L, S, Hkv, Dh/8] and "qjl_norms" float32 [P, L, S, Hkv]).
    """

    k: Any  # keys after RoPE, page-major storage pytree (see class doc)
    v: Any
    block_tables: jax.Array  # [max_seqs, max_pages_per_seq] int32, page ids per slot (NULL_PAGE = none)
    seq_lens: jax.Array  # [max_seqs] int32, tokens stored per slot
    spec: KVSpec = struct.field(pytree_node=False, default=KVSpec("bf16"))
    k_codec: TurboQuant | None = struct.field(pytree_node=False, default=None)
    v_codec: TurboQuant | None = struct.field(pytree_node=False, default=None)

    @property
    def _first_leaf(self) -> jax.Array:
        return jax.tree_util.tree_leaves(self.k)[0]

    @property
    def num_pages(self) -> int:
        return self._first_leaf.shape[0]

    @property
    def num_layers(self) -> int:
        return self._first_leaf.shape[1]

    @property
    def page_size(self) -> int:
        return self._first_leaf.shape[2]

    @property
    def max_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.block_tables.shape[1]

    def encode(self, k: jax.Array, v: jax.Array) -> tuple[Any, Any]:
        """New keys/values [..., Hkv, Dh] -> storage pytrees (bit patterns, or TurboQuant codes)."""
        return _encode(k, self.k_codec, self.spec), _encode(v, self.v_codec, self.spec)

    def decode(self, k: Any, v: Any) -> tuple[jax.Array, jax.Array]:
        """Storage pytrees -> keys/values [..., Hkv, Dh] as stored (float32 when quantized)."""
        return _decode(k, self.k_codec, self.spec), _decode(v, self.v_codec, self.spec)

    def read(self, page_table: jax.Array, layer: int | jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values of one layer for the pages of each row.

        Args:
            page_table: [B, NP] page ids.
            layer: layer index.

        Returns:
            k, v: [B, NP * S, Hkv, Dh] as stored.
        """
        b, num_pages = page_table.shape

        def gather(tree):
            return jax.tree_util.tree_map(
                lambda a: a[page_table, layer].reshape(b, num_pages * a.shape[2], *a.shape[3:]), tree
            )

        return self.decode(gather(self.k), gather(self.v))

    def write(self, pages: jax.Array, offsets: jax.Array, k: Any, v: Any) -> PagedKVCache:
        """Stores new keys/values of every layer.

        Args:
            pages, offsets: [B, T] page id and slot within the page of each new token.
            k, v: storage pytrees (from `encode`) whose leaves are [L, B, T, Hkv, ...].
        """
        layers = jnp.arange(self.num_layers, dtype=jnp.int32)[None, None, :]
        index = (pages[:, :, None], layers, offsets[:, :, None])

        # [L, B, T, ...] -> [B, T, L, ...] to match the pool's [page, layer, offset] index order.
        def put(pool, new):
            return pool.at[index].set(jnp.moveaxis(new, 0, 2))

        return self.replace(k=jax.tree_util.tree_map(put, self.k, k), v=jax.tree_util.tree_map(put, self.v, v))


def _encode(x: jax.Array, codec: TurboQuant | None, spec: KVSpec) -> Any:
    if codec is not None:
        return codec.encode(x)
    if spec.unquantized_bytes == 2:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(jnp.float32)


def _decode(stored: Any, codec: TurboQuant | None, spec: KVSpec) -> jax.Array:
    if codec is not None:
        return codec.decode(stored)
    if spec.unquantized_bytes == 2:
        return jax.lax.bitcast_convert_type(stored, jnp.bfloat16)
    return stored


def make_codecs(spec: KVSpec, head_dim: int, seed: int = 0) -> tuple[TurboQuant | None, TurboQuant | None]:
    """The key and value codecs of a format (keys and values get different rotations)."""
    if not spec.quantized:
        return None, None
    return (
        TurboQuant(head_dim=head_dim, bits=spec.key_bits, seed=seed, qjl=spec.key_qjl),
        TurboQuant(head_dim=head_dim, bits=spec.value_bits, seed=seed + 1, qjl=spec.value_qjl),
    )


def init_cache(
    cfg: ModelConfig,
    *,
    num_pages: int,
    max_seqs: int,
    max_pages_per_seq: int,
    page_size: int = 16,
    kv_cache_dtype: str = "bf16",
    fill_value: float = 0.0,
    seed: int = 0,
) -> PagedKVCache:
    """An empty cache. Tests pass `fill_value=nan` so any unmasked read of a stale page shows
    (for quantized formats the norms hold it)."""
    spec = parse_kv_spec(kv_cache_dtype)
    if num_pages < 2:
        raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {num_pages}")
    k_codec, v_codec = make_codecs(spec, cfg.head_dim, seed)
    lead = (num_pages, cfg.num_layers, page_size, cfg.num_kv_heads)

    def pool(codec: TurboQuant | None) -> Any:
        if codec is None:
            return _encode(jnp.full((*lead, cfg.head_dim), fill_value, jnp.float32), None, spec)
        # Encode one vector to learn the storage layout, then broadcast it over the pool.
        proto = codec.encode(jnp.ones((cfg.head_dim,), jnp.float32))
        tree = {k: jnp.zeros((*lead, *a.shape), a.dtype) for k, a in proto.items()}
        for key in ("norms", "qjl_norms"):
            if key in tree:
                tree[key] = jnp.full(lead, fill_value, jnp.float32)
        return tree

    return PagedKVCache(
        k=pool(k_codec),
        v=pool(v_codec),
        block_tables=jnp.full((max_seqs, max_pages_per_seq), NULL_PAGE, jnp.int32),
        seq_lens=jnp.zeros((max_seqs,), jnp.int32),
        spec=spec,
        k_codec=k_codec,
        v_codec=v_codec,
    )
