"""Two models resident in one process (two-block random-weight stand-ins of SmolLM2 and
Gemma-3): the planner's zones equal what the engines allocate, each model's greedy output with
both resident equals its output alone, no prefix is shared across models, a route change
compiles nothing, and budgets that do not fit are refused."""

from __future__ import annotations

import pytest

import aither_jax as aj
from aither_jax.compile.counter import CompileCounter
from aither_jax.fleet.fleet import Fleet
from aither_jax.fleet.planner import PlanError

MODELS = ("smollm2-135m", "gemma3-270m")
SETTINGS = dict(
    dtype="float32", kv_cache_dtype="fp32", max_model_len=128, max_num_seqs=2, max_prefill_chunk=64, progress=False,
    _num_layers=2,
)  # fmt: skip
GREEDY = aj.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def fleet() -> Fleet:
    return Fleet(list(MODELS), memory_budget_gib=3.0, **SETTINGS)


def test_the_planned_zones_are_what_the_engines_allocate(fleet):
    allocated = fleet.allocated()
    for model in MODELS:
        for zone in ("weights", "kv_pool"):
            assert fleet.plan.zone(model, zone).bytes == allocated[(model, zone)], (model, zone)
        assert fleet.llms[model].engine.scheduler.num_usable_pages == fleet.plan.num_pages[model] - 1
    assert fleet.plan.device_bytes <= fleet.plan.budget
    # Gemma-3-270M has more parameters: it is the heavy model.
    assert (fleet.router.light, fleet.router.heavy) == MODELS


def test_each_model_with_both_resident_answers_as_alone_and_shares_no_prefix(fleet):
    both = {m: fleet.generate([PROMPT, PROMPT], GREEDY, model=m) for m in MODELS}
    for m in MODELS:
        assert both[m][0].model == m
        assert both[m][1].num_cached_tokens == 0  # prefix caching is off here; nothing crosses models either
        alone = aj.LLM(m, **SETTINGS, num_pages=fleet.plan.num_pages[m]).generate([PROMPT], GREEDY)[0]
        assert both[m][0].token_ids == alone.token_ids, m


def test_a_route_change_compiles_nothing(fleet):
    fleet.generate([PROMPT], GREEDY, model=MODELS[0])
    fleet.generate([PROMPT], GREEDY, model=MODELS[1])
    before = CompileCounter.count()
    for m in (*MODELS, *MODELS):
        fleet.generate([PROMPT], GREEDY, model=m)
    assert CompileCounter.count() == before


def test_auto_routes_by_effort(fleet):
    easy = [{"role": "user", "content": "hi there!"}]
    hard = [{"role": "user", "content": "Prove that the square root of 2 is irrational."}]
    with pytest.raises(ValueError, match="not served"):
        fleet.chat([easy], GREEDY, model="llama")
    # Gemma's file ships no chat template: its family's turn format is used.
    outs = fleet.chat([easy, hard], GREEDY, model="auto")
    assert [o.model for o in outs] == list(MODELS)
    assert outs[1].prompt_token_ids[:2] == [2, 105]  # <bos><start_of_turn>


def test_budgets_that_do_not_fit_are_refused():
    with pytest.raises(PlanError, match="does not hold the weights of gemma3-270m"):
        Fleet(list(MODELS), memory_budget_gib=0.5, **SETTINGS)
    with pytest.raises(ValueError, match="memory budget"):
        Fleet(list(MODELS), **SETTINGS)  # CPU: a budget is required
