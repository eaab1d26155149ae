"""The in-step sampler against exact distributions, and SamplingParams validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aither_jax.device import sampling as sampling_module
from aither_jax.device.sampling import (
    WINDOWS,
    SamplingBatch,
    SamplingParams,
    filtered_logits,
    greedy_tokens,
    sample_tokens,
)

LOGITS = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32))
N = 4000


def draw(temperature: float, top_k: int, top_p: float, logits=LOGITS, n: int = N) -> np.ndarray:
    """n samples for one row, each with its own seed (one call, n identical rows)."""
    batch = SamplingBatch(
        temperature=jnp.full(n, temperature, jnp.float32),
        top_k=jnp.full(n, top_k, jnp.int32),
        top_p=jnp.full(n, top_p, jnp.float32),
        seeds=jnp.arange(n, dtype=jnp.uint32),
    )
    fn = jax.jit(sample_tokens, static_argnames="greedy_only")
    out = fn(jnp.broadcast_to(jnp.asarray(logits), (n, len(logits))), batch, jnp.zeros(n, jnp.int32), greedy_only=False)
    return np.asarray(out)


def expected(temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Reference distribution computed independently in numpy.

    As in HF transformers and vLLM: top-k first, then top-p on the distribution renormalized
    over the top-k tokens.
    """
    z = LOGITS.astype(np.float64) / temperature
    order = np.argsort(-z)
    k = len(z) if top_k <= 0 else top_k
    p = np.zeros_like(z)
    p[order[:k]] = np.exp(z[order[:k]] - z.max())
    p /= p.sum()
    keep = np.zeros_like(p, bool)
    mass = 0.0
    for rank, i in enumerate(order[:k]):
        if rank > 0 and mass >= top_p:
            break
        keep[i] = True
        mass += p[i]
    q = np.where(keep, p, 0)
    return q / q.sum()


def total_variation(samples: np.ndarray, probs: np.ndarray) -> float:
    freq = np.bincount(samples, minlength=len(probs)) / len(samples)
    return 0.5 * np.abs(freq - probs).sum()


# With N = 4000 draws over 6 outcomes the sampling noise in TV distance is ~0.02; 0.04 is a
# 4-5 sigma bound, while any wrong rule below moves the distribution by >= 0.06.
TV_BOUND = 0.04


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (1.0, 2, 1.0), (1.0, 0, 0.7), (0.8, 3, 0.5)],
)
def test_sampler_matches_reference_distribution(temperature, top_k, top_p):
    samples = draw(temperature, top_k, top_p)
    probs = expected(temperature, top_k, top_p)
    assert set(np.unique(samples)) <= set(np.flatnonzero(probs))
    assert total_variation(samples, probs) < TV_BOUND


def test_wrong_temperature_would_fail_the_same_check():
    """Negative control: the check distinguishes temperature 1 from 0.5."""
    assert total_variation(draw(1.0, 0, 1.0), expected(0.5, 0, 1.0)) > TV_BOUND


def test_greedy_rows_take_argmax_and_seeds_are_reproducible():
    assert (draw(0.0, 0, 1.0, n=16) == 0).all()
    np.testing.assert_array_equal(draw(1.0, 0, 1.0, n=64), draw(1.0, 0, 1.0, n=64))


def kept_reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Which tokens a row keeps, from a full sort in float64: the k largest tempered logits,
    then, largest first, while the mass (over the top-k set) before a token is below top_p;
    every token whose logit reaches the smallest kept one stays."""
    x = logits.astype(np.float64) / (temperature if temperature > 0 else 1.0)
    desc = np.sort(x)[::-1]
    k = top_k if 0 < top_k < len(x) else len(x)
    p = np.exp(desc[:k] - desc[0])
    p /= p.sum()
    count = max(int(np.sum(np.cumsum(p) - p < top_p)), 1)
    return x >= desc[count - 1]


# (temperature, top_k, top_p, logit scale): a nucleus inside the window; a nucleus past it (flat
# logits, top_p near 1: the full sort); top-k past the window (the sort); top-k inside it with
# top-p; no filtering at all.
ROWS = [
    (1.0, 0, 0.9, 4.0),
    (1.0, 0, 0.999, 0.01),
    (0.7, WINDOWS[0] + 44, 1.0, 1.0),
    (1.3, 50, 0.8, 2.0),
    (1.0, 0, 1.0, 1.0),
]


def _batch(rows, vocab=1000, seed=5):
    rng = np.random.default_rng(seed)
    logits = np.stack([rng.standard_normal(vocab).astype(np.float32) * scale for *_, scale in rows])
    sampling = SamplingBatch(
        temperature=jnp.asarray([r[0] for r in rows], jnp.float32),
        top_k=jnp.asarray([r[1] for r in rows], jnp.int32),
        top_p=jnp.asarray([r[2] for r in rows], jnp.float32),
        seeds=jnp.arange(len(rows), dtype=jnp.uint32) + 11,
    )
    return logits, sampling


def test_filtered_logits_keep_what_a_full_sort_keeps():
    """Over a vocabulary wider than the first top-k window, the kept sets match a float64
    full-sort reference, both where the window decides and where the sort must."""
    logits, sampling = _batch(ROWS)
    got = np.asarray(jax.jit(lambda x, s: filtered_logits(x, s))(jnp.asarray(logits), sampling))
    for r, (temperature, top_k, top_p, _) in enumerate(ROWS):
        keep = kept_reference(logits[r], temperature, top_k, top_p)
        np.testing.assert_array_equal(np.isfinite(got[r]), keep, err_msg=f"row {r}")
        np.testing.assert_allclose(got[r][keep], logits[r][keep] / temperature, rtol=1e-6)
    counts = np.isfinite(got).sum(axis=1)
    assert counts[0] < WINDOWS[0] < counts[1] < 1000 and counts[2] == WINDOWS[0] + 44 and counts[4] == 1000


def test_every_stage_of_the_window_cascade(monkeypatch):
    """With windows of 16 and 128 over 1,000 tokens, rows decided by the first window, by the
    second and by the full sort all keep what the reference keeps, and each keeps the same
    alone as in the batch."""
    monkeypatch.setattr(sampling_module, "WINDOWS", (16, 128))
    rows = [
        (1.0, 0, 0.5, 6.0),  # a narrow nucleus: the first window
        (1.0, 0, 0.9, 3.0),  # tens of tokens: the second
        (1.0, 0, 0.95, 0.05),  # nearly flat: the sort
        (0.9, 100, 1.0, 1.0),  # top-k inside the second window
        (1.1, 500, 0.99, 1.0),  # top-k past it: the sort
    ]
    logits, sampling = _batch(rows, seed=9)
    fresh = lambda: jax.jit(lambda x, s: filtered_logits(x, s))  # noqa: E731 (no trace cached under other windows)
    got = np.asarray(fresh()(jnp.asarray(logits), sampling))
    counts = np.isfinite(got).sum(axis=1)
    assert counts[0] <= 16 < counts[1] <= 128 < counts[2] and counts[3] == 100, counts
    for r, (temperature, top_k, top_p, _) in enumerate(rows):
        keep = kept_reference(logits[r], temperature, top_k, top_p)
        np.testing.assert_array_equal(np.isfinite(got[r]), keep, err_msg=f"row {r}")
        one = jax.tree_util.tree_map(lambda a, r=r: a[r : r + 1], sampling)
        np.testing.assert_array_equal(np.asarray(fresh()(jnp.asarray(logits[r : r + 1]), one))[0], got[r])


def test_a_row_draws_the_same_whatever_shares_its_batch():
    """A row decided by its window gives the same filtered logits and the same seeded token
    alone and beside a row that needs the full sort."""
    logits, sampling = _batch(ROWS)
    sample = jax.jit(sample_tokens, static_argnames="greedy_only")
    positions = jnp.arange(len(ROWS), dtype=jnp.int32)
    together = np.asarray(sample(jnp.asarray(logits), sampling, positions, greedy_only=False))
    both = np.asarray(jax.jit(filtered_logits)(jnp.asarray(logits), sampling))
    for r in (0, 3, 4):
        one = jax.tree_util.tree_map(lambda a, r=r: a[r : r + 1], sampling)
        alone = sample(jnp.asarray(logits[r : r + 1]), one, positions[r : r + 1], greedy_only=False)
        assert int(alone[0]) == int(together[r])
        alone_logits = jax.jit(filtered_logits)(jnp.asarray(logits[r : r + 1]), one)
        np.testing.assert_array_equal(np.asarray(alone_logits)[0], both[r])


def test_greedy_tokens_equal_argmax_with_ties_and_infinities():
    """The max-then-first-index form picks what argmax picks: random rows, rows of ties (the
    first wins), rows with -inf and +inf, and any leading batch shape."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 5, 257)).astype(np.float32)
    x[0, 0] = 1.0  # all tied
    x[1, 2, [7, 9, 200]] = 50.0  # a tie among three
    x[2, 1, :] = -np.inf
    x[3, 3, 100] = np.inf
    x[4] = np.round(x[4])  # many ties
    got = np.asarray(jax.jit(greedy_tokens)(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    assert (got[0, 0], got[1, 2], got[2, 1], got[3, 3]) == (0, 7, 0, 100)
    nan_row = np.asarray(greedy_tokens(jnp.full((1, 9), np.nan, jnp.float32)))
    assert 0 <= int(nan_row[0]) < 9  # stays a valid token id


def _keys(n: int, seed: int = 0):
    return jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(jnp.arange(n))


def _chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    from scipy.stats import chisquare

    counts = np.bincount(samples, minlength=len(probs))
    exp = probs * len(samples)
    keep = exp >= 5  # pool rare tokens
    obs, exp = np.append(counts[keep], counts[~keep].sum()), np.append(exp[keep], exp[~keep].sum())
    return float(chisquare(obs, exp / exp.sum() * obs.sum()).pvalue)


def test_blocked_gumbel_max_draws_softmax():
    """20,000 draws over 1,000 tokens (the last block padded) with -inf holes, two whole -inf
    blocks and a -inf tail follow softmax (chi-square), never pick a -inf token, and would
    fail the same test against the distribution a wrong block choice gives."""
    rng = np.random.default_rng(5)
    v, n = 1000, 20_000
    logits = rng.standard_normal(v).astype(np.float32) * 1.5
    logits[rng.choice(v, 300, replace=False)] = -np.inf
    logits[256:512] = -np.inf
    logits[990:] = -np.inf
    p = np.exp(logits.astype(np.float64) - logits.max())
    p /= p.sum()
    got = np.asarray(
        jax.jit(sampling_module.blocked_gumbel_max)(jnp.broadcast_to(jnp.asarray(logits), (n, v)), _keys(n))
    )
    assert not np.isin(got, np.flatnonzero(~np.isfinite(logits))).any()
    assert _chi2_pvalue(got, p) > 1e-3
    # Negative control: every block equally likely (the block's mass ignored).
    size = sampling_module.GUMBEL_BLOCK
    mass = np.add.reduceat(p, np.arange(0, v, size))
    wrong = p / np.repeat(np.where(mass > 0, mass, 1), size)[:v] / (mass > 0).sum()
    assert _chi2_pvalue(got, wrong / wrong.sum()) < 1e-6


def test_blocked_gumbel_max_on_degenerate_rows():
    """A row with one finite logit always gives it (here in the third block, past the first
    two); rows of all -inf or NaN still give a valid id."""
    v = 300
    one = np.full(v, -np.inf, np.float32)
    one[290] = -5.0
    rows = np.stack([one] * 50 + [np.full(v, -np.inf, np.float32), np.full(v, np.nan, np.float32)])
    got = np.asarray(sampling_module.blocked_gumbel_max(jnp.asarray(rows), _keys(len(rows))))
    assert (got[:50] == 290).all()
    assert ((got[50:] >= 0) & (got[50:] < v)).all()


def test_draws_hold_under_last_bits_of_the_logits():
    """Plain decoding and a verify pass compute the same logits in different shapes, so they
    differ in the last bits. Over 2,000 keys on a flat 49,152-token row, a relative change of
    1e-5 in every logit moves at most 2 draws; an inverse CDF at one uniform number per key
    (the control, in numpy) moves ~30."""
    rng = np.random.default_rng(0)
    n, v = 2000, 49_152
    x = rng.standard_normal(v).astype(np.float32)
    y = (x * (1 + 1e-5 * rng.standard_normal(v))).astype(np.float32)
    keys = _keys(n)
    draw = jax.jit(sampling_module.blocked_gumbel_max)
    a, b = (np.asarray(draw(jnp.broadcast_to(jnp.asarray(z), (n, v)), keys)) for z in (x, y))
    assert (a != b).sum() <= 2
    u = np.asarray(jax.vmap(lambda k: jax.random.uniform(k, ()))(keys))

    def inverse_cdf(z):
        c = np.cumsum(np.exp(z - z.max()), dtype=np.float32)
        return np.searchsorted(c, u * c[-1], side="right")

    assert (inverse_cdf(x) != inverse_cdf(y)).sum() > 10


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**40}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x"] * 40}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "ab"}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"temperature": True}, "temperature"),
        ({"top_p": True}, "top_p"),
        ({"stop": 5}, "stop must be a string"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_stop_token_ids_bounded_by_vocab():
    with pytest.raises(ValueError, match="vocabulary size"):
        SamplingParams(stop_token_ids=[10**6]).validate(vocab_size=49152)
