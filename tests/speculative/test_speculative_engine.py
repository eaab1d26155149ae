"""Speculative decoding in the engine on the real model (float32 weights).

Greedy speculative output must equal plain greedy output token for token, whatever the
method, batch, block size or denoising steps, with a bf16 KV cache. With a TurboQuant cache
the verify pass computes keys in a chunk of 16 where plain decoding computes one at a time;
float32 rounding differs in the last bit, and a value that sits on a codebook boundary then
gets the neighbouring code, which moves later logits by up to a few tenths (prefix caching
and prefill chunking show the same). There each output must equal plain decoding's, or each
of its tokens must be the target's greedy choice under its own cache, or within MAX_GAP nats
of it. After rejections the
target's cache and the draft's context cache must equal what plain decoding of the committed
tokens gives.
"""

import numpy as np
import pytest

import aither_jax as aj
from aither_jax.speculative import SHIPPED_DRAFTS, ngram_propose

PROMPTS = [
    "Write a haiku about the sea.",
    "What is the difference between a list and a tuple in Python?",
    "Give me three tips for a job interview.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Count from 1 to 15, separated by commas.",
    "Explain photosynthesis to a ten-year-old.",
    "Write a Python function that reverses a string.",
    "What are the planets of the solar system?",
]
GREEDY = aj.SamplingParams(max_tokens=40, temperature=0.0)
COMMON = dict(dtype="float32", max_model_len=512, progress=False)
MAX_GAP = 0.5  # nats between the target's best token and a speculative token (TurboQuant caches)


@pytest.fixture(scope="module")
def baselines():
    """Plain greedy outputs per (KV format, batch size)."""
    cache = {}

    def get(kv, batch):
        if (kv, batch) not in cache:
            llm = aj.LLM("smollm2-135m", kv_cache_dtype=kv, max_num_seqs=batch, **COMMON)
            outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], GREEDY)
            cache[kv, batch] = [o.token_ids for o in outs]
        return cache[kv, batch]

    return get


def test_shipped_draft_is_present_and_small():
    path = SHIPPED_DRAFTS["smollm2-135m"]
    assert path.is_file(), f"{path} is missing"
    assert path.stat().st_size <= 16 * 2**20


@pytest.mark.parametrize(
    ("method", "kv", "batch", "block", "steps", "kernels"),
    [
        ("dflash", "bf16", 8, 16, 1, False),
        ("dflash", "auto", 8, 4, 4, False),
        ("dflash", "bf16", 1, 16, 4, False),
        ("dflash", "auto", 1, 4, 1, False),
        ("dflash", "bf16", 8, 16, 2, True),  # the Pallas drafting kernels (interpreted on CPU)
        ("ngram", "bf16", 8, 8, 1, False),
    ],
)
def test_greedy_speculative_equals_plain_greedy(baselines, method, kv, batch, block, steps, kernels):
    spec = {"method": method, "num_speculative_tokens": block - 1}
    if method == "dflash":
        spec |= {"steps": steps, "draft_kernels": kernels, "prompt_lookup": False}  # the draft model alone
    llm = aj.LLM("smollm2-135m", kv_cache_dtype=kv, max_num_seqs=batch, speculative=spec, **COMMON)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], GREEDY)
    _check_greedy(llm, outs, baselines(kv, batch), kv)
    e = llm.engine
    assert e.num_drafts > 0 and 0 <= e.num_accepted_tokens <= e.num_draft_tokens
    assert e.accepted_per_pos.sum() == e.num_accepted_tokens
    assert list(e.accepted_per_pos) == sorted(e.accepted_per_pos, reverse=True)  # position j needs j-1 first


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


@pytest.mark.parametrize(("kv", "batch"), [("bf16", 8), ("auto", 1)])
def test_tree_drafts_keep_plain_greedy_output(baselines, kv, batch):
    """Drafts as a tree of 15 nodes per row (prompt lookup rows verify their chains beside
    them): greedy output is plain greedy output, and some verify passes accept a path that
    leaves the draft's first choices (the point of a tree)."""
    llm = aj.LLM(
        "smollm2-135m", kv_cache_dtype=kv, max_num_seqs=batch, speculative={"method": "dflash", "tree": 15},
        **COMMON,
    )  # fmt: skip
    e = llm.engine
    paths, verify = [], e._verify

    def spy(*args, **kwargs):
        out = verify(*args, **kwargs)
        if kwargs["parents"] is not None and out[3] is not None:
            paths.append((np.asarray(kwargs["parents"]), np.asarray(out[0]), np.asarray(out[3])))
        return out

    e._verify = spy
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], GREEDY)
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
    assert e.num_accepted_tokens > 0 and e.accepted_per_pos.sum() == e.num_accepted_tokens


def _slot_kv(engine, seq):
    """Target keys/values [layers, tokens, Hkv, Dh] of the sequence's cached tokens."""
    table = np.asarray(engine.scheduler.block_tables[seq.slot : seq.slot + 1])
    ks, vs = zip(*(engine.cache.read(table, i) for i in range(engine.cfg.num_layers)), strict=True)
    n = seq.num_cached
    return np.stack([np.asarray(k)[0, :n] for k in ks]), np.stack([np.asarray(v)[0, :n] for v in vs])


def test_adaptive_draft_length_keeps_the_output(baselines):
    """With drafts per step chosen as the engine goes (0, 1, 3, 7 or 15), greedy output is
    still plain greedy output token for token, and every option really ran."""
    spec = {"method": "dflash", "adaptive": True}
    llm = aj.LLM("smollm2-135m", kv_cache_dtype="bf16", max_num_seqs=8, speculative=spec, **COMMON)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], GREEDY)
    assert [o.token_ids for o in outs] == baselines("bf16", 8)
    chooser = llm.engine.draft_length
    assert chooser.options == [0, 1, 3, 7, 15] and all(chooser.chosen[k] > 0 for k in chooser.options)
    assert llm.engine.num_accepted_tokens > 0


def test_prompt_lookup_drafts_the_rows_whose_context_repeats(baselines):
    """dflash with prompt_lookup: a row whose context has an n-gram match gets prompt lookup's
    drafts, every other row the draft model's; a step where every row matches does not run
    the draft model; greedy output is still plain greedy output token for token."""
    spec = {"method": "dflash", "prompt_lookup": True}
    llm = aj.LLM("smollm2-135m", kv_cache_dtype="bf16", max_num_seqs=8, speculative=spec, **COMMON)
    e = llm.engine
    model_calls, steps = [], []
    draft_model, propose = e.drafter.propose, e._propose

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

    e.drafter.propose, e._propose = spy_model, spy
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], GREEDY)
    assert [o.token_ids for o in outs] == baselines("bf16", 8)
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


@pytest.mark.parametrize("spec", ["dflash", {"method": "dflash", "tree": 15}])
def test_rollback_leaves_the_caches_of_plain_decoding(spec):
    prompt = [{"role": "user", "content": "Name five fruits and say what colour each one is."}]
    spec = aj.LLM("smollm2-135m", kv_cache_dtype="fp32", max_num_seqs=2, speculative=spec, **COMMON)
    tok = spec.tokenizer
    ids = tok.encode(tok.apply_chat_template(prompt, add_generation_prompt=True))
    seq = spec.engine.add_request(ids, aj.SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    rejected = 0
    while len(seq.output_ids) < 30:
        before = seq.num_draft_tokens - seq.num_accepted_tokens
        spec.engine.step()
        rejected += seq.num_draft_tokens - seq.num_accepted_tokens - before
    assert rejected > 0 and seq.num_accepted_tokens > 0  # both paths were taken

    plain = aj.LLM("smollm2-135m", kv_cache_dtype="fp32", max_num_seqs=2, **COMMON)
    params = aj.SamplingParams(max_tokens=len(seq.output_ids) + 8, temperature=0.0, ignore_eos=True)
    ref = plain.engine.add_request(ids, params)
    while len(ref.output_ids) < len(seq.output_ids):
        plain.engine.step()
    assert ref.output_ids == seq.output_ids and ref.num_cached == seq.num_cached
    for got, want in zip(_slot_kv(spec.engine, seq), _slot_kv(plain.engine, ref), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)

    # The draft's context cache: projections of the target's hidden states of the committed tokens.
    drafter = spec.engine.drafter
    hidden = plain.engine.hidden_states(seq.token_slice(0, seq.num_cached), drafter.taps)
    from models.draft import context_features, context_kv

    feats = context_features(drafter.params, drafter.cfg, hidden[None])
    k_want, v_want = context_kv(drafter.params, drafter.cfg, feats, np.arange(seq.num_cached)[None])
    pages = np.asarray(spec.engine.scheduler.block_tables[seq.slot])
    pos = np.arange(seq.num_cached)
    page_size = spec.engine.page_size
    k_got = np.asarray(drafter.pools.k)[:, pages[pos // page_size], pos % page_size]
    v_got = np.asarray(drafter.pools.v)[:, pages[pos // page_size], pos % page_size]
    np.testing.assert_allclose(k_got, np.asarray(k_want)[:, 0], rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(v_got, np.asarray(v_want)[:, 0], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("method", ["dflash", "ngram", {"method": "dflash", "tree": 8}])
def test_sampled_speculative_equals_plain_sampling_with_the_same_seed(method):
    """The verifier draws each position's token with the key plain decoding uses there, so a
    seeded sampled request emits the same tokens with or without speculation (float32 logits,
    bf16 KV), whatever shares its batch."""
    convs = [[{"role": "user", "content": p}] for p in PROMPTS[:6]] + [[{"role": "user", "content": PROMPTS[0]}]]
    params = [aj.SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(6)]
    params.append(params[0])  # the same request twice in one batch
    plain = aj.LLM("smollm2-135m", kv_cache_dtype="bf16", max_num_seqs=4, **COMMON)
    expected = [o.token_ids for o in plain.chat(convs, params)]
    del plain
    llm = aj.LLM("smollm2-135m", kv_cache_dtype="bf16", max_num_seqs=4, speculative=method, **COMMON)
    got = [o.token_ids for o in llm.chat(convs, params)]
    assert got == expected
    assert got[0] == got[-1]
    assert llm.engine.num_accepted_tokens > 0  # some emitted tokens came through accepted drafts


def test_sampled_speculative_matches_the_targets_distribution(monkeypatch):
    """Through the whole engine, over 800 seeds (temperature 1, top-k 3): the first token is
    sampled after the prefill; the second goes through verification of a draft that is the
    target's greedy choice (so it is often accepted). The joint distribution of the two must be
    the target's, computed exactly from its logits."""
    from scipy.stats import chisquare

    llm = aj.LLM(
        "smollm2-135m", kv_cache_dtype="fp32", max_num_seqs=32, speculative="ngram", enable_prefix_caching=True,
        **COMMON,
    )  # fmt: skip
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

    monkeypatch.setattr(llm.engine, "_propose", propose)
    n = 800
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
    p_value = chisquare(obs, exp / exp.sum() * obs.sum()).pvalue
    assert p_value > 1e-3, (p_value, counts)
    assert llm.engine.num_accepted_tokens > n // 4  # the drafts were really verified, not just dropped


@pytest.mark.parametrize(
    "spec",
    [{"method": "dflash", "num_speculative_tokens": 7}, {"method": "ngram", "num_speculative_tokens": 7}]
    + [{"method": "dflash", "tree": 7}],
)
def test_warmup_covers_drafting_and_verify_shapes(spec, caplog):
    llm = aj.LLM(
        "smollm2-135m", speculative=spec,
        max_num_seqs=2, num_pages=40, **{**COMMON, "max_model_len": 256},
    )  # fmt: skip
    convs = [[{"role": "user", "content": p}] for p in PROMPTS[4:6]]
    llm.chat(convs, aj.SamplingParams(max_tokens=1, temperature=0.0))  # compiles the prefill shapes
    assert llm.warmup(max_len=120, sampling=False) == 2  # rows {1, 2} x pages {8}
    before = llm.engine.num_compiles
    with caplog.at_level("WARNING", logger="aither_jax.engine"):
        llm.chat(convs, aj.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert llm.engine.num_compiles == before  # drafting, verify and context writes were all warm
    assert llm.engine.spec_stats()["num_drafts"] > 0
