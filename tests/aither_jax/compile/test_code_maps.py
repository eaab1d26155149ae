"""The mapping budget for compiled code (aither_jax.compile.code_maps): compiled steps are dropped when
the process nears its memory-mapping limit, decoding goes on with the same tokens, and warm-up
stops short of the limit instead of crashing the process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aither_jax.compile import code_maps
from aither_jax.compile.code_maps import CodeMapBudget

ROOT = Path(__file__).resolve().parents[3]
LINUX = os.path.exists(code_maps.MAPS_PATH) and os.path.exists(code_maps.LIMIT_PATH)

# A fresh interpreter, since dropping compiled code clears JAX's caches for the whole process:
# decodes twice, then again with a budget over its limit until the first release (so the next
# step drops the compiled steps), warms up under a spent budget and under one its own shapes
# fill, and tries a limit too low to reach.
CHILD = """
import json, logging
import jax
import aither_jax as aj
from aither_jax.compile.code_maps import CodeMapBudget, map_count
from aither_jax.compile.counter import CompileCounter
logging.basicConfig(level=logging.WARNING)

class OnceOver(CodeMapBudget):  # over its limit until the first release, then far below it
    def release_if_over(self, scope=None):
        released = super().release_if_over(scope)
        if released:
            self.limit = 10**9
        return released

llm = aj.LLM("smollm2-135m", dtype="float32", kv_cache_dtype="fp32", max_model_len=128, max_num_seqs=2,
             num_pages=20, progress=False)
params = aj.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
eng = llm.engine
first = llm.generate(["The capital of France is"], params)[0].token_ids
steady = eng.num_compiles
again = llm.generate(["The capital of France is"], params)[0].token_ids
recompiles_unbudgeted = eng.num_compiles - steady
eng.code_budget = OnceOver(limit=map_count() // 2)
before = eng.num_compiles
budgeted = llm.generate(["The capital of France is"], params)[0].token_ids
out = {
    "same": first == again == budgeted,
    "recompiles_unbudgeted": recompiles_unbudgeted,
    "recompiles_after_release": eng.num_compiles - before,
    "releases": eng.code_budget.num_releases,
}
# Over the limit before a warm-up (earlier shapes' code): the warm-up drops it, then compiles.
eng.code_budget = OnceOver(limit=map_count() // 2)
out["warmed_after_release"] = eng.warmup(max_len=128, sampling=False, workers=1)
out["warm_releases"] = eng.code_budget.num_releases

class FullOnceCompiled(CodeMapBudget):  # reaches its limit as soon as the warm-up compiles a shape
    def __init__(self):
        super().__init__(limit=10**9)
        self.start = CompileCounter.count()

    def over(self):
        return CompileCounter.count() > self.start

jax.clear_caches()
eng.code_budget = FullOnceCompiled()
out["warmed_filling_budget"] = eng.warmup(max_len=128, sampling=False, workers=1)
# The same for recorded shapes (`precompile`, what `serve --compile-shapes` runs).
eng.code_budget = OnceOver(limit=map_count() // 2)
recorded = eng.step_shapes()
out["num_recorded"] = len(recorded)
out["precompiled_after_release"] = eng.precompile(recorded, workers=1)
out["precompile_releases"] = eng.code_budget.num_releases
tiny = CodeMapBudget(limit=10)  # below what any process holds without compiled code
out["tiny"] = [tiny.release_if_over(), tiny.release_if_over(), tiny.limit]
print(json.dumps(out))
"""


@pytest.mark.skipif(not LINUX, reason="needs /proc (Linux)")
def test_steps_past_the_budget_drop_compiled_code_and_decode_the_same():
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["same"]
    assert out["recompiles_unbudgeted"] == 0  # warm shapes run from the jit cache
    # Over the limit (by more than the model's code holds), the first step dropped the model's
    # compiled steps, then every other one; they compiled again.
    assert out["releases"] == 1 and out["recompiles_after_release"] > 0
    assert "dropping the compiled steps of smollm2-135m left" in proc.stderr and "dropped them all" in proc.stderr
    # A warm-up that starts over the budget drops the code compiled before it and compiles its
    # shapes; one whose own shapes fill the budget stops short of them, with a warning.
    assert out["warm_releases"] == 1 and out["warmed_after_release"] > 1
    assert 1 <= out["warmed_filling_budget"] < out["warmed_after_release"]
    assert f"warm-up stopped after {out['warmed_filling_budget']} of {out['warmed_after_release']}" in proc.stderr
    assert out["precompile_releases"] == 1 and out["precompiled_after_release"] == out["num_recorded"] > 0
    # A limit that clearing cannot get under is given up after one try, not retried every step.
    assert out["tiny"] == [True, False, None] and "no further clearing" in proc.stderr


@pytest.mark.skipif(not LINUX, reason="needs /proc (Linux)")
def test_the_limit_and_count_come_from_proc():
    with open(code_maps.LIMIT_PATH, encoding="ascii") as f:
        assert code_maps.map_limit() == int(f.read())
    assert code_maps.map_count() > 10
    budget = CodeMapBudget()
    assert budget.limit == code_maps.map_limit()
    assert budget.threshold == int(budget.limit * code_maps.HIGH_WATER)
    assert not budget.over()  # this test process is far below the limit
    assert not budget.release_if_over() and budget.num_releases == 0


def test_without_a_known_limit_nothing_is_dropped(monkeypatch):
    monkeypatch.setattr(code_maps, "LIMIT_PATH", "/nonexistent/max_map_count")
    budget = CodeMapBudget()
    assert budget.limit is None and budget.threshold is None
    assert not budget.over() and not budget.release_if_over()


@pytest.mark.parametrize("high_water", [0.0, 1.0, -0.5, 2])
def test_bad_high_water(high_water):
    with pytest.raises(ValueError, match="high_water"):
        CodeMapBudget(limit=1000, high_water=high_water)


@pytest.mark.parametrize("low_water", [0.0, 0.8, -1])
def test_bad_low_water(low_water):
    with pytest.raises(ValueError, match="low_water"):
        CodeMapBudget(limit=1000, high_water=0.7, low_water=low_water)
