"""The simulation half of scripts/draft_ranks.py, against brute force and hand-made cases."""

import itertools
import pathlib
import sys
import types

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "scripts"))

import draft_ranks as dr  # noqa: E402


@pytest.mark.parametrize("seed", range(5))
def test_best_prefixes_are_the_most_probable_paths(seed):
    rng = np.random.default_rng(seed)
    depth, width = 3, 4
    top = -np.sort(-np.log(rng.dirichlet(np.ones(10), size=depth)), axis=1)[:, :width]
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(width), repeat=d)]
    logp = {p: sum(top[i, r] for i, r in enumerate(p)) for p in paths}
    ranked = sorted(paths, key=lambda p: -logp[p])
    for size in (1, 2, 5, 11, 30, len(paths)):
        got = dr.best_prefixes(top, size)
        assert set(got) == set(ranked[:size]) and len(got) == size, size
        assert all(got.index(p[:-1]) < got.index(p) for p in got if len(p) > 1)  # prefixes first
        assert all(p[:-1] in got for p in got if len(p) > 1)  # closed under prefixes


def test_acceptance_along_a_chain_a_tree_and_a_lookup():
    ranks = np.array([0, 0, 1, 0, -1])
    assert dr.accepted_chain(ranks, 15) == 2 and dr.accepted_chain(ranks, 1) == 1
    chain = {(0,), (0, 0), (0, 0, 0)}
    assert dr.accepted_tree(ranks, chain) == 2
    assert dr.accepted_tree(ranks, chain | {(0, 0, 1), (0, 0, 1, 0)}) == 4
    assert dr.accepted_tree(np.array([0, 0, 0, 0, -1]), {(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)}) == 4
    assert dr.accepted_tree(np.array([2, 0]), chain) == 0
    assert dr.accepted_drafts([5, 6, 7], np.array([5, 6, 8, 9])) == 2
    assert dr.accepted_drafts([5, 6, 7], np.array([5])) == 1


def test_walk_commits_drafts_plus_the_bonus_token():
    accepted = [1, 9, 0, 3, 9, 9, 9, 0, 2, 9]  # anchors 0, 2, 3, 7, 8 are the ones visited
    assert dr.walk(len(accepted), lambda i: accepted[i]) == [2, 1, 4, 1, 3]
    assert dr.walk(0, lambda i: 0) == []


def test_summary_of_a_draft_that_is_always_right():
    """A text of 40 tokens whose every rank is 0: each chain pass commits the whole block
    (15 drafts + bonus) until the text ends; prompt lookup finds nothing in a text without
    repeats, so chain+lookup equals the chain."""
    block = 16
    tokens = np.arange(100, 140)
    plen = 4
    anchors = len(tokens) - plen
    pos = np.arange(anchors)[:, None] + 1 + np.arange(block - 1)
    ranks = np.where(pos < anchors, 0, -1)
    top = np.tile(np.log(np.array([0.9, 0.05, 0.05]))[None, None], (anchors, block - 1, 1))
    from aither_jax.speculative.ngram import ngram_propose

    args = types.SimpleNamespace(trees=[4], draft=None, prompts="p.jsonl", max_tokens=36)
    r = dr.summarize(args, [(tokens, plen, ranks, top)], ngram_propose, block)
    assert r["tau"]["chain"] == r["tau"]["chain+lookup"] == np.mean([16, 16, 4])
    assert r["tau"]["lookup"] == 1.0 and r["lookup_passes_in_chain+lookup"] == 0
    assert r["tau"]["tree 4"] == np.mean([5] * 7 + [1])  # a 4-node tree is the 4-long chain here
    assert r["topk_accuracy_by_position"]["1"]["1"] == 1.0
