"""Speculative decoding in the engine (float32 weights): on the real model with its shipped
draft once, else on the two-block stand-in target (common.STAND_IN) with a draft made for it,
whose drafts `steer_drafts` sets right up to known points, so every verify pass accepts some
drafts and rejects the rest.

Greedy speculative output must equal plain greedy output token for token, whatever the
method, batch, block size or denoising steps, with a bf16 KV cache. With a TurboQuant cache
the verify pass computes keys in a chunk of 16 where plain decoding computes one at a time;
float32 rounding differs in the last bit, and a value that sits on a codebook boundary then
gets the neighbouring code, which moves later logits by up to a few tenths (prefix caching
and prefill chunking show the same). There each output must equal plain decoding's, or each
of its tokens must be the target's greedy choice under its own cache, or within MAX_GAP nats
of it. After rejections the target's cache and the draft's context cache must equal what
plain decoding of the committed tokens gives, within the rounding of the cache format.
"""

import numpy as np
import pytest

import aither_jax as aj
from aither_jax.context.prompt import chat_prompt
from aither_jax.speculative.ngram import ngram_propose
from models.registry import shipped_draft
from tests.aither_jax.speculative.common import CHAIN, COMMON, GREEDY, MAX_GAP, PROMPTS, stand_in_llm, steer_drafts

CONVERSATIONS = [[{"role": "user", "content": p}] for p in PROMPTS]


@pytest.fixture(scope="module")
def baselines(stand_in_key_transform):
    """Plain greedy outputs per (KV format, batch size, on the stand-in or the real model)."""
    cache = {}

    def get(kv, batch, real=False):
        if (kv, batch, real) not in cache:
            if real:
                llm = aj.LLM("smollm2-135m", kv_cache_dtype=kv, max_num_seqs=batch, **COMMON)
            else:
                llm = stand_in_llm(kv, batch)
            cache[kv, batch, real] = [o.token_ids for o in llm.chat(CONVERSATIONS, GREEDY)]
        return cache[kv, batch, real]

    return get


def stand_in(stand_in_draft, kv, batch, spec, baseline, monkeypatch) -> aj.LLM:
    """An engine on the stand-in target whose drafts are steered to plain decoding's output
    `baseline` (`steer_drafts`): every third output position wrong."""
    llm = stand_in_llm(kv, batch, spec, draft=stand_in_draft)
    prompts = [tuple(chat_prompt(llm.tokenizer, c).ids) for c in CONVERSATIONS]
    steer_drafts(llm.engine, dict(zip(prompts, baseline, strict=True)), monkeypatch)
    return llm


@pytest.mark.parametrize(
    "spec",
    [{"method": "dflash", "num_speculative_tokens": 15, "steps": 1, "prompt_lookup": False}]
    + [{"method": "ngram", "num_speculative_tokens": 7}],
    ids=["shipped-draft", "prompt-lookup"],
)
def test_real_drafts_on_the_real_model(baselines, spec):
    """The real model with its shipped draft, and with prompt lookup, drafting unsteered:
    greedy output is plain greedy output token for token, and some drafts are accepted."""
    llm = aj.LLM("smollm2-135m", kv_cache_dtype="bf16", max_num_seqs=8, speculative=spec, **COMMON)
    outs = llm.chat(CONVERSATIONS, GREEDY)
    assert [o.token_ids for o in outs] == baselines("bf16", 8, real=True)
    assert llm.engine.spec_counters.num_accepted_tokens > 0


def test_shipped_draft_is_present_and_small():
    path = shipped_draft("smollm2-135m")
    assert path.is_file(), f"{path} is missing"
    assert path.stat().st_size <= 16 * 2**20


@pytest.mark.parametrize(
    ("kv", "batch", "block", "steps", "kernels"),
    [
        ("bf16", 8, 16, 1, False),
        ("bf16", 8, 4, 4, False),
        ("turboquant", 8, 4, 1, False),  # denoising steps change the drafts only: S = 4 runs on bf16
        ("bf16", 1, 16, 4, False),
        ("bf16", 1, 16, 1, False),
        ("bf16", 1, 4, 1, False),
        ("turboquant", 1, 4, 1, False),
        ("bf16", 8, 16, 2, True),  # the Pallas drafting kernels (interpreted on CPU)
    ],
)
def test_greedy_speculative_equals_plain_greedy(
    baselines, stand_in_draft, monkeypatch, kv, batch, block, steps, kernels
):
    spec = {"method": "dflash", "num_speculative_tokens": block - 1, "steps": steps, "draft_kernels": kernels}
    spec |= {"prompt_lookup": False}  # the draft model alone
    llm = stand_in(stand_in_draft, kv, batch, spec, baselines(kv, batch), monkeypatch)
    outs = llm.chat(CONVERSATIONS, GREEDY)
    _check_greedy(llm, outs, baselines(kv, batch), kv)
    e = llm.engine
    assert 0 < e.spec_counters.num_accepted_tokens < e.spec_counters.num_draft_tokens
    assert e.spec_counters.accepted_per_pos.sum() == e.spec_counters.num_accepted_tokens
    assert list(e.spec_counters.accepted_per_pos) == sorted(
        e.spec_counters.accepted_per_pos, reverse=True
    )  # position j needs j-1 first


def _check_greedy(llm, outs, plain, kv):
    """bf16 KV: outputs equal plain greedy decoding's. TurboQuant KV: half of them equal, and
    in the others every token from the first that differs from plain decoding's within MAX_GAP
    nats of the target's greedy choice."""
    if kv == "bf16":
        assert [o.token_ids for o in outs] == plain
    else:
        same = sum(o.token_ids == b for o, b in zip(outs, plain, strict=True))
        assert same >= len(PROMPTS) // 2, f"only {same} of {len(PROMPTS)} outputs equal plain decoding"
        # Tokens equal to plain decoding's are right by definition: their distance from the
        # full recompute below measures the cache, not speculation (plain decoding itself sits
        # about half a nat off it on one of these prompts).
        for o, b in ((o, b) for o, b in zip(outs, plain, strict=True) if o.token_ids != b):
            first = next((i for i, (x, y) in enumerate(zip(o.token_ids, b, strict=False)) if x != y), len(b))
            logits = llm.logits(o.prompt_token_ids + o.token_ids)[len(o.prompt_token_ids) - 1 : -1]
            logp = logits - logits.max(axis=1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
            gaps = (logp.max(axis=1) - logp[np.arange(len(o.token_ids)), o.token_ids])[first:]
            if gaps.size:
                assert gaps.max() <= MAX_GAP, f"token {first + int(gaps.argmax())} is {gaps.max():.2f} nats off greedy"


@pytest.mark.parametrize(("kv", "batch"), [("bf16", 8), ("turboquant", 1)])
def test_tree_drafts_keep_plain_greedy_output(baselines, stand_in_draft, monkeypatch, kv, batch):
    """Drafts as a tree of 15 nodes per row (prompt lookup rows verify their chains beside
    them): greedy output is plain greedy output, and some verify passes accept a path that
    leaves the draft's first choices (the point of a tree)."""
    llm = stand_in(stand_in_draft, kv, batch, {"method": "dflash", "tree": 15}, baselines(kv, batch), monkeypatch)
    e = llm.engine
    paths, verify = [], e.runner.verify

    def spy(*args, **kwargs):
        out = verify(*args, **kwargs)
        if kwargs["parents"] is not None and out[3] is not None:
            paths.append((np.asarray(kwargs["parents"]), np.asarray(out[0]), np.asarray(out[3])))
        return out

    e.runner.verify = spy
    outs = llm.chat(CONVERSATIONS, GREEDY)
    _check_greedy(llm, outs, baselines(kv, batch), kv)
    off_chain = 0
    for parents, accepted, path in paths:
        for i, n in enumerate(accepted):
            nodes = path[i, 1 : 1 + n]
            assert all(parents[i, c] == p for p, c in zip(path[i, :n], nodes, strict=True))  # a real path
            # Siblings come in the draft's order of preference: a node with an earlier sibling
            # is not the draft's first choice there.
            off_chain += any(np.flatnonzero(parents[i, 1:] == parents[i, c])[0] + 1 < c for c in nodes)
    assert off_chain > 0
    assert (
        e.spec_counters.num_accepted_tokens > 0
        and e.spec_counters.accepted_per_pos.sum() == e.spec_counters.num_accepted_tokens
    )


def test_adaptive_draft_length_keeps_the_output(baselines, stand_in_draft, monkeypatch):
    """With drafts per step chosen as the engine goes (0, 1, 3, 7 or 15), greedy output is
    still plain greedy output token for token, and every option really ran."""
    spec = {"method": "dflash", "adaptive": True}
    llm = stand_in(stand_in_draft, "bf16", 8, spec, baselines("bf16", 8), monkeypatch)
    outs = llm.chat(CONVERSATIONS, GREEDY)
    assert [o.token_ids for o in outs] == baselines("bf16", 8)
    chooser = llm.engine.draft_length
    assert chooser.options == [0, 1, 3, 7, 15] and all(chooser.chosen[k] > 0 for k in chooser.options)
    assert llm.engine.spec_counters.num_accepted_tokens > 0


def test_prompt_lookup_drafts_the_rows_whose_context_repeats(baselines):
    """dflash with prompt_lookup: a row whose context has an n-gram match gets prompt lookup's
    drafts, every other row the draft model's; a step where every row matches does not run
    the draft model; greedy output is still plain greedy output token for token."""
    spec = CHAIN | {"prompt_lookup": True}  # the real model: the stand-in's text never repeats
    llm = aj.LLM("smollm2-135m", kv_cache_dtype="bf16", max_num_seqs=8, speculative=spec, **COMMON)
    e = llm.engine
    model_calls, steps = [], []
    draft_model, propose = e.drafter.propose, e.speculator.propose

    def spy_model(*args):
        model_calls.append(draft_model(*args))
        return model_calls[-1]

    def spy(rows):
        contexts = [s.token_slice(0, s.num_tokens) for s, _ in rows]
        limits = [e.scheduler.num_lookahead(s) for s, _ in rows]
        calls = len(model_calls)
        out, parents = propose(rows)
        assert parents is None  # chains
        steps.append((contexts, limits, model_calls[-1] if len(model_calls) > calls else None, out))
        return out, parents

    e.drafter.propose, e.speculator.propose = spy_model, spy
    outs = llm.chat(CONVERSATIONS, GREEDY)
    assert [o.token_ids for o in outs] == baselines("bf16", 8, real=True)
    mixed = skipped = matched = 0
    for contexts, limits, model, out in steps:
        lookup = [ngram_propose(c, k) if k else [] for c, k in zip(contexts, limits, strict=True)]
        matched += sum(map(bool, lookup))
        if model is None:
            skipped += 1
            assert out == lookup and all(d or not k for d, k in zip(lookup, limits, strict=True))
        else:
            from_model = [list(map(int, model[i, :k])) for i, k in enumerate(limits)]
            assert out == [d or m for d, m in zip(lookup, from_model, strict=True)]
            mixed += any(lookup)
    assert mixed > 0 and skipped > 0, (mixed, skipped)
    assert e.spec_stats()["num_lookup_drafts"] == matched
