"""Two models resident in one process (two-block random-weight stand-ins of SmolLM2 and
Gemma-3): the planner's zones equal what the engines allocate, each model's greedy output with
both resident equals its output alone, no prefix is shared across models, a route change
compiles nothing, one model's code release keeps the other's steps compiled, and budgets that do
not fit are refused."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest

import aither_jax as aj
from aither_jax.compile import code_maps
from aither_jax.compile.code_maps import HIGH_WATER, MAPS_PATH, CodeMapBudget, map_count
from aither_jax.compile.counter import CompileCounter
from aither_jax.fleet.balloon import Move
from aither_jax.fleet.fleet import Fleet, base_model_note
from aither_jax.fleet.planner import PlanError
from aither_jax.kv.tiers import GIB

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


class OverOnce(CodeMapBudget):
    """Over its limit until its first release, then far below it."""

    def release_if_over(self, scope=None):
        released = super().release_if_over(scope)
        if released:
            self.limit = 10**9
        return released


@pytest.mark.skipif(not os.path.exists(MAPS_PATH), reason="needs /proc (Linux)")
def test_one_models_code_release_keeps_the_other_models_steps_compiled(fleet, caplog):
    light, heavy = (fleet.llms[m].engine for m in MODELS)
    first = {m: fleet.generate([PROMPT], GREEDY, model=m)[0].token_ids for m in MODELS}  # both warm
    shared = light.code_budget
    try:
        # Over by less than the light model's code holds: its next step drops its steps alone.
        count = map_count()
        limit = int((count - 10) / HIGH_WATER)
        light.code_budget = OverOnce(limit=limit, low_water=(count - 100) / limit)
        before = CompileCounter.count()
        with caplog.at_level(logging.WARNING, logger=code_maps.__name__):
            assert fleet.generate([PROMPT], GREEDY, model=MODELS[0])[0].token_ids == first[MODELS[0]]
        assert light.code_budget.num_releases == 1 and CompileCounter.count() > before  # compiled again
        assert f"dropped those of {light.compile_scope.name}," in caplog.text and "every model's" not in caplog.text
        before = CompileCounter.count()
        assert fleet.generate([PROMPT], GREEDY, model=MODELS[1])[0].token_ids == first[MODELS[1]]
        assert CompileCounter.count() == before  # the heavy model's steps stayed compiled
        # Over by more than the light model's code: every model's steps are dropped.
        light.code_budget = OverOnce(limit=map_count() // 2)
        with caplog.at_level(logging.WARNING, logger=code_maps.__name__):
            assert fleet.generate([PROMPT], GREEDY, model=MODELS[0])[0].token_ids == first[MODELS[0]]
        assert "dropping every model's" in caplog.text
        before = CompileCounter.count()
        assert fleet.generate([PROMPT], GREEDY, model=MODELS[1])[0].token_ids == first[MODELS[1]]
        assert CompileCounter.count() > before
    finally:
        light.code_budget = shared
    assert heavy.code_budget is shared


def test_auto_routes_by_effort(fleet):
    easy = [{"role": "user", "content": "hi there!"}]
    hard = [{"role": "user", "content": "Prove that the square root of 2 is irrational."}]
    with pytest.raises(ValueError, match="not served"):
        fleet.chat([easy], GREEDY, model="llama")
    # Gemma's file ships no chat template: its family's turn format is used.
    outs = fleet.chat([easy, hard], GREEDY, model="auto")
    assert [o.model for o in outs] == list(MODELS)
    assert outs[1].prompt_token_ids[:2] == [2, 105]  # <bos><start_of_turn>
    assert fleet.router.heavy == "gemma3-270m"  # the one with more parameters
    assert "base model not tuned for chat" in base_model_note("gemma3-270m", "smollm2-135m")  # logged at start
    assert base_model_note("smollm2-135m", "gemma3-270m") is None
    outs = fleet.generate(["hi there!", "hi there!"], GREEDY, model="auto", reasoning_effort="high")
    assert [o.model for o in outs] == ["gemma3-270m"] * 2
    # Token ids (and assembled Prompts) are one model's: they are not routed, only sent.
    with pytest.raises(ValueError, match="name the model"):
        fleet.generate([[1, 2, 3]], GREEDY, model="auto")
    one = fleet.generate(fleet.llms[MODELS[0]].tokenizer.encode("hi there!"), GREEDY, model=MODELS[0])
    assert len(one) == 1 and one[0].model == MODELS[0]  # a flat list of ids is one prompt


def test_a_stream_is_routed_as_chat_is_and_streams_that_models_reply(fleet):
    hard = [{"role": "user", "content": "Prove that the square root of 2 is irrational."}]
    stream = fleet.stream(hard, GREEDY)
    text = "".join(stream)
    routed = fleet.chat([hard], GREEDY)[0]
    assert stream.model == stream.output.model == routed.model == "gemma3-270m"
    assert text == routed.text and stream.output.token_ids == routed.token_ids
    easy = fleet.stream("hi there!", GREEDY)
    assert "".join(easy) == fleet.generate(["hi there!"], GREEDY, model=MODELS[0])[0].text
    assert easy.model == MODELS[0]
    with pytest.raises(ValueError, match="name the model"):
        fleet.stream([1, 2, 3], GREEDY)


def test_the_fleets_host_and_disk_tier_sizes_are_shared_by_kv_share(tmp_path, caplog):
    """Tier sizes given for the fleet are the process's: the models without a size of their own
    share them by `kv_share` (the disk tier's default 4 GiB too); a model's own size stands."""
    models = {MODELS[0]: {"kv_share": 3.0}, MODELS[1]: {"kv_disk_size": 0.5}}
    fl = Fleet(
        models, memory_budget_gib=3.0, kv_offloading_size=0.04, kv_cache_dir=str(tmp_path),
        enable_prefix_caching=True, **SETTINGS,
    )  # fmt: skip
    assert "a base model not tuned for chat" in caplog.text  # routing's heavy model, chosen by size
    host = {m: fl.plan.zone(m, "host_tier").bytes for m in MODELS}
    assert host == {MODELS[0]: int(0.03 * GIB), MODELS[1]: int(0.01 * GIB)}
    for m, disk_gib in zip(MODELS, (4.0, 0.5), strict=True):
        tiers = fl.llms[m].engine.tiers
        assert tiers.host.capacity == host[m] // tiers.page_bytes
        assert tiers.disk.capacity == int(disk_gib * GIB) // tiers.page_bytes, m


def test_budgets_that_do_not_fit_are_refused(monkeypatch):
    with pytest.raises(PlanError, match="does not hold the weights of gemma3-270m"):
        Fleet(list(MODELS), memory_budget_gib=0.5, **SETTINGS)
    with pytest.raises(ValueError, match="memory budget"):
        Fleet(list(MODELS), **SETTINGS)  # CPU: a budget is required
    monkeypatch.setattr("aither_jax.fleet.fleet.load_model", lambda *a, **k: pytest.fail("loaded a model"))
    for step in (0, 2.5, True):  # refused before any model loads
        with pytest.raises(ValueError, match="balloon_step must be a whole number of pages"):
            Fleet(list(MODELS), memory_budget_gib=4, balloon=True, balloon_step=step, **SETTINGS)


# The balloon's settings: four sequences of up to 8 pages each, prefix caching on (a shrink gives
# back cached pages).
BALLOON = dict(SETTINGS, max_num_seqs=4, enable_prefix_caching=True)
LONG = " ".join(f"Item {i} of the list is a word." for i in range(12))  # ~100 tokens: 8 pages with its output


def test_the_balloon_lends_idle_pages_to_a_waiting_model_and_takes_them_back(fleet):
    """A budget with room for about 16 pages per pool; four full-length requests to SmolLM2
    need 32. Before they run, Gemma's idle pages above its floor move to SmolLM2 (as bytes:
    pages of the two formats differ in size), whose batch then equals a run on an engine built
    with the grown pool. A request to Gemma afterwards takes them back to the plan. After each
    move the zones equal what the engines hold, within the budget."""
    from aither_jax.fleet.fleet import model_needs
    from models.registry import load_model

    needs = [model_needs(m, load_model(m, "float32", num_layers=2), BALLOON) for m in MODELS]
    fixed = sum(n.weight_bytes + n.activation_bytes + n.kv_fixed_bytes for n in needs)
    budget = fixed + 16 * sum(n.page_bytes for n in needs)
    fl = Fleet(list(MODELS), memory_budget_gib=budget / (1 << 30), balloon=True, min_move_pages=1, **BALLOON)
    planned = dict(fl.plan.num_pages)
    light, heavy = MODELS

    def check_zones():
        allocated = fl.allocated()
        for m in MODELS:
            assert fl.plan.zone(m, "kv_pool").bytes == allocated[(m, "kv_pool")], m
            assert fl.plan.num_pages[m] == fl.llms[m].engine.num_pages, m
        assert fl.plan.device_bytes <= fl.plan.budget

    params = aj.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [f"{i}: {LONG}" for i in range(4)]
    outs = fl.generate(prompts, params, model=light)
    (lend,) = fl.moves
    assert (lend.lender, lend.borrower, lend.reason) == (heavy, light, "demand")
    assert fl.llms[heavy].engine.num_pages == planned[heavy] - lend.lender_pages >= fl.needs[heavy].min_pages
    grown = planned[light] + lend.borrower_pages
    assert fl.llms[light].engine.num_pages == grown > planned[light]
    for m in MODELS:  # both on their grids: the plan plus whole steps (an eighth of it, here)
        assert fl.balloon_step[m] == max(planned[m] // 8, 1), (planned, fl.balloon_step)
        assert (fl.llms[m].engine.num_pages - planned[m]) % fl.balloon_step[m] == 0
    assert fl.balloon_step[light] > 1
    check_zones()
    alone = aj.LLM(light, **BALLOON, num_pages=grown).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]

    fl.generate([PROMPT], GREEDY, model=heavy)
    back = fl.moves[-1]
    assert (len(fl.moves), back.lender, back.borrower, back.reason) == (2, light, heavy, "return")
    # Neither move compiled first: the loan came before either model had run a step, and the
    # return's lender (SmolLM2) was idle, its borrower yet to run one.
    assert back.compile_s == 0 and lend.compile_s == 0
    assert {m: fl.llms[m].engine.num_pages for m in MODELS} == planned
    check_zones()
    # The same loan again: with both idle there is nothing to compile first. With a request
    # waiting, Gemma (which has run steps since it was small) compiles them for its smaller
    # pool; SmolLM2 left the grown pool with no shape seen since.
    again = Move(heavy, light, lend.lender_pages, lend.borrower_pages, lend.bytes, "demand")
    assert fl.ready(again) and fl.prepare(again) == 0
    gemma = fl.llms[heavy].engine
    waiting = gemma.add_request(gemma.tokenizer.encode(PROMPT), GREEDY)
    assert not fl.ready(again)
    assert fl.prepare(again) == len(gemma.step_shapes()) > 0
    assert fl.ready(again) and fl.prepare(again) == 0
    gemma.abort(waiting)
    # Moved while idle, Gemma compiles nothing for a pool of a size new to it; having left it,
    # that size is not ready for a Gemma with a request.
    other = dataclasses.replace(again, lender_pages=again.lender_pages - 1)
    out = fl.apply(other)
    fl.apply(Move(light, heavy, out.borrower_pages, out.lender_pages, 0, "return"))
    assert {m: fl.llms[m].engine.num_pages for m in MODELS} == planned
    waiting = gemma.add_request(gemma.tokenizer.encode(PROMPT), GREEDY)
    assert not fl.ready(other)
    gemma.abort(waiting)
    # A borrower whose device refuses the grown pools: the lender takes its pages back, and
    # the plan still equals what both hold.
    smol = fl.llms[light].engine
    real_resize = smol.store.resize

    def refuse(n):
        raise RuntimeError("RESOURCE_EXHAUSTED")

    smol.store.resize = refuse
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        fl.apply(again)
    smol.store.resize = real_resize
    assert {m: fl.llms[m].engine.num_pages for m in MODELS} == planned
    check_zones()


def test_the_draft_zones_are_what_the_drafter_allocates(stand_in_draft):
    """With a DFlash draft, its weights and its context pools are zones of their own."""
    speculative = {"method": "dflash", "model": stand_in_draft}
    drafting = Fleet({MODELS[0]: {"speculative": speculative}}, memory_budget_gib=1.0, **SETTINGS)
    allocated = drafting.allocated()
    for zone in ("weights", "kv_pool", "draft_weights", "draft_pool"):
        assert drafting.plan.zone(MODELS[0], zone).bytes == allocated[(MODELS[0], zone)] > 0, zone
