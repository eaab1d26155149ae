"""The KV tiers under the engine: multi-turn conversations on a device pool too small to keep
any of them, every follow-up's earlier rounds restored from host or disk, give the same greedy
tokens as a pool that keeps everything (float32 cache, unused pages NaN), speculation on too;
a restarted engine finds its pages on disk."""

from __future__ import annotations

import numpy as np
import pytest

import aither_jax as aj
from tests.conftest import F32, TINY

MODEL = "smollm2-135m"
# conftest's float32 settings (unused pages NaN) on the stand-in, two slots, no fixed pool size;
# LRU eviction, whose order the counts below follow (the advisor's tiers: test_advisor.py).
SETTINGS = {k: v for k, v in F32.items() if k != "num_pages"} | dict(
    max_model_len=256, max_num_seqs=2, page_size=16, enable_prefix_caching=True, eviction_policy="lru", **TINY
)
# Each conversation's rounds outgrow a 12-page pool together: a round's earlier rounds were
# evicted by the other conversations' rounds in between.
SMALL_POOL = 12
GREEDY = aj.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def conversations(llm: aj.LLM, rounds: int = 3) -> tuple[list[list[int]], list[list[int]]]:
    """Four conversations, round-robin: every round sends all prior rounds (prompt and answer)
    plus a new question. Returns (the prompts sent, the answers) in order."""
    rng = np.random.default_rng(0)
    history = [rng.integers(100, 5000, 40).tolist() for _ in range(4)]
    prompts, answers = [], []
    for _ in range(rounds):
        for c in range(4):
            prompt = history[c] + rng.integers(100, 5000, 10).tolist()
            answer = llm.generate([prompt], GREEDY)[0].token_ids
            prompts.append(prompt)
            answers.append(answer)
            history[c] = prompt + answer
    return prompts, answers


@pytest.fixture(scope="module")
def reference():
    """The answers of a pool that keeps every page of every round."""
    return conversations(aj.LLM(MODEL, num_pages=120, **SETTINGS))[1]


@pytest.mark.parametrize(
    ("tiers", "speculative"),
    [
        (dict(kv_offloading_size=0.01), None),  # every follow-up restores from host
        (dict(kv_offloading_size=0.01), "ngram"),
        (dict(kv_cache_dir="DIR"), None),  # no host pool: straight to disk and back
    ],
)
def test_follow_ups_restored_from_a_lower_tier_answer_as_a_pool_that_keeps_everything(
    tiers, speculative, reference, tmp_path
):
    tiers = {k: str(tmp_path) if v == "DIR" else v for k, v in tiers.items()}
    llm = aj.LLM(MODEL, num_pages=SMALL_POOL, speculative=speculative, **tiers, **SETTINGS)
    _, answers = conversations(llm)
    assert answers == reference
    counters = llm.engine.tiers.counters
    hits = counters.num_disk_hits if "kv_cache_dir" in tiers else counters.num_host_hits
    # Rounds 2 and 3 of four conversations: each starts from its earlier rounds' full pages.
    assert hits >= 8 * 2 and llm.engine.scheduler.num_prefix_hits >= hits * 16


def test_a_restarted_engine_finds_its_pages_on_disk(reference, tmp_path):
    first = aj.LLM(MODEL, num_pages=SMALL_POOL, kv_offloading_size=0.001, kv_cache_dir=tmp_path, **SETTINGS)
    prompts, answers = conversations(first)
    assert first.persist() > 0
    del first
    second = aj.LLM(MODEL, num_pages=SMALL_POOL, kv_cache_dir=tmp_path, **SETTINGS)
    restored = [o.token_ids for o in second.generate(prompts[-4:], GREEDY)]
    assert restored == answers[-4:] == reference[-4:]
    assert second.engine.tiers.counters.num_disk_hits >= 4 * 3  # each last round's first 48 tokens
    assert second.engine.tiers.disk.counters.num_corrupt == 0


def test_tiers_need_prefix_caching():
    with pytest.raises(ValueError, match="need prefix caching"):
        aj.LLM(MODEL, **{**SETTINGS, "enable_prefix_caching": False}, kv_offloading_size=1.0)
    with pytest.raises(ValueError, match="persist\\(\\) writes to the disk tier"):
        aj.LLM(MODEL, num_pages=SMALL_POOL, kv_offloading_size=0.001, **SETTINGS).persist()


def test_follow_ups_recompute_when_the_cost_model_measures_reloading_slower(reference):
    llm = aj.LLM(MODEL, num_pages=SMALL_POOL, kv_offloading_size=0.01, **SETTINGS)
    cost = llm.engine.tiers.cost
    cost.observe_prefill(10**9, 1.0)  # recompute "measured" at a billion tokens per second
    cost.observe_reload(1, 0, 1.0)  # and reloading at one byte per second
    _, answers = conversations(llm)
    assert answers == reference
    assert llm.engine.tiers.counters.num_host_hits == 0 and cost.num_recompute >= 8 and cost.num_reload == 0


def test_idle_pages_beyond_the_high_watermark_are_demoted_between_steps():
    llm = aj.LLM(MODEL, num_pages=SMALL_POOL, kv_offloading_size=0.01, kv_high_watermark=0.5, **SETTINGS)
    conversations(llm, rounds=1)
    sched = llm.engine.scheduler
    assert sched.allocator.num_used <= 0.5 * sched.num_usable_pages
    assert llm.engine.tiers.counters.num_demoted > 0


def test_requests_waiting_for_a_slot_have_their_pages_promoted_ahead(reference):
    one_slot = SETTINGS | dict(max_num_seqs=1)
    llm = aj.LLM(MODEL, num_pages=40, kv_offloading_size=0.01, kv_high_watermark=1.0, kv_low_watermark=1.0, **one_slot)
    prompts, answers = conversations(llm, rounds=2)
    cache = llm.engine.scheduler.prefix_cache
    cache.evict(cache.num_evictable)  # every page to the host
    assert [o.token_ids for o in llm.generate(prompts[4:], GREEDY)] == answers[4:] == reference[4:8]
    counters = llm.engine.tiers.counters
    # Each second-round prompt starts with 4 full pages of its first round; the first request
    # promotes them at its admission, the three that wait for the slot are promoted ahead.
    assert counters.num_prefetched == 3 * 4 and counters.num_host_hits == 4 * 4


def test_a_preempted_request_gets_its_pages_back_from_the_host():
    rng = np.random.default_rng(5)
    prompts = [rng.integers(100, 5000, 40).tolist() for _ in range(2)]
    long = aj.SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    alone = [o.token_ids for o in aj.LLM(MODEL, num_pages=40, **SETTINGS).generate(prompts, long)]
    llm = aj.LLM(MODEL, num_pages=SMALL_POOL, kv_offloading_size=0.01, **SETTINGS)
    assert [o.token_ids for o in llm.generate(prompts, long)] == alone
    # Two requests of 7 pages each in 11: the newer is preempted; its computed pages leave the
    # device for the host and come back at its readmission instead of being recomputed.
    assert llm.engine.scheduler.num_preemptions >= 1 and llm.engine.tiers.counters.num_host_hits >= 2


@pytest.mark.parametrize("below", ["host", "corrupt disk"])
def test_a_resized_pool_stops_above_pages_in_use_and_keeps_what_it_cuts_off_below(below, tmp_path):
    """`Engine.resize_pool` (the fleet's balloon) between steps: a shrink stops above the
    pages a running request holds, which then finishes as it would have; a later shrink
    demotes the idle cached pages it cuts off to the tier below, and grown back, a follow-up
    finds them there and the device pages after them. On a disk whose files went bad the hit
    ends before them, and the device pages after are given back. Answers equal a large pool's."""
    settings = dict(SETTINGS, max_model_len=128)  # a floor of 9 pages
    rng = np.random.default_rng(1)
    first = [rng.integers(100, 5000, 40).tolist() for _ in range(2)]
    running = rng.integers(100, 5000, 100).tolist()
    big = aj.LLM(MODEL, num_pages=120, **settings)
    want = [o.token_ids for o in big.generate([*first, running], GREEDY)]
    follow_up = running + want[2] + rng.integers(100, 5000, 10).tolist()
    want_follow_up = big.generate([follow_up], GREEDY)[0].token_ids

    tier = dict(kv_offloading_size=0.01) if below == "host" else dict(kv_cache_dir=str(tmp_path))
    llm = aj.LLM(MODEL, num_pages=40, **tier, **settings)
    engine = llm.engine
    assert [o.token_ids for o in llm.generate(first, GREEDY)] == want[:2]
    seq = engine.add_request(running, GREEDY)
    engine.step()  # its first prefill chunk, on pages above the cached ones
    top = max(seq.pages)
    assert engine.scheduler.min_pool_size() == top + 1  # what the balloon counts as reachable
    assert engine.resize_pool(9) == top + 1 == engine.num_pages > 9
    assert len(engine.scheduler.allocator.blocks) == top + 1
    while engine.has_unfinished():
        chain = list(seq.pages)  # its pages in chain order (given back when it finishes)
        engine.step()
    assert seq.output_ids == want[2]

    cache, tiers = engine.scheduler.prefix_cache, engine.scheduler.prefix_cache.tiers
    cut = [p for p in range(9, engine.num_pages) if cache.idle(p)]
    demoted, hits = tiers.counters.num_demoted, tiers.counters.num_host_hits
    assert cut and engine.resize_pool(9) == 9
    assert tiers.counters.num_demoted - demoted == len(cut) and not any(cache.idle(p) for p in cut if p < 9)
    assert engine.resize_pool(40) == 40
    if below == "corrupt disk":
        tiers.disk.sync()  # every page written (a pending write is read from memory)
        for path in tmp_path.rglob("*.kvpage"):
            path.write_bytes(path.read_bytes()[:-1] + b"?")
    out = llm.generate([follow_up], GREEDY)[0]
    assert out.token_ids == want_follow_up
    # The running request's chain had pages below the cut after those above it: the lookup
    # takes the device run after the lower run too, so all of its stored tokens are reused.
    if below == "host":
        assert tiers.counters.num_host_hits - hits == len(cut)  # the pages cut off came back
        assert out.num_cached_tokens == len(running) + len(want[2]) - 1
    else:
        assert tiers.disk.counters.num_corrupt == 1
        assert out.num_cached_tokens == 16 * next(i for i, p in enumerate(chain) if p in cut)
    allocator = engine.scheduler.allocator
    assert all(allocator.ref_count(p) == 0 or cache.idle(p) for p in range(1, engine.num_pages))  # nothing held
    with pytest.raises(ValueError, match="too small"):
        engine.resize_pool(8)
    # A device that refuses the new pools (out of memory) leaves the engine as it was: the
    # scheduler takes its size back, and the next request runs on the old pools.
    real_resize = engine.store.resize

    def refuse(n):
        raise RuntimeError("RESOURCE_EXHAUSTED")

    engine.store.resize = refuse
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        engine.resize_pool(60)
    engine.store.resize = real_resize
    assert engine.num_pages == 40 == len(allocator.blocks) == engine.store.num_usable_pages + 1
    assert llm.generate([follow_up], GREEDY)[0].token_ids == want_follow_up
