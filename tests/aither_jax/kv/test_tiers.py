"""The host and disk tiers: pages leave the device and come back byte for byte, for every KV
format and both models; the prefix cache demotes instead of dropping and promotes on lookup."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from aither_jax.compile.shapes import ShapeRegistry
from aither_jax.eviction.graph import EdgeType
from aither_jax.eviction.policy import AdvisorPolicy, LRUPolicy
from aither_jax.kv.allocator import PageAllocator
from aither_jax.kv.disk import DiskStore, DiskStoreError
from aither_jax.kv.prefix_cache import PrefixCache, hash_chain
from aither_jax.kv.store import PageStore, fits_beside
from aither_jax.kv.tiers import KVTiers, TierConfig
from aither_jax.speculative.dflash import DraftPools
from models.config import ModelConfig
from models.gguf_file import GGUFFile
from models.kv_cache import init_cache
from models.kv_spec import parse_kv_spec
from models.kv_transform import load_key_transforms
from models.registry import resolve_model

NUM_PAGES = 24
PAGE = 4


class FakeDraft:
    """A draft's context pools ([L, P, ...], layer-major like DFlashProposer's)."""

    fingerprint = "draft"

    def __init__(self, rng, num_pages: int):
        shape = (2, num_pages, PAGE, 1, 8)
        self.pools = DraftPools(*(jax.numpy.asarray(rng.standard_normal(shape), jax.numpy.bfloat16) for _ in "kv"))


def random_bytes(rng, tree):
    """`tree` with every leaf's bytes random (any bit pattern must survive a roundtrip)."""

    def fill(leaf):
        raw = rng.integers(0, 256, leaf.size * leaf.dtype.itemsize, dtype=np.uint8)
        return jax.numpy.asarray(raw.view(leaf.dtype).reshape(leaf.shape))

    return jax.tree.map(fill, tree)


def store_for(model: str, kv: str, rng, *, draft: bool = False) -> PageStore:
    cfg = ModelConfig.from_gguf(GGUFFile(resolve_model(model)))
    transform = None
    if parse_kv_spec(kv).precondition:
        transform = load_key_transforms(model, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    cache = init_cache(
        cfg, num_pages=NUM_PAGES, max_seqs=1, max_pages_per_seq=4, page_size=PAGE, kv_cache_dtype=kv,
        key_transform=transform,
    )  # fmt: skip
    cache = cache.replace(k=random_bytes(rng, cache.k), v=random_bytes(rng, cache.v))
    drafter = FakeDraft(rng, NUM_PAGES) if draft else None
    return PageStore(cache, drafter=drafter, shapes=ShapeRegistry(), num_usable_pages=NUM_PAGES - 1)


def page_bytes(store: PageStore, pages: list[int]) -> list[bytes]:
    """Each page's stored bytes over every pool."""
    rows = store.read(pages)
    return [b"".join(row[i].tobytes() for row in rows) for i in range(len(pages))]


FORMATS = [
    ("smollm2-135m", "bf16", False),
    ("smollm2-135m", "fp32", True),  # with a draft's context pools beside the target's
    ("smollm2-135m", "tq-k6v4-s2", False),  # sinks
    ("smollm2-135m", "tq4-pc", False),  # the fitted key transform
    ("smollm2-135m", "tq3.5", False),  # split groups
    ("smollm2-135m", "turboquant", False),  # the measured format: per-layer groups, key transform, sinks
    ("gemma3-270m", "bf16", False),  # sliding-window layers
    ("gemma3-270m", "turboquant", False),
]


@pytest.mark.parametrize(("model", "kv", "draft"), FORMATS)
def test_pages_roundtrip_device_host_disk_device_byte_exact(model, kv, draft, tmp_path):
    from models.registry import resolve_kv_cache_dtype

    rng = np.random.default_rng(0)
    kv = resolve_kv_cache_dtype(kv, model)
    store = store_for(model, kv, rng, draft=draft)
    disk = DiskStore(tmp_path, fingerprint=store.fingerprint(model), page_bytes=store.page_bytes, capacity=40)
    tiers = KVTiers(store, host_pages=6, disk=disk)  # a small host pool: most sets spill to disk
    expected: dict[bytes, bytes] = {}
    for i in range(1000):
        pages = rng.choice(np.arange(1, NUM_PAGES), size=rng.integers(1, 5), replace=False).tolist()
        names = [bytes([i % 256, i // 256, j]) * 11 for j in range(len(pages))]
        expected.update(zip(names, page_bytes(store, pages), strict=True))
        tiers.demote([(name, None, page, None) for name, page in zip(names, pages, strict=True)])
        # Bring back a random run of what is held, into random device pages.
        held = [n for n in expected if tiers.holds(n)]
        back = [held[j] for j in rng.choice(len(held), size=min(len(held), rng.integers(1, 5)), replace=False)]
        dst = rng.choice(np.arange(1, NUM_PAGES), size=len(back), replace=False).tolist()
        assert tiers.promote(back, dst) == len(back)
        assert page_bytes(store, dst) == [expected[name] for name in back]
    assert tiers.counters.num_host_hits and tiers.counters.num_disk_hits and tiers.counters.num_spilled
    assert disk.counters.num_dropped  # the disk tier stayed within its 40 pages
    assert disk.counters.num_corrupt == 0


def chain_cache(tiers_store=None, *, host_pages=2, disk=None, num_pages=6, policy=None):
    allocator = PageAllocator(num_pages)
    cache = PrefixCache(allocator, PAGE, max_pinned_pages=2, policy=policy or LRUPolicy())
    if tiers_store is not None:
        cache.tiers = KVTiers(tiers_store, host_pages=host_pages, disk=disk)
    return cache


def test_the_prefix_cache_demotes_evicted_pages_and_finds_them_below_the_device():
    store = store_for("smollm2-135m", "tq4", np.random.default_rng(1))
    cache = chain_cache(store, host_pages=3)
    names = hash_chain(b"salt", list(range(12)), PAGE)
    pages = cache.allocator.allocate(3)
    for i, (name, page) in enumerate(zip(names, pages, strict=True)):
        cache.insert(name, page, names[i - 1] if i else None)
    before = page_bytes(store, pages)
    for i, page in enumerate(pages):  # what the block records knew travels with the bytes
        block = cache.blocks[page]
        block.source_tag, block.importance, block.token_range = "identity", 1.0 - i / 10, (4 * i, 4 * i + 4)
        block.reuse_interval = 30.0 + i
    cache.allocator.free(pages)
    assert cache.evict(3) == 3 and cache.match(names) == []
    assert cache.match_lower(names) == names and cache.tiers.num_host_pages == 3
    # Another tenant's chain over the same tokens has other names: nothing below serves it.
    assert cache.match_lower(hash_chain(b"other", list(range(12)), PAGE)) == []
    fresh = cache.allocator.allocate(3)
    assert cache.promote(names, fresh, None) == 3
    assert page_bytes(store, fresh) == before
    cache.allocator.free(fresh)  # the sequence's references; the cache keeps its own
    assert cache.match(names) == fresh and cache.match_lower(names) == []
    assert [cache.blocks[p].parent for p in fresh] == [None, *names[:2]]
    assert [(cache.blocks[p].source_tag, cache.blocks[p].importance) for p in fresh] == [
        ("identity", 1.0),
        ("identity", 0.9),
        ("identity", 0.8),
    ]
    assert [cache.blocks[p].token_range for p in fresh] == [(0, 4), (4, 8), (8, 12)]
    assert [cache.blocks[p].reuse_interval for p in fresh] == [30.0, 31.0, 32.0]


def test_a_chain_comes_back_up_to_a_page_that_fails_its_checksum(tmp_path):
    store = store_for("smollm2-135m", "bf16", np.random.default_rng(2))
    disk = DiskStore(tmp_path, fingerprint="f", page_bytes=store.page_bytes, capacity=8)
    tiers = KVTiers(store, host_pages=0, disk=disk)  # straight to disk
    names = [b"a" * 32, b"b" * 32, b"c" * 32]
    tiers.demote([(n, None, p, None) for n, p in zip(names, [1, 2, 3], strict=True)])
    path = disk.dir / (names[1].hex() + ".kvpage")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert tiers.promote(names, [4, 5, 6]) == 1
    assert disk.counters.num_corrupt == 1 and names[1] not in disk and not path.exists()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (dict(host_gib=-1), "host_gib must be a size in GiB >= 0"),
        (dict(host_gib="1"), "host_gib must be a size"),
        (dict(disk_gib=1.0), "needs a directory"),
        (dict(host_gib=1e-9), "holds less than one KV page"),
        (dict(disk_dir="DIR", disk_gib=1e-9), "holds less than one KV page"),
        (dict(high_watermark=0), "high_watermark must be in \\(0, 1\\]"),
        (dict(low_watermark=1.5), "low_watermark must be in \\[0, 1\\]"),
        (dict(high_watermark=0.6, low_watermark=0.7), "must not exceed high_watermark"),
        (dict(host_gib=float("inf")), "host_gib must be a size in GiB >= 0"),
        (dict(disk_dir="DIR", disk_gib=float("inf")), "disk_gib must be a size in GiB >= 0"),
        (dict(host_gib=1 << 20), "exceeds this machine's memory"),
        (dict(disk_dir=""), "kv_cache_dir must name a directory"),
    ],
)
def test_tier_settings_are_checked(config, message, tmp_path):
    store = store_for("smollm2-135m", "bf16", np.random.default_rng(3))
    if config.get("disk_dir") == "DIR":
        config["disk_dir"] = str(tmp_path)
    with pytest.raises(ValueError, match=message):
        TierConfig(**config).build(store, "model")


def test_a_disk_tier_in_a_directory_that_cannot_be_written_is_refused(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(DiskStoreError, match="cannot be created"):
        DiskStore(blocked / "sub", fingerprint="f", page_bytes=8, capacity=1)


def test_the_cost_model_reloads_unless_recomputing_is_measured_faster():
    from aither_jax.kv.tiers import ReloadCost

    cost = ReloadCost()
    assert cost.reload(1 << 20, 0, 64)  # nothing measured: reload
    cost.observe_prefill(1000, 1.0)  # 1,000 tokens/s
    cost.observe_reload(1 << 20, 0, 0.01)  # 100 MiB/s from host
    assert cost.estimate(1 << 20, 0, 64) == pytest.approx((0.01, 0.064))
    assert cost.reload(1 << 20, 0, 64)
    assert not cost.reload(100 << 20, 0, 64)  # 1 s to reload what recomputes in 0.064 s
    assert cost.reload(0, 1 << 20, 64)  # disk speed not measured yet
    assert (cost.num_reload, cost.num_recompute) == (3, 1)


def test_a_mixed_promotion_measures_the_tier_whose_speed_is_unknown():
    from aither_jax.kv.tiers import ReloadCost

    cost = ReloadCost()
    cost.observe_reload(1 << 20, 1 << 20, 0.02)  # nothing known: both take the blended rate
    assert cost.host_bytes_per_s == cost.disk_bytes_per_s == pytest.approx(100 << 20)
    cost = ReloadCost()
    cost.observe_reload(1 << 20, 0, 0.01)  # 100 MiB/s from host
    cost.observe_reload(1 << 20, 1 << 20, 0.11)  # the host's 0.01 s, then 0.1 s for the disk's MiB
    assert cost.host_bytes_per_s == pytest.approx(100 << 20)
    assert cost.disk_bytes_per_s == pytest.approx(10 << 20)


def test_a_run_of_recompute_decisions_ends_in_a_timed_reload():
    """Only reloading measures reloads: a stale estimate that says recompute would never be
    corrected, so every RECHECK_EVERY-th decision in a row reloads, and is timed."""
    from aither_jax.kv.tiers import ReloadCost

    cost = ReloadCost()
    cost.observe_prefill(1000, 1.0)
    cost.observe_reload(1 << 20, 0, 1.0)  # a slow first measurement: 1 MiB/s
    decisions = [cost.reload(1 << 20, 0, 64) for _ in range(2 * cost.RECHECK_EVERY)]
    assert decisions.count(True) == 2 and decisions[cost.RECHECK_EVERY - 1] and cost.recheck
    assert not cost.reload(1 << 20, 0, 64, count=False)  # a look ahead (prefetch) decides nothing


def test_the_low_watermark_defaults_to_half_or_the_high_one():
    assert TierConfig().low_watermark == 0.5 and TierConfig(high_watermark=0.3).low_watermark == 0.3
    assert TierConfig(low_watermark=0).low_watermark == 0


@pytest.mark.parametrize("disk", [False, True])
def test_a_demotion_larger_than_the_host_pool_sends_its_oldest_pages_on_down(disk, tmp_path):
    store = store_for("smollm2-135m", "bf16", np.random.default_rng(4))
    below = DiskStore(tmp_path, fingerprint="f", page_bytes=store.page_bytes, capacity=8) if disk else None
    tiers = KVTiers(store, host_pages=2, disk=below)
    names = [bytes([i]) * 32 for i in range(5)]
    before = page_bytes(store, [1, 2, 3, 4, 5])
    tiers.demote([(n, None, p, None) for n, p in zip(names, [1, 2, 3, 4, 5], strict=True)])
    c = tiers.counters
    assert tiers.num_host_pages == 2 and all(tiers.holds(n) == disk for n in names[:3])
    assert (c.num_spilled, c.num_host_dropped) == ((3, 0) if disk else (0, 3))
    assert tiers.take_lost() == ([] if disk else names[:3]) and tiers.take_lost() == []
    if disk:
        assert tiers.promote(names, [6, 7, 8, 9, 10]) == 5
        assert page_bytes(store, [6, 7, 8, 9, 10]) == before


def test_a_flush_onto_a_full_disk_keeps_the_most_recent_pages_and_counts_what_it_wrote(tmp_path):
    store = store_for("smollm2-135m", "bf16", np.random.default_rng(6))
    below = DiskStore(tmp_path, fingerprint="f", page_bytes=store.page_bytes, capacity=2)
    tiers = KVTiers(store, host_pages=2, disk=below)
    host, device = [bytes([i]) * 32 for i in (2, 3)], [bytes([i]) * 32 for i in (7, 8)]
    tiers.demote([(n, None, p, None) for n, p in zip(host, [2, 3], strict=True)])
    assert tiers.flush([(n, None, p, None) for n, p in zip(device, [7, 8], strict=True)]) == 4
    assert [n in below for n in host + device] == [False, False, True, True]  # the device's pages are newest
    assert tiers.flush() == 2  # the host's pages again (the disk dropped them)
    assert tiers.flush() == 0  # all on disk now


@pytest.mark.parametrize("host_pages", [2, 0])
def test_a_page_demoted_again_keeps_what_its_record_knows_now(host_pages, tmp_path):
    store = store_for("smollm2-135m", "bf16", np.random.default_rng(5))
    below = DiskStore(tmp_path, fingerprint="f", page_bytes=store.page_bytes, capacity=8)
    tiers = KVTiers(store, host_pages=host_pages, disk=below)
    name = bytes([7]) * 32
    tiers.demote([(name, None, 1, {"hits": 1, "importance": 0.1})])
    assert tiers.promote([name], [2]) == 1
    tiers.demote([(name, None, 2, {"hits": 9, "importance": 0.9})])
    assert tiers.meta(name) == {"hits": 9, "importance": 0.9}


@pytest.mark.parametrize("model, kv, draft", [FORMATS[1], FORMATS[5]], ids=["fp32+draft", "turboquant"])
def test_a_resize_through_host_memory_equals_the_one_call_resize(model, kv, draft, monkeypatch):
    """Where the device has no room for the new pools beside the old ones, a resize goes
    through host memory one leaf at a time, each old leaf deleted on the device before its
    new one is put there. Shrunk or grown, every pool (the draft's too) comes out byte for
    byte as the one-call resize makes it."""
    from models.registry import resolve_kv_cache_dtype

    kv = resolve_kv_cache_dtype(kv, model)
    for num_pages in (NUM_PAGES - 8, NUM_PAGES + 8):
        one_call, through_host = (store_for(model, kv, np.random.default_rng(0), draft=draft) for _ in range(2))
        monkeypatch.setattr(through_host, "_room_for", lambda n: False)
        old = jax.tree.leaves(
            (through_host.cache.k, through_host.cache.v, through_host.drafter.pools if draft else None)
        )
        one_call.resize(num_pages)
        through_host.resize(num_pages)
        assert all(leaf.is_deleted() for leaf in old)
        assert through_host.num_usable_pages == num_pages - 1
        pages = list(range(num_pages))
        assert page_bytes(through_host, pages) == page_bytes(one_call, pages)
        layout = [np.asarray(x).shape for x in jax.tree.leaves((through_host.cache.k, through_host.cache.v))]
        assert layout == [np.asarray(x).shape for x in jax.tree.leaves((one_call.cache.k, one_call.cache.v))]


def test_a_device_has_room_for_a_one_call_resize_only_with_margin_to_spare():
    gib = 1 << 30
    assert fits_beside(10 * gib, None) and fits_beside(10 * gib, {})  # no statistics (CPU)
    assert fits_beside(10 * gib, {"bytes_limit": 20 * gib, "bytes_in_use": 9 * gib})
    assert not fits_beside(10 * gib, {"bytes_limit": 20 * gib, "bytes_in_use": 10 * gib})  # no margin left


@pytest.mark.parametrize("fail_at", [2, 4], ids=["target leaf", "draft leaf"])
@pytest.mark.parametrize("num_pages", [NUM_PAGES + 8, NUM_PAGES - 8], ids=["grow", "shrink"])
def test_a_resize_through_host_memory_that_fails_puts_the_old_pools_back(fail_at, num_pages, monkeypatch):
    """If the device refuses a resized leaf midway (out of memory after all), every leaf goes
    back at the old size: the failed one from its host copy, those already resized read back.
    The store keeps its size and the bytes of every page the smaller size holds, and raises."""
    import aither_jax.kv.store as store_module

    store = store_for("smollm2-135m", "fp32", np.random.default_rng(0), draft=True)
    monkeypatch.setattr(store, "_room_for", lambda n: False)
    kept = list(range(min(num_pages, NUM_PAGES)))
    before = page_bytes(store, kept)
    draft_before = [np.asarray(x)[:, : len(kept)] for x in jax.tree.leaves(store.drafter.pools)]
    real_put, calls = jax.device_put, []

    def put(x, *args, **kwargs):
        calls.append(np.shape(x))
        if len(calls) == fail_at:  # k, v, then the draft's two pools
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        return real_put(x, *args, **kwargs)

    monkeypatch.setattr(store_module.jax, "device_put", put)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        store.resize(num_pages)
    monkeypatch.setattr(store_module.jax, "device_put", real_put)
    assert store.num_usable_pages == NUM_PAGES - 1
    shapes = [x.shape for x in jax.tree.leaves((store.cache.k, store.cache.v, store.drafter.pools))]
    assert [s[0] for s in shapes[:2]] == [NUM_PAGES] * 2 and [s[1] for s in shapes[2:]] == [NUM_PAGES] * 2
    assert page_bytes(store, kept) == before
    draft_after = [np.asarray(x)[:, : len(kept)] for x in jax.tree.leaves(store.drafter.pools)]
    assert all((a == b).all() for a, b in zip(draft_after, draft_before, strict=True))
    store.resize(num_pages)  # and it can still resize
    assert page_bytes(store, kept) == before and store.num_usable_pages == num_pages - 1


def linked_chain(cache, policy, n: int) -> tuple[list[bytes], list[int]]:
    """A chain of `n` idle cached pages, each TEMPORAL-linked to the next in the advisor's graph."""
    names = hash_chain(b"salt", list(range(PAGE * n)), PAGE)
    pages = cache.allocator.allocate(n)
    for i, (name, page) in enumerate(zip(names, pages, strict=True)):
        cache.insert(name, page, names[i - 1] if i else None)
        if i:
            policy.graph.add(names[i - 1], name, EdgeType.TEMPORAL)
    cache.allocator.free(pages)
    return names, pages


@pytest.mark.parametrize("disk", [False, True])
def test_pages_dropped_from_the_lowest_tier_leave_the_advisors_graph(disk, tmp_path):
    # Host pool of 2 (and a disk of 2): of six pages evicted one by one, the first two leave
    # every tier, and with them their graph edges; the ones still held below keep theirs, and
    # so does a page back on the device whose host copy went.
    store = store_for("smollm2-135m", "bf16", np.random.default_rng(7))
    below = DiskStore(tmp_path, fingerprint="f", page_bytes=store.page_bytes, capacity=2) if disk else None
    policy = AdvisorPolicy(max_protected_pages=0)
    cache = chain_cache(store, host_pages=2, disk=below, num_pages=8, policy=policy)
    names, pages = linked_chain(cache, policy, 7)
    held = 4 if disk else 2
    for i in range(6):
        assert cache.evict_pages([pages[i]]) == 1
        if below is not None:
            below.sync()
    gone, kept = names[: 6 - held], names[6 - held : 6]
    assert [cache.tiers.holds(n) for n in names[:6]] == [False] * len(gone) + [True] * held
    assert all(policy.graph.neighbours(n) == [] for n in gone)
    assert all(policy.graph.neighbours(n) for n in kept)
    # Promoted back, a page stays on the host too; when that copy is pushed out it is not gone.
    back = cache.allocator.allocate(1)
    assert cache.promote([kept[-1]], back, kept[-2]) == 1
    cache.allocator.free(back)
    cache.tiers.spill()
    if below is not None:
        below.sync()
    cache.evict_pages([pages[6]])
    assert policy.graph.weight(kept[-1], names[6], EdgeType.TEMPORAL) > 0


def test_pages_one_eviction_sends_past_the_host_pool_leave_the_advisors_graph():
    store = store_for("smollm2-135m", "bf16", np.random.default_rng(8))
    policy = AdvisorPolicy(max_protected_pages=0)
    cache = chain_cache(store, host_pages=2, num_pages=8, policy=policy)
    names, pages = linked_chain(cache, policy, 5)
    assert cache.evict_pages(pages) == 5  # one batch: three go straight past the two host slots
    gone = [n for n in names if not cache.tiers.holds(n)]
    assert len(gone) == 3 and all(policy.graph.neighbours(n) == [] for n in gone)
