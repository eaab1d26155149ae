"""The device-side page store: every pool that shares page ids, changed together.

The target's paged KV cache and, with a DFlash draft, the draft's context pools are indexed by
the same page ids but laid out differently. A page copy (prefix caching's copy on write), or a
page's bytes read out to a lower tier or written back from one (kv/tiers.py), applies to all
of them in one padded call each, so no caller repeats a page operation per pool.
"""

from __future__ import annotations

import copy
import hashlib

import jax
import numpy as np

from aither_jax.compile.buckets import bucket
from aither_jax.compile.shapes import ShapeRegistry
from aither_jax.device.steps import copy_pages, page_key_summaries, read_pages, resize_pools, write_pages
from models.kv_cache import PagedKVCache

# Bumped whenever the meaning of stored page bytes changes (part of `fingerprint`).
PAGE_FORMAT_VERSION = 1
# The device must have this share more than the new pools' bytes free to resize in one call.
RESIZE_MARGIN = 0.05


def _fit(host: np.ndarray, fill: np.ndarray, axis: int, num_pages: int) -> np.ndarray:
    """`host` cut or extended (with `fill`) to `num_pages` along `axis`."""
    have = host.shape[axis]
    if num_pages <= have:
        return host[(slice(None),) * axis + (slice(0, num_pages),)]
    shape = list(host.shape)
    shape[axis] = num_pages - have
    return np.concatenate([host, np.broadcast_to(fill, shape).astype(host.dtype)], axis=axis)


def fits_beside(new_bytes: int, stats: dict | None) -> bool:
    """Whether a device with memory statistics `stats` (`Device.memory_stats()`) has room for
    `new_bytes` more, with `RESIZE_MARGIN` to spare; True where it reports none (CPU, where
    device memory is host memory)."""
    if not stats or not stats.get("bytes_limit"):
        return True
    return new_bytes * (1 + RESIZE_MARGIN) <= stats["bytes_limit"] - stats.get("bytes_in_use", 0)


class PageStore:
    """Owns the device pools that share page ids: `cache` (the target's) and the draft's, kept
    by its proposer (`DFlashProposer.copy_pages`)."""

    def __init__(self, cache: PagedKVCache, *, drafter=None, shapes: ShapeRegistry, num_usable_pages: int):
        self.cache = cache
        self.drafter = drafter
        self.shapes = shapes
        self.num_usable_pages = num_usable_pages
        # One empty page of the target's pools (empty now), to fill pages a resize adds; the
        # draft's context pools start as zeros (speculative/dflash.py).
        self._empty = jax.tree.map(lambda x: x[1:2], (cache.k, cache.v))

    def copy(self, copies: list[tuple[int, int]]) -> None:
        """Copies (source page, destination page) pairs in every pool, in one padded call each."""
        if not copies:
            return
        n = self.padded_size(len(copies))
        self.shapes.note("copy", warmed=False, pages=n)
        src = np.zeros(n, np.int32)  # padding copies the null page onto itself
        dst = np.zeros(n, np.int32)
        src[: len(copies)], dst[: len(copies)] = zip(*copies, strict=True)
        self.cache = copy_pages(self.cache, src, dst)
        if self.drafter is not None:
            self.drafter.copy_pages(src, dst)

    def resize(self, num_pages: int) -> None:
        """Cuts every pool to its first `num_pages` pages, or extends it with empty ones (as
        `Scheduler.resize_pool` left the page ids). In one call (`resize_pools`) where the
        device has room for the new pools beside the old; else through host memory, one leaf
        at a time (`_resize_through_host`), so the device never holds more than the larger of
        the old and the new pools."""
        if self._room_for(num_pages):
            (k, v), pools = resize_pools(*self._resize_args(), num_pages=num_pages)
        else:
            (k, v), pools = self._resize_through_host(num_pages)
        self._set_pools((k, v), pools)
        self.num_usable_pages = num_pages - 1

    def _set_pools(self, target: tuple, draft) -> None:
        """Takes (k, v) and the draft's pools (None without a draft) as this store's."""
        self.cache = self.cache.replace(k=target[0], v=target[1])
        if self.drafter is not None:
            self.drafter.pools = draft

    def _room_for(self, num_pages: int) -> bool:
        """Whether the device can hold pools of `num_pages` pages beside the pools now (what
        the one-call resize allocates before it frees)."""
        leaf = jax.tree.leaves(self.cache.k)[0]
        return fits_beside(num_pages * self.page_bytes, next(iter(leaf.devices())).memory_stats())

    def _resize_through_host(self, num_pages: int) -> tuple:
        """`resize_pools`' result made one leaf at a time: each leaf copied to host memory and
        deleted on the device, then its resized copy put back. Slower (every byte crosses the
        host link twice) but needs no device memory beyond the pools themselves, and no host
        memory beyond one leaf's copy. If putting a leaf back fails (the device ran out after
        all), every leaf goes back at its old size (the failed one from its host copy, those
        already resized read back and cut or extended again), the store keeps its old pools
        and size, and the error is raised."""
        target, empty, draft = self._resize_args()
        empty = jax.tree.map(np.asarray, empty)
        leaves, treedef = jax.tree.flatten((target, draft))
        fills = jax.tree.leaves(empty) + [np.zeros((), x.dtype) for x in jax.tree.leaves(draft)]
        axes = [0] * len(jax.tree.leaves(target)) + [1] * len(jax.tree.leaves(draft))
        resized, previous = [], self.num_usable_pages + 1
        for i, (leaf, fill, axis) in enumerate(zip(leaves, fills, axes, strict=True)):
            sharding = leaf.sharding
            host = np.array(leaf, copy=True)
            leaf.delete()
            try:
                resized.append(jax.device_put(np.ascontiguousarray(_fit(host, fill, axis, num_pages)), sharding))
            except Exception:
                restored = []
                for new, f, ax in zip(resized, fills, axes, strict=False):
                    back, where = np.array(new, copy=True), new.sharding
                    new.delete()
                    restored.append(jax.device_put(np.ascontiguousarray(_fit(back, f, ax, previous)), where))
                restored.append(jax.device_put(host, sharding))
                self._set_pools(*jax.tree.unflatten(treedef, restored + leaves[i + 1 :]))
                raise
            del host
        return jax.tree.unflatten(treedef, resized)

    def lower_resize(self, num_pages: int):
        """`resize` to `num_pages` pages lowered (for `Engine.precompile_pool`, on `abstract()`)."""
        return resize_pools.lower(*self._resize_args(), num_pages=num_pages)

    def _resize_args(self) -> tuple:
        return (self.cache.k, self.cache.v), self._empty, self.drafter.pools if self.drafter is not None else None

    def abstract(self, num_pages: int | None = None) -> PageStore:
        """A copy of this store whose pools are abstract values (shapes and dtypes, no
        buffers) of `num_pages` pages (default: as now), for lowering step calls ahead of a
        resize (`Engine.precompile_pool`) on another thread: it holds none of the live buffers,
        which the next step donates."""
        num_pages = self.num_usable_pages + 1 if num_pages is None else num_pages

        def shape(leaf, axis: int | None = None):
            dims = list(leaf.shape)
            if axis is not None:
                dims[axis] = num_pages
            return jax.ShapeDtypeStruct(tuple(dims), leaf.dtype)

        store = copy.copy(self)
        k, v = jax.tree.map(lambda x: shape(x, 0), (self.cache.k, self.cache.v))
        store.cache = jax.tree.map(shape, self.cache.replace(k=k, v=v))
        if self.drafter is not None:
            store.drafter = copy.copy(self.drafter)
            store.drafter.pools = jax.tree.map(lambda x: shape(x, 1), self.drafter.pools)
        store.num_usable_pages = num_pages - 1
        return store

    # -- page bytes for the lower tiers -----------------------------------------------------------

    def _pools(self) -> list[tuple[object, int]]:
        """Every pool tree sharing page ids and its page axis: the target's keys and values
        (page-major), the draft's context (layer-major)."""
        pools = [((self.cache.k, self.cache.v), 0)]
        if self.drafter is not None:
            pools.append((self.drafter.pools, 1))
        return pools

    def page_layout(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        """(shape, dtype) of one page's slice of every stored leaf, in `read`'s order."""
        layout = []
        for pools, axis in self._pools():
            for leaf in jax.tree.leaves(pools):
                shape = leaf.shape[:axis] + leaf.shape[axis + 1 :]
                layout.append((tuple(shape), np.dtype(leaf.dtype)))
        return layout

    @property
    def page_bytes(self) -> int:
        """Stored bytes per page over every pool."""
        return sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in self.page_layout())

    def fingerprint(self, model_id: str) -> str:
        """SHA-256 of everything that makes stored page bytes meaningful: the model
        (`model_id`), the KV format and its codecs (`PagedKVCache.fingerprint`), the page
        layout of every pool (the draft's included) and the page format version."""
        h = hashlib.sha256(f"{PAGE_FORMAT_VERSION}|{model_id}|{self.cache.fingerprint}".encode())
        for shape, dtype in self.page_layout():
            h.update(f"|{shape}:{dtype.str}".encode())
        if self.drafter is not None:
            h.update(f"|draft:{self.drafter.fingerprint}".encode())
        return h.hexdigest()

    def padded_size(self, num_pages: int) -> int:
        """The bucket `copy`, `read` and `write` pad `num_pages` pages to (one compiled call each)."""
        return bucket(num_pages, 4, max(4, self.num_usable_pages + 1))

    def _padded(self, pages: list[int]) -> np.ndarray:
        """`pages` padded to a bucket by repeating the first (the same bytes written twice)."""
        out = np.full(self.padded_size(len(pages)), pages[0], np.int32)
        out[: len(pages)] = pages
        return out

    def key_summaries(self, pages: list[int], layer: int) -> np.ndarray:
        """Each page's mean decoded key at `layer`: [len(pages), Hkv * Dh] float32."""
        index = self._padded(pages)
        self.shapes.note("summaries", warmed=False, pages=len(index), layer=layer)
        return np.asarray(page_key_summaries(self.cache, index, layer=layer))[: len(pages)]

    def read(self, pages: list[int]) -> list[np.ndarray]:
        """The stored bytes of device `pages`: one [len(pages), ...] host array per leaf of
        every pool (`page_layout`'s order)."""
        index = self._padded(pages)
        rows = []
        for pools, axis in self._pools():
            rows += [np.asarray(r)[: len(pages)] for r in read_pages(pools, index, axis=axis)]
        return rows

    def write(self, pages: list[int], rows: list[np.ndarray]) -> None:
        """Stores `rows` (as `read` returns them) into device `pages` of every pool."""
        index = self._padded(pages)
        pad = len(index) - len(pages)
        rows = [np.concatenate([r, np.repeat(r[:1], pad, axis=0)]) if pad else r for r in rows]
        n = len(jax.tree.leaves((self.cache.k, self.cache.v)))
        k, v = write_pages((self.cache.k, self.cache.v), index, rows[:n], axis=0)
        self.cache = self.cache.replace(k=k, v=v)
        if self.drafter is not None:
            self.drafter.pools = write_pages(self.drafter.pools, index, rows[n:], axis=1)

    def lower_summaries(self, num_pages: int, layer: int):
        """The summaries call of `num_pages` pages at `layer` lowered on padding inputs (for precompiling)."""
        return page_key_summaries.lower(self.cache, np.zeros(num_pages, np.int32), layer=layer)

    def lower_copy(self, num_pages: int):
        """The copy call of `num_pages` pages lowered on padding inputs (for precompiling)."""
        zeros = np.zeros(num_pages, np.int32)
        return copy_pages.lower(self.cache, zeros, zeros)
