"""Step-shape records (`Engine.step_shapes`, `Engine.precompile`) and their files
(`aither_jax.compile.shape_file`): what one run compiled, compiled up front by the next."""

from __future__ import annotations

import json
import logging

import pytest

import aither_jax as aj
from aither_jax.compile import shape_file
from aither_jax.compile.counter import CompileCounter
from tests.conftest import TINY

PROMPTS = [
    "Tell me about the sea and the wind that moves across it at night. " * 6,
    "Why is the sky blue?",
    "Write a poem about cats, dogs and birds.",
]
GREEDY = aj.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SAMPLED = aj.SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)


def _workload(llm: aj.LLM) -> list[list[int]]:
    """Prefill chunks with and without stored pages, greedy and sampled decode rows, and a
    follow-up prompt that hits the prefix cache mid-page (a page copy and a sink refill)."""
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    follow_up = first[1].prompt_token_ids + first[1].token_ids + llm.tokenizer.encode(" Say more.")
    second = llm.generate([follow_up, PROMPTS[2]], [GREEDY, SAMPLED], use_tqdm=False)
    return [o.token_ids for o in first + second]


@pytest.mark.parametrize(
    "extra, kinds, pages",
    [
        (
            {"kv_cache_dtype": "tq4-s2", "enable_prefix_caching": True, **TINY},
            {"forward", "sinks", "copy", "summaries"},
            67,
        ),
        (
            {"kv_cache_dtype": "fp32", "speculative": {"method": "dflash", "num_speculative_tokens": 7}, **TINY},
            {"forward", "verify", "draft"},
            71,
        ),
        ({"kv_cache_dtype": "fp32", "num_scheduler_steps": 4, **TINY}, {"forward", "steps"}, 75),
    ],
    ids=["turboquant-sinks-copies", "dflash", "fused-steps"],
)
def test_a_run_precompiled_from_recorded_shapes_compiles_nothing(tmp_path, stand_in_draft, extra, kinds, pages):
    """Engine A runs a workload and records its shapes (every kind it ran, `on_new_shape`
    told once per shape); through a file, engine B compiles them on 2 threads; the same
    workload on B then compiles nothing and gives A's tokens. The engines differ in pool size,
    so B shares no executable with A (nor with other tests: the sizes are unique to this test).
    Then A compiles its shapes for a larger pool (`precompile_pool`), grows to it and runs the
    workload again, compiling nothing."""
    if "speculative" in extra:
        extra = {**extra, "speculative": {**extra["speculative"], "model": stand_in_draft}}
    settings = dict(dtype="float32", max_model_len=320, max_num_seqs=4, max_prefill_chunk=64, progress=False, **extra)
    a = aj.LLM("smollm2-135m", num_pages=pages, **settings)
    told: list[dict] = []
    a.engine.on_new_shape = told.append
    want = _workload(a)
    shapes = a.engine.step_shapes()
    assert told == shapes
    assert {s["kind"] for s in shapes} == kinds
    forward = [s for s in shapes if s["kind"] in ("forward", "steps")]
    assert {s["greedy"] for s in forward} == {True, False}
    chunks = [s for s in shapes if s["kind"] == "forward" and s["tokens"] > 1]
    assert {s["pages"] > 0 for s in chunks} == {True, False}  # prefill chunks with and without stored pages

    path = tmp_path / "shapes.json"
    shape_file.save(path, shapes, recorded_with={"num_pages": pages})
    assert json.loads(path.read_text())["recorded_with"] == {"num_pages": pages}
    b = aj.LLM("smollm2-135m", num_pages=pages + 2, **settings)
    before = CompileCounter.count()
    assert b.engine.precompile(shape_file.load(path), workers=2) == len(shapes)
    assert CompileCounter.count() > before
    assert b.engine.step_shapes() == shapes
    told_b: list[dict] = []
    b.engine.on_new_shape = told_b.append
    compiled = CompileCounter.count()
    assert _workload(b) == want
    assert CompileCounter.count() == compiled
    assert told_b == []  # nothing new to add to a shapes file

    # A's steps and its resize compiled ahead for a larger pool (over abstract pools, the
    # draft's included): the resize and the workload after it, on an empty prefix cache as at
    # first, compile nothing.
    if a.engine.scheduler.prefix_cache is not None:
        a.engine.scheduler.prefix_cache.clear()
    assert a.engine.precompile_pool(pages + 4) == len(shapes)
    compiled = CompileCounter.count()
    assert a.engine.resize_pool(pages + 4) == pages + 4
    assert _workload(a) == want
    assert CompileCounter.count() == compiled


def test_precompile_rejects_malformed_records(llm_f32):
    engine = llm_f32.engine
    good = {"kind": "forward", "rows": 1, "tokens": 1, "pages": 8, "logits": "none", "greedy": True, "taps": []}
    good["shared_pages"] = 0
    bad = [
        ([7], "expected an object"),
        ([{"kind": "prefill"}], "kind must be one of"),
        ([{k: v for k, v in good.items() if k != "pages"}], "missing 'pages'"),
        ([{**good, "rows": 0}], "bad rows 0"),
        ([{**good, "rows": True}], "bad rows True"),
        ([{**good, "pages": "8"}], "bad pages '8'"),
        ([{**good, "greedy": 1}], "bad greedy 1"),
        ([{**good, "logits": "some"}], "bad logits 'some'"),
        ([{**good, "taps": [-1]}], r"bad taps \[-1\]"),
        ([{"kind": "verify", "rows": 1, "tokens": 4, "pages": 8, "logits": "none", "greedy": True}], "bad logits"),
        ([good, {"kind": "copy"}], "step shape 1 \\(copy\\): missing 'pages'"),
    ]
    before = CompileCounter.count()
    for records, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.precompile(records, workers=1)
    with pytest.raises(ValueError, match="workers"):
        engine.precompile([good], workers=0)
    assert CompileCounter.count() == before  # a bad record stops the call before any compile


def test_precompile_skips_shapes_this_engine_cannot_run(llm_f32, caplog):
    """Records from a server with other settings: each is skipped with a warning naming why."""
    engine = llm_f32.engine
    forward = {"kind": "forward", "rows": 1, "tokens": 1, "pages": 8, "logits": "none", "greedy": True, "taps": []}
    forward["shared_pages"] = 0
    unfit = [
        ({**forward, "rows": 3}, "power of two"),
        ({**forward, "rows": 2 * engine.max_num_seqs}, "power of two"),
        ({**forward, "tokens": 2 * engine.max_prefill_chunk}, "tokens per row"),
        ({**forward, "pages": engine.max_pages_per_seq + 1}, "more pages than a sequence holds"),
        ({**forward, "taps": [1, engine.cfg.num_layers]}, "not layers of this model"),
        ({"kind": "steps", "rows": 1, "pages": 8, "greedy": True}, "num_scheduler_steps > 1"),
        ({"kind": "verify", "rows": 1, "tokens": 4, "pages": 8, "logits": False, "greedy": True}, "speculative"),
        ({"kind": "sinks", "rows": 1, "tokens": 16}, "no sink tokens"),
        ({"kind": "copy", "pages": 1 << 19}, "more pages than the pool's"),
        ({"kind": "summaries", "pages": 4, "layer": 99}, "not a layer of this model"),
        ({"kind": "summaries", "pages": 4, "layer": 0}, "taken by the eviction advisor and bounded residency"),
    ]
    before, known = CompileCounter.count(), engine.step_shapes()
    with caplog.at_level(logging.WARNING, logger="aither_jax.core.warmup"):
        assert engine.precompile([r for r, _ in unfit], workers=1) == 0
    assert CompileCounter.count() == before and engine.step_shapes() == known
    warnings = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warnings) == len(unfit)
    for warning, (_, why) in zip(warnings, unfit, strict=True):
        assert why in warning, warning


def test_precompile_takes_every_forward_the_engine_runs_whatever_its_taps(llm_f32):
    """`forward` runs with no taps (scoring) or any layers' taps (a draft's training data) on any
    engine, so their records compile wherever they were recorded, not only with the taps of the
    engine's own draft."""
    engine = llm_f32.engine
    ids = list(range(100, 137))
    for taps in ((), (1, 14, 27)):
        engine.forward(ids, taps=taps, logits=True)
        records = [r for r in engine.step_shapes() if r["kind"] == "forward" and r["taps"] == list(taps)]
        assert records and engine.precompile(records, workers=1) == len(records)  # none skipped


def test_shape_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "shapes.json"
    records = [{"kind": "copy", "pages": 4}, {"kind": "sinks", "rows": 2, "tokens": 16}]
    shape_file.save(path, records, recorded_with={"max_num_seqs": 2})
    assert shape_file.load(path) == records
    shape_file.save(path, records[:1])  # replaces the file whole, leaves no temporary behind
    assert shape_file.load(path) == records[:1]
    assert [p.name for p in tmp_path.iterdir()] == ["shapes.json"]
    assert path.stat().st_mode & 0o777 == shape_file.FILE_MODE

    def fails(text: str | None, message: str) -> None:
        if text is not None:
            path.write_text(text)
        with pytest.raises(ValueError, match=message) as e:
            shape_file.load(path)
        assert str(path) in str(e.value)

    fails("{not json", "cannot read")
    fails(json.dumps([records]), "not a step-shapes file")
    fails(json.dumps({"format": "something else", "version": 1, "shapes": []}), "not a step-shapes file")
    fails(json.dumps({"format": shape_file.FORMAT, "version": 99, "shapes": []}), "version 99")
    fails(json.dumps({"format": shape_file.FORMAT, "version": 1, "shapes": {}}), "must be a list")
    path.write_bytes(b"\xff\xfe")
    fails(None, "cannot read")
    path.unlink()
    fails(None, "cannot read")


def test_the_first_request_shapes_cover_a_first_chat_request_and_its_follow_up():
    """`serve --compile-first-requests` compiles these records before it listens: a short chat
    request (sampled, as the API's default) and a follow-up on its cached pages (greedy) must
    run no other shape."""
    llm = aj.LLM(
        "smollm2-135m", dtype="float32", kv_cache_dtype="tq4-s2", max_model_len=256, max_num_seqs=2, num_pages=53,
        enable_prefix_caching=None, progress=False, **TINY,
    )  # fmt: skip
    records = llm.engine.compiler.first_request_shapes()
    assert len(records) == len({json.dumps(r, sort_keys=True) for r in records})
    first = [{"role": "user", "content": "Name three colors."}]
    out = llm.chat([first], aj.SamplingParams(max_tokens=8, seed=1))[0]
    follow_up = [*first, {"role": "assistant", "content": out.text}, {"role": "user", "content": "And three more?"}]
    llm.chat([follow_up], aj.SamplingParams(max_tokens=8, temperature=0.0))
    ran = llm.engine.step_shapes()
    assert {r["kind"] for r in ran} >= {"forward", "sinks"}  # the follow-up hit the cache
    assert [r for r in ran if r not in records] == []
    with pytest.raises(ValueError, match="prompt_tokens"):
        llm.engine.compiler.first_request_shapes(prompt_tokens=0)
