"""The functional paged KV cache: device page pools plus per-slot block tables and lengths.

Everything here is data; the host-side `PageAllocator` (aither_jax.kv.allocator) decides
which pages a sequence owns and writes its block-table row. Page 0 is the null page: it is
never handed out, padding rows write their garbage into it, and unassigned block-table
entries point at it, so every read of it is masked.

Pools are page-major, [num_pages, num_layers, page_size, num_kv_heads, ...], so one page's
bytes for every layer are contiguous (cheap to move between device and host). The storage
format is named by a `KVSpec` (models/kv_spec.py), which may give layers different formats:
layers that share a format share a pool (a layer group), so keys and values are each a tuple
of group pools. bf16 pools hold uint16 bit patterns (XLA's
CPU backend widens bf16 gathers and scatters by converting the whole pool to float32 every
step, while integer ones stay in place); TurboQuant pools hold packed codes and norms
(pallas_kernels/turboquant.py). The reference read path decodes the gathered pages into a
buffer; kernels read the packed pages directly.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models.config import ModelConfig
from models.kv_spec import KVSpec, parse_kv_spec
from pallas_kernels.tq_encode import tq_encode
from pallas_kernels.turboquant import SplitTurboQuant, TurboQuant, make_codec

NULL_PAGE = 0


@dataclasses.dataclass(frozen=True)
class LayerGroups:
    """Which layers share a pool on one side (keys or values), and each group's codec.

    `groups[g]` lists the layers of group g in order; layer i lives in group `where[i][0]` at
    index `where[i][1]`; `codecs[g]` is None for unquantized groups.
    """

    groups: tuple[tuple[int, ...], ...]
    codecs: tuple[TurboQuant | SplitTurboQuant | None, ...]
    where: tuple[tuple[int, int], ...]

    @staticmethod
    def build(
        bits: tuple[int | float | None, ...], head_dim: int, seed: int, qjl: bool, rotation: str = "haar"
    ) -> LayerGroups:
        formats = sorted(set(bits), key=lambda b: (b is None, b or 0))
        groups = tuple(tuple(i for i, b in enumerate(bits) if b == f) for f in formats)
        codecs = tuple(
            None if f is None else make_codec(head_dim, f, seed=seed, qjl=qjl, rotation=rotation) for f in formats
        )
        where = [None] * len(bits)
        for g, layers in enumerate(groups):
            for j, i in enumerate(layers):
                where[i] = (g, j)
        return LayerGroups(groups, codecs, tuple(where))

    def codec(self, layer: int) -> TurboQuant | SplitTurboQuant | None:
        return self.codecs[self.where[layer][0]]


@struct.dataclass
class PagedKVCache:
    """Page pools for keys and values plus the per-slot tables.

    `k` and `v` are tuples with one storage pytree per layer group (`k_groups`, `v_groups`),
    whose leaves all start with [P, Lg, S, Hkv]: one array [P, Lg, S, Hkv, Dh] for unquantized
    groups; for TurboQuant groups a dict with "codes" uint8 [P, Lg, S, Hkv, Dh*b/8] and "norms"
    float16 [P, Lg, S, Hkv] (and with QJL "qjl_signs" uint8 [P, Lg, S, Hkv, Dh/8] and
    "qjl_norms" float16 [P, Lg, S, Hkv]); split-group groups hold "group_norms" float16
    [P, Lg, S, Hkv, 2] instead of "norms".
    """

    k: tuple[Any, ...]  # keys after RoPE, one page-major storage pytree per key layer group
    v: tuple[Any, ...]
    # With sink tokens (spec.sink_tokens = n > 0): the first n keys/values of each slot, bf16
    # bit patterns [max_seqs, L, n, Hkv, Dh], read instead of their quantized page copies.
    sink_k: jax.Array | None
    sink_v: jax.Array | None
    block_tables: jax.Array  # [max_seqs, max_pages_per_seq] int32, page ids per slot (NULL_PAGE = none)
    seq_lens: jax.Array  # [max_seqs] int32, tokens stored per slot
    # With spec.precondition: keys are stored as k @ key_transform and queries read them as
    # q @ query_transform ([L, Hkv, Dh, Dh] float32 each: M^T and M^-1 of models/kv_transform.py).
    key_transform: jax.Array | None = None
    query_transform: jax.Array | None = None
    spec: KVSpec = struct.field(pytree_node=False, default=KVSpec("bf16"))
    k_groups: LayerGroups | None = struct.field(pytree_node=False, default=None)
    v_groups: LayerGroups | None = struct.field(pytree_node=False, default=None)

    @property
    def _first_leaf(self) -> jax.Array:
        return jax.tree_util.tree_leaves(self.k)[0]

    @property
    def num_pages(self) -> int:
        return self._first_leaf.shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.k_groups.where)

    @property
    def page_size(self) -> int:
        return self._first_leaf.shape[2]

    @property
    def max_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.block_tables.shape[1]

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the stored format: the name, every layer's codec on both sides (rotation
        and codebook, `TurboQuant.fingerprint`) and the key transform. Pages written under one
        fingerprint decode correctly only under the same one."""
        h = hashlib.sha256(self.spec.name.encode())
        for groups in (self.k_groups, self.v_groups):
            for g, _ in groups.where:
                codec = groups.codecs[g]
                h.update(b"|" + (b"unquantized" if codec is None else codec.fingerprint.encode()))
        if self.key_transform is not None:
            h.update(np.asarray(self.key_transform, np.float32).tobytes())
        return h.hexdigest()

    def quantized(self, layer: int) -> bool:
        """Whether the keys or the values of `layer` are TurboQuant-coded."""
        return self.k_groups.codec(layer) is not None or self.v_groups.codec(layer) is not None

    def layer_pools(self, layer: int) -> tuple[Any, Any, int, int]:
        """(key pool, value pool, index of `layer` in the key pool, in the value pool)."""
        (kg, ki), (vg, vi) = self.k_groups.where[layer], self.v_groups.where[layer]
        return self.k[kg], self.v[vg], ki, vi

    def encode(self, k: jax.Array, v: jax.Array, layer: int, *, kernel: bool = False) -> tuple[Any, Any]:
        """New keys/values [..., Hkv, Dh] of `layer` -> storage pytrees (bit patterns, or codes).
        `kernel` quantizes with the Pallas encoder instead of the jnp codec (same result)."""
        return (
            _encode(k, self.k_groups.codec(layer), self.spec, kernel),
            _encode(v, self.v_groups.codec(layer), self.spec, kernel),
        )

    def decode(self, k: Any, v: Any, layer: int) -> tuple[jax.Array, jax.Array]:
        """Storage pytrees of `layer` -> keys/values [..., Hkv, Dh] as stored (float32 when quantized)."""
        return (
            _decode(k, self.k_groups.codec(layer), self.spec),
            _decode(v, self.v_groups.codec(layer), self.spec),
        )

    def read(self, page_table: jax.Array, layer: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values of one layer for the pages of each row.

        Args:
            page_table: [B, NP] page ids.
            layer: layer index (a Python int: it picks the layer's pool).

        Returns:
            k, v: [B, NP * S, Hkv, Dh] as stored.
        """
        return self.decode(*self.gather(page_table, layer), layer)

    def gather(self, page_table: jax.Array, layer: int) -> tuple[Any, Any]:
        """`read` without the decoding: the storage pytrees of one layer for the pages of
        each row, leaves [B, NP * S, Hkv, ...]."""
        b, num_pages = page_table.shape
        k_pool, v_pool, ki, vi = self.layer_pools(layer)

        def gather(tree, index):
            return jax.tree_util.tree_map(
                lambda a: a[page_table, index].reshape(b, num_pages * a.shape[2], *a.shape[3:]), tree
            )

        return gather(k_pool, ki), gather(v_pool, vi)

    @property
    def num_sinks(self) -> int:
        return self.spec.sink_tokens

    def sinks(self, slots: jax.Array, layer: int) -> tuple[jax.Array, jax.Array]:
        """The sink keys/values [B, n, Hkv, Dh] (float32) of `layer` for the given slots."""
        rows = jnp.minimum(slots, self.max_seqs - 1)
        return tuple(
            jax.lax.bitcast_convert_type(a[rows, layer], jnp.bfloat16).astype(jnp.float32)
            for a in (self.sink_k, self.sink_v)
        )

    def write_sinks(self, slots: jax.Array, start: jax.Array, num_new: jax.Array, k: jax.Array, v: jax.Array):
        """Stores the sink-position tokens among a step's first n new tokens per row.

        Args:
            slots, start, num_new: [B] the rows' slots, first positions and valid counts.
            k, v: [L, B, T', Hkv, Dh] uint16 bf16 bits of the rows' first T' = min(T, n) new tokens.
        """
        if self.num_sinks == 0:
            return self
        t = k.shape[2]
        pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T']
        keep = (jnp.arange(t)[None, :] < num_new[:, None]) & (pos < self.num_sinks)
        pos = jnp.where(keep, pos, self.num_sinks)  # out of range: dropped
        index = (slots[:, None], slice(None), pos)

        def put(buf, new):  # buf [max_seqs, L, n, ...]; new [L, B, T', ...] -> [B, T', L, ...]
            return buf.at[index].set(jnp.moveaxis(new, 0, 2), mode="drop")

        return self.replace(sink_k=put(self.sink_k, k), sink_v=put(self.sink_v, v))

    def stack_layers(self, k: list[Any], v: list[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """Per-layer storage pytrees (from `encode`, in layer order) -> per-group pytrees with
        leaves [Lg, ...], the form `write` takes."""

        def stack(per_layer, groups):
            return tuple(jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *(per_layer[i] for i in g)) for g in groups)

        return stack(k, self.k_groups.groups), stack(v, self.v_groups.groups)

    def write(self, pages: jax.Array, offsets: jax.Array, k: tuple[Any, ...], v: tuple[Any, ...]) -> PagedKVCache:
        """Stores new keys/values of every layer.

        Args:
            pages, offsets: [B, T] page id and slot within the page of each new token.
            k, v: per-group storage pytrees (from `stack_layers`) whose leaves are [Lg, B, T, Hkv, ...].
        """

        def put_group(pool_tree, new_tree):
            layers = jnp.arange(jax.tree_util.tree_leaves(pool_tree)[0].shape[1], dtype=jnp.int32)
            index = (pages[:, :, None], layers[None, None, :], offsets[:, :, None])

            # [Lg, B, T, ...] -> [B, T, Lg, ...] to match the pool's [page, layer, offset] index order.
            def put(pool, new):
                return pool.at[index].set(jnp.moveaxis(new, 0, 2))

            return jax.tree_util.tree_map(put, pool_tree, new_tree)

        return self.replace(
            k=tuple(put_group(p, n) for p, n in zip(self.k, k, strict=True)),
            v=tuple(put_group(p, n) for p, n in zip(self.v, v, strict=True)),
        )


def _encode(x: jax.Array, codec: TurboQuant | SplitTurboQuant | None, spec: KVSpec, kernel: bool = False) -> Any:
    if codec is not None:
        return tq_encode(x, codec) if kernel and isinstance(codec, TurboQuant) else codec.encode_tree(x)
    if spec.unquantized_bytes == 2 or spec.quantized:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(jnp.float32)


def _decode(stored: Any, codec: TurboQuant | SplitTurboQuant | None, spec: KVSpec) -> jax.Array:
    if codec is not None:
        return codec.decode_tree(stored)
    if stored.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(stored, jnp.bfloat16)
    return stored


def make_groups(spec: KVSpec, num_layers: int, head_dim: int, seed: int = 0) -> tuple[LayerGroups, LayerGroups]:
    """Key and value layer groups of a format (keys and values get different rotations)."""
    keys, values = (
        LayerGroups.build(spec.layer_bits(side, num_layers), head_dim, seed + i, spec.qjl(side), spec.rotation(side))
        for i, side in enumerate("kv")
    )
    return keys, values


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
    key_transform: np.ndarray | None = None,
) -> PagedKVCache:
    """An empty cache. Tests pass `fill_value=nan` so any unmasked read of a stale page shows
    (for quantized formats the norms hold it). `key_transform` (M [L, Hkv, Dh, Dh], see
    models/kv_transform.py) is required by formats with the `-pc` modifier and refused by others."""
    spec = parse_kv_spec(kv_cache_dtype)
    if num_pages < 2:
        raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {num_pages}")
    if spec.precondition != (key_transform is not None):
        raise ValueError(
            f"{spec.name!r} needs the model's key transform"
            if spec.precondition
            else f"a key transform was given but {spec.name!r} has no -pc modifier"
        )
    transforms = {}
    if key_transform is not None:
        m = np.asarray(key_transform, np.float64)
        expected = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim)
        if m.shape != expected:
            raise ValueError(f"key_transform must have shape {expected}, got {m.shape}")
        transforms = {
            "key_transform": jnp.asarray(np.swapaxes(m, -1, -2), jnp.float32),
            "query_transform": jnp.asarray(np.linalg.inv(m), jnp.float32),
        }
    k_groups, v_groups = make_groups(spec, cfg.num_layers, cfg.head_dim, seed)

    def pool(codec: TurboQuant | SplitTurboQuant | None, num_layers: int) -> Any:
        lead = (num_pages, num_layers, page_size, cfg.num_kv_heads)
        if codec is None:
            return _encode(jnp.full((*lead, cfg.head_dim), fill_value, jnp.float32), None, spec)
        # Encode one vector to learn the storage layout, then broadcast it over the pool.
        proto = codec.encode_tree(jnp.ones((cfg.head_dim,), jnp.float32))
        return {
            k: jnp.full((*lead, *a.shape), fill_value if k.endswith("norms") else 0, a.dtype) for k, a in proto.items()
        }

    def pools(groups: LayerGroups) -> tuple[Any, ...]:
        return tuple(pool(c, len(g)) for c, g in zip(groups.codecs, groups.groups, strict=True))

    def sinks() -> jax.Array | None:
        if not spec.sink_tokens:
            return None
        shape = (max_seqs, cfg.num_layers, spec.sink_tokens, cfg.num_kv_heads, cfg.head_dim)
        return _encode(jnp.full(shape, fill_value, jnp.float32), None, spec)

    return PagedKVCache(
        k=pools(k_groups),
        v=pools(v_groups),
        sink_k=sinks(),
        sink_v=sinks(),
        block_tables=jnp.full((max_seqs, max_pages_per_seq), NULL_PAGE, jnp.int32),
        seq_lens=jnp.zeros((max_seqs,), jnp.int32),
        **transforms,
        spec=spec,
        k_groups=k_groups,
        v_groups=v_groups,
    )
