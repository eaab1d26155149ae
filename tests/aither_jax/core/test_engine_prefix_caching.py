"""Prefix caching on the real model: the same tokens with caching on and off, on a float32 cache
whose unused pages hold NaN (a read of a freed, evicted or uncopied page poisons the output)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import aither_jax as aj
from aither_jax.core.sequence import Sequence
from models.registry import load_model
from tests.conftest import TINY, give_key_transform

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
PAGE = 16
EXACT = dict(
    dtype="float32",
    kv_cache_dtype="fp32",
    max_model_len=256,
    max_num_seqs=4,
    page_size=PAGE,
    max_prefill_chunk=64,
    progress=False,
    _cache_fill_value=float("nan"),
    **TINY,
)
GREEDY = aj.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SAMPLED = aj.SamplingParams(max_tokens=12, temperature=0.8, seed=1234, ignore_eos=True)

# Six prompts over a ~85-token common prefix (5 pages). Arriving together, all but the first wait
# for the first to compute the prefix's pages, then start from them.
PREFIX = "Here is a list of facts about the planets of the solar system. " * 6
SHARED = [
    PREFIX + tail
    for tail in (
        "The largest planet is",
        "The smallest planet is",
        "The hottest planet is",
        "The planet with rings is",
        "Counting from the Sun, the third planet is",
        "Nobody lives on",
    )
]


@pytest.fixture(scope="module")
def cached() -> aj.LLM:
    return aj.LLM(MODEL, num_pages=64, enable_prefix_caching=True, **EXACT)


@pytest.fixture(scope="module")
def plain() -> aj.LLM:
    """The reference: no prefix caching, ample pages."""
    return aj.LLM(MODEL, num_pages=64, enable_prefix_caching=False, **EXACT)


@pytest.fixture(scope="module")
def tight() -> aj.LLM:
    """13 usable pages for 4 slots: four short prompts fit, their decodes do not."""
    return aj.LLM(MODEL, num_pages=14, enable_prefix_caching=True, **EXACT)


def generate(llm: aj.LLM, prompts: list[list[int]], params: aj.SamplingParams) -> list[Sequence]:
    """Runs token-id prompts to completion on the engine; returns their sequences."""
    seqs = [llm.engine.add_request(p, params) for p in prompts]
    while llm.engine.has_unfinished():
        llm.engine.step()
    return seqs


def token_ids(llm: aj.LLM, texts: list[str]) -> list[list[int]]:
    return [llm.tokenizer.encode(t) for t in texts]


def test_shared_prefix_outputs_match_without_caching_and_second_pass_hits(cached, plain):
    prompts = token_ids(plain, SHARED)
    common = len(os.path.commonprefix(prompts))
    assert common > 3 * PAGE
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    assert len({tuple(e) for e in expected}) == len(prompts)  # the tails matter
    sched = cached.engine.scheduler
    hits = [sched.num_prefix_hits]
    for _ in range(2):
        seqs = generate(cached, prompts, GREEDY)
        assert [s.output_ids for s in seqs] == expected
        hits.append(sched.num_prefix_hits)
    # First pass: every prompt but the first finds at least the common prefix's full pages.
    assert hits[1] - hits[0] >= (len(prompts) - 1) * (common // PAGE * PAGE)
    # Second pass: every full page of each prompt but its last token is found.
    assert hits[2] - hits[1] == sum((len(p) - 1) // PAGE * PAGE for p in prompts) >= len(prompts) * 3 * PAGE
    assert all(s.num_cached_prompt == (len(s.prompt_ids) - 1) // PAGE * PAGE for s in seqs)
    assert not cached.engine.has_unfinished() and sched.num_preemptions == 0


@pytest.fixture
def share_small_prefixes(monkeypatch):
    """Shared-prefix attention from 2 common pages in steps of 2 (normally 32 and 16), so the
    ~85-token prefix (5 full pages) is read once per decode step as 4 shared pages."""
    import aither_jax.core.runner as runner_module

    monkeypatch.setattr(runner_module, "MIN_SHARED_PAGES", 2)
    monkeypatch.setattr(runner_module, "SHARED_PAGE_STEP", 2)


def test_shared_prefix_attention_gives_the_uncached_outputs(cached, plain, share_small_prefixes):
    """Decode steps whose rows share cached prefix pages read them once for the batch and merge
    (NaN in every unused page); the tokens equal those of the engine without prefix caching,
    and turning the feature off stops the count."""
    prompts = token_ids(plain, SHARED)
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    eng = cached.engine
    for on in (True, False):
        eng.runner.shared_prefix_attention = on
        before = eng.runner.num_shared_prefix_steps
        try:
            seqs = generate(cached, prompts, GREEDY)
        finally:
            eng.runner.shared_prefix_attention = True
        assert [s.output_ids for s in seqs] == expected
        steps = eng.runner.num_shared_prefix_steps - before
        assert steps >= GREEDY.max_tokens - 1 if on else steps == 0


# The model's measured TurboQuant format (models.registry.SMOLLM2_KV) on the stand-in's two
# layers: their own widths, the fitted key transform, two sink tokens.
TINY_TURBOQUANT = "tq-k6v5-k5@0-v6@1-pc-s2"


def test_shared_prefix_attention_on_the_measured_turboquant_format(share_small_prefixes, tmp_path, monkeypatch):
    """The same with the model's measured TurboQuant format, whose layers take the
    rotated-domain path (shared pages read as one row holding every row's queries): on and
    off agree."""
    give_key_transform(monkeypatch, load_model(MODEL, EXACT["dtype"], num_layers=TINY["_num_layers"]), tmp_path)
    llm = aj.LLM(MODEL, **{**EXACT, "kv_cache_dtype": TINY_TURBOQUANT}, num_pages=64, enable_prefix_caching=True)
    assert llm.engine.cache.key_transform is not None and llm.engine.cache.num_sinks == 2
    prompts = token_ids(llm, SHARED[:4])
    outs = []
    for on in (True, False):
        llm.engine.runner.shared_prefix_attention = on
        outs.append([s.output_ids for s in generate(llm, prompts, GREEDY)])
    assert llm.engine.runner.num_shared_prefix_steps >= GREEDY.max_tokens - 1
    assert outs[0] == outs[1]


def test_follow_up_adopts_the_finished_partial_page_by_copy(cached, plain, monkeypatch):
    prompt = cached.tokenizer.encode("In a small village at the edge of a dark forest lived an old clockmaker who")
    num_out = next(m for m in (10, 11) if (len(prompt) + m - 1) % PAGE)  # end inside a page
    params = aj.SamplingParams(max_tokens=num_out, temperature=0.0, ignore_eos=True)
    (first,) = generate(cached, [prompt], params)
    assert first.output_ids == plain.generate([prompt], params)[0].token_ids
    follow_up = prompt + first.output_ids[:-1] + cached.tokenizer.encode(" One morning, a stranger")
    copies = []
    copy_pages = cached.engine.store.copy
    monkeypatch.setattr(cached.engine.store, "copy", lambda c: (copies.append(list(c)), copy_pages(c)))
    (second,) = generate(cached, [follow_up], GREEDY)
    assert second.num_cached_prompt == len(prompt) + num_out - 1
    assert len(copies) == 1 and len(copies[0]) == 1  # the partial page, copied once
    expected = plain.generate([follow_up], GREEDY)[0].token_ids
    assert second.output_ids == expected and len(set(expected)) > 1


def test_preemption_on_a_tight_pool_gives_the_ample_pool_outputs(tight, plain):
    texts = [
        "Write a long story about a robot who learns to paint the sky over the harbor every evening.",
        "Describe, step by step and in detail, how bread is baked in a wood-fired oven at dawn.",
        "Explain to a child why the moon changes its shape over the course of a month in the sky.",
        "List the rules of chess for a beginner, starting with how each of the pieces can move.",
    ]
    prompts = token_ids(plain, texts)
    params = aj.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    sched = tight.engine.scheduler
    pages = [sched.pages_needed(len(p)) for p in prompts]
    assert sum(pages) <= sched.num_usable_pages < sum(sched.pages_needed(len(p) + 40) for p in prompts)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    seqs = generate(tight, prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [s.output_ids for s in seqs] == expected
    assert all(len(set(e)) > 1 for e in expected)
    sched.prefix_cache.clear()
    assert sched.allocator.num_free == sched.num_usable_pages


def test_seeded_sampling_is_the_same_with_caching_on_and_off(cached, plain):
    prompts = token_ids(plain, SHARED[:4])
    expected = [o.token_ids for o in plain.generate(prompts, SAMPLED)]
    assert expected != [o.token_ids for o in plain.generate(prompts, GREEDY)]
    hits = cached.engine.scheduler.num_prefix_hits
    for _ in range(2):
        assert [s.output_ids for s in generate(cached, prompts, SAMPLED)] == expected
    assert cached.engine.scheduler.num_prefix_hits - hits >= 4 * 3 * PAGE


def test_sink_formats_refill_their_sinks_on_cached_pages(share_small_prefixes, monkeypatch):
    """A -s<n> format keeps the first n keys/values unquantized per slot, which cached pages do
    not carry: each admission on cached pages recomputes them (a sink refill), and every slot
    then holds the sinks that a full prefill of the same first tokens stores. Shared-prefix
    attention (sinks as a third part) on and off agree. Without the refills the slots admitted
    on cached pages keep their NaN fill and the outputs change."""
    kw = {**EXACT, "kv_cache_dtype": "tq4-s4", "num_pages": 64}
    plain = aj.LLM(MODEL, enable_prefix_caching=False, **kw)
    prompts = token_ids(plain, SHARED[:4])
    generate(plain, prompts, GREEDY)

    def sinks(llm: aj.LLM) -> np.ndarray:  # [slots, L, n, Hkv, Dh] float32 of the bf16 bits
        bits = np.asarray(llm.engine.cache.sink_k).astype(np.uint32) << 16
        return bits.view(np.float32)

    expected = sinks(plain)
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0
    cached = aj.LLM(MODEL, enable_prefix_caching=True, **kw)
    eng = cached.engine
    outs = []
    for on in (True, False):
        eng.runner.shared_prefix_attention = on
        refills, shared = eng.runner.num_sink_refills, eng.runner.num_shared_prefix_steps
        outs.append([s.output_ids for s in generate(cached, prompts, GREEDY)])
        assert eng.runner.num_sink_refills - refills >= len(prompts) - 1
        assert (
            eng.runner.num_shared_prefix_steps - shared >= GREEDY.max_tokens - 1
            if on
            else eng.runner.num_shared_prefix_steps == shared
        )
        np.testing.assert_allclose(sinks(cached), expected, rtol=1e-2, atol=1e-2)
    assert outs[0] == outs[1]
    assert aj.LLM(MODEL, enable_prefix_caching=None, **kw).engine.scheduler.prefix_cache is not None

    unfilled = aj.LLM(MODEL, enable_prefix_caching=True, **kw)
    monkeypatch.setattr(unfilled.engine.runner, "refill_sinks", lambda rows: None)
    assert [s.output_ids for s in generate(unfilled, prompts, GREEDY)] != outs[0]
    assert not np.isfinite(sinks(unfilled)).all()
