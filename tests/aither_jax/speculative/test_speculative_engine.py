"""Speculative decoding in the engine on the real model (float32 weights).

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

import jax.numpy as jnp
import numpy as np
import pytest

import aither_jax as aj
from aither_jax.device import steps
from aither_jax.device.verify import verify
from aither_jax.speculative.ngram import ngram_propose
from models.registry import shipped_draft

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
    path = shipped_draft("smollm2-135m")
    assert path.is_file(), f"{path} is missing"
    assert path.stat().st_size <= 16 * 2**20


@pytest.mark.parametrize(
    ("method", "kv", "batch", "block", "steps", "kernels"),
    [
        ("dflash", "bf16", 8, 16, 1, False),
        ("dflash", "bf16", 8, 4, 4, False),
        ("dflash", "auto", 8, 4, 4, False),
        ("dflash", "bf16", 1, 16, 4, False),
        ("dflash", "bf16", 1, 16, 1, False),
        ("dflash", "bf16", 1, 4, 1, False),
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
    assert (
        e.spec_counters.num_drafts > 0 and 0 <= e.spec_counters.num_accepted_tokens <= e.spec_counters.num_draft_tokens
    )
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
    paths, verify = [], e.runner.verify

    def spy(*args, **kwargs):
        out = verify(*args, **kwargs)
        if kwargs["parents"] is not None and out[3] is not None:
            paths.append((np.asarray(kwargs["parents"]), np.asarray(out[0]), np.asarray(out[3])))
        return out

    e.runner.verify = spy
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
    assert (
        e.spec_counters.num_accepted_tokens > 0
        and e.spec_counters.accepted_per_pos.sum() == e.spec_counters.num_accepted_tokens
    )


def test_adaptive_draft_length_keeps_the_output(baselines):
    """With drafts per step chosen as the engine goes (0, 1, 3, 7 or 15), greedy output is
    still plain greedy output token for token, and every option really ran."""
    spec = {"method": "dflash", "adaptive": True}
    llm = aj.LLM("smollm2-135m", kv_cache_dtype="bf16", max_num_seqs=8, speculative=spec, **COMMON)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], GREEDY)
    assert [o.token_ids for o in outs] == baselines("bf16", 8)
    chooser = llm.engine.draft_length
    assert chooser.options == [0, 1, 3, 7, 15] and all(chooser.chosen[k] > 0 for k in chooser.options)
    assert llm.engine.spec_counters.num_accepted_tokens > 0


CHAIN = {"method": "dflash", "tree": 0}  # a chain of 15 drafts on every backend (CPU's default is a tree)


def test_prompt_lookup_drafts_the_rows_whose_context_repeats(baselines):
    """dflash with prompt_lookup: a row whose context has an n-gram match gets prompt lookup's
    drafts, every other row the draft model's; a step where every row matches does not run
    the draft model; greedy output is still plain greedy output token for token."""
    spec = CHAIN | {"prompt_lookup": True}
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


ROLLBACK_PROMPTS = [
    "Name five fruits and say what colour each one is.",
    "Count from 1 to 15, separated by commas.",
    "Write a Python function that reverses a string.",
]
# The largest error, relative to its norm, of any cached key/value vector (one layer, position
# and head) against plain decoding's. bf16 and TurboQuant caches round the keys the verify pass
# computes in a chunk differently from keys computed one at a time (module docstring); the
# difference compounds over the tokens (measured: 0.013 bf16, 0.16 TurboQuant). At every
# position some vector of the neighbouring position's keys and values is at least 0.5 off.
ROLLBACK_TOL = {"fp32": 1e-4, "bf16": 0.03, "auto": 0.3}


@pytest.mark.parametrize(
    ("spec", "kv", "num_rows"),
    [
        (CHAIN, "fp32", 1),
        ({"method": "dflash", "tree": 15}, "fp32", 1),
        (CHAIN, "bf16", 3),
        ({"method": "dflash", "tree": 15}, "bf16", 3),
        (CHAIN, "auto", 3),
    ],
    ids=["chain-fp32-1", "tree-fp32-1", "chain-bf16-3", "tree-bf16-3", "chain-auto-3"],
)
def test_rollback_leaves_the_caches_of_plain_decoding(spec, kv, num_rows):
    """Rows of different prompts decode side by side, so a row's rejected drafts could land in
    its own later positions or in another row's pages. After rejections in every row, each row's
    target keys/values and draft context are those plain decoding of its committed tokens gives,
    every vector within ROLLBACK_TOL[kv]."""
    convs = [[{"role": "user", "content": p}] for p in ROLLBACK_PROMPTS[:num_rows]]
    # One spare slot: `hidden_states` below scores in a slot of its own.
    llm = aj.LLM("smollm2-135m", kv_cache_dtype=kv, max_num_seqs=num_rows + 1, speculative=spec, **COMMON)
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True)) for c in convs]
    params = aj.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    seqs = [llm.engine.add_request(ids, params) for ids in prompts]

    def mixed(s):  # the row has had drafts both rejected and accepted
        return s.num_draft_tokens > s.num_accepted_tokens > 0

    def longest():
        return max(len(s.output_ids) for s in seqs)

    # At least 30 tokens a row, then on until every row is mixed; a step commits at most 16
    # tokens, so stopping by 46 keeps every row short of its 64 and none finishes.
    while longest() < 46 and (longest() < 30 or not all(map(mixed, seqs))):
        llm.engine.step()
    assert all(map(mixed, seqs)), [(s.num_draft_tokens, s.num_accepted_tokens, len(s.output_ids)) for s in seqs]

    plain = aj.LLM("smollm2-135m", kv_cache_dtype=kv, max_num_seqs=num_rows + 1, **COMMON)
    refs = [plain.engine.add_request(ids, params) for ids in prompts]
    while any(len(r.output_ids) < len(s.output_ids) for r, s in zip(refs, seqs, strict=True)):
        plain.engine.step()
    drafter, page_size = llm.engine.drafter, llm.engine.page_size
    from models.draft import context_features, context_kv

    tol = ROLLBACK_TOL[kv]
    for i, (seq, ref) in enumerate(zip(seqs, refs, strict=True)):
        n = seq.num_cached
        assert ref.output_ids[: len(seq.output_ids)] == seq.output_ids and ref.num_cached >= n
        for name, got, want in zip("kv", _slot_kv(llm.engine, seq, n), _slot_kv(plain.engine, ref, n), strict=True):
            _assert_vectors_close(got, want, tol, f"row {i} target {name}")

        # The draft's context cache: projections of the target's hidden states of the committed tokens.
        hidden = plain.engine.hidden_states(seq.token_slice(0, n), drafter.taps)
        feats = context_features(drafter.params, drafter.cfg, hidden[None])
        want = context_kv(drafter.params, drafter.cfg, feats, np.arange(n)[None])  # ([L, 1, n, Hkv, Dh],) * 2
        pages = np.asarray(llm.engine.scheduler.block_tables[seq.slot])[np.arange(n) // page_size]
        for name, pool, w in zip("kv", (drafter.pools.k, drafter.pools.v), want, strict=True):
            got = np.asarray(pool)[:, pages, np.arange(n) % page_size]
            _assert_vectors_close(got, np.asarray(w)[:, 0], tol, f"row {i} draft context {name}")


def _slot_kv(engine, seq, num_tokens: int):
    """Target keys/values [layers, tokens, Hkv, Dh] of the sequence's first `num_tokens` cached tokens."""
    table = np.asarray(engine.scheduler.block_tables[seq.slot : seq.slot + 1])
    ks, vs = zip(*(engine.cache.read(table, i) for i in range(engine.cfg.num_layers)), strict=True)
    return np.stack([np.asarray(k)[0, :num_tokens] for k in ks]), np.stack([np.asarray(v)[0, :num_tokens] for v in vs])


def _assert_vectors_close(got, want, tol: float, what: str):
    """Every vector got[l, t, h] [Dh] within `tol` of want's, relative to want's norm."""
    err = np.linalg.norm(got - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-6)
    layer, pos, head = np.unravel_index(err.argmax(), err.shape)
    assert err.max() <= tol, f"{what}: layer {layer}, position {pos}, head {head} is {err.max():.3g} off"


@pytest.mark.parametrize("method", [CHAIN, "ngram", {"method": "dflash", "tree": 8}, "dflash"])
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
    assert llm.engine.spec_counters.num_accepted_tokens > 0  # some emitted tokens came through accepted drafts


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
    steps.verify_step.clear_cache()  # verify_step traced with the right verifier must not be reused
    try:
        p_value, counts, _ = _two_token_chisquare(monkeypatch)
    finally:
        monkeypatch.undo()
        steps.verify_step.clear_cache()  # nor this one by later tests
    assert p_value < 1e-6, (p_value, counts)


def _two_token_chisquare(monkeypatch, n: int = 800):
    """The chi-square p-value of the first two tokens of `n` seeded requests through an ngram
    engine whose one draft (after the first token) is the target's greedy next token, against
    the target's exact joint distribution: (p-value, counts, the engine)."""
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
def test_warmup_covers_drafting_and_verify_shapes(spec, caplog):
    llm = aj.LLM(
        "smollm2-135m", speculative=spec,
        max_num_seqs=2, num_pages=40, **{**COMMON, "max_model_len": 256},
    )  # fmt: skip
    convs = [[{"role": "user", "content": p}] for p in PROMPTS[4:6]]
    llm.chat(convs, aj.SamplingParams(max_tokens=1, temperature=0.0))  # compiles the prefill shapes
    assert llm.warmup(max_len=120, sampling=False) == 2  # rows {1, 2} x pages {8}
    before = llm.engine.num_compiles
    with caplog.at_level("WARNING", logger="aither_jax.compile.shapes"):
        llm.chat(convs, aj.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert llm.engine.num_compiles == before  # drafting, verify and context writes were all warm
    assert llm.engine.spec_stats()["num_drafts"] > 0
