"""The eviction advisor: protected pages stay, the score orders the rest, rankings are swapped
atomically and fall back to LRU when stale, and the scheduler's events build the graph.

Scheduler-level tests run on the prefix-cache tests' `FakeDevice` (pages of token ids, every
sequence checked to read back its own tokens and produce the reference output)."""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aither_jax.context.prompt import SectionSpan
from aither_jax.core.residency import Residency
from aither_jax.eviction.graph import EdgeType
from aither_jax.eviction.policy import AdvisorPolicy, make_policy
from aither_jax.kv.blocks import Block
from tests.aither_jax.kv import test_prefix_cache
from tests.aither_jax.kv.test_prefix_cache import PAGE, FakeDevice, check_drained, make_seq, run_until


def make_scheduler(**overrides):
    """The prefix-cache tests' scheduler, pins limited to a quarter of the pool."""
    return test_prefix_cache.make_scheduler(**{"max_pinned_fraction": 0.25, **overrides})


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def block(page: int, *, tag=None, importance=None, hits=0, last_access=0, touched_at=100.0) -> Block:
    b = Block(page, name=bytes([page]) * 32, source_tag=tag, importance=importance, hits=hits)
    b.last_access, b.touched_at = last_access, touched_at
    return b


def test_protected_pages_are_never_victims_up_to_the_cap():
    policy = AdvisorPolicy(max_protected_pages=2, clock=Clock())
    blocks = [
        block(1, tag="system", last_access=1),
        block(2, tag="identity", last_access=2),
        block(3, tag="notes", importance=1.0, last_access=3),  # importance 1.0 protects too
        block(4, tag="user", importance=0.6, last_access=4),
        block(5, tag="assistant", importance=0.4, last_access=5),
    ]
    assert policy.num_evictable(blocks) == 3  # two open pages and the protected one past the cap
    # The least recently used protected page past the cap goes first (the cap is what protection
    # holds); then, with a stale ranking (none yet), LRU among the open pages.
    assert [b.page for b in policy.victims(blocks, 5)] == [1, 4, 5]
    assert policy.num_stale == 1
    policy.refresh(blocks)
    # Fresh: by score; the assistant page (importance 0.4) before the user page (0.6).
    assert [b.page for b in policy.victims(blocks, 5)] == [1, 5, 4]
    assert policy.evicted_by_tag == {"user": 2, "assistant": 2, "system": 2}


def test_the_score_follows_the_original_weights():
    clock = Clock()
    policy = AdvisorPolicy(max_protected_pages=0, clock=clock)
    old, hit, linked = block(1, touched_at=0.0), block(2, hits=1), block(3)
    policy.graph.add(linked.name, b"other" * 7, EdgeType.TEMPORAL, 2.0)
    stats = policy.graph.stats()
    assert policy.score(old, stats, clock.now) == pytest.approx(0.01 * 100)
    assert policy.score(hit, stats, clock.now) == pytest.approx(-3.0)
    assert policy.score(linked, stats, clock.now) == pytest.approx(-5.0 - 2 * 2.0)
    important = block(4, importance=0.5)
    important.attention_mass = 0.25
    assert policy.score(important, stats, clock.now) == pytest.approx(-20 * 0.5 - 10 * 0.25)


def test_weights_are_configurable_and_checked():
    from aither_jax.eviction.policy import AdvisorWeights

    assert AdvisorWeights.parse('{"age": 1}') == AdvisorWeights(age=1.0)
    assert make_policy("advisor", weights={"hits": 0}).weights.hits == 0.0
    for bad, message in [
        ({"speed": 1}, "unknown advisor weight 'speed'"),
        ({"age": "1"}, "must be a finite number"),
        ({"age": float("inf")}, "must be a finite number"),
        ({"age": 10**400}, "must be a finite number"),  # too large for a float
        ("[1]", "must be an object"),
        ("{", "must be a JSON object"),
    ]:
        with pytest.raises(ValueError, match=message):
            AdvisorWeights.parse(bad)
    with pytest.raises(ValueError, match="advisor only"):
        make_policy("lru", weights={"age": 1})


def test_a_stale_ranking_falls_back_to_lru_order():
    clock = Clock()
    policy = AdvisorPolicy(max_protected_pages=0, clock=clock, stale_s=2.0)
    blocks = [block(1, importance=0.9, last_access=1), block(2, importance=0.1, last_access=2)]
    policy.refresh(blocks)
    assert [b.page for b in policy.victims(blocks, 2)] == [2, 1] and policy.num_stale == 0
    clock.now += 2.5
    assert [b.page for b in policy.victims(blocks, 2)] == [1, 2] and policy.num_stale == 1
    assert policy.ranking_age == pytest.approx(2.5)


def test_readers_see_one_whole_ranking_while_it_is_swapped():
    policy = AdvisorPolicy(max_protected_pages=0)
    blocks = [block(p) for p in range(1, 41)]
    orders = {tuple(range(1, 41)), tuple(range(40, 0, -1))}
    stop, seen, bad = threading.Event(), set(), []

    def writer():
        flip = False
        while not stop.is_set():
            for i, b in enumerate(blocks):
                b.hits = i if flip else 40 - i  # hits lower the score: fewer hits go first
            policy.refresh(blocks)
            flip = not flip

    def reader():
        for _ in range(300):
            order = tuple(b.page for b in policy.victims(blocks, 40))
            (seen if order in orders else bad).add(order)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    assert not bad and seen  # never a mix of two rankings


def test_the_ranking_thread_refreshes_and_stops_with_its_owner():
    policy = AdvisorPolicy(max_protected_pages=0, refresh_s=0.01)

    class Owner:
        def blocks(self):
            return [block(1)]

    owner = Owner()
    policy.start(owner.blocks)
    for _ in range(500):
        if policy.num_refreshes >= 2:
            break
        threading.Event().wait(0.01)
    assert policy.num_refreshes >= 2 and policy.ranking_age < 1.0
    thread = policy._thread
    del owner  # the source's owner is gone: the thread ends by itself
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_the_advisor_is_the_default_and_its_default_share_leaves_one_request_room(caplog):
    """With prefix caching the advisor runs unless LRU is asked for. Its default protected
    share (a quarter of the usable pages) is lowered, with a warning, where with the pinned
    share it would leave one request short of pages (its full length, or its resident bound),
    also when the pool is resized; the same share given explicitly is refused."""
    default = functools.partial(make_scheduler, eviction_policy=None)  # (the cache tests pin LRU)
    assert default().policy.name == "advisor"
    assert default(eviction_policy="lru").policy.name == "lru"
    assert default(enable_prefix_caching=False).policy.name == "lru"
    caplog.clear()
    roomy = default(num_pages=41, max_pages_per_seq=8)  # 40 usable: 10 pinned, 10 protected
    assert (roomy.prefix_cache.max_pinned_pages, roomy.policy.max_protected_pages) == (10, 10)
    exact = default(num_pages=17, max_pages_per_seq=8)  # 16 usable: 4 pinned, 8 for a request
    assert (exact.prefix_cache.max_pinned_pages, exact.policy.max_protected_pages) == (4, 4)
    assert not caplog.records  # nothing lowered so far
    tight = default(num_pages=13, max_pages_per_seq=8)  # 12 usable: 3 pinned, 8 for a request
    assert tight.policy.max_protected_pages == 1
    with caplog.at_level(logging.WARNING, logger="aither_jax.core.scheduler"):
        tight = default(num_pages=11, max_pages_per_seq=8)  # 10 usable: 2 pinned, 8 for a request
    assert tight.policy.max_protected_pages == 0
    assert "keeps at most 0 idle protected pages" in caplog.text
    bounded = default(num_pages=11, max_pages_per_seq=8, max_resident_pages=4)  # 4 for a request
    assert bounded.policy.max_protected_pages == 2
    assert tight.resize_pool(41) == 41 and tight.policy.max_protected_pages == 10
    assert tight.resize_pool(13) == 13 and tight.policy.max_protected_pages == 1  # 12 usable: 3 pinned
    with pytest.raises(ValueError, match="leaving less than one request"):
        default(num_pages=11, max_pages_per_seq=8, max_protected_fraction=0.25)
    # Nor does a shrink (a balloon move) take the explicit share below that: 14 usable pages
    # hold 3 pinned, 3 protected and 8 for a request; 13 would leave 2 for 3 protected.
    explicit = default(num_pages=41, max_pages_per_seq=8, max_protected_fraction=0.25)
    assert explicit.min_pool_size() == 15
    assert explicit.resize_pool(9) == 15 and explicit.policy.max_protected_pages == 3
    assert default(num_pages=41, max_pages_per_seq=8).min_pool_size() == 9  # the default share yields
    # Both shares round down, so fitting is not monotone in the pool's size: 9 and 11 usable
    # pages leave a request of 8 room, 10 do not (1 pinned and 2 protected leave 7).
    uneven = functools.partial(default, num_pages=41, max_pages_per_seq=8, max_pinned_fraction=0.1)
    assert uneven(max_protected_fraction=0.2).resize_pool(11) == 12
    assert uneven(max_protected_fraction=0.2).resize_pool(10) == 10


def test_configurations_whose_protected_pages_could_fill_the_pool_are_refused():
    with pytest.raises(ValueError, match="leaving less than one request"):
        make_scheduler(eviction_policy="advisor", num_pages=17, max_pages_per_seq=8, max_protected_fraction=0.5)
    with pytest.raises(ValueError, match="max_protected_fraction must be in"):
        make_scheduler(eviction_policy="advisor", max_protected_fraction=1.5)
    with pytest.raises(ValueError, match="needs prefix caching"):
        make_scheduler(eviction_policy="advisor", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="eviction policy must be one of"):
        make_scheduler(eviction_policy="graph")


# -- the scheduler's events ---------------------------------------------------------------------


def system_seq(system: list[int], user: list[int], *, max_tokens: int = 2, tag: str = "system"):
    """A chat-like sequence: a system span (protected), then a user span."""
    seq = make_seq(system + user, max_tokens=max_tokens)
    n = len(system)
    seq.sections = (SectionSpan(tag, 1.0, 0, n), SectionSpan("user", 0.6, n, n + len(user)))
    return seq


def edges(graph, kind):
    return {tuple(sorted((a, b))) for a in graph._adj for b, k in graph._adj[a] if k == kind}


def test_the_scheduler_makes_temporal_prefix_share_and_memory_ref_edges_from_their_events():
    sched = make_scheduler(eviction_policy="advisor", num_pages=32)
    graph, device = sched.policy.graph, FakeDevice(sched)
    first = make_seq(list(range(1, 14)), max_tokens=1)  # 3 full prompt pages
    sched.add(first)
    device.run_until_done()
    assert edges(graph, EdgeType.TEMPORAL) == {tuple(sorted(p)) for p in itertools.pairwise(first.names)}
    assert graph.num_edges() == 2
    # A second request reuses the first two pages, then forks.
    second = make_seq([*range(1, 9), 50, 51, 52, 53, 54], max_tokens=1)
    sched.add(second)
    device.run_until_done()
    assert second.fork == first.names[1]
    assert edges(graph, EdgeType.PREFIX_SHARE) == {tuple(sorted((first.names[1], second.names[2])))}
    assert graph.num_edges() == 3
    # A request whose prompt holds a retrieved memory: its pages link to the request's last page.
    third = make_seq([*range(60, 72), 5, 6, 7, 8, 9], max_tokens=1)
    third.sections = (SectionSpan("memories", 0.3, 0, 8), SectionSpan("user", 0.6, 8, 17))
    sched.add(third)
    device.run_until_done()
    reader = third.names[3]
    assert edges(graph, EdgeType.MEMORY_REF) == {tuple(sorted((third.names[i], reader))) for i in (0, 1)}
    assert graph.num_edges(EdgeType.SPILL_LINK) == graph.num_edges(EdgeType.CO_ATTEND) == 0
    blocks = [sched.allocator.blocks[sched.prefix_cache._full[n]] for n in third.names]
    assert [b.source_tag for b in blocks] == ["memories", "memories", "user", "user"]
    assert [b.token_range for b in blocks] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert all(b.tenant == third.salt and b.created_at > 0 for b in blocks)


class FakeTiers:
    """Takes demoted pages (the cache only needs `demote`, `holds`, `touch` and `take_lost` here)."""

    def __init__(self):
        self.demoted = []

    def demote(self, pages):
        self.demoted += [name for name, _, _, _ in pages]

    def take_lost(self):
        return []

    def holds(self, name):
        return False

    def touch(self, names):
        pass


def test_a_demoted_page_is_spill_linked_to_its_chain_left_on_the_device():
    sched = make_scheduler(eviction_policy="advisor", num_pages=32)
    sched.prefix_cache.tiers = FakeTiers()
    device = FakeDevice(sched)
    seq = make_seq(list(range(1, 14)), max_tokens=1)
    sched.add(seq)
    device.run_until_done()
    cache = sched.prefix_cache
    middle = cache._full[seq.names[1]]
    for b in cache.cached_blocks():  # every other page protected: the middle one goes
        b.importance = 0.0 if b.page == middle else 1.0
    assert cache.evict(1) == 1 and cache.tiers.demoted == [seq.names[1]]
    pairs = {tuple(sorted((seq.names[1], seq.names[j]))) for j in (0, 2)}
    assert edges(sched.policy.graph, EdgeType.SPILL_LINK) == pairs


def test_an_identity_used_once_survives_pressure_with_the_advisor_and_not_with_lru():
    """The original system's worst bug: a persona's system pages, written at the start and not
    used again for a while, were evicted first and had to be recomputed."""
    persona = list(range(200, 212))  # 3 full pages
    results = {}
    for policy in ("lru", "advisor"):
        sched = make_scheduler(eviction_policy=policy, num_pages=17, max_num_seqs=1, max_pages_per_seq=8)
        device = FakeDevice(sched)
        seqs = [system_seq(persona, [1, 2, 3, 4])]
        for i in range(12):  # other users' requests in between, under another system prompt
            seqs.append(system_seq(list(range(300, 304)), [10 + i] * 9, tag="other-system"))
        again = system_seq(persona, [5, 6, 7, 8])
        for s in [*seqs, again]:
            sched.add(s)
            device.run_until_done()
        results[policy] = again.num_cached_prompt
        check_drained(sched, [*seqs, again])
    assert results == {"lru": 0, "advisor": 12}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 16), st.integers(1, 8), st.booleans()), min_size=1, max_size=16
    ),
    st.integers(20, 32),
    st.integers(1, 3),
)
def test_protected_pages_within_the_cap_are_never_evicted_and_the_pool_never_deadlocks(requests, num_pages, seqs):
    sched = make_scheduler(eviction_policy="advisor", num_pages=num_pages, max_num_seqs=seqs, max_pages_per_seq=8)
    policy = sched.policy
    evicted_protected = []
    original = policy.victims

    def victims(candidates, n):
        chosen = original(candidates, n)
        protected = [b for b in candidates if policy.protected(b)]
        if len(protected) <= policy.max_protected_pages:
            evicted_protected.extend(b for b in chosen if policy.protected(b))
        return chosen

    policy.victims = victims
    device = FakeDevice(sched)
    seqs_ = []
    for persona, user_len, max_tokens, wait in requests:
        system = [100 + 10 * persona + j for j in range(8)]
        seq = system_seq(system, [persona + 1] * user_len, max_tokens=max_tokens)
        seqs_.append(seq)
        sched.add(seq)
        if wait:
            run_until(device, lambda s=seq: s.finished)
    device.run_until_done()
    check_drained(sched, seqs_)
    assert evicted_protected == []
    assert PAGE == 4


def test_a_page_never_ranks_before_the_pages_that_continue_its_chain():
    clock = Clock()
    policy = AdvisorPolicy(max_protected_pages=0, clock=clock)
    # A chain root -> a -> b, and a fork root -> c; the root is the least important page.
    root, a, b, c = block(1, importance=0.0), block(2, importance=0.9), block(3, importance=0.5), block(4)
    a.parent, b.parent, c.parent = root.name, a.name, root.name
    c.importance = 0.8
    policy.refresh([b, c, a, root])
    order = [x.page for x in policy.victims([root, a, b, c], 4)]
    assert order.index(3) < order.index(2) < order.index(1) and order.index(4) < order.index(1)
    # a -> b continues into nothing else: one run, worth its best page (a, 0.9), so c (0.8)
    # goes first; then the run from its end; the root, capped below them all, last.
    assert order == [4, 3, 2, 1]


def test_a_protected_page_past_the_cap_never_goes_before_the_pages_that_continue_it():
    """Past the cap (0 in a pool of two full-length requests) a system page loses protection
    but keeps its place in the chain: its conversation's pages go first."""
    policy = AdvisorPolicy(max_protected_pages=0, clock=Clock())
    system = block(1, tag="system", last_access=10)  # a lookup touches a chain from its end to its start
    turns = [block(2 + i, tag="user", last_access=9 - i) for i in range(4)]
    parent = system
    for b in turns:
        b.parent, parent = parent.name, b
    for fresh in (False, True):  # LRU order (no ranking yet), then by score
        if fresh:
            policy.refresh([system, *turns])
        assert [b.page for b in policy.victims([system, *turns], 2)] == [5, 4], fresh


def test_a_page_forgotten_or_renamed_while_the_ranking_is_computed_does_not_stop_it():
    """The engine's thread evicts (forgets) and renames pages while the ranking thread scores
    them: each page's key, name and parent are read once."""
    policy = AdvisorPolicy(max_protected_pages=0, clock=Clock())
    root, a, b = block(1), block(2), block(3)
    a.parent, b.parent = root.name, a.name
    score = policy.score

    def forgetting(block, *args):
        if block is b:  # the last page scored: every key is taken
            root.forget()  # evicted mid-ranking
            b.name = bytes([9]) * 32  # and a page renamed
        return score(block, *args)

    policy.score = forgetting
    policy.refresh([root, a, b])
    assert policy.num_refreshes == 1


def test_a_conversation_is_evicted_whole_before_another_loses_its_newest_turn():
    clock = Clock()
    policy = AdvisorPolicy(max_protected_pages=0, clock=clock)
    root = block(1, importance=0.0)
    # Conversation x: two pages reused by a follow-up (hits), then its newest turn (no hits
    # yet, just written). Conversation y: two pages never reused.
    x1, x2, x3 = block(2, hits=2), block(3, hits=2), block(4, touched_at=120.0)
    y1, y2 = block(5, hits=1), block(6)
    x1.parent, x2.parent, x3.parent, y1.parent, y2.parent = root.name, x1.name, x2.name, root.name, y1.name
    clock.now = 130.0
    pages = [root, x1, x2, x3, y1, y2]
    policy.refresh(pages)
    assert [b.page for b in policy.victims(pages, 3)] == [6, 5, 4]  # all of y, from its end, then x's tail
    later = block(7)  # a page written after the ranking continues x's run: it ranks with it
    later.parent = x3.name
    assert [b.page for b in policy.victims([*pages, later], 3)] == [6, 5, 7]


class RowTiers:
    """A host tier for `FakeDevice`'s pages of token ids: keeps each demoted page's row, so a
    promoted page must read back its own tokens."""

    high_watermark, low_watermark = 1.0, 1.0

    def __init__(self, device: FakeDevice):
        self.device, self.rows = device, {}
        self.counters = types.SimpleNamespace(num_prefetched=0)
        self.cost = types.SimpleNamespace(reload=lambda *a, **k: True)

    def take_lost(self):
        return []

    def demote(self, pages):
        for name, parent, page, meta in pages:
            self.rows[name] = (self.device.pages[page].copy(), parent, meta)

    def holds(self, name):
        return name in self.rows

    def touch(self, names):
        pass

    def stage(self, names):
        return 0

    def should_reload(self, names, num_tokens, count=True):
        return True

    def parent(self, name):
        return self.rows[name][1]

    def meta(self, name):
        return self.rows[name][2]

    def promote(self, names, pages):
        for name, page in zip(names, pages, strict=False):
            self.device.pages[page] = self.rows[name][0]
        return len(names)


def test_promoting_a_page_brings_its_spilled_neighbours_along():
    sched = make_scheduler(eviction_policy="advisor", num_pages=40)
    device = FakeDevice(sched)
    cache = sched.prefix_cache
    cache.tiers = RowTiers(device)
    a = make_seq(list(range(1, 14)), max_tokens=1)  # pages a0 a1 a2
    b = make_seq([*range(1, 9), 40, 41, 42, 43, 44], max_tokens=1)  # a0 a1, then its own b2
    for s in (a, b):
        sched.add(s)
        device.run_until_done()
    cache.evict(cache.num_evictable)  # everything to the host
    assert not any(cache.contains(n) for n in a.names + b.names)
    c = make_seq([*range(1, 9), 70, 71], max_tokens=2)  # a0 a1 again
    sched.add(c)
    device.step()  # admission promotes a0 and a1; after the step their neighbours follow
    assert Residency(sched).prefetch() == 2
    assert cache.contains(a.names[2]) and cache.contains(b.names[2])  # a1's TEMPORAL and PREFIX_SHARE neighbours
    assert cache.tiers.counters.num_prefetched == 2
    device.run_until_done()
    d = make_seq([*range(1, 13), 99], max_tokens=1)  # a0 a1 a2 from the device now
    sched.add(d)
    device.step()
    assert d.num_cached_prompt == 12
    device.run_until_done()
    check_drained(sched, [a, b, c, d])


def test_prefetch_promotes_every_lower_run_of_a_chain_in_order():
    """A resized pool can leave a chain's pages below the device on both sides of a device
    page; a waiting request's prefetch promotes both runs, so its admission finds the whole
    chain on the device."""
    sched = make_scheduler(num_pages=40)
    device = FakeDevice(sched)
    cache = sched.prefix_cache
    cache.tiers = RowTiers(device)
    a = make_seq(list(range(1, 4 * PAGE + 2)), max_tokens=1)  # pages a0 a1 a2 a3
    sched.add(a)
    device.run_until_done()
    names = a.names[:4]
    cache.evict(cache.num_evictable)
    page = sched.allocator.allocate(1)
    assert cache.promote(names[1:2], page, names[0]) == 1  # a1 back on the device, a0 a2 a3 below
    sched.allocator.free(page)
    b = make_seq([*range(1, 4 * PAGE + 1), 99], max_tokens=1)
    sched.add(b)
    assert Residency(sched).prefetch() == 3
    assert all(cache.contains(n) for n in names) and cache.tiers.counters.num_prefetched == 3
    hits = [cache.blocks[cache.match([n])[0]].hits for n in names]
    assert hits == [0, 1, 0, 0]  # a1's promotion above was an admission's; a prefetch is none
    device.step()
    assert b.num_cached_prompt == 4 * PAGE
    assert [cache.blocks[cache.match([n])[0]].hits for n in names] == [h + 1 for h in hits]  # b's admission
    device.run_until_done()
    check_drained(sched, [a, b])


def test_the_advisor_preempts_the_request_whose_pages_matter_least():
    policy = AdvisorPolicy(max_protected_pages=0)
    blocks = {p: block(p) for p in range(1, 7)}
    blocks[1].source_tag = "system"  # the oldest request holds a protected page
    for p, importance in ((2, 0.5), (3, 0.9), (4, 0.9), (5, 0.2), (6, 0.2)):
        blocks[p].importance = importance
    old, middle, new = (types.SimpleNamespace(pages=pages) for pages in ([1, 2], [3, 4], [5, 6]))
    assert policy.preemption_victim([old, middle, new], blocks) is new
    new.pages = [3, 4]  # now as important as the middle one: the newer of the two goes
    middle.pages = [3, 4]
    assert policy.preemption_victim([old, middle, new], blocks) is new
    assert policy.preemption_victim([old, middle], blocks) is middle  # never the protected one
    assert make_policy("lru").preemption_victim([old, middle, new], blocks) is new


def used(page: int, at: float, interval: float = 0.0) -> Block:
    """A conversation's page, last used `at` (its reuse interval, if measured)."""
    b = block(page, touched_at=at, last_access=int(at * 10))
    b.used_at, b.reuse_interval = at, interval
    return b


def test_the_conversation_due_back_soonest_is_kept_longest():
    """With reuse gaps known, a page scores by how far now is from its expected next use: the
    conversation just served goes first, the one due back now last; one that stopped coming
    back goes as it grows late."""
    clock = Clock()
    policy = AdvisorPolicy(max_protected_pages=0, clock=clock)
    due, middle, just = used(1, 100.0), used(2, 105.0), used(3, 109.5)
    gone = used(4, 50.0)  # due at 60: 50 s late
    own = used(5, 108.0, interval=2.5)  # its own interval: due at 110.5
    late = used(6, 98.0)  # due at 108: 2 s late counts as 8 s early
    clock.now = 110.0
    pages = [due, middle, just, gone, own, late]
    policy.refresh(pages)  # no gap measured yet: the term is off, the order is by age alone
    assert policy._ranking[3] == 0.0
    assert [b.page for b in policy.victims(pages, 6)] == [4, 6, 1, 2, 5, 3]
    for gap in (9.0, 10.0, 11.0):
        policy.reused(gap)
    policy.refresh(pages)
    assert [b.page for b in policy.victims(pages, 6)] == [4, 3, 6, 2, 5, 1]
    assert policy.score(middle, {}, clock.now, 10.0) == pytest.approx(policy.weights.reuse * 0.5 + 0.01 * 5.0)
    from aither_jax.eviction.policy import reuse_distance

    assert reuse_distance(gone, clock.now, 10.0) == 4.0  # 20 intervals late, capped
    lru = make_policy("lru").victims(pages, 6)
    assert [b.page for b in lru] == [4, 6, 1, 2, 5, 3]  # touched order: the one due back goes early
    # Requests admitted together on a shared prompt report gaps of milliseconds: the typical
    # interval has a floor of 1 s, or every idle page would look thousands of intervals late.
    policy = AdvisorPolicy(max_protected_pages=0, clock=clock)
    for _ in range(3):
        policy.reused(0.002)
    policy.refresh(pages)
    assert policy._ranking[3] == 1.0


def test_new_conversations_arriving_turn_the_ranking_toward_idle_time():
    """A conversation from an earlier set, due back now, and one just served: while requests
    return to their conversations the one due back is kept; when new conversations arrive
    instead, the expected returns are not trusted and the one idle longest goes first."""
    clock = Clock()
    policy = AdvisorPolicy(max_protected_pages=0, clock=clock)
    due, just = used(1, 100.0, interval=10.0), used(2, 109.5)
    clock.now = 110.0
    for _ in range(3):
        policy.reused(10.0)  # returns: trust stays whole
    policy.refresh([due, just])
    assert policy.trust == 1.0
    assert [b.page for b in policy.victims([due, just], 2)] == [2, 1]
    for _ in range(3):
        policy.reused(10.0, returning=False)  # new conversations under a shared prompt
    assert policy.trust == pytest.approx(0.125)
    policy.refresh([due, just])
    assert [b.page for b in policy.victims([due, just], 2)] == [1, 2]
    # The distance mixes the expected use and the idle time by the trust.
    from aither_jax.eviction.policy import reuse_distance

    assert reuse_distance(due, clock.now, 10.0, 0.125) == pytest.approx(0.875 * 1.0)
    assert reuse_distance(just, clock.now, 10.0, 0.125) == pytest.approx(0.125 * 0.95 + 0.875 * 0.05)
    # Idle time is not capped (the expectation is, at 4): at low trust the longest idle goes first.
    assert reuse_distance(used(3, 10.0), clock.now, 10.0, 0.125) == pytest.approx(0.125 * 4.0 + 0.875 * 10.0)
    for _ in range(3):
        policy.reused(10.0)  # conversations come back again
    policy.refresh([due, just])
    assert policy.trust > 0.8 and [b.page for b in policy.victims([due, just], 2)] == [2, 1]


@pytest.mark.parametrize("protected_fraction", [0.25, 0.0])
def test_admissions_tell_a_conversation_s_return_from_a_new_one(protected_fraction):
    """The page an admission reports its gap at says which it is: a chain's end (nothing
    cached continues it, or it left the device) is a conversation coming back; a page two
    chains continued, or a protected system page, is a prompt new conversations share, also
    after it left the device (with no protected share, the persona's pages are evicted too)."""
    sched = make_scheduler(
        eviction_policy="advisor", num_pages=40, max_num_seqs=1, max_pages_per_seq=8,
        max_protected_fraction=protected_fraction,
    )  # fmt: skip
    device, calls = FakeDevice(sched), []
    sched.policy.reused = lambda gap, returning=True: calls.append((gap is not None, returning))
    shared = list(range(100, 108))  # 2 pages, untagged
    persona = list(range(200, 208))  # 2 pages, a protected system prompt
    first = make_seq(shared + [1, 2, 3, 4])
    # The second one to branch off the shared pages looks like `first` diverging (a return);
    # from then on the shared pages are known as a shared prompt.
    other = make_seq(shared + [5, 6, 7, 8])
    third = make_seq(shared + [9, 9, 9, 9])
    alone = system_seq(persona, [20, 21, 22, 23])  # the persona's only conversation
    seqs = [first, other, third, alone]
    for s in seqs:
        sched.add(s)
        device.run_until_done()
    cache, shared_tip = sched.prefix_cache, first.names[1]
    assert cache._branches[shared_tip] == 3  # `first`, `other` and `third` continue it
    back = make_seq(shared + [1, 2, 3, 4] + first.output_ids + [9])  # `first` continues
    sched.add(back)
    device.run_until_done()
    assert calls == [(False, False), (True, True), (True, False), (False, False), (True, True)]
    cache.evict(cache.num_evictable)
    assert cache.contains(alone.names[1]) == (protected_fraction > 0) and not cache.contains(alone.names[2])
    assert shared_tip not in cache._branches and alone.names[1] not in cache._branches  # counts follow evictions
    fresh = system_seq(persona, [30, 31, 32, 33])  # a new conversation under the persona
    again = system_seq(persona, [20, 21, 22, 23, *alone.output_ids, 24])  # `alone` comes back
    newer = make_seq(shared + [40, 41, 42, 43])  # a new one under the shared pages, all evicted
    for s in (fresh, again, newer):
        sched.add(s)
        device.run_until_done()
    assert calls[5:] == [(True, False), (True, True), (True, False)]
    check_drained(sched, [*seqs, back, fresh, again, newer])


def test_admission_measures_each_page_s_idle_gap_and_the_request_s_return():
    sched = make_scheduler(eviction_policy="advisor", num_pages=33, max_num_seqs=1, max_pages_per_seq=8)
    clock = Clock()
    sched.prefix_cache.clock = sched.policy.clock = clock
    device = FakeDevice(sched)
    prompt = list(range(1, 14))  # 3 full pages and a partial one
    first = make_seq(prompt, max_tokens=3)
    sched.add(first)
    device.run_until_done()
    pages = [sched.prefix_cache._full[n] for n in first.names[:3]]
    assert [sched.allocator.blocks[p].used_at for p in pages] == [100.0] * 3
    seqs = [first]
    for at, interval in [(105.0, 5.0), (107.0, 3.5)]:  # moving average, newest gap weighted 0.5
        clock.now = at
        seqs.append(make_seq(prompt + [50, 51, 52, 53], max_tokens=1))
        sched.add(seqs[-1])
        device.run_until_done()
        assert [sched.allocator.blocks[p].reuse_interval for p in pages] == [interval] * 3
    # The request's return gap is taken at the deepest page of its chain used before: the
    # second follow-up reused the first follow-up's pages (used at 5.0), not only the prompt's.
    assert list(sched.policy.gaps) == [5.0, 2.0]
    # A chain that left the device is still remembered by name: its gap is measured on return.
    sched.prefix_cache.evict(sched.prefix_cache.num_evictable)
    assert sched.prefix_cache.num_cached == 0
    clock.now = 120.0
    seqs.append(make_seq(prompt + [50, 51, 52, 53], max_tokens=1))
    sched.add(seqs[-1])
    device.run_until_done()
    assert seqs[-1].num_cached_prompt == 0 and list(sched.policy.gaps)[-1] == 13.0
    check_drained(sched, seqs)


def test_a_conversation_back_from_the_host_tier_reports_its_real_gap():
    """Pages that come back from a lower tier are named anew by the promotion: the gap is
    measured before it, so the request reports how long its chain was away."""
    sched = make_scheduler(eviction_policy="advisor", num_pages=40)
    clock = Clock()
    sched.prefix_cache.clock = sched.policy.clock = clock
    device = FakeDevice(sched)
    cache = sched.prefix_cache
    cache.tiers = RowTiers(device)
    first = make_seq(list(range(1, 14)), max_tokens=1)
    sched.add(first)
    device.run_until_done()
    cache.evict(cache.num_evictable)  # everything to the host
    clock.now = 112.0
    again = make_seq([*range(1, 14), 20, 21], max_tokens=1)
    sched.add(again)
    device.run_until_done()
    assert again.num_cached_prompt == 12  # three pages promoted
    assert list(sched.policy.gaps) == [12.0] and sched.policy.trust == 0.75  # a new one, then a return
    # A chain held below the device with no last use remembered (left by an earlier process,
    # on disk) still counts as a return, its gap unknown.
    cache.evict(cache.num_evictable)
    cache._ghosts.clear()
    later = make_seq([*range(1, 14), 20, 21, 22, 23], max_tokens=1)
    sched.add(later)
    device.run_until_done()
    assert later.num_cached_prompt == 12 and list(sched.policy.gaps) == [12.0]
    assert sched.policy.trust == 0.875
    check_drained(sched, [first, again, later])


def round_robin(policy: str, weights: str | None = None, num_pages: int = 44) -> list[int]:
    """Follow-up prompt tokens found cached past the system prompt (24 tokens, shared), per
    round, when 6 conversations take 3 turns each in turn, after 6 others did the same and
    ended, on a pool that holds about two thirds of one set (`num_pages` 44)."""
    sched = make_scheduler(
        eviction_policy=policy, num_pages=num_pages, max_num_seqs=1, max_pages_per_seq=20, advisor_weights=weights
    )
    clock = Clock()
    sched.prefix_cache.clock = clock
    if policy == "advisor":
        sched.policy.clock = clock
    device = FakeDevice(sched)
    cached, seqs = [0, 0, 0], []
    for first in (2000, 3000):  # the first set's tokens never come back
        histories = [list(range(first, first + 24)) for _ in range(6)]
        for turn in range(18):
            c = turn % 6
            histories[c] += [first + 100 + 7 * turn + j for j in range(7)]
            seq = make_seq(histories[c], max_tokens=9)
            if policy == "advisor":
                sched.policy.refresh(sched.prefix_cache.cached_blocks())
            sched.add(seq)
            device.run_until_done()
            histories[c] += seq.output_ids
            if first == 3000:
                cached[turn // 6] += max(seq.num_cached_prompt - 24, 0)
            seqs.append(seq)
            clock.now += 1.0
    check_drained(sched, seqs)
    return cached


def test_conversations_taking_turns_keep_their_pages_with_the_advisor():
    """LRU evicts exactly the conversation that comes back next; the advisor, knowing how long
    conversations stay away, evicts the one just served and keeps the rest, and lets go of
    conversations that stopped coming back."""
    lru, advisor, no_reuse = (sum(round_robin(*args)) for args in [("lru",), ("advisor",), ("advisor", '{"reuse": 0}')])
    assert advisor >= 3 * max(lru, no_reuse) and advisor > 100, (lru, advisor, no_reuse)


def test_a_new_set_of_conversations_keeps_its_first_turns(monkeypatch):
    """When the second set starts, the first set's conversations look due back; new ones
    arriving instead of returns turn the ranking toward idle time, so the new set's first
    turns are kept for its second round as LRU keeps them, and the third round is the
    advisor's. Trusting the expected returns regardless loses second-round hits."""
    lru = round_robin("lru", num_pages=60)
    advisor = round_robin("advisor", num_pages=60)
    monkeypatch.setattr(AdvisorPolicy, "RETURN_SMOOTHING", 0.0)  # trust stays whole
    trusting = round_robin("advisor", num_pages=60)
    assert advisor[1] >= lru[1] > trusting[1], (lru, advisor, trusting)
    assert advisor[2] >= 3 * lru[2], (lru, advisor)


def test_a_conversation_under_a_protected_prompt_does_not_take_its_score():
    """A persona serving one conversation: its system pages and that conversation are one chain
    that continues into no other. The run rule must not give the conversation the protected
    pages' score, or it would never be evicted."""
    policy = AdvisorPolicy(max_protected_pages=4, clock=Clock())
    system = block(1, tag="system", importance=1.0, hits=10)
    x1, x2 = block(2), block(3)  # its conversation, never reused
    root, y1 = block(4), block(5, hits=2)  # another conversation, reused twice
    x1.parent, x2.parent, y1.parent = system.name, x1.name, root.name
    pages = [system, x1, x2, root, y1]
    policy.refresh(pages)
    assert [b.page for b in policy.victims(pages, 3)] == [3, 2, 5]
