"""The KV memory hierarchy below the device: a host pool (warm) and a disk store (cold).

A named full page that the prefix cache evicts from the device is demoted instead of dropped:
its stored bytes (every pool's, the draft's context included, exactly as kept on the device:
TurboQuant codes and norms, not bf16) go to the host pool; when the host pool is full its
least recently used page spills to disk (with `--kv-cache-dir`), and when the disk is full its
least recently used page is dropped, to be recomputed if it is ever needed again. A lookup
that runs past the device's cached pages continues here: pages found on host or disk are
promoted, written back into fresh device pages, instead of recomputed.

Pages keep their chain names (already salted per tenant), so a tier never serves one tenant's
page to another. The host keeps its copy of a promoted page (its bytes never change), so
demoting it again costs nothing. Moves are made while the scheduler plans a step, before the
step runs, in batches (one device read for all the pages one eviction demotes, one write for
all the pages one admission promotes). Disk files are written and read on the disk store's I/O
thread: a spill costs the engine thread a copy into memory, and the pages of requests still
waiting for a slot are read ahead (`stage`) so that promoting them finds their bytes in memory.
A promotion is dispatched without waiting for the device to finish the write; one in
`TIME_EVERY` is waited for and timed, to keep the reload-or-recompute cost model measured.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import time
from collections.abc import Sequence

import jax
import numpy as np

from aither_jax.kv.disk import DiskStore
from aither_jax.kv.store import PageStore

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TierCounters:
    """What moved between tiers (pages unless named otherwise), read by the metrics."""

    num_demoted: int = 0  # device -> host (or straight to disk without a host pool)
    num_spilled: int = 0  # host -> disk
    num_host_dropped: int = 0  # left the host with nowhere to go
    num_host_hits: int = 0  # pages promoted from host
    num_disk_hits: int = 0  # pages promoted from disk
    num_prefetched: int = 0  # pages promoted for requests still waiting (below the low watermark)
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    promote_seconds: float = 0.0  # engine-thread time spent promoting, over all promotions


class ReloadCost:
    """Whether reloading a prompt's pages from the tiers beats recomputing them, from measured
    speeds: bytes per second promoted from host and from disk, prompt tokens per second
    prefilled (exponential moving averages). With no measurement yet of either side it
    reloads (on the CPU and on PCIe a reload is normally far faster than recompute)."""

    SMOOTHING = 0.3
    # Only a reload measures reloading: after this many recompute decisions in a row one
    # reloads anyway (`recheck`, and its promotion is timed), so a stale estimate can flip back.
    RECHECK_EVERY = 32

    def __init__(self):
        self.host_bytes_per_s: float | None = None
        self.disk_bytes_per_s: float | None = None
        self.prefill_tokens_per_s: float | None = None
        self.num_reload = 0  # decisions
        self.num_recompute = 0
        self.recheck = False  # a reload decided to measure: the next promotion is timed
        self._recomputes_in_a_row = 0

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.SMOOTHING) * old + self.SMOOTHING * new

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s = self._ema(self.prefill_tokens_per_s, num_tokens / seconds)

    def observe_reload(self, host_bytes: int, disk_bytes: int, seconds: float) -> None:
        """One promotion's bytes by source and its time. From one tier alone it measures that
        tier; from both, the tier with a known speed is charged its share at that speed and the
        rest of the time measures the other (with neither known, both take the blended rate)."""
        total = host_bytes + disk_bytes
        if total <= 0 or seconds <= 0:
            return
        host, disk = self.host_bytes_per_s, self.disk_bytes_per_s
        if host_bytes and disk_bytes and (host is not None or disk is not None):
            if host is not None:
                left = seconds - host_bytes / host
                if left > 0:
                    self.disk_bytes_per_s = self._ema(disk, disk_bytes / left)
            else:
                left = seconds - disk_bytes / disk
                if left > 0:
                    self.host_bytes_per_s = self._ema(host, host_bytes / left)
            return
        rate = total / seconds
        if host_bytes:
            self.host_bytes_per_s = self._ema(host, rate)
        if disk_bytes:
            self.disk_bytes_per_s = self._ema(disk, rate)

    def estimate(self, host_bytes: int, disk_bytes: int, num_tokens: int) -> tuple[float | None, float | None]:
        """(seconds to reload, seconds to recompute), None where nothing is measured yet."""
        reload = 0.0
        for nbytes, rate in ((host_bytes, self.host_bytes_per_s), (disk_bytes, self.disk_bytes_per_s)):
            if nbytes:
                if rate is None:
                    reload = None
                    break
                reload += nbytes / rate
        recompute = None if self.prefill_tokens_per_s is None else num_tokens / self.prefill_tokens_per_s
        return reload, recompute

    def reload(self, host_bytes: int, disk_bytes: int, num_tokens: int, *, count=True) -> bool:
        """Decides whether to reload these bytes rather than recompute the tokens (`count`:
        counts the decision, for a request it is admitted with)."""
        reload_s, recompute_s = self.estimate(host_bytes, disk_bytes, num_tokens)
        choice = reload_s is None or recompute_s is None or reload_s <= recompute_s
        if not count:
            return choice
        if not choice and self._recomputes_in_a_row + 1 >= self.RECHECK_EVERY:
            choice = self.recheck = True
        if choice:
            self.num_reload += 1
            self._recomputes_in_a_row = 0
        else:
            self.num_recompute += 1
            self._recomputes_in_a_row += 1
        log.debug(
            "KV tiers: %s %d tokens (reload ~%s s, recompute ~%s s)",
            "reloading" if choice else "recomputing", num_tokens, _secs(reload_s), _secs(recompute_s),
        )  # fmt: skip
        return choice


def _secs(x: float | None) -> str:
    return "?" if x is None else f"{x:.4f}"


def page_payload(rows: Sequence[np.ndarray], i: int) -> bytes:
    """Page `i`'s bytes from per-leaf rows ([n, ...] each, as `PageStore.read` returns them),
    every leaf in order: what the disk store keeps."""
    return b"".join(row[i].tobytes() for row in rows)


class HostPool:
    """Pages in host memory: one array per stored leaf, [capacity, *page shape], and a free
    list. (On CPU this is a separate allocation with the device pool's layout.)"""

    def __init__(self, layout: Sequence[tuple[tuple[int, ...], np.dtype]], capacity: int):
        self.layout = list(layout)
        self.capacity = capacity
        self.arrays = [np.zeros((capacity, *shape), dtype) for shape, dtype in self.layout]
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def write(self, slots: Sequence[int], rows: Sequence[np.ndarray]) -> None:
        for array, row in zip(self.arrays, rows, strict=True):
            array[list(slots)] = row

    def read(self, slots: Sequence[int]) -> list[np.ndarray]:
        return [array[list(slots)] for array in self.arrays]

    def payload(self, slot: int) -> bytes:
        """One page's bytes, every leaf in order (what the disk store keeps)."""
        return page_payload(self.arrays, slot)

    def unpack(self, payloads: Sequence[bytes]) -> list[np.ndarray]:
        """`payload`'s inverse for several pages: one [n, ...] array per leaf."""
        rows, offset = [], 0
        for shape, dtype in self.layout:
            count = int(np.prod(shape))
            pages = [np.frombuffer(p, dtype, count=count, offset=offset) for p in payloads]
            rows.append(np.stack(pages).reshape(len(payloads), *shape))
            offset += count * dtype.itemsize
        return rows


class KVTiers:
    """The host pool and the disk store under one device page store.

    Holds, per page name, where its bytes are below the device; the prefix cache asks it
    whether a name is held (`holds`), hands it the pages it evicts (`demote`), and has it fill
    fresh device pages from below (`promote`).
    """

    TIME_EVERY = 8  # promotions between two timed ones (the first of each size only compiles)

    def __init__(
        self,
        store: PageStore,
        *,
        host_pages: int,
        disk: DiskStore | None = None,
        high_watermark=1.0,
        low_watermark=0.0,
    ):
        if host_pages < 0:
            raise ValueError(f"host_pages must be >= 0, got {host_pages}")
        if host_pages == 0 and disk is None:
            raise ValueError("a KV tier needs a host pool or a disk store")
        self.store = store
        self.host = HostPool(store.page_layout(), host_pages)
        self.disk = disk
        self.page_bytes = store.page_bytes
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        # name -> (host slot, parent name), least recently used first.
        self._host: collections.OrderedDict[bytes, tuple[int, bytes | None]] = collections.OrderedDict()
        self.counters = TierCounters()
        self.cost = ReloadCost()
        self._sizes: set[int] = set()  # padded promotion sizes already compiled
        self._num_promotions = 0
        self._lost: list[bytes] = []  # names that left the host with nowhere to go (`take_lost`)

    def should_reload(self, names: Sequence[bytes], num_tokens: int, *, count=True) -> bool:
        """The cost model's choice for a run of lower-tier pages holding `num_tokens` tokens."""
        on_host = sum(1 for n in names if n in self._host)
        host, disk = on_host * self.page_bytes, (len(names) - on_host) * self.page_bytes
        return self.cost.reload(host, disk, num_tokens, count=count)

    def stage(self, names: Sequence[bytes]) -> int:
        """Starts reading the disk-only pages among `names` in the background."""
        if self.disk is None:
            return 0
        return self.disk.stage([n for n in names if n not in self._host])

    @property
    def num_host_pages(self) -> int:
        return len(self._host)

    @property
    def num_disk_pages(self) -> int:
        return len(self.disk) if self.disk is not None else 0

    def parent(self, name: bytes) -> bytes | None:
        """The chain parent of a page held below the device (None for a chain's first page)."""
        if name in self._host:
            return self._host[name][1]
        return self.disk.parent(name)

    def meta(self, name: bytes) -> dict | None:
        """The block metadata a page held below the device was demoted with."""
        if name in self._host:
            return self._host[name][2]
        return self.disk.meta(name) if self.disk is not None else None

    def holds(self, name: bytes) -> bool:
        return name in self._host or (self.disk is not None and name in self.disk)

    def take_lost(self) -> list[bytes]:
        """The names of the pages dropped from the tiers since the last call (host pages with no
        disk, disk pages dropped), none of them held below the device any more: their bytes
        are gone, to be recomputed if ever needed."""
        lost, self._lost = self._lost, []
        if self.disk is not None:
            while self.disk.lost:
                lost.append(self.disk.lost.popleft())
        return [n for n in lost if not self.holds(n)]

    def touch(self, names: Sequence[bytes]) -> None:
        """Makes `names` the most recently used host pages (last first), so that demotions
        made while they are promoted do not spill them."""
        for name in reversed(names):
            if name in self._host:
                self._host.move_to_end(name)

    # -- down ---------------------------------------------------------------------------------

    def demote(self, pages: Sequence[tuple[bytes, bytes | None, int]]) -> None:
        """Keeps the bytes of device pages about to be dropped: (name, parent, page, block
        metadata or None) each."""
        todo = []
        for name, parent, page, meta in pages:
            if name in self._host:  # its bytes are kept already; what its record knows is newer
                slot, held_parent, held_meta = self._host[name]
                self._host[name] = (slot, held_parent, meta or held_meta)
                self._host.move_to_end(name)
            elif self.host.capacity == 0 and self.disk is not None and name in self.disk:
                self.disk.touch(name, meta)  # on disk already: only its order and metadata change
                continue
            else:
                todo.append((name, parent, page, meta))
        if not todo:
            return
        rows = self.store.read([page for _, _, page, _ in todo])
        self.counters.num_demoted += len(todo)
        self.counters.bytes_to_host += len(todo) * self.page_bytes
        if self.host.capacity == 0:  # no host pool: straight to disk
            for i, (name, parent, _, meta) in enumerate(todo):
                self.disk.write(name, parent, page_payload(rows, i), meta)
            return
        # More pages than the host holds: the first ones (least recently used) go on down.
        over = max(len(todo) - self.host.capacity, 0)
        for i, (name, parent, _, meta) in enumerate(todo[:over]):
            if self.disk is not None:
                self.disk.write(name, parent, page_payload(rows, i), meta)
                self.counters.num_spilled += 1
            else:
                self.counters.num_host_dropped += 1
                self._lost.append(name)
        todo, rows = todo[over:], [r[over:] for r in rows]
        slots = []
        for name, parent, _, meta in todo:
            if not self.host.num_free:
                self._spill()
            slot = self.host.allocate()
            self._host[name] = (slot, parent, meta)
            slots.append(slot)
        self.host.write(slots, rows)

    def spill(self, n: int | None = None) -> int:
        """Moves the `n` least recently used host pages (all by default) to disk, or drops them
        without one; returns how many left the host."""
        n = len(self._host) if n is None else min(n, len(self._host))
        for _ in range(n):
            self._spill()
        return n

    def _spill(self) -> None:
        """Frees the least recently used host page, writing it to disk if there is one."""
        name, (slot, parent, meta) = self._host.popitem(last=False)
        if self.disk is not None:
            self.disk.write(name, parent, self.host.payload(slot), meta)
            self.counters.num_spilled += 1
        else:
            self.counters.num_host_dropped += 1
            self._lost.append(name)
        self.host.free(slot)

    def flush(self, device: Sequence[tuple[bytes, bytes | None, int]] = ()) -> int:
        """Writes every host page, and the named `device` pages (as `demote` takes them),
        to disk (a clean shutdown), so a restart finds them all; returns the pages written."""
        if self.disk is None:
            return 0
        device = [d for d in device if d[0] not in self._host and d[0] not in self.disk]
        written = 0
        # Least recently used first, so that a full disk keeps the most recent: the host's
        # pages (oldest first), then the device's.
        for name, (slot, parent, meta) in self._host.items():
            if not self.disk.touch(name, meta):
                self.disk.write(name, parent, self.host.payload(slot), meta)
                written += 1
        if device:
            rows = self.store.read([page for _, _, page, _ in device])
            for i, (name, parent, _, meta) in enumerate(device):
                self.disk.write(name, parent, page_payload(rows, i), meta)
        self.disk.sync()
        return written + len(device)

    # -- up -----------------------------------------------------------------------------------

    def promote(self, names: Sequence[bytes], pages: Sequence[int]) -> int:
        """Fills device `pages` with the bytes of `names` (a run of one chain, each held below
        the device); stops at the first whose bytes cannot be read back (a corrupt disk file)
        and returns how many pages were filled."""
        start = time.perf_counter()
        found = []  # per page in chain order: its leaves, [1, ...] each
        num_host = 0
        for name in names:
            if name in self._host:
                self._host.move_to_end(name)
                found.append(self.host.read([self._host[name][0]]))
                num_host += 1
                continue
            payload = self.disk.read(name) if self.disk is not None else None
            if payload is None:
                break
            found.append(self.host.unpack([payload]))
        n = len(found)
        if n == 0:
            return 0
        rows = [np.concatenate(leaf) for leaf in zip(*found, strict=True)]
        self.store.write(list(pages[:n]), rows)
        size = self.store.padded_size(n)
        # A first call of a size compiles (not a transfer speed); other calls are timed, to the
        # end of the device write, while nothing is measured and then one in TIME_EVERY.
        timed = size in self._sizes and (
            self._num_promotions % self.TIME_EVERY == 0
            or self.cost.recheck
            or (num_host and self.cost.host_bytes_per_s is None)
            or (num_host < n and self.cost.disk_bytes_per_s is None)
        )
        self.cost.recheck = self.cost.recheck and not timed
        self._sizes.add(size)
        self._num_promotions += 1
        if timed:
            jax.block_until_ready(self.store.cache.k)
        seconds = time.perf_counter() - start
        if timed:
            self.cost.observe_reload(num_host * self.page_bytes, (n - num_host) * self.page_bytes, seconds)
        self.counters.num_host_hits += num_host
        self.counters.num_disk_hits += n - num_host
        self.counters.bytes_to_device += n * self.page_bytes
        self.counters.promote_seconds += seconds
        return n


GIB = 1 << 30
DEFAULT_DISK_GIB = 4.0

DEFAULT_LOW_WATERMARK = 0.5


def physical_memory() -> int | None:
    """This machine's memory in bytes, where the system says."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@dataclasses.dataclass(frozen=True)
class TierConfig:
    """The lower tiers' sizes: `host_gib` of host memory (vLLM's --kv-offloading-size), and a
    disk store of `disk_gib` in `disk_dir` that survives restarts (--kv-cache-dir)."""

    host_gib: float = 0.0
    disk_dir: str | None = None
    disk_gib: float | None = None  # default DEFAULT_DISK_GIB with a directory
    # Between steps, idle cached pages beyond this share of the device pool are demoted ahead
    # of need, so that admitting a request rarely waits on a device -> host copy.
    high_watermark: float = 0.8
    # Between steps, while less than this share is in use, the lower-tier pages of requests
    # waiting for a slot are promoted ahead, so that their admission needs no copy. None:
    # DEFAULT_LOW_WATERMARK, or the high watermark if that is lower.
    low_watermark: float | None = None

    def __post_init__(self):
        if self.low_watermark is None:
            high = self.high_watermark if isinstance(self.high_watermark, int | float) else 1.0
            object.__setattr__(self, "low_watermark", min(DEFAULT_LOW_WATERMARK, high))
        for name, lowest in (("high_watermark", "(0"), ("low_watermark", "[0")):
            w = getattr(self, name)
            if isinstance(w, bool) or not isinstance(w, int | float) or not 0 <= w <= 1 or (w == 0 and lowest == "(0"):
                raise ValueError(f"{name} must be in {lowest}, 1], got {w!r}")
        if self.low_watermark > self.high_watermark:
            raise ValueError(
                f"low_watermark ({self.low_watermark}) must not exceed high_watermark ({self.high_watermark})"
            )
        for name in ("host_gib", "disk_gib"):
            value = getattr(self, name)
            if value is None and name == "disk_gib":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a size in GiB >= 0, got {value!r}")
        memory = physical_memory()
        if memory and self.host_gib * GIB > memory:
            raise ValueError(f"host_gib {self.host_gib} GiB exceeds this machine's memory ({memory / GIB:.1f} GiB)")
        if self.disk_gib is not None and self.disk_dir is None:
            raise ValueError("a disk tier size needs a directory (kv_cache_dir)")
        if self.disk_dir is not None and not str(self.disk_dir).strip():
            raise ValueError("kv_cache_dir must name a directory, got an empty path")

    @property
    def enabled(self) -> bool:
        return self.host_gib > 0 or self.disk_dir is not None

    def build(self, store: PageStore, model_id: str) -> KVTiers:
        """The tiers under `store`, sized in its pages. Raises ValueError for a size that holds
        less than one page, DiskStoreError for a directory that cannot be used."""
        page_bytes = store.page_bytes
        host_pages = int(self.host_gib * GIB) // page_bytes
        if self.host_gib > 0 and host_pages < 1:
            raise ValueError(f"kv_offloading_size {self.host_gib} GiB holds less than one KV page ({page_bytes} bytes)")
        disk = None
        if self.disk_dir is not None:
            gib = DEFAULT_DISK_GIB if self.disk_gib is None else self.disk_gib
            disk_pages = int(gib * GIB) // page_bytes
            if disk_pages < 1:
                raise ValueError(f"kv_disk_size {gib} GiB holds less than one KV page ({page_bytes} bytes)")
            disk = DiskStore(
                self.disk_dir,
                fingerprint=store.fingerprint(model_id),
                page_bytes=page_bytes,
                capacity=disk_pages,
                background=True,
            )
        return KVTiers(
            store,
            host_pages=host_pages,
            disk=disk,
            high_watermark=self.high_watermark,
            low_watermark=self.low_watermark,
        )
