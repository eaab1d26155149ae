"""The balloon in the server (serving/balloon.py): moves made on running engine loops through
`AsyncEngine.call`, after their new pool sizes compiled on a background thread where needed,
counted in both models' metrics and listed in the plan; `call` hands back results and errors
and refuses a stopped engine. Two-block stand-ins of both models."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

import aither_jax as aj
from aither_jax.fleet.balloon import Move
from aither_jax.fleet.fleet import Fleet, model_needs
from models.registry import load_model
from serving.async_engine import AsyncEngine, EngineDeadError
from serving.balloon import BalloonLoop
from serving.metrics import Metrics

MODELS = ("smollm2-135m", "gemma3-270m")
SETTINGS = dict(
    dtype="float32", kv_cache_dtype="fp32", max_model_len=128, max_num_seqs=4, max_prefill_chunk=64, progress=False,
    enable_prefix_caching=True, _num_layers=2,
)  # fmt: skip
LONG = " ".join(f"Item {i} of the list is a word." for i in range(12))


@pytest.fixture(scope="module")
def loops():
    handles = {m: load_model(m, "float32", num_layers=2) for m in MODELS}  # kept: the fleet loads these again
    needs = [model_needs(m, handles[m], SETTINGS) for m in MODELS]
    fixed = sum(n.weight_bytes + n.activation_bytes + n.kv_fixed_bytes for n in needs)
    budget = fixed + 16 * sum(n.page_bytes for n in needs)  # about 16 pages per pool
    fleet = Fleet(list(MODELS), memory_budget_gib=budget / (1 << 30), balloon=True, min_move_pages=1, **SETTINGS)
    engines = {m: AsyncEngine(fleet.llms[m].engine, Metrics(m), max_waiting=8) for m in MODELS}
    for e in engines.values():
        e.start()
    yield fleet, engines, BalloonLoop(fleet, engines)
    for e in engines.values():
        e.stop()


def test_moves_run_between_steps_of_live_engines_and_are_counted(loops):
    fleet, engines, balloon = loops
    light, heavy = MODELS
    planned = dict(fleet.plan.num_pages)
    engine = fleet.llms[light].engine
    params = aj.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ids = [engine.tokenizer.encode(f"{i}: {LONG}") for i in range(4)]
    # Queued on the loop thread; two of them wait for pages while the first two run.
    engines[light].call(lambda: [engine.add_request(p, params) for p in ids])
    fleet.prepare_moves = False  # at once: the loop may have run a step, and the wait be over after a compile
    lend = balloon.step()
    fleet.prepare_moves = True
    assert (lend.lender, lend.borrower, lend.reason) == (heavy, light, "demand") and lend.borrower_pages > 0
    assert engines[light].call(lambda: engine.num_pages) == planned[light] + lend.borrower_pages
    while engines[light].call(engine.has_unfinished):
        time.sleep(0.05)
    back = balloon.step()  # both idle: nothing to compile first
    assert (back.lender, back.borrower, back.reason) == (light, heavy, "return") and back.compile_s == 0
    assert fleet.plan.num_pages == planned == {m: fleet.llms[m].engine.num_pages for m in MODELS}
    assert [m["reason"] for m in fleet.plan.to_json()["moves"]] == ["demand", "return"]
    lent = f'aither:kv_balloon_moves_total{{direction="lent",model_name="{heavy}",reason="demand"}}'
    assert f"{lent} {float(lend.lender_pages)}" in engines[heavy].metrics.render()
    assert balloon.step() is None  # back at the plan, nobody waiting


class PreparedFleet:
    """The fleet calls `BalloonLoop.step` makes, with a move due whose sizes need compiling
    first; `prepare` waits for `release`, and `sizes` changes the move load asks for."""

    prepare_moves = True

    def __init__(self):
        self.release, self.prepared, self.applied = threading.Event(), [], []
        self.move = Move("b", "a", 4, 4, 4096, "demand")

    def next_move(self, run):
        return self.move

    def ready(self, move):
        return move in self.prepared

    def prepare(self, move):
        self.release.wait(10)
        self.prepared.append(move)

    def apply(self, move, run):
        self.applied.append(move)
        return move


def test_a_move_waits_for_its_compilation_on_a_background_thread_and_is_not_held_back_twice():
    fleet = PreparedFleet()
    engines = {m: SimpleNamespace(metrics=Metrics(m)) for m in "ab"}
    balloon = BalloonLoop(fleet, engines)
    assert balloon.step() is None and balloon.preparing  # compiling; the engines go on
    assert balloon.step() is None and not fleet.applied
    fleet.release.set()
    while balloon.preparing:
        time.sleep(0.01)
    assert balloon.step() == fleet.move and fleet.applied == [fleet.move]  # the move it compiled for
    # Load changed the sizes while the next move compiled: made anyway, not compiled again.
    fleet.move = Move("b", "a", 8, 8, 8192, "demand")
    fleet.release.clear()
    assert balloon.step() is None and balloon.preparing
    fleet.release.set()
    while balloon.preparing:
        time.sleep(0.01)
    fleet.move = Move("b", "a", 6, 6, 6144, "demand")
    assert balloon.step() == fleet.move and len(fleet.prepared) == 2 and len(fleet.applied) == 2
    assert 'aither:kv_balloon_moves_total{direction="borrowed",model_name="a",reason="demand"} 10.0' in (
        engines["a"].metrics.render()
    )


def test_call_returns_results_and_errors_and_refuses_a_stopped_engine():
    e = AsyncEngine(aj.LLM(MODELS[0], **SETTINGS).engine, Metrics(MODELS[0]), max_waiting=8)
    with pytest.raises(EngineDeadError):
        e.call(lambda: None)  # not started
    e.start()
    assert e.call(lambda: e.engine.num_pages) == e.engine.num_pages
    with pytest.raises(ZeroDivisionError):
        e.call(lambda: 1 / 0)
    assert e.alive  # a failed call does not stop the loop
    e.stop()
    with pytest.raises(EngineDeadError):
        e.call(lambda: None)
