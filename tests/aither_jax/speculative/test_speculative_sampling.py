"""Speculative decoding on the stand-in target (common.STAND_IN): seeded sampled output equals
plain sampling's, the sampled tokens follow the target's distribution (and a broken verifier
fails that test), and warm-up compiles every drafting and verify shape."""

import jax.numpy as jnp
import numpy as np
import pytest

import aither_jax as aj
from aither_jax.device import steps
from aither_jax.device.verify import verify
from tests.aither_jax.speculative.common import CHAIN, PROMPTS, stand_in_llm, steer_drafts


@pytest.mark.parametrize("method", [CHAIN, "ngram", {"method": "dflash", "tree": 8}, "dflash"])
def test_sampled_speculative_equals_plain_sampling_with_the_same_seed(method, stand_in_draft, monkeypatch):
    """The verifier draws each position's token with the key plain decoding uses there, so a
    seeded sampled request emits the same tokens with or without speculation (float32 logits,
    bf16 KV), whatever shares its batch. Drafts are steered to plain sampling's tokens
    (every third position wrong), so some are accepted and some rejected in every row."""
    convs = [[{"role": "user", "content": p}] for p in PROMPTS[:6]] + [[{"role": "user", "content": PROMPTS[0]}]]
    params = [aj.SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(6)]
    params.append(params[0])  # the same request twice in one batch
    plain = stand_in_llm("bf16", 4)
    outs = plain.chat(convs, params)
    expected = [o.token_ids for o in outs]
    del plain
    llm = stand_in_llm("bf16", 4, method, draft=stand_in_draft)
    steer_drafts(llm.engine, {tuple(o.prompt_token_ids): o.token_ids for o in outs}, monkeypatch)
    got = [o.token_ids for o in llm.chat(convs, params)]
    assert got == expected
    assert got[0] == got[-1]
    c = llm.engine.spec_counters
    assert 0 < c.num_accepted_tokens < c.num_draft_tokens  # some emitted tokens came through accepted drafts


def test_sampled_speculative_matches_the_targets_distribution(monkeypatch):
    """Through the whole engine, over 800 seeds (temperature 1, top-k 3): the first token is
    sampled after the prefill; the second goes through verification of a draft that is the
    target's greedy choice (so it is often accepted). The joint distribution of the two must be
    the target's, computed exactly from its logits."""
    p_value, counts, engine = _two_token_chisquare(monkeypatch)
    assert p_value > 1e-3, (p_value, counts)
    assert engine.spec_counters.num_accepted_tokens > 800 // 4  # the drafts were really verified, not just dropped


def test_a_broken_verifier_fails_the_same_distribution_test(monkeypatch):
    """The engine with a verifier that commits a row's first draft unchecked (the second token
    is then always the draft) fails the test above by far."""

    def first_unchecked(logits, drafts, num_drafts, sampling, start, *, greedy_only):
        rest = verify(
            logits[:, 1:], drafts[:, 1:], jnp.maximum(num_drafts - 1, 0), sampling, start + 1, greedy_only=greedy_only
        )
        checked = verify(logits, drafts, num_drafts, sampling, start, greedy_only=greedy_only)  # rows without drafts
        has_drafts = num_drafts > 0
        return jnp.where(has_drafts, rest[0] + 1, checked[0]), jnp.where(has_drafts, rest[1], checked[1])

    monkeypatch.setattr(steps, "verify", first_unchecked)
    steps.accept_step.clear_cache()  # accept_step traced with the right verifier must not be reused
    try:
        p_value, counts, _ = _two_token_chisquare(monkeypatch)
    finally:
        monkeypatch.undo()
        steps.accept_step.clear_cache()  # nor this one by later tests
    assert p_value < 1e-6, (p_value, counts)


def _two_token_chisquare(monkeypatch, n: int = 800):
    """The chi-square p-value of the first two tokens of `n` seeded requests through an ngram
    engine whose one draft (after the first token) is the target's greedy next token, against
    the target's exact joint distribution: (p-value, counts, the engine)."""
    from scipy.stats import chisquare

    llm = stand_in_llm("fp32", 32, "ngram", enable_prefix_caching=True)
    tok = llm.tokenizer
    conv = [{"role": "user", "content": "Pick a colour."}]
    ids = tok.encode(tok.apply_chat_template(conv, add_generation_prompt=True))

    def top3(context):
        logits = llm.logits(context)[-1].astype(np.float64)
        top = np.argsort(-logits)[:3]
        p = np.exp(logits[top] - logits[top].max())
        return top, p / p.sum()

    first, p_first = top3(ids)
    joint = {}
    greedy_next = {}
    for t1, p1 in zip(first, p_first, strict=True):
        second, p_second = top3(ids + [int(t1)])
        greedy_next[int(t1)] = int(second[0])
        for t2, p2 in zip(second, p_second, strict=True):
            joint[int(t1), int(t2)] = p1 * p2

    def propose(rows):  # deterministic: the target's greedy next token after the first
        out = []
        for s, _ in rows:
            ctx = s.token_slice(0, s.num_tokens)
            ok = len(ctx) == len(ids) + 1 and llm.engine.scheduler.num_lookahead(s) > 0
            out.append([greedy_next[ctx[-1]]] if ok else [])
        return out, None

    monkeypatch.setattr(llm.engine.speculator, "propose", propose)
    params = [aj.SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=i, ignore_eos=True) for i in range(n)]
    outs = llm.generate([ids] * n, params, use_tqdm=False)
    counts = {}
    for o in outs:
        counts[tuple(o.token_ids[:2])] = counts.get(tuple(o.token_ids[:2]), 0) + 1
    assert set(counts) <= set(joint), "a token outside the target's top 3 was emitted"
    keys = sorted(joint, key=lambda k: -joint[k])
    exp = np.array([joint[k] * n for k in keys])
    obs = np.array([counts.get(k, 0) for k in keys], float)
    keep = exp >= 5
    obs = np.append(obs[keep], obs[~keep].sum())
    exp = np.append(exp[keep], exp[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp / exp.sum() * obs.sum()).pvalue, counts, llm.engine


@pytest.mark.parametrize(
    "spec",
    [{"method": "dflash", "num_speculative_tokens": 7}, {"method": "ngram", "num_speculative_tokens": 7}]
    + [{"method": "dflash", "tree": 7}],
)
def test_warmup_covers_drafting_and_verify_shapes(spec, stand_in_draft, monkeypatch, caplog):
    llm = stand_in_llm("auto", 2, spec, draft=stand_in_draft, num_pages=40, max_model_len=256)
    steer_drafts(llm.engine, {}, monkeypatch)  # prompt lookup alone: placeholder drafts
    convs = [[{"role": "user", "content": p}] for p in PROMPTS[4:6]]
    llm.chat(convs, aj.SamplingParams(max_tokens=1, temperature=0.0))  # compiles the prefill shapes
    assert llm.warmup(max_len=120, sampling=False) == 2  # rows {1, 2} x pages {8}
    before = llm.engine.num_compiles
    with caplog.at_level("WARNING", logger="aither_jax.compile.shapes"):
        llm.chat(convs, aj.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert llm.engine.num_compiles == before  # drafting, verify and context writes were all warm
    assert llm.engine.spec_stats()["num_drafts"] > 0
