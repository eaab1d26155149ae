"""Verification rules on a distribution small enough to count.

The target's distributions over a 6-token vocabulary at each block position are fixed; the
draft proposes deterministically (the argmax of its own, different, marginals). Over many
seeds the first emitted token must follow the target's p_0 and, when the first draft was
accepted, the second must follow p_1. The same statistics catch two broken verifiers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aither_jax.device.sampling import SamplingBatch, sample_tokens
from aither_jax.device.verify import verify, verify_tree
from aither_jax.speculative.config import CPU_TREE, SpeculativeConfig
from aither_jax.speculative.dflash import draft_tree
from aither_jax.speculative.ngram import ngram_propose

V, T, N = 6, 3, 40_000
P_VALUE = 1e-3  # the correct rule must pass at this level; the broken ones must fail far below it

rng = np.random.default_rng(0)
TARGET_LOGITS = rng.standard_normal((T, V)).astype(np.float32) * 1.5
DRAFT_MARGINALS = jax.nn.softmax(jnp.asarray(rng.standard_normal((T - 1, V)) * 1.5), axis=-1)
DRAFTS = np.asarray(jnp.argmax(DRAFT_MARGINALS, axis=-1), np.int32)  # deterministic proposal


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    from scipy.stats import chisquare

    keep = probs * counts.sum() >= 5  # pool rare categories
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(probs[keep], probs[~keep].sum()) * counts.sum()
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp / exp.sum() * obs.sum()
    return float(chisquare(obs, exp).pvalue)


def _sampling(n):
    return SamplingBatch(
        jnp.ones(n, jnp.float32), jnp.zeros(n, jnp.int32), jnp.ones(n, jnp.float32), jnp.arange(n, dtype=jnp.uint32)
    )


def _emitted(verifier):
    logits = jnp.broadcast_to(jnp.asarray(TARGET_LOGITS), (N, T, V))
    drafts = jnp.broadcast_to(jnp.asarray(DRAFTS), (N, T - 1))
    acc, nxt = verifier(logits, drafts, jnp.full(N, T - 1, jnp.int32), _sampling(N), jnp.zeros(N, jnp.int32))
    acc, nxt = np.asarray(acc), np.asarray(nxt)
    first = np.where(acc >= 1, DRAFTS[0], nxt)
    second = np.where(acc >= 2, DRAFTS[1], nxt)[acc >= 1]  # the token after an accepted d_1
    return first, second


def _pvalues(verifier):
    p = np.asarray(jax.nn.softmax(jnp.asarray(TARGET_LOGITS), axis=-1), np.float64)
    first, second = _emitted(verifier)
    return _chi2_pvalue(np.bincount(first, minlength=V), p[0]), _chi2_pvalue(np.bincount(second, minlength=V), p[1])


def _correct(logits, drafts, num_drafts, sampling, start):
    return verify(logits, drafts, num_drafts, sampling, start, greedy_only=False)


def _ratio_rule(logits, drafts, num_drafts, sampling, start):
    """Broken on purpose: Leviathan's min(1, p/q) with the draft's marginals q, though the
    tokens were not sampled from q."""
    p = jax.nn.softmax(logits, axis=-1)
    n, t, v = logits.shape
    q = jnp.broadcast_to(DRAFT_MARGINALS, (n, t - 1, v))
    pd = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
    qd = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    keys = jax.vmap(jax.random.PRNGKey)(sampling.seeds)
    u = jax.vmap(lambda k: jax.random.uniform(k, (t - 1,)))(keys)
    acc = jnp.cumprod(u < jnp.minimum(1.0, pd / qd), axis=1).sum(axis=1)
    resid = jnp.maximum(p[:, :-1] - q, 0)
    resid = jnp.concatenate([resid, p[:, -1:]], axis=1)
    row = jnp.take_along_axis(resid, acc[:, None, None], axis=1)[:, 0]
    keys2 = jax.vmap(lambda k: jax.random.fold_in(k, 9))(keys)
    nxt = jax.vmap(jax.random.categorical)(keys2, jnp.log(row))
    return acc, nxt


def _first_unchecked(logits, drafts, num_drafts, sampling, start):
    """Broken on purpose: the first draft token is committed without a check."""
    acc, nxt = verify(logits[:, 1:], drafts[:, 1:], num_drafts - 1, sampling, start + 1, greedy_only=False)
    return acc + 1, nxt


def test_deterministic_proposal_rule_is_lossless():
    p0, p1 = _pvalues(_correct)
    assert p0 > P_VALUE and p1 > P_VALUE, (p0, p1)


@pytest.mark.parametrize("broken", [_ratio_rule, _first_unchecked], ids=["ratio-with-marginals", "first-unchecked"])
def test_broken_verifiers_fail_the_same_test(broken):
    assert min(_pvalues(broken)) < 1e-6


def test_greedy_accepts_matching_prefix_and_adds_bonus():
    logits = np.full((3, 5, 10), -5.0, np.float32)
    best = np.array([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5]])
    np.put_along_axis(logits, best[..., None], 5.0, axis=-1)
    drafts = np.array([[1, 2, 3, 4], [1, 9, 3, 4], [1, 2, 3, 4]], np.int32)
    num = np.array([4, 4, 2], np.int32)
    zeros = jnp.zeros(3, jnp.int32)
    greedy = SamplingBatch(jnp.zeros(3), zeros, jnp.ones(3), zeros.astype(jnp.uint32))
    acc, nxt = verify(jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(num), greedy, zeros, greedy_only=True)
    np.testing.assert_array_equal(np.asarray(acc), [4, 1, 2])  # all; first only; capped by num_drafts
    np.testing.assert_array_equal(np.asarray(nxt), [5, 2, 3])  # the target's token after the accepted prefix
    acc2, nxt2 = verify(jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(num), greedy, zeros, greedy_only=False)
    np.testing.assert_array_equal(np.asarray(acc2), np.asarray(acc))  # temperature 0 rows stay greedy
    np.testing.assert_array_equal(np.asarray(nxt2), np.asarray(nxt))


def test_sampled_rows_emit_what_plain_sampling_draws_whatever_was_drafted():
    """Every token a sampled row emits (accepted drafts, then the next token) is the token
    `sample_tokens` draws at that position with the row's seed, for drafts that agree with
    those draws for a random number of positions and then differ, or are absent."""
    b, t, v = 64, 6, 50
    r = np.random.default_rng(1)
    logits = jnp.asarray(r.standard_normal((b, t, v)).astype(np.float32) * 2.0)
    sampling = SamplingBatch(
        jnp.asarray(r.uniform(0.5, 1.5, b), jnp.float32),
        jnp.asarray(r.choice([0, 5, 20], b), jnp.int32),
        jnp.asarray(r.choice([1.0, 0.9], b), jnp.float32),
        jnp.arange(b, dtype=jnp.uint32) * 7,
    )
    start = jnp.asarray(r.integers(0, 100, b), jnp.int32)
    sample = jax.jit(sample_tokens, static_argnames="greedy_only")
    plain = np.stack(
        [np.asarray(sample(logits[:, j], sampling, start + 1 + j, greedy_only=False)) for j in range(t)], axis=1
    )
    agree = r.integers(0, t, b)  # drafts equal the draws for this many positions, then differ
    drafts = np.where(np.arange(t - 1)[None, :] < agree[:, None], plain[:, :-1], (plain[:, :-1] + 1) % v)
    num = r.integers(0, t, b).astype(np.int32)
    acc, nxt = verify(logits, jnp.asarray(drafts, jnp.int32), jnp.asarray(num), sampling, start, greedy_only=False)
    acc, nxt = np.asarray(acc), np.asarray(nxt)
    np.testing.assert_array_equal(acc, np.minimum(agree, num))
    np.testing.assert_array_equal(nxt, plain[np.arange(b), acc])
    assert 0 < acc.mean() < t - 1  # both accepted and rejected drafts occurred


def test_ngram_propose():
    assert ngram_propose([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
    assert ngram_propose([1, 2, 3, 4, 1, 2, 3], 3, min_n=2, max_n=2) == [4, 1, 2]
    assert ngram_propose([5, 6, 7, 8], 4) == []
    assert ngram_propose([1, 2, 9, 1, 2, 8, 1, 2], 2) == [8, 1]  # the latest match wins
    assert ngram_propose([3], 4) == []


def test_speculative_config_parsing():
    assert SpeculativeConfig.parse("ngram").method == "ngram"
    cfg = SpeculativeConfig.parse('{"method": "dflash", "num_speculative_tokens": 7, "steps": 2}')
    assert (cfg.num_speculative_tokens, cfg.steps) == (7, 2)
    assert cfg.prompt_lookup and not SpeculativeConfig.parse("ngram").prompt_lookup  # on by default for dflash
    assert not SpeculativeConfig.parse('{"method": "dflash", "prompt_lookup": false}').prompt_lookup
    for bad, match in [
        ('{"method": "eagle"}', "method must be one of"),
        ('{"method": "ngram", "foo": 1}', "unknown speculative config keys"),
        ("{not json", "not valid JSON"),
        ('{"method": "dflash", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "dflash", "steps": 0}', "steps"),
        ('{"num_speculative_tokens": 3}', "needs a method"),
        ('{"method": "ngram", "prompt_lookup": true}', "prompt lookup alone"),
        ('{"method": "dflash", "prompt_lookup": 1}', "prompt_lookup must be true or false"),
        ('{"method": "dflash", "tree": 64}', "tree must be an integer"),
        ('{"method": "ngram", "tree": 8}', "tree drafts need method dflash"),
        ('{"method": "dflash", "tree": 8, "steps": 2}', "tree drafts need method dflash with steps 1"),
        ('{"method": "dflash", "tree": 8, "adaptive": true}', "without adaptive"),
    ]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(bad)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_the_default_tree_is_three_nodes_on_cpu_and_a_chain_elsewhere(monkeypatch, backend):
    """Left unset, `tree` is CPU_TREE for a dflash config at its defaults on CPU, and 0 (a
    chain) on other backends and wherever the config asks for a chain's settings."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    default = CPU_TREE if backend == "cpu" else 0
    assert CPU_TREE == 3
    assert SpeculativeConfig.parse("dflash").tree == default
    assert SpeculativeConfig.parse('{"method": "dflash", "prompt_lookup": false}').tree == default
    for chain in [
        '{"method": "dflash", "num_speculative_tokens": 15}',
        '{"method": "dflash", "steps": 2}',
        '{"method": "dflash", "adaptive": true}',
        '{"method": "dflash", "tree": 0}',
        "ngram",
    ]:
        assert SpeculativeConfig.parse(chain).tree == 0, chain
    assert SpeculativeConfig.parse('{"method": "dflash", "tree": 15}').tree == 15


# -- trees ----------------------------------------------------------------------------------


def _chain(b, t):
    return jnp.broadcast_to(jnp.arange(-1, t - 1, dtype=jnp.int32), (b, t)), jnp.broadcast_to(jnp.arange(t), (b, t))


@pytest.mark.parametrize("greedy_only", [True, False])
def test_tree_verify_of_a_chain_is_chain_verify(greedy_only):
    """A chain (parents i - 1) verified as a tree accepts and emits what `verify` does, greedy
    and sampled rows mixed, and its path is the chain itself."""
    b, t, v = 64, 6, 12
    r = np.random.default_rng(3)
    logits = jnp.asarray(r.standard_normal((b, t, v)) * 2, jnp.float32)
    # Drafts that follow the argmax for a while, so acceptances of every length occur.
    best = np.asarray(jnp.argmax(logits, axis=-1))
    cut = r.integers(0, t, b)
    drafts = np.where(np.arange(t - 1)[None] < cut[:, None], best[:, :-1], r.integers(0, v, (b, t - 1)))
    tokens = jnp.asarray(np.concatenate([r.integers(0, v, (b, 1)), drafts], axis=1), jnp.int32)
    num_new = jnp.asarray(r.integers(1, t + 1, b), jnp.int32)
    temperature = jnp.asarray(np.where(greedy_only, 0.0, r.choice([0.0, 1.0], b)), jnp.float32)
    sampling = SamplingBatch(
        temperature, jnp.zeros(b, jnp.int32), jnp.ones(b, jnp.float32), jnp.arange(b, dtype=jnp.uint32)
    )
    start = jnp.asarray(r.integers(0, 100, b), jnp.int32)
    acc, nxt = verify(logits, tokens[:, 1:], num_new - 1, sampling, start, greedy_only=greedy_only)
    parents, depth = _chain(b, t)
    acc_t, nxt_t, path = verify_tree(logits, tokens, parents, depth, num_new, sampling, start, greedy_only=greedy_only)
    np.testing.assert_array_equal(acc_t, acc)
    np.testing.assert_array_equal(nxt_t, nxt)
    np.testing.assert_array_equal(path, np.broadcast_to(np.arange(t), (b, t)))
    assert 0 < int((np.asarray(acc) > 0).sum()) < b


def test_tree_verify_follows_the_branch_the_target_takes():
    """Node 1 and 2 are siblings after the last token, node 3 follows node 2, node 4 follows
    node 3, node 5 follows node 1. The target's argmax: after the last token the token of
    node 2, after node 2 the token of node 3, after node 3 not node 4's. So nodes 2 and 3 are
    accepted, the next token is the argmax after node 3, and the path lists 0, 2, 3."""
    v = 10
    tokens = jnp.asarray([[7, 1, 2, 3, 4, 5]], jnp.int32)
    parents = jnp.asarray([[-1, 0, 0, 2, 3, 1]], jnp.int32)
    depth = jnp.asarray([[0, 1, 1, 2, 3, 2]], jnp.int32)
    want = [2, 9, 3, 8, 0, 0]  # the target's argmax at each node; node 3 -> 8 (not node 4's 4)
    logits = jax.nn.one_hot(jnp.asarray([want]), v) * 5.0
    greedy = SamplingBatch(jnp.zeros(1), jnp.zeros(1, jnp.int32), jnp.ones(1), jnp.zeros(1, jnp.uint32))
    acc, nxt, path = verify_tree(
        logits, tokens, parents, depth, jnp.asarray([6]), greedy, jnp.asarray([10]), greedy_only=True
    )
    assert int(acc[0]) == 2 and int(nxt[0]) == 8
    assert list(np.asarray(path[0, :3])) == [0, 2, 3]
    # Node 3 left out of the row (num_new 3): only node 2 is accepted, then the argmax after it.
    acc, nxt, _ = verify_tree(
        logits, tokens, parents, depth, jnp.asarray([3]), greedy, jnp.asarray([10]), greedy_only=True
    )
    assert (int(acc[0]), int(nxt[0])) == (1, 3)


def test_draft_tree_holds_the_most_probable_paths():
    """`draft_tree` on guesses whose log-probabilities make the best paths known: the first
    position's two guesses, then the second position's best after each."""
    ids = np.asarray([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    logp = np.log(np.asarray([[0.6, 0.3, 0.1], [0.9, 0.05, 0.05], [0.6, 0.3, 0.1]]))
    tokens, parents = draft_tree(ids, logp, 5)
    # Paths by probability: (0,) .6, (0,0) .54, (0,0,0) .324, (1,) .3, (1,0) .27, (0,0,1) .162 ...
    assert tokens[:3] == [10, 20, 30] and parents[:3] == [0, 1, 2]
    assert sorted(zip(tokens[3:], parents[3:], strict=True)) == [(11, 0), (20, 4)]
    assert draft_tree(ids, logp, 0) == ([], [])
    assert all(p < i + 1 for i, p in enumerate(parents))  # a parent comes before its children


def test_tree_depth_and_mask():
    from models.llama import tree_depth_and_mask
    from pallas_kernels.paged_attention import causal_mask

    depth, mask = tree_depth_and_mask(jnp.asarray([[-1, 0, 0, 2, 3, 1]], jnp.int32))
    assert list(np.asarray(depth[0])) == [0, 1, 1, 2, 3, 2]
    seen = {i: set(np.flatnonzero(np.asarray(mask[0, i]))) for i in range(6)}
    assert seen == {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 2, 3}, 4: {0, 2, 3, 4}, 5: {0, 1, 5}}
    depth, mask = tree_depth_and_mask(jnp.broadcast_to(jnp.arange(-1, 7, dtype=jnp.int32), (2, 8)))
    np.testing.assert_array_equal(depth, np.broadcast_to(np.arange(8), (2, 8)))
    np.testing.assert_array_equal(mask, np.broadcast_to(causal_mask(8), (2, 8, 8)))
