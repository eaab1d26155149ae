"""The block graph: each edge type made by its own event, weights growing and decaying, bounded
memory, co-attendance counted without favouring any ids."""

from __future__ import annotations

import numpy as np
import pytest

from aither_jax.eviction.graph import CO_ATTEND_MIN, BlockGraph, EdgeType


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def name(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def test_co_attend_edges_appear_at_the_third_co_occurrence_and_then_grow():
    graph = BlockGraph(clock=Clock())
    masses = {name(1): 0.5, name(2): 0.3, name(3): 0.01}
    for _ in range(CO_ATTEND_MIN - 1):
        assert graph.co_attend(masses, threshold=0.1) == 0
    assert graph.num_edges() == 0
    assert graph.co_attend(masses, threshold=0.1) == 1
    assert graph.weight(name(1), name(2), EdgeType.CO_ATTEND) == 1.0
    graph.co_attend(masses, threshold=0.1)
    assert graph.weight(name(2), name(1), EdgeType.CO_ATTEND) == 2.0
    assert graph.num_edges() == graph.num_edges(EdgeType.CO_ATTEND) == 1  # page 3 stayed below the threshold


def test_co_attendance_counts_the_heaviest_pages_whatever_their_ids():
    # 40 pages over the threshold; the 4 heaviest have the highest ids. Counting the first pairs
    # in id order (the public version's 100-pair cap) would never link them.
    graph = BlockGraph(clock=Clock(), co_attend_top=4)
    masses = {name(i): 0.1 + (0.5 if i >= 36 else 0.0) + i * 1e-4 for i in range(40)}
    for _ in range(CO_ATTEND_MIN):
        graph.co_attend(masses, threshold=0.05)
    heavy = [name(i) for i in range(36, 40)]
    assert graph.num_edges(EdgeType.CO_ATTEND) == 6  # every pair of the four, nothing else
    assert all(graph.weight(a, b, EdgeType.CO_ATTEND) == 1.0 for a in heavy for b in heavy if a < b)


def test_semantic_edges_link_pages_whose_key_summaries_are_close():
    graph = BlockGraph(clock=Clock())
    rng = np.random.default_rng(0)
    common = 10 * rng.standard_normal(64)  # every key's shared direction
    pages = [common + rng.standard_normal(64) for _ in range(20)]  # unrelated pages
    for i, summary in enumerate(pages):
        graph.summarize(name(i), summary)
    assert graph.num_edges() == 0  # alike only through the common direction: not linked
    near = pages[3] + 0.1 * rng.standard_normal(64)
    assert graph.summarize(name(99), near) == 1
    assert graph.weight(name(3), name(99), EdgeType.SEMANTIC) > 0.8
    assert graph.num_edges() == graph.num_edges(EdgeType.SEMANTIC) == 1
    assert graph.summarize(name(100), np.zeros(64)) == 0  # no direction: no summary
    for i in range(101, 106):  # five more near page 3: each links to at most its 3 closest
        assert graph.summarize(name(i), pages[3] + 0.1 * rng.standard_normal(64)) == min(i - 99, 3)
    assert max(d for d, _ in graph.stats().values()) <= 3 + 5


def test_weights_decay_with_the_half_life_and_grow_from_the_decayed_value():
    clock = Clock()
    graph = BlockGraph(half_life_s=10.0, clock=clock)
    graph.add(name(1), name(2), EdgeType.TEMPORAL, 4.0)
    clock.now = 10.0
    assert graph.weight(name(1), name(2), EdgeType.TEMPORAL) == pytest.approx(2.0)
    graph.add(name(1), name(2), EdgeType.TEMPORAL, 1.0)
    clock.now = 20.0
    assert graph.weight(name(1), name(2), EdgeType.TEMPORAL) == pytest.approx(1.5)
    assert graph.stats()[name(1)] == (1, pytest.approx(1.5))


def test_the_graph_keeps_at_most_max_edges_dropping_the_weakest():
    clock = Clock()
    graph = BlockGraph(max_edges=50, clock=clock)
    for i in range(200):
        clock.now = float(i)  # later edges are stronger (less decayed)
        graph.add(name(i), name(i + 1), EdgeType.TEMPORAL, 1.0)
    assert graph.num_edges() <= 50 and graph.num_pruned >= 150
    assert graph.weight(name(199), name(200), EdgeType.TEMPORAL) > 0  # the newest survive
    assert graph.weight(name(0), name(1), EdgeType.TEMPORAL) == 0
    graph.remove(name(199))
    assert graph.neighbours(name(199)) == [] and graph.weight(name(199), name(200), EdgeType.TEMPORAL) == 0


def test_the_dump_lists_nodes_and_edges_by_type():
    graph = BlockGraph(clock=Clock())
    graph.add(name(1), name(2), EdgeType.TEMPORAL)
    graph.add(name(2), name(3), EdgeType.TEMPORAL)
    graph.add(name(3), name(9), EdgeType.MEMORY_REF)
    dump = graph.to_json(lambda n: {"tag": "x"})
    assert dump["num_edges"]["temporal"] == 2 and dump["num_edges"]["memory_ref"] == 1
    assert dump["num_edges"]["spill_link"] == 0
    assert [n["name"] for n in dump["nodes"]] == sorted(name(i).hex() for i in (1, 2, 3, 9))
    assert dump["nodes"][0]["tag"] == "x"


def test_weights_and_page_strengths_stay_exact_over_thousands_of_half_lives():
    # Stored weights are kept at a reference time that moves forward; a page's strength is
    # kept as edges change. Both must equal the decayed weights of the edges at every read
    # (to rounding: a removed strong edge leaves a residue of its weight times 1e-16).
    clock = Clock()
    graph = BlockGraph(half_life_s=1.0, max_edges=40, clock=clock)
    rng = np.random.default_rng(0)
    for _ in range(600):
        clock.now += float(rng.choice([0.0, 0.5, 30.0]))  # 30 half-lives at a time, now and then
        a, b = (int(x) for x in rng.integers(0, 12, 2))
        if rng.random() < 0.1:
            graph.remove(name(a))
        else:
            graph.add(name(a), name(b), EdgeType.TEMPORAL if rng.random() < 0.5 else EdgeType.SEMANTIC, 1.0)
        stats = graph.stats()
        for i in range(12):
            links = graph.neighbours(name(i))
            want = (len(links), sum(w for _, _, w in links))
            assert stats.get(name(i), (0, 0.0)) == (want[0], pytest.approx(want[1], rel=1e-9, abs=1e-12))
            assert graph.stats([name(i)]).get(name(i), (0, 0.0)) == stats.get(name(i), (0, 0.0))
    assert clock.now > 2000 and graph.num_pruned > 0  # past 2^1024 without moving the reference
    clock.now += 3.0
    graph.add(name(100), name(101), EdgeType.TEMPORAL, 8.0)
    clock.now += 3.0
    assert graph.weight(name(100), name(101), EdgeType.TEMPORAL) == pytest.approx(1.0)
