"""Bounded residency (aither_jax/core/bounded.py): a sequence's KV past `max_resident_tokens`
lives on the host; attention reads exactly the resident pages, at their true positions."""

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import aither_jax as aj
from aither_jax.context.prompt import SectionSpan, chat_prompt
from aither_jax.core.bounded import ResidencyConfig, ResidencyError
from aither_jax.device.sampling import SamplingParams
from models.llama import _attention_inputs, _attention_output, _mlp_block, embed, rms_norm, rope_tables, vocab_logits
from pallas_kernels.paged_attention import paged_attention_reference

# The two-block random-weight stand-in of the default model, float32 weights and KV, unused
# pages NaN (a stray read poisons the output).
SETTINGS = dict(
    dtype="float32", kv_cache_dtype="fp32", max_model_len=2048, max_num_seqs=2, num_pages=160, page_size=16,
    max_prefill_chunk=64, attention="reference", progress=False, _cache_fill_value=float("nan"), _num_layers=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def plain():
    return aj.LLM(**SETTINGS)


def _bounded(max_tokens, **kw):
    return aj.LLM(**(SETTINGS | kw), max_resident_tokens=max_tokens)


def _ids(n, seed=0):
    return np.random.default_rng(seed).integers(100, 20000, n).tolist()


def test_a_bound_at_least_the_context_changes_nothing(plain):
    ids = _ids(300)
    llm = _bounded(1024)
    np.testing.assert_array_equal(llm.engine.score(ids), plain.engine.score(ids))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = plain.generate([ids], params)[0].token_ids
    assert llm.generate([ids], params)[0].token_ids == want


def _record_reads(llm):
    """Wraps the runner so each call records (first new position, new tokens, resident page
    indices) of its row: what attention may read."""
    runner, seen = llm.engine.runner, []
    run = runner.run

    def recording(rows, **kw):
        ((seq, toks),) = rows
        seen.append((seq.num_cached, len(toks), list(seq.resident.logical)))
        return run(rows, **kw)

    runner.run = recording
    return seen


def _dense_logits(llm, ids, visible, at=None):
    """Logits of a dense forward pass over `ids` where query p attends to keys `visible[p]`
    (bool [T, T]) and, in sliding-window layers, to the window's keys only: the reference for
    any resident set. `at`: the positions to return (default all)."""
    weights, cfg = llm.engine.weights, llm.config
    t = len(ids)
    tokens = jnp.asarray(ids, jnp.int32)[None]
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    rope = {base: rope_tables(positions, cfg.head_dim, base) for base in cfg.rope_bases}
    x = embed(weights, tokens, cfg).reshape(t, -1)
    empty = jnp.zeros((1, 0, cfg.num_kv_heads, cfg.head_dim), x.dtype)
    zero, length = jnp.zeros((1,), jnp.int32), jnp.full((1,), t, jnp.int32)
    mask = jnp.asarray(visible)[None]
    distance = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]
    for idx, lw in enumerate(weights.layers):
        q, k, v = _attention_inputs(x, lw, cfg, *rope[cfg.layer_rope_base(idx)], 1, False)
        window = cfg.window(idx)
        layer_mask = mask if window is None else mask & (distance < window)[None]
        attn = paged_attention_reference(q, k, v, empty, empty, zero, length, new_mask=layer_mask)
        x = _mlp_block(_attention_output(x, attn, lw, cfg, False), lw, cfg, False)
    x = rms_norm(x, weights.final_norm, cfg.rms_norm_eps)
    return np.asarray(vocab_logits(x if at is None else x[np.asarray(at)], weights.lm_head))


@pytest.mark.parametrize(
    "model, bound, prompt, scorer",
    [("smollm2-135m", 384, 600, "attention"), ("smollm2-135m", 384, 600, "qk"), ("gemma3-270m", 768, 1200, "qk")],
)
def test_attention_reads_exactly_the_resident_pages_at_their_true_positions(model, bound, prompt, scorer):
    """A 600-token prompt and 120 greedy tokens through a 384-token bound (Gemma-3: 1,200 and
    768, its 512-token sliding window in the tail), reselected every 24 tokens: pages leave and
    come back, and every sampled token and its log probability equal a dense pass whose mask
    is the resident set each call ran with (and the window, in sliding layers). A
    block table not rebuilt after a move (a stale mask: during decoding, moves fall between
    the steps that add pages), a key read at its table position instead of its true one, or
    a page brought back to the wrong place would all change them."""
    layers = 6 if model == "gemma3-270m" else 2  # five sliding-window layers and a global one
    llm = _bounded(bound, model=model, residency_tau=24, residency_scorer=scorer, _num_layers=layers)
    ids = _ids(prompt, seed=1)
    seen = _record_reads(llm)
    scheduler = llm.engine.scheduler
    allocate = scheduler.allocate

    def elsewhere(n):  # never the pages just freed: a page brought back changes device page
        freed = allocate(n)
        pages = allocate(n)
        scheduler.allocator.free(freed)
        return pages

    scheduler.allocate = elsewhere
    engine = llm.engine
    seq = engine.add_request(ids, SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True), num_logprobs=0)
    while engine.has_unfinished():
        engine.step()
    tokens = ids + seq.output_ids
    page = llm.engine.page_size
    visible = np.zeros((len(tokens), len(tokens)), bool)
    for start, n, resident in seen:
        keys = np.zeros(len(tokens), bool)
        for i in resident:
            keys[i * page : (i + 1) * page] = True
        for p in range(start, start + n):
            visible[p, : p + 1] = keys[: p + 1]
    assert sum(1 for s, n, r in seen if len(r) < -(-(s + n) // page)) > len(seen) // 2  # most calls held pages off
    # Pages came back from the host: a call's resident set holds an older page that the
    # call before it did not.
    pairs = zip(seen, seen[1:], strict=False)
    back = [i for a, b in pairs for i in set(b[2]) - set(a[2]) if i < -(-(a[0] + a[1]) // page)]
    assert len(back) >= 4
    want = _dense_logits(llm, tokens[:-1], visible[:-1, :-1], at=range(len(ids) - 1, len(tokens) - 1))
    assert want.argmax(-1).tolist() == seq.output_ids
    logp = want - want.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    got = np.array([lp[0] for lp in seq.logprobs])  # the sampled tokens' log probabilities
    np.testing.assert_allclose(got, logp[np.arange(len(got)), seq.output_ids], atol=1e-3)


def test_pages_moved_to_other_device_pages_mid_sequence_read_as_before(plain):
    """1,000 tokens teacher-forced with every page but the newest moved out and back into
    other device pages after every chunk (a bound that holds them all): logits identical to
    the plain engine's."""
    llm = _bounded(1200, residency_scorer="lru")
    engine, bounded = llm.engine, llm.engine.bounded
    ids = _ids(1000, seed=2)
    runner, run, moves = engine.runner, engine.runner.run, []

    def shuffling(rows, **kw):
        ((seq, _),) = rows
        movable = seq.resident.logical[:-1]
        if movable:
            before = list(seq.pages)
            bounded.page_out(seq, movable)
            spare = engine.scheduler.allocate(len(movable))  # the freed pages are taken first
            bounded.page_in(seq, movable)
            engine.scheduler.allocator.free(spare)
            moves.append(sum(a != b for a, b in zip(before, seq.pages, strict=True)))
        return run(rows, **kw)

    runner.run = shuffling
    got = engine.score(ids)
    assert sum(moves) > 100
    np.testing.assert_array_equal(got, plain.engine.score(ids))


def test_page_out_and_in_is_byte_exact():
    llm = _bounded(1024)
    engine, bounded = llm.engine, llm.engine.bounded
    seq = engine.add_request(_ids(200, seed=3), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.step()  # admitted, first chunk computed
    while seq.prefilling:
        engine.step()
    out = [1, 2, 5]
    before = engine.store.read([seq.pages[i] for i in out])
    bounded.page_out(seq, out)
    assert seq.kv_offset == 3 * engine.page_size and sorted(seq.resident.held) == out
    for leaf, held in zip(before, zip(*(seq.resident.held[i] for i in out), strict=True), strict=True):
        np.testing.assert_array_equal(leaf, np.stack(held))
        assert all(page.base is None for page in held)  # its own bytes, not a view of the padded read
    assert bounded.page_in(seq, out) == 3
    after = engine.store.read([seq.pages[i] for i in out])
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    assert seq.kv_offset == 0 and seq.resident.logical == list(range(len(seq.pages)))


def test_bounds_too_small_for_the_pages_that_never_leave_are_refused():
    with pytest.raises(ValueError, match="max_resident_tokens 128 holds 8 pages .* raise max_resident_tokens"):
        _bounded(128)
    with pytest.raises(ValueError, match="residency scorer must be one of"):
        ResidencyConfig(1024, scorer="random").check()
    with pytest.raises(ValueError, match="needs 160 KV pages but the cache has 159"):
        _bounded(2560)
    with pytest.raises(ValueError, match="does not run with speculative decoding"):
        _bounded(1024, speculative="ngram")
    engine = _bounded(320).engine
    system = (SectionSpan("system", 1.0, 0, 200),)
    with pytest.raises(ValueError, match="protected .* fills 11 KV pages"):
        engine.add_request(_ids(400), SamplingParams(max_tokens=4), sections=system)
    assert not engine.has_unfinished()


def _find(ids, part):
    return next(i for i in range(len(ids)) if ids[i : i + len(part)] == part)


def test_the_persona_survives_a_small_resident_budget():
    """A system prompt names the assistant, five long turns follow (1,172 tokens, the
    conversation a full cache produced), then "What is your name?" with 768 resident tokens:
    the protected system pages stay on the device and the answer is the full cache's. Without
    protection (`window`: sinks and the newest pages) the name's pages are on the host and the
    model gives itself another name."""
    messages = json.loads((pathlib.Path(__file__).parent / "persona_conversation.json").read_text())
    params = SamplingParams(max_tokens=12, temperature=0.0)  # the answer's first sentence
    full = aj.LLM(max_model_len=2048, progress=False).chat(messages, params)[0].text
    assert "Aria" in full
    answers = {}
    for scorer in ("attention", "window"):
        llm = aj.LLM(max_model_len=2048, progress=False, max_resident_tokens=768, residency_scorer=scorer)
        seen = _record_reads(llm)
        longer = SamplingParams(max_tokens=20, temperature=0.0)  # far enough for the other name
        answers[scorer] = llm.chat(messages, params if scorer == "attention" else longer)[0].text
        prompt = chat_prompt(llm.tokenizer, messages)
        name = _find(prompt.ids, llm.tokenizer.encode(" Aria.")) // llm.engine.page_size
        assert name >= llm.engine.bounded.sink_pages  # not a sink page
        assert all((name in r) == (scorer == "attention") for s, _, r in seen[-12:]), scorer
    assert answers["attention"] == full
    assert "My name is" in answers["window"] and "Aria" not in answers["window"], answers["window"]


def test_a_page_that_cannot_be_placed_fails_its_request_and_the_engine_goes_on(monkeypatch):
    llm = _bounded(320)
    engine, bounded = llm.engine, llm.engine.bounded
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    doomed = engine.add_request(_ids(500, seed=4), params)
    grow = bounded.grow

    def failing(seq, num_tokens):
        if seq is doomed and num_tokens > 400:
            raise ResidencyError("request 0: no room")
        return grow(seq, num_tokens)

    monkeypatch.setattr(bounded, "grow", failing)
    other = engine.add_request(_ids(100, seed=5), params)
    while engine.has_unfinished():
        engine.step()
    assert doomed.finish_reason == "abort" and doomed.slot < 0
    assert other.finish_reason == "length" and len(other.output_ids) == 8
    assert engine.scheduler.allocator.num_used == 0  # every page came back


def test_a_cached_prompt_longer_than_the_bound_is_admitted_within_it_and_the_rest_comes_back(monkeypatch):
    """A prompt seen before whose cached pages (on the device and in the host tier) outnumber
    the bound starts on its first pages only, leaving a prefill chunk's room (it started over
    the bound, and failed the engine with OutOfPagesError where the pool could not hold every
    promoted page); the rest of its cached pages come back chunk by chunk, paging the
    lowest-scored out, instead of being recomputed. With the window scorer both runs end on
    the same resident pages, so the tokens are the same."""
    llm = _bounded(384, num_pages=41, enable_prefix_caching=True, kv_offloading_size=0.02, residency_scorer="window")
    bounded, sched = llm.engine.bounded, llm.engine.scheduler
    admitted, computed = [], []
    admit, compute = bounded.admit, sched.computed
    monkeypatch.setattr(bounded, "admit", lambda seq: (admitted.append(len(seq.pages)), admit(seq)))
    monkeypatch.setattr(sched, "computed", lambda seq, n: (computed.append(n), compute(seq, n)))
    ids, params = _ids(600, seed=6), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = llm.generate([ids], params)[0]
    assert sum(computed) == 600 + 7 and first.num_cached_tokens == 0
    computed.clear()
    host_hits = llm.engine.tiers.counters.num_host_hits
    again = llm.generate([ids], params)[0]
    assert max(admitted) <= bounded.max_pages
    assert again.num_cached_tokens == 599 // 16 * 16 > bounded.max_cached_pages * bounded.page_size
    assert sum(computed) == 600 - again.num_cached_tokens + 7  # the partial last page and the answer
    assert llm.engine.tiers.counters.num_host_hits > host_hits  # some came back from the host tier
    assert again.token_ids == first.token_ids
