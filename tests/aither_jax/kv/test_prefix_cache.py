"""Prefix caching on the host: page names, the cache's references and eviction, and the scheduler
sharing, deferring, copying and preempting pages.

The scheduler tests run plans on `FakeDevice`, a stand-in for the engine whose pages hold token
ids instead of keys and values: it makes the plan's copies, writes each row's tokens through the
block table and reads the whole context back the same way. A sequence must always read back its
own tokens, and its fake "model" output (a hash of what it read) must equal the output computed
from the token ids alone, whatever was shared, copied or preempted on the way.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from aither_jax.compile.buckets import bucket
from aither_jax.core.plan import StepPlan
from aither_jax.core.scheduler import Scheduler
from aither_jax.core.sequence import Sequence
from aither_jax.device.sampling import SamplingParams
from aither_jax.eviction.policy import LRUPolicy
from aither_jax.kv.allocator import PageAllocator
from aither_jax.kv.prefix_cache import PrefixCache, hash_chain, page_hash, tenant_salt
from models.kv_cache import NULL_PAGE

PAGE = 4
SECRET = b"test-secret"
SALT_A = tenant_salt(SECRET, "a")
SALT_B = tenant_salt(SECRET, "b")
UNWRITTEN = -1
MAX_STEPS = 500

# -- page names ------------------------------------------------------------------------------


def test_equal_tokens_and_salt_give_equal_names():
    tokens = list(range(10, 23))
    assert hash_chain(SALT_A, tokens, PAGE) == hash_chain(SALT_A, list(tokens), PAGE)
    assert hash_chain(SALT_A, tokens, PAGE) == hash_chain(SALT_A, np.array(tokens), PAGE)
    assert len(set(hash_chain(SALT_A, tokens, PAGE))) == 3


def test_different_salts_give_disjoint_names():
    assert SALT_A != SALT_B and tenant_salt(b"other-secret", "a") != SALT_A
    tokens = [7] * 16
    names_a, names_b = hash_chain(SALT_A, tokens, PAGE), hash_chain(SALT_B, tokens, PAGE)
    assert len(names_a) == len(names_b) == 4
    assert not set(names_a) & set(names_b)


@pytest.mark.parametrize("changed", range(12))
def test_changing_one_token_renames_its_page_and_all_later_ones(changed):
    tokens = list(range(100, 112))
    edited = list(tokens)
    edited[changed] += 1
    before, after = hash_chain(SALT_A, tokens, PAGE), hash_chain(SALT_A, edited, PAGE)
    page = changed // PAGE
    assert after[:page] == before[:page]
    assert all(a != b for a, b in zip(after[page:], before[page:], strict=True))


@pytest.mark.parametrize("num_tokens, num_names", [(0, 0), (3, 0), (4, 1), (7, 1), (8, 2), (11, 2)])
def test_only_full_pages_are_named(num_tokens, num_names):
    tokens = list(range(num_tokens))
    names = hash_chain(SALT_A, tokens, PAGE)
    assert len(names) == num_names
    assert names == hash_chain(SALT_A, tokens[: num_names * PAGE], PAGE)


def test_chain_continues_from_a_parent():
    tokens = list(range(50, 66))
    names = hash_chain(SALT_A, tokens, PAGE)
    assert names[0] == page_hash(SALT_A, tokens[:PAGE])
    assert hash_chain(SALT_A, tokens[8:], PAGE, parent=names[1]) == names[2:]


# -- the cache ---------------------------------------------------------------------------------


def make_cache(num_pages: int = 9, max_pinned_pages: int = 2) -> PrefixCache:
    return PrefixCache(PageAllocator(num_pages), PAGE, max_pinned_pages=max_pinned_pages, policy=LRUPolicy())


def computed_pages(cache: PrefixCache, tokens: list[int], salt: bytes = SALT_A) -> tuple[list[bytes], list[int]]:
    """Names and pages of a sequence that computed `tokens`, cached, then let go of its pages."""
    names = hash_chain(salt, tokens, PAGE)
    pages = cache.allocator.allocate(len(names))
    for i, (name, page) in enumerate(zip(names, pages, strict=True)):
        assert cache.insert(name, page, names[i - 1] if i else None)
    cache.allocator.free(pages)
    return names, pages


def test_insert_takes_one_reference_and_idle_pages_are_evictable():
    cache = make_cache()
    alloc = cache.allocator
    names = hash_chain(SALT_A, list(range(8)), PAGE)
    pages = alloc.allocate(2)
    assert cache.insert(names[0], pages[0]) and cache.insert(names[1], pages[1])
    assert [alloc.ref_count(p) for p in pages] == [2, 2]
    assert cache.num_cached == 2 and cache.num_evictable == 0  # the sequence still holds them
    assert cache.evict(2) == 0
    alloc.free(pages)
    assert [alloc.ref_count(p) for p in pages] == [1, 1]
    assert cache.num_evictable == 2 and alloc.num_free == 6
    assert cache.evict(5) == 2
    assert alloc.num_free == 8 and cache.num_cached == 0
    assert not cache.contains(names[0]) and cache.match(names) == []


def test_insert_of_a_cached_name_or_page_is_refused_without_a_reference():
    cache = make_cache()
    alloc = cache.allocator
    (name,) = hash_chain(SALT_A, [1, 2, 3, 4], PAGE)
    (other,) = hash_chain(SALT_A, [5, 6, 7, 8], PAGE)
    first, second = alloc.allocate(2)
    assert cache.insert(name, first)
    assert not cache.insert(name, second)  # the second copy stays private
    assert not cache.insert(other, first)  # a page has one name
    assert alloc.ref_count(first) == 2 and alloc.ref_count(second) == 1
    assert cache.match([name]) == [first] and not cache.contains(other)


@pytest.mark.parametrize("cached, expected", [([0, 1, 2, 3], 4), ([0, 1, 3], 2), ([1, 2, 3], 0), ([], 0)])
def test_match_returns_the_longest_cached_run_from_the_start(cached, expected):
    cache = make_cache()
    names = hash_chain(SALT_A, list(range(16)), PAGE)
    pages = cache.allocator.allocate(4)
    for i in cached:
        cache.insert(names[i], pages[i])
    assert cache.match(names) == pages[:expected]


def test_eviction_is_least_recently_used_first_and_children_before_parents():
    cache = make_cache()
    names_x, pages_x = computed_pages(cache, [1] * 12)
    names_y, pages_y = computed_pages(cache, [2] * 8)
    assert cache.num_evictable == 5
    cache.match(names_x)  # y's pages are now the oldest, then x's deepest page
    assert cache.evict(2) == 2
    assert cache.match(names_y) == [] and cache.match(names_x) == pages_x
    assert cache.evict(1) == 1
    assert cache.match(names_x) == pages_x[:2]  # a usable prefix is left
    assert cache.allocator.num_free == 8 - 2


def test_a_chain_never_matched_also_loses_children_before_parents():
    """A finished sequence's pages were inserted parent first; evicting one of them should keep
    a usable prefix, as it does once the chain has been matched."""
    cache = make_cache()
    names, pages = computed_pages(cache, list(range(12)))
    assert cache.evict(1) == 1
    assert cache.match(names) == pages[:2]


def test_match_partial_picks_the_longest_stored_prefix_shorter_than_the_query():
    cache = make_cache()
    parent = hash_chain(SALT_A, [9] * PAGE, PAGE)[0]
    stored = {(1,): None, (1, 2): None, (1, 2, 3): None, (5, 6): None}
    for tokens in stored:
        (page,) = cache.allocator.allocate(1)
        assert cache.insert_partial(parent, tokens, page)
        cache.allocator.free([page])
        stored[tokens] = page
    queries = {
        (1, 2, 3, 4): (1, 2, 3),
        (1, 2, 3): (1, 2),  # one token must be left to compute
        (1, 2, 9): (1, 2),
        (1, 7): (1,),
        (1,): None,
        (5, 6, 7, 8, 9): (5, 6),
        (2, 1): None,
    }
    for query, best in queries.items():
        expected = None if best is None else (stored[best], len(best))
        assert cache.match_partial(parent, list(query)) == expected, query
    assert cache.match_partial(SALT_A, [1, 2, 3, 4]) is None  # under another parent


@pytest.mark.parametrize("tokens", [[], [1, 2, 3, 4], [1, 2, 3, 4, 5]])
def test_insert_partial_refuses_empty_and_full_pages(tokens):
    cache = make_cache()
    (page,) = cache.allocator.allocate(1)
    assert not cache.insert_partial(SALT_A, tokens, page)
    assert cache.allocator.ref_count(page) == 1 and cache.num_cached == 0


def test_insert_partial_refuses_a_stored_prefix_and_a_named_page():
    cache = make_cache()
    first, second = cache.allocator.allocate(2)
    assert cache.insert_partial(SALT_A, [1, 2], first)
    assert not cache.insert_partial(SALT_A, [1, 2], second)
    assert not cache.insert_partial(SALT_A, [1, 2, 3], first)
    assert cache.allocator.ref_count(first) == 2 and cache.allocator.ref_count(second) == 1


def test_pins_are_never_idle_capped_and_survive_clear():
    cache = make_cache(max_pinned_pages=2)
    alloc = cache.allocator
    names, pages = computed_pages(cache, list(range(12)))
    other_names, _ = computed_pages(cache, [3] * 4)
    assert cache.pin(names) == 2  # the share is full after two pages
    assert cache.num_pinned == 2
    assert [alloc.ref_count(p) for p in pages] == [2, 2, 1]
    assert cache.pin(names[:1]) == 1  # already pinned: counted, no new reference
    assert alloc.ref_count(pages[0]) == 2
    assert cache.num_evictable == 2
    assert cache.evict(8) == 2
    assert cache.match(names) == pages[:2] and cache.match(other_names) == []
    (page,) = alloc.allocate(1)  # the evicted third page computed again
    assert cache.insert(names[2], page)
    alloc.free([page])
    assert cache.clear() == 1  # the third page of `names`; pinned pages keep their names
    assert cache.match(names) == pages[:2] and cache.num_cached == 2
    assert cache.unpin(names) == 2  # pages[0] still holds a second pin
    assert cache.num_pinned == 1 and cache.num_evictable == 1
    assert cache.unpin(names) == 1
    assert cache.num_pinned == 0 and cache.num_evictable == 2
    assert cache.clear() == 2
    assert alloc.num_free == 8


def test_pin_stops_at_the_first_name_not_cached():
    cache = make_cache(max_pinned_pages=4)
    names, pages = computed_pages(cache, list(range(12)))
    cache.match(names)
    cache.evict(1)  # the deepest page goes first
    assert cache.pin(names) == 2
    assert cache.unpin(names) == 2 and cache.allocator.ref_count(pages[0]) == 1


# -- the scheduler on a fake device ------------------------------------------------------------


def fake_model(context: list[int]) -> int:
    """The next token of a deterministic toy model: a hash of the whole context."""
    return 100 + sum((i + 1) * (t + 7) for i, t in enumerate(context)) * 2654435761 % 97


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    out = []
    while len(out) < max_tokens:
        out.append(fake_model(prompt + out))
    return out


def make_scheduler(**overrides) -> Scheduler:
    kwargs = dict(
        num_pages=16,
        page_size=PAGE,
        max_num_seqs=4,
        max_pages_per_seq=16,
        max_prefill_chunk=8,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        eviction_policy="lru",  # the cache's own mechanics (the advisor's: tests/aither_jax/eviction)
    )
    return Scheduler(**(kwargs | overrides))


_ids = iter(range(10**9))


def make_seq(prompt: list[int], max_tokens: int = 4, salt: bytes = SALT_A) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Sequence(next(_ids), list(prompt), params, 0, max_tokens, frozenset(), salt=salt)


class FakeDevice:
    """Runs plans like the engine does, on pages of token ids [num_pages, page_size]."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.pages = np.full((sched.allocator.num_pages, sched.page_size), UNWRITTEN, np.int64)

    def step(self) -> StepPlan:
        plan = self.sched.schedule()
        self.run(plan)
        return plan

    def run(self, plan: StepPlan) -> None:
        self.pages[[d for _, d in plan.copies]] = self.pages[[s for s, _ in plan.copies]]
        self.sched.copies_done(plan.copies)
        for rows in (plan.decode, plan.prefill):  # two calls, as in Engine.step
            for seq, toks in rows:
                for j, tok in enumerate(toks):
                    self.pages[self._where(seq, seq.num_cached + j)] = tok
            for seq, toks in rows:  # every row reads after all rows wrote: overlaps would show
                context = [int(self.pages[self._where(seq, p)]) for p in range(seq.num_cached + len(toks))]
                assert context == seq.token_slice(0, seq.num_cached + len(toks)), f"sequence {seq.seq_id}"
                self.sched.computed(seq, len(toks))
                if seq.num_pending == 0:
                    seq.output_ids.append(fake_model(context))
                    if len(seq.output_ids) >= seq.max_tokens:
                        seq.finish_reason = "length"
        self.sched.finish()
        check_ledger(self.sched)

    def _where(self, seq: Sequence, position: int) -> tuple[int, int]:
        page = int(self.sched.block_tables[seq.slot, position // self.sched.page_size])
        assert page != NULL_PAGE, f"sequence {seq.seq_id} has no page for position {position}"
        return page, position % self.sched.page_size

    def run_until_done(self) -> int:
        steps = 0
        while self.sched.has_unfinished():
            plan = self.step()
            assert plan.decode or plan.prefill, "a step with work waiting ran nothing"
            steps += 1
            assert steps < MAX_STEPS
        return steps


def check_ledger(sched: Scheduler) -> None:
    """Every allocator reference is held by a running sequence, a cache name or a pin."""
    alloc, cache = sched.allocator, sched.prefix_cache
    held = sum(len(s.pages) for s in sched.running)
    if cache is not None:
        held += cache.num_cached + cache.num_pinned
    assert sum(alloc.ref_count(p) for p in range(alloc.num_pages)) == held
    assert alloc.num_free == sum(alloc.ref_count(p) == 0 for p in range(1, alloc.num_pages))
    for s in sched.running:
        assert list(sched.block_tables[s.slot, : len(s.pages)]) == s.pages
        assert sched.pages_needed(s.num_cached) <= len(s.pages)


def check_drained(sched: Scheduler, seqs: list[Sequence]) -> None:
    """Everything finished with the reference output; no page or slot left behind."""
    assert not sched.has_unfinished()
    for s in seqs:
        assert s.finished and s.output_ids == reference_output(s.prompt_ids, s.max_tokens), s.seq_id
        assert s.slot == -1 and s.pages == []
    assert (sched.block_tables == NULL_PAGE).all()
    cache = sched.prefix_cache
    if cache is not None:  # each cached name counts the cached full pages continuing it
        for _ in range(2):  # before and after `clear` (pinned pages stay)
            parents = [cache.blocks[p].parent for p in cache._full.values()]
            assert cache._branches == collections.Counter(n for n in parents if n is not None)
            cache.clear()
        assert not cache._shared
    assert sched.allocator.num_free == sched.allocator.num_pages - 1


def run_until(device: FakeDevice, condition) -> None:
    for _ in range(MAX_STEPS):
        if condition():
            return
        device.step()
    raise AssertionError("condition never held")


PROMPT_LENGTHS = [3, 9, 14, 20, 5, 11, 2]


@pytest.mark.parametrize("batched, chunk", [(16, 8), (8, 8), (6, 4), (4, 8), (5, 2)])
@pytest.mark.parametrize("caching", [True, False])
def test_rows_respect_the_token_budget_and_decodes_go_first(batched, chunk, caching):
    sched = make_scheduler(
        max_num_batched_tokens=batched, max_prefill_chunk=chunk, num_pages=64, enable_prefix_caching=caching
    )
    device = FakeDevice(sched)
    seqs = [make_seq([(3 * i + j) % 50 for j in range(n)], max_tokens=5) for i, n in enumerate(PROMPT_LENGTHS)]
    for s in seqs:
        sched.add(s)
    while sched.has_unfinished():
        plan = sched.schedule()
        scheduled = {s for s, _ in plan.decode + plan.prefill}
        assert sum(len(t) for _, t in plan.decode + plan.prefill) <= batched
        if len(plan.prefill) > 1:  # the padded prefill call fits the budget as well
            width = bucket(max(len(t) for _, t in plan.prefill), 1, chunk)
            assert bucket(len(plan.prefill), 1, sched.max_num_seqs) * width <= batched
        assert all(len(t) == 1 and not s.prefilling for s, t in plan.decode)
        assert all(1 <= len(t) <= min(chunk, s.num_pending) for s, t in plan.prefill)
        assert all(s.prefilling for s in sched.running if s not in scheduled)  # no decode is left out
        device.run(plan)
    assert sched.num_preemptions == 0
    check_drained(sched, seqs)


@pytest.mark.parametrize("min_token_bucket", [1, 4])
def test_prefill_rows_are_chosen_so_the_padded_call_fits_the_budget(min_token_bucket):
    # Five 5-token prompts, 32 tokens a step: five rows would pad to 8 x 8 = 64 slots, so a
    # step takes four (4 x 8 = 32); the fifth starts in the next one.
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=32, num_pages=64, min_token_bucket=min_token_bucket)
    device = FakeDevice(sched)
    seqs = [make_seq([i + 1] * 5, max_tokens=2) for i in range(5)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    assert [s for s, _ in plan.prefill] == seqs[:4] and all(len(t) == 5 for _, t in plan.prefill)
    device.run(plan)
    plan = sched.schedule()
    assert [s for s, _ in plan.prefill] == seqs[4:] and len(plan.decode) == 4
    device.run(plan)
    device.run_until_done()
    check_drained(sched, seqs)


def test_a_later_prefill_row_takes_a_shorter_chunk_to_fit_the_padded_budget():
    sched = make_scheduler(max_num_seqs=8, max_prefill_chunk=32, max_num_batched_tokens=32, num_pages=64)
    device = FakeDevice(sched)
    short, long = make_seq([7, 8, 9], max_tokens=2), make_seq([(5 * i) % 47 + 1 for i in range(40)], max_tokens=2)
    sched.add(short)
    sched.add(long)
    plan = sched.schedule()
    # 29 tokens of the long prompt would fit the 32-token budget but pad the call to 2 x 32.
    assert [(s, len(t)) for s, t in plan.prefill] == [(short, 3), (long, 16)]
    device.run(plan)
    device.run_until_done()
    check_drained(sched, [short, long])


@pytest.mark.parametrize("length", [5, 8, 9, 12, 13, 17])
def test_same_prompt_later_starts_from_the_cached_full_pages(length):
    sched = make_scheduler()
    device = FakeDevice(sched)
    prompt = [(5 * i) % 31 for i in range(length)]
    first = make_seq(prompt, max_tokens=10)
    sched.add(first)
    run_until(device, lambda: first.output_ids)  # its prompt pages are all computed and named
    second = make_seq(prompt, max_tokens=3)
    sched.add(second)
    plan = sched.schedule()
    # The last prompt token is never taken from the cache: its logits are needed to sample.
    expected = (length - 1) // PAGE * PAGE
    assert second.num_cached_prompt == second.num_cached == expected
    assert second.pages[: expected // PAGE] == first.pages[: expected // PAGE]
    rows = dict(plan.decode + plan.prefill)
    assert rows[second] == prompt[expected : expected + 8]
    assert (second in dict(plan.decode)) == (length - expected == 1)
    assert sched.num_prefix_hits == expected and sched.num_prefix_queries == 2 * length
    device.run(plan)
    device.run_until_done()
    assert second.output_ids == first.output_ids[:3]
    check_drained(sched, [first, second])


def test_a_page_being_computed_is_waited_for_while_others_are_admitted():
    sched = make_scheduler()
    device = FakeDevice(sched)
    prompt = list(range(1, 21))  # 5 pages, computed 8 tokens a step
    first = make_seq(prompt, max_tokens=2)
    sched.add(first)
    device.step()
    assert first.num_cached == 8
    same, other = make_seq(prompt, max_tokens=2), make_seq([40, 41, 42, 43, 44])
    sched.add(same)
    sched.add(other)
    device.step()  # `first` is filling the third page: `same` would compute it again
    assert list(sched.waiting) == [same] and same.slot == -1
    assert other in sched.running and first.num_cached == 16
    plan = device.step()
    assert same.num_cached_prompt == 16
    assert dict(plan.prefill)[same] == prompt[16:]
    device.run_until_done()
    assert same.num_computed == 4 + 1  # the rest of its prompt, then one decode
    check_drained(sched, [first, same, other])


def test_arrivals_in_one_pass_wait_for_the_first_to_compute_their_prefix():
    sched = make_scheduler()
    device = FakeDevice(sched)
    prompt = list(range(1, 9))  # 2 pages, computed in one step
    first, same, other = make_seq(prompt), make_seq(prompt + [50, 51]), make_seq([40, 41, 42, 43, 44])
    for s in (first, same, other):
        sched.add(s)
    plan = device.step()
    assert [s for s, _ in plan.prefill] == [first, other] and list(sched.waiting) == [same]
    plan = device.step()
    assert same.num_cached_prompt == 8 and dict(plan.prefill)[same] == [50, 51]
    device.run_until_done()
    check_drained(sched, [first, same, other])


@pytest.mark.parametrize("length, max_tokens", [(5, 1), (6, 2), (9, 2), (3, 4), (2, 2)])
def test_a_finished_partial_page_is_adopted_by_copy(length, max_tokens):
    """Prompt + output of a finished sequence continued by a follow-up (a chat turn)."""
    sched = make_scheduler()
    device = FakeDevice(sched)
    first = make_seq([11 + i for i in range(length)], max_tokens=max_tokens)
    sched.add(first)
    while not first.finished:
        plan = sched.schedule()
        pages = list(first.pages)  # before the step's finish() releases them
        device.run(plan)
    cached_tokens = length + max_tokens - 1  # the last sampled token was never run
    assert cached_tokens % PAGE, "the case must end inside a page"
    assert first.num_cached == cached_tokens
    partial_page, full_pages = pages[cached_tokens // PAGE], pages[: cached_tokens // PAGE]
    assert sched.allocator.ref_count(partial_page) == 1  # only the cache keeps it
    follow_up = make_seq(first.prompt_ids + first.output_ids[:-1] + [90, 91], max_tokens=3)
    sched.add(follow_up)
    free_before = [p for p in range(1, sched.allocator.num_pages) if sched.allocator.ref_count(p) == 0]
    plan = sched.schedule()
    ((src, dst),) = plan.copies
    assert src == partial_page and dst in free_before
    assert follow_up.pages[: len(full_pages) + 1] == [*full_pages, dst]  # then fresh pages for its new tokens
    assert follow_up.num_cached_prompt == follow_up.num_cached == cached_tokens
    assert sched.allocator.ref_count(src) == 2 and sched.allocator.ref_count(dst) == 1
    device.run(plan)  # copies_done drops the copy's hold on the source
    assert sched.allocator.ref_count(src) == 1
    device.run_until_done()
    check_drained(sched, [first, follow_up])


def test_a_partial_page_of_another_tenant_is_not_adopted():
    sched = make_scheduler()
    device = FakeDevice(sched)
    first = make_seq([1, 2, 3, 4, 5, 6], max_tokens=1, salt=SALT_A)
    sched.add(first)
    device.run_until_done()
    for salt, copies in ((SALT_B, 0), (SALT_A, 1)):
        seq = make_seq([1, 2, 3, 4, 5, 6, 7], max_tokens=1, salt=salt)
        sched.add(seq)
        plan = device.step()
        assert len(plan.copies) == copies
        device.run_until_done()
        assert seq.num_cached_prompt == 6 * copies


@pytest.mark.parametrize("caching", [True, False])
def test_the_newest_sequence_is_preempted_when_pages_run_out(caching):
    # 8 usable pages: the four prompts fit (2 pages each), their decodes do not (4 pages each).
    sched = make_scheduler(num_pages=9, enable_prefix_caching=caching)
    device = FakeDevice(sched)
    seqs = [make_seq([20 * i + j for j in range(6)], max_tokens=8) for i in range(4)]
    for s in seqs:
        sched.add(s)
    device.step()
    assert sched.running == seqs
    while sched.num_preemptions == 0:
        running = list(sched.running)
        assert len(running) == 4 and not sched.waiting
        device.step()
    victim = running[-1]
    assert sched.num_preemptions == victim.num_preemptions == 1
    assert list(sched.waiting) == [victim] and victim not in sched.running
    assert victim.num_cached == 0 and victim.pages == [] and victim.slot == -1
    assert [s for s in running if s is not victim] == sched.running
    device.run_until_done()
    assert sum(s.num_preemptions for s in seqs) == sched.num_preemptions
    if caching:
        assert sched.num_prefix_queries == 4 * 6  # counted once, at first admission
    check_drained(sched, seqs)


@pytest.mark.parametrize("salts", [(SALT_A, SALT_B), (b"", SALT_A)])
def test_two_salts_never_share_pages(salts):
    sched = make_scheduler()
    device = FakeDevice(sched)
    prompt = list(range(30, 43))
    first = make_seq(prompt, max_tokens=6, salt=salts[0])
    sched.add(first)
    run_until(device, lambda: first.output_ids)
    stranger, sibling = make_seq(prompt, max_tokens=6, salt=salts[1]), make_seq(prompt, max_tokens=6, salt=salts[0])
    sched.add(stranger)
    sched.add(sibling)
    device.step()
    assert stranger.num_cached_prompt == 0 and not set(stranger.pages) & set(first.pages)
    assert sibling.num_cached_prompt == 12 and sibling.pages[:3] == first.pages[:3]
    device.run_until_done()
    check_drained(sched, [first, stranger, sibling])


def random_workload(rng: np.random.Generator, caching: bool, num_pages: int) -> tuple[Scheduler, list[Sequence]]:
    """Requests over a few shared prefixes and two tenants, some continuing finished ones,
    arriving between steps; runs them all on a fake device."""
    sched = make_scheduler(num_pages=num_pages, enable_prefix_caching=caching)
    device = FakeDevice(sched)
    prefixes = [list(rng.integers(0, 60, size=n)) for n in (0, 5, 9, 14)]
    seqs: list[Sequence] = []
    for _ in range(MAX_STEPS):
        if len(seqs) < 24:
            for _ in range(rng.integers(0, 3)):
                done = [s for s in seqs if s.finished]
                if done and rng.random() < 0.3:
                    parent = done[rng.integers(len(done))]
                    prompt, salt = parent.prompt_ids + parent.output_ids[:-1], parent.salt
                else:
                    prompt, salt = list(prefixes[rng.integers(len(prefixes))]), (SALT_A, SALT_B)[rng.integers(2)]
                prompt = [int(t) for t in prompt + list(rng.integers(0, 60, size=rng.integers(1, 6)))]
                if sched.pages_needed(len(prompt) + 8) <= num_pages - 1:
                    seqs.append(make_seq(prompt, max_tokens=int(rng.integers(1, 9)), salt=salt))
                    sched.add(seqs[-1])
        elif not sched.has_unfinished():
            return sched, seqs
        if sched.has_unfinished():
            device.step()
    raise AssertionError("the workload did not finish")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("caching", [True, False])
def test_random_workloads_read_their_own_tokens_and_leave_nothing_behind(seed, caching):
    sched, seqs = random_workload(np.random.default_rng(seed), caching, num_pages=64)
    if caching:
        assert sched.num_prefix_hits > 0
    check_drained(sched, seqs)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("caching", [True, False])
def test_random_workloads_on_a_tight_pool_preempt_and_still_agree(seed, caching):
    sched, seqs = random_workload(np.random.default_rng(seed), caching, num_pages=9)
    assert sched.num_preemptions > 0
    check_drained(sched, seqs)


def test_adopting_the_last_idle_page_by_copy_does_not_run_out_of_pages():
    """Two usable pages: one held by a running sequence, the other an idle cached partial page.
    Admission counts the idle page as free, then holds it as the copy's source and has no page
    left for the copy's destination."""
    sched = make_scheduler(num_pages=3, max_num_seqs=2, max_pages_per_seq=2, max_num_batched_tokens=8)
    device = FakeDevice(sched)
    first, busy = make_seq([1, 2, 3], max_tokens=1), make_seq([7, 7, 7], max_tokens=4)
    sched.add(first)
    sched.add(busy)
    device.step()
    assert first.finished and sched.allocator.num_free == 0 and sched.prefix_cache.num_evictable == 1
    follow_up = make_seq([1, 2, 3, 4], max_tokens=1)
    sched.add(follow_up)
    device.run_until_done()
    check_drained(sched, [first, busy, follow_up])


@pytest.mark.parametrize("sink_tokens", [0, 3, 6])
def test_admission_on_cached_pages_comes_with_a_sink_refill(sink_tokens):
    """With sink tokens a sequence admitted on cached pages (full ones, or a partial page by
    copy) gets its first min(n, cached) tokens to recompute; one computed from scratch and
    every sequence of a format without sinks get none."""
    sched = make_scheduler(sink_tokens=sink_tokens)
    device = FakeDevice(sched)
    seqs = []
    # (prompt computed first, prompt admitted on its pages, tokens found cached)
    for done, later, cached in (
        ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 7, 8, 9, 70], 8),
        ([5, 6], [5, 6, 80], 2),
    ):
        first = make_seq(done, max_tokens=1)
        sched.add(first)
        assert device.step().sink_refills == []
        device.run_until_done()
        seq = make_seq(later)
        sched.add(seq)
        plan = device.step()
        assert seq.num_cached_prompt == cached
        assert plan.sink_refills == ([(seq, later[: min(sink_tokens, cached)])] if sink_tokens else [])
        device.run_until_done()
        seqs += [first, seq]
    check_drained(sched, seqs)


def test_an_owners_pin_is_taken_once_and_replaced_by_its_next_prefix():
    """A context pipeline's requests pin their stable prefix under the context's key: however
    many ask for it the owner holds one pin, a new prefix releases the old one once computed,
    and a request that never computes changes nothing."""
    sched = make_scheduler(num_pages=32, max_num_seqs=2, max_pinned_fraction=0.5)
    cache, device, key = sched.prefix_cache, FakeDevice(sched), b"context"
    old, new = list(range(1, 9)), list(range(40, 48))  # two pages each

    def ask(prefix: list[int], tail: int) -> Sequence:
        seq = make_seq(prefix + [tail], max_tokens=1)
        seq.pin_tokens, seq.pin_key = len(prefix), key
        sched.add(seq)
        return seq

    for tail in (90, 91, 92):
        seq = ask(old, tail)
        device.run_until_done()
        assert seq.num_pinned_pages == 2
    pinned = [p for p in range(sched.allocator.num_pages) if sched.allocator.blocks[p].pins]
    assert len(pinned) == 2 and all(sched.allocator.blocks[p].pins == 1 for p in pinned)
    sched.abort(ask(new, 93))  # never computed: the old pin stays
    assert cache.num_pinned == 2 and cache.num_pinned_of(seq.names[:2]) == 2
    ask(new, 94)
    device.run_until_done()
    assert cache.num_pinned == 2 and cache.num_pinned_of(seq.names[:2]) == 0  # the old prefix let go
    assert sched.release_pin(key) == 2 and cache.num_pinned == 0
    assert sched.release_pin(key) == 0
