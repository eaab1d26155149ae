"""Engine behaviour: batching, paging, NaN-safe masking, compile stability, stops (on the two-block
stand-in of the default model where the model is not the point, on the real model for stops)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import aither_jax as aj
from aither_jax.compile.buckets import bucket, page_bucket
from aither_jax.compile.counter import CompileCounter
from aither_jax.core.runner import MIN_PAGE_BUCKET, MIN_WIDE_PAGE_BUCKET, WIDE_STEP_ROWS
from aither_jax.device.steps import decode_steps, forward_step
from tests.conftest import TINY

GREEDY = aj.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

PROMPTS = [
    "Hi",
    "Write a short poem about the sea and the wind that moves across it at night.",
    "1, 2, 3, 4,",
    "The history of the Roman Empire spans many centuries, beginning with the founding of the city and",
    "Q: What is 7 times 8?\nA:",
    # Longer than the fixture's 64-token prefill chunk: its prefill spans several steps while
    # the other rows are already decoding.
    "Here is a list of facts about the planets of the solar system. " * 8 + "The largest planet is",
]


def test_bucket_is_power_of_two_within_bounds():
    assert [bucket(n, 16, 256) for n in (1, 16, 17, 100, 256, 900)] == [16, 16, 32, 128, 256, 256]
    assert bucket(3, 1, 8) == 4


def test_page_bucket_adds_the_halfway_points():
    got = [page_bucket(n, 8, 128) for n in (1, 8, 9, 12, 13, 16, 17, 24, 25, 33, 48, 49, 65, 97, 200)]
    assert got == [8, 8, 12, 12, 16, 16, 24, 24, 32, 48, 48, 64, 96, 128, 128]
    assert [page_bucket(n, 1, 1 << 20) for n in (1, 2, 3, 4, 5, 6, 7)] == [1, 2, 4, 4, 6, 6, 8]
    assert page_bucket(100, 8, 100) == 100  # clamped to the table width


def test_batch_of_different_lengths_equals_each_alone(tiny_f32):
    together = tiny_f32.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, together, strict=True):
        alone = tiny_f32.generate([prompt], GREEDY)[0]
        assert out.token_ids == alone.token_ids, prompt


def test_more_prompts_than_slots_queue_and_join_between_steps(tiny_f32):
    """12 requests over 8 slots with different lengths: later ones join as earlier ones leave."""
    prompts = [f"Item {i}: the number {i} squared is" for i in range(12)]
    params = [aj.SamplingParams(max_tokens=2 + 3 * (i % 4), temperature=0.0, ignore_eos=True) for i in range(12)]
    outs = tiny_f32.generate(prompts, params)
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        assert len(out.token_ids) == params[i].max_tokens
        assert out.finish_reason == "length"
        assert out.token_ids == tiny_f32.generate([p], params[i])[0].token_ids


def test_long_sequence_spans_many_pages_and_matches_scoring(tiny_f32):
    """Greedy decoding across ~20 pages agrees with argmax of full-sequence logits (NaN pool never read)."""
    prompt = "List the days of the week and describe each one in a sentence. Monday is"
    out = tiny_f32.generate([prompt], aj.SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True))[0]
    ids = out.prompt_token_ids + out.token_ids
    assert len(ids) > 16 * 18
    logits = tiny_f32.logits(ids[:-1])
    assert np.isfinite(logits).all()
    n = len(out.prompt_token_ids)
    np.testing.assert_array_equal(logits[n - 1 :].argmax(-1), out.token_ids)


def test_first_prefill_chunk_reads_no_pages_and_later_chunks_do(tiny_f32):
    """A prompt's first chunk has nothing stored to attend to, so its call reads no pages; the
    next chunks read the pages the first ones wrote. (That the outputs stay right is the HF
    parity tests' job: they score prompts through the same chunked path.)"""
    engine = tiny_f32.engine
    engine.shapes.clear()
    tiny_f32.generate([PROMPTS[-1]], GREEDY)  # spans several 64-token chunks
    prefill = [r for r in engine.step_shapes() if r["kind"] == "forward" and r["tokens"] > 1]
    pages = {r["pages"] for r in prefill}
    assert 0 in pages and max(pages) >= 8, prefill


def test_pages_and_slots_return_after_requests_and_reuse_gives_same_output(tiny_f32):
    engine = tiny_f32.engine
    free_before = engine.scheduler.allocator.num_free
    first = tiny_f32.generate(PROMPTS, GREEDY)
    assert engine.scheduler.allocator.num_free == free_before
    assert not engine.has_unfinished()
    # The freed pages now hold stale KV of other prompts; outputs must not change.
    second = tiny_f32.generate(list(reversed(PROMPTS)), GREEDY)
    assert [o.token_ids for o in first] == [o.token_ids for o in reversed(second)]


def test_compile_counter_sees_new_compilations(tiny_f32):
    import jax
    import jax.numpy as jnp

    from aither_jax.compile.counter import CompileCounter

    before = tiny_f32.engine.num_compiles
    seconds, lowering = CompileCounter.seconds(), CompileCounter.lowering_seconds()
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(7)).block_until_ready()
    assert tiny_f32.engine.num_compiles > before
    assert CompileCounter.seconds() > seconds  # their time adds up too (the server's metric)
    assert CompileCounter.lowering_seconds() > lowering  # and so does lowering, counted apart


def test_steady_state_decoding_does_not_recompile(tiny_f32):
    params = aj.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    tiny_f32.generate(["Warm up the buckets with this prompt"] * 3, params)
    before = tiny_f32.engine.num_compiles
    tiny_f32.generate(["Another prompt of similar length here"] * 3, params)
    tiny_f32.generate(["A third prompt, again similar"] * 4, params)
    assert tiny_f32.engine.num_compiles == before


def test_seeded_sampling_is_reproducible_and_independent_of_batch(tiny_f32):
    params = aj.SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = tiny_f32.generate(["Tell me a story about a dragon"], params)[0]
    batched = tiny_f32.generate(["Tell me a story about a dragon", "Something else entirely"], params)[0]
    assert alone.token_ids == batched.token_ids
    other = tiny_f32.generate(
        ["Tell me a story about a dragon"],
        aj.SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=4321, ignore_eos=True),
    )[0]
    assert other.token_ids != alone.token_ids


def test_top_k_one_is_greedy(tiny_f32):
    greedy = tiny_f32.generate(PROMPTS[:2], GREEDY)
    topk1 = tiny_f32.generate(
        PROMPTS[:2], aj.SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=7, ignore_eos=True)
    )
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk1]


def test_stop_string_truncates_text(llm_f32):
    base = llm_f32.generate(["Count: 1, 2, 3,"], GREEDY)[0]
    assert "," in base.text
    out = llm_f32.generate(["Count: 1, 2, 3,"], aj.SamplingParams(max_tokens=12, temperature=0.0, stop=[","]))[0]
    assert out.finish_reason == "stop"
    assert out.text == base.text[: base.text.index(",")]
    assert out.token_ids == base.token_ids[: len(out.token_ids)]


def test_a_streamed_completion_is_the_generated_one_in_pieces_and_holds_back_a_stop_string(tiny_f32):
    prompt = PROMPTS[1]
    base = tiny_f32.generate([prompt], GREEDY)[0]
    stream = tiny_f32.stream(prompt, GREEDY)
    pieces = list(stream)
    assert len(pieces) > 1 and "".join(pieces) == base.text
    assert stream.output.token_ids == base.token_ids and stream.output.finish_reason == "length"
    # A stop string from the middle of the text: what streams never includes any of it.
    stop = base.text[len(base.text) // 2 :][:3]
    params = aj.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])
    stopped = tiny_f32.generate([prompt], params)[0]
    stream = tiny_f32.stream(prompt, params)
    assert "".join(stream) == stopped.text == base.text[: base.text.index(stop)]
    assert stream.output.finish_reason == "stop"
    with pytest.raises(RuntimeError, match="once"):
        list(stream)
    # A conversation goes through the chat template, as `chat` renders it.
    messages = [{"role": "user", "content": "Hi"}]
    assert "".join(tiny_f32.stream(messages, GREEDY)) == tiny_f32.chat([messages], GREEDY)[0].text


def test_streams_read_in_turn_each_give_their_whole_text(tiny_f32):
    """Two streams on one LLM step the same engine: one finishes while the other waits at a
    yield, and must still hand over its text to the end."""
    short = aj.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    expected = [tiny_f32.generate([PROMPTS[0]], GREEDY)[0].text, tiny_f32.generate([PROMPTS[2]], short)[0].text]
    streams = [tiny_f32.stream(PROMPTS[0], GREEDY), tiny_f32.stream(PROMPTS[2], short)]
    pieces = [[], []]
    for got in itertools.zip_longest(*streams):
        for i, piece in enumerate(got):
            if piece is not None:
                pieces[i].append(piece)
    assert ["".join(p) for p in pieces] == expected


def test_leaving_a_stream_early_aborts_its_request(tiny_f32):
    engine = tiny_f32.engine
    free_before = engine.scheduler.allocator.num_free
    pieces = iter(tiny_f32.stream(PROMPTS[0], GREEDY))
    next(pieces)
    assert engine.has_unfinished()
    pieces.close()
    assert not engine.has_unfinished() and engine.scheduler.allocator.num_free == free_before
    with pytest.raises(ValueError, match="maximum context length"):
        next(iter(tiny_f32.stream([1] * 700, GREEDY)))


def test_stop_token_ids_and_eos(llm_f32):
    base = llm_f32.generate(["The alphabet: A, B, C,"], GREEDY)[0]
    stop_tok = base.token_ids[3]
    out = llm_f32.generate(
        ["The alphabet: A, B, C,"], aj.SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_tok])
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_tok) + 1]
    chat = llm_f32.chat([[{"role": "user", "content": "Say hello."}]], aj.SamplingParams(max_tokens=60, temperature=0))
    assert chat[0].finish_reason == "stop" and chat[0].token_ids[-1] in llm_f32.tokenizer.stop_token_ids
    assert "<|im_end|>" not in chat[0].text


def test_max_tokens_clipped_to_context(tiny_f32):
    ids = list(range(100, 100 + 630))
    out = tiny_f32.generate([ids], aj.SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 640 - 630 and out.finish_reason == "length"


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], GREEDY, "empty"),
        ([[5, 10**9]], GREEDY, "out of range"),
        ([list(range(100, 740))], GREEDY, "maximum context length is 640"),
        ([[1.5]], GREEDY, "string or a list of token ids"),
        (["a"], {"max_tokens": 3}, "sampling_params must be a SamplingParams"),
    ],
)
def test_bad_generate_inputs(tiny_f32, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        tiny_f32.generate(prompt, params)
    assert not tiny_f32.engine.has_unfinished()


def test_bad_logits_inputs(tiny_f32):
    with pytest.raises(ValueError, match="empty"):
        tiny_f32.logits([])
    with pytest.raises(ValueError, match="out of range"):
        tiny_f32.logits([1, -3])
    with pytest.raises(ValueError, match="maximum context length"):
        tiny_f32.logits(list(range(700)))


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="dtype"):
        aj.LLM("smollm2-135m", dtype="float16")
    with pytest.raises(ValueError, match="unknown model 'nope'.*smollm2-135m"):
        aj.LLM("nope")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(page_size=0), "page_size must be an integer"),
        (dict(seed=-1), "seed must be an integer"),
        (dict(shared_prefix_attention="no"), "shared_prefix_attention must be True or False"),
        (dict(enable_prefix_caching="yes"), "enable_prefix_caching must be True or False"),
        (dict(kv_offloading_size=-1, enable_prefix_caching=True), "^kv_offloading_size must be"),
        (dict(kv_high_watermark=5, enable_prefix_caching=True), "^kv_high_watermark must be"),
        (dict(max_resident_tokens=-5), "^max_resident_tokens must be"),
    ],
)
def test_bad_arguments_are_named_as_the_caller_wrote_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        aj.LLM("smollm2-135m", progress=False, **kwargs)


def test_a_flat_list_of_token_ids_is_one_prompt(tiny_f32):
    ids = list(range(100, 112))
    params = aj.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    (one,) = tiny_f32.generate(ids, params)
    assert one.prompt_token_ids == ids and one.token_ids == tiny_f32.generate([ids], params)[0].token_ids
    rows = tiny_f32.generate(np.array([ids, ids], np.int32), params)  # a NumPy array: a row per prompt
    assert [r.token_ids for r in rows] == [one.token_ids] * 2


def test_requested_logprobs_are_the_models_log_softmax_at_each_generated_token(tiny_f32):
    ids = list(range(100, 112))
    params = [
        aj.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3),
        aj.SamplingParams(max_tokens=5, temperature=0.8, seed=4, ignore_eos=True, logprobs=0),
        aj.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
    ]
    outs = tiny_f32.generate([ids] * 3, params, use_tqdm=False)
    for out, p in zip(outs[:2], params[:2], strict=True):
        assert len(out.logprobs) == len(out.token_ids) == 5
        logits = tiny_f32.logits(ids + out.token_ids)[len(ids) - 1 : -1].astype(np.float64)
        want = logits - logits.max(-1, keepdims=True)
        want -= np.log(np.exp(want).sum(-1, keepdims=True))
        for row, token, lp in zip(want, out.token_ids, out.logprobs, strict=True):
            top = np.argsort(-row)[: p.logprobs]
            assert list(lp)[0] == token and set(lp) == {token, *top.tolist()}
            np.testing.assert_allclose([lp[t] for t in lp], row[list(lp)], atol=1e-4)
        assert out.cumulative_logprob == pytest.approx(want[np.arange(5), out.token_ids].sum(), abs=1e-3)
    assert len(outs[0].logprobs[0]) == 3  # greedy: the token is the most likely of the top 3
    assert outs[2].logprobs is None and outs[2].cumulative_logprob is None


def test_default_dtype_is_float32_on_cpu_bfloat16_elsewhere():
    """The library default is the CLI's "auto": XLA's CPU bfloat16 matmuls are slow."""
    import jax

    llm = aj.LLM("smollm2-135m", max_model_len=64, num_pages=8, progress=False)
    want = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    assert llm.dtype == want
    assert llm.engine.weights.embed.dtype == want


def test_warmup_compiles_decode_shapes_and_later_new_shapes_warn(caplog):
    llm = aj.LLM(
        "smollm2-135m", dtype="float32", max_model_len=256, max_num_seqs=2, num_pages=40, progress=False, **TINY
    )
    assert llm.warmup(max_len=128, sampling=False) == 2  # rows {1, 2} x pages {8}
    params = aj.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    with caplog.at_level("WARNING", logger="aither_jax.compile.shapes"):
        llm.generate(["A short prompt", "Another one"], params)  # compiles the prefill shape only
        assert not caplog.records
        before = llm.engine.num_compiles
        llm.generate(["A third prompt", "And a fourth"], params)
        assert llm.engine.num_compiles == before
        llm.generate(["A short prompt"], aj.SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True))
    assert any("not compiled during warm-up" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="max_len"):
        llm.warmup(max_len=1000)


def test_sampled_batches_run_the_greedy_forward_programs():
    """Sampled rows draw from the forward step's last logits in `sample_step`, a call of its
    own, so a sampled batch runs exactly the forward programs its greedy twin compiled."""
    llm = aj.LLM(
        "smollm2-135m", dtype="float32", max_model_len=256, max_num_seqs=2, num_pages=44, progress=False, **TINY
    )
    prompts = ["A short prompt", "Another one"]
    greedy = llm.generate(prompts, aj.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    forward = llm.engine.compile_scope.jit(forward_step)  # the engine's own (compile/scope.py)
    programs = forward._cache_size()
    assert programs > 0
    sampled = llm.generate(prompts, aj.SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True))
    assert forward._cache_size() == programs
    assert [o.token_ids for o in sampled] != [o.token_ids for o in greedy]


def test_wide_steps_start_from_a_smaller_page_bucket(caplog):
    """Steps of WIDE_STEP_ROWS rows or more read from MIN_WIDE_PAGE_BUCKET pages up, narrower
    ones from MIN_PAGE_BUCKET: warm-up to 8 pages compiles pages {8} for rows 1, 2 and 4 and
    pages {4, 6, 8} for rows 8."""
    assert MIN_WIDE_PAGE_BUCKET < MIN_PAGE_BUCKET and WIDE_STEP_ROWS == 8
    llm = aj.LLM(
        "smollm2-135m", dtype="float32", max_model_len=256, max_num_seqs=8, num_pages=40, progress=False, **TINY
    )
    assert llm.warmup(max_len=128, sampling=False) == 6
    prompts = [f"Count to {i}: 1, 2," for i in range(3, 11)]
    params = aj.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with caplog.at_level("WARNING", logger="aither_jax.compile.shapes"):
        outs = llm.generate(prompts, params)
    assert not caplog.records  # every decode step had a warm shape
    for p, out in zip(prompts[:2], outs, strict=False):  # 4 pages read at 8 rows, 8 alone: same tokens
        assert out.token_ids == llm.generate([p], params)[0].token_ids


@pytest.mark.parametrize(
    "extra",
    [
        {"kv_cache_dtype": "tq4-s2", "num_pages": 36, **TINY},
        {
            "kv_cache_dtype": "bf16",
            "num_pages": 34,
            "speculative": {"method": "ngram", "num_speculative_tokens": 5},
            **TINY,
        },
        {"kv_cache_dtype": "fp32", "num_pages": 38, "num_scheduler_steps": 4, **TINY},
        {
            "kv_cache_dtype": "fp32",
            "num_pages": 39,
            "speculative": {"method": "dflash", "num_speculative_tokens": 3},
            **TINY,
        },
    ],
    ids=["turboquant", "ngram-verify", "decode-steps", "dflash"],
)
def test_threaded_warmup_leaves_the_warmup_calls_nothing_to_compile(monkeypatch, request, extra):
    """Warm-up compiles its step calls on 2 threads first (`Compiler.precompile`: decode steps,
    cache writes, verify passes, drafting calls and draft context writes); its own calls of
    the same shapes must then find every
    executable compiled. (num_pages is unique to this test, so no earlier test compiled
    these shapes.) DFlash drafts with a random-weight draft made for the stand-in."""
    if "speculative" in extra and extra["speculative"]["method"] == "dflash":
        extra = {**extra, "speculative": {**extra["speculative"], "model": request.getfixturevalue("stand_in_draft")}}
    llm = aj.LLM("smollm2-135m", dtype="float32", max_model_len=256, max_num_seqs=2, progress=False, **extra)
    compiler, counts = llm.engine.compiler, {}
    precompile = compiler.precompile

    def counted(*args, **kwargs):
        counts["before"] = CompileCounter.count()
        precompile(*args, **kwargs)
        counts["after"] = CompileCounter.count()

    monkeypatch.setattr(compiler, "precompile", counted)
    assert llm.warmup(max_len=120, sampling=True, workers=2) == 4  # rows {1, 2} x {greedy, sampled}, 8 pages
    # A decode step per row count (greedy and sampled shapes share it; the sampler, one per
    # row count, may be compiled already: it depends on nothing but the rows), with ngram per
    # shape 2 verify buckets (4 and 8 tokens), one write per distinct update shape; fused
    # decode steps (`decode_steps`, one per shape) write inside the call. With DFlash also the
    # drafting call of each greedy shape and the draft's context writes.
    want = {"turboquant": 2 + 1, "ngram-verify": 2 + 1 + 8, "decode-steps": 4, "dflash": 2 + 1 + 8 + 2 + 1}
    assert counts["after"] - counts["before"] >= want[request.node.callspec.id]
    assert CompileCounter.count() == counts["after"]
    with pytest.raises(ValueError, match="workers"):
        llm.warmup(max_len=128, workers=0)


def test_several_decode_steps_per_call_give_the_tokens_of_single_steps(tiny_f32):
    """`num_scheduler_steps=4`: rows feed back their own tokens inside one call. Against the
    single-step fixture: greedy and seeded sampled rows, stop strings and stop ids mid-call,
    max_tokens that are not multiples of 4, more requests than slots (rows join between
    calls), a log-probability request (single steps) and a follow-up turn reading prefix-cache
    pages that fused steps named."""
    llm = aj.LLM(
        "smollm2-135m", dtype="float32", kv_cache_dtype="fp32", max_model_len=640, max_num_seqs=4,
        num_pages=120, max_prefill_chunk=64, progress=False, _cache_fill_value=float("nan"),
        num_scheduler_steps=4, enable_prefix_caching=True, **TINY,
    )  # fmt: skip
    greedy = [aj.SamplingParams(max_tokens=5 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(len(PROMPTS))]
    sampled = [
        aj.SamplingParams(max_tokens=13, temperature=0.9, top_p=0.9, top_k=50, seed=i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    stopping = [aj.SamplingParams(max_tokens=40, temperature=0.0, stop=[" the", "\n"], stop_token_ids=[11])] * 3
    for prompts, params in ((PROMPTS, greedy), (PROMPTS, sampled), (PROMPTS[:3], stopping)):
        want = tiny_f32.generate(prompts, params, use_tqdm=False)
        got = llm.generate(prompts, params, use_tqdm=False)
        for w, g in zip(want, got, strict=True):
            assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert llm.engine.num_multi_steps > 0

    def with_logprobs(x):  # rows that want log probabilities: single steps
        seqs = [x.engine.add_request(x.tokenizer.encode(p), greedy[1], num_logprobs=2) for p in PROMPTS[:2]]
        while x.engine.has_unfinished():
            x.engine.step()
        return [s.output_ids for s in seqs], [[lp[0] for lp in s.logprobs] for s in seqs]

    fused = llm.engine.num_multi_steps
    (got_ids, got_lp), (want_ids, want_lp) = with_logprobs(llm), with_logprobs(tiny_f32)
    assert got_ids == want_ids and len(got_lp[0]) == len(want_ids[0])
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-4)
    assert llm.engine.num_multi_steps == fused
    conversation = [{"role": "user", "content": PROMPTS[3]}]
    first = llm.chat(conversation, greedy[-1], use_tqdm=False)[0]
    follow_up = [*conversation, {"role": "assistant", "content": first.text}, {"role": "user", "content": "Why?"}]
    hits = llm.engine.scheduler.num_prefix_hits
    got, want = (x.chat(follow_up, greedy[-1], use_tqdm=False)[0] for x in (llm, tiny_f32))
    assert llm.engine.scheduler.num_prefix_hits > hits
    assert got.token_ids == want.token_ids
    with pytest.raises(ValueError, match="speculative"):
        aj.LLM(
            "smollm2-135m", max_model_len=64, num_pages=8, progress=False, speculative="ngram", num_scheduler_steps=2
        )


def test_fused_decode_steps_update_the_pool_in_place(tiny_f32):
    """Inside `decode_steps`' loop the previous step's keys/values are written before the next
    forward pass reads the pool; in the other order XLA copied each whole pool every step
    (two `copy` ops per pool in the optimized HLO)."""
    engine = tiny_f32.engine
    tokens, batch, params = engine.runner.padding_rows(2, True)
    args, static = engine.runner.steps_args(tokens, batch, params, np.zeros(2, np.int32), 8, True)
    hlo = decode_steps.lower(*args, **{**static, "num_steps": 4}).compile().as_text()
    pool = "f32[" + ",".join(map(str, engine.cache.k[0].shape)) + "]"
    assert any(pool in line and "scatter" in line for line in hlo.splitlines())  # the in-place write
    assert [line for line in hlo.splitlines() if pool in line and " copy(" in line] == []


def test_device_seq_lens_track_the_host_after_each_step(tiny_f32):
    engine = tiny_f32.engine
    seqs = [engine.add_request(tiny_f32.tokenizer.encode(p), GREEDY) for p in PROMPTS[:3]]
    for _ in range(4):
        engine.step()
        lens = np.asarray(engine.cache.seq_lens)
        for s in seqs:
            if s.slot >= 0:
                assert lens[s.slot] == s.num_cached
    while engine.has_unfinished():
        engine.step()
    assert all(s.finish_reason == "length" for s in seqs)
