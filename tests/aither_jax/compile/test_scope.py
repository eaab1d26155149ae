"""Compile scopes (aither_jax.compile.scope): each scope dispatches a step function through a jit
object of its own, and releasing one scope's code leaves another's executables compiled."""

from __future__ import annotations

import threading

import numpy as np

from aither_jax.compile import code_maps
from aither_jax.compile import scope as scope_module
from aither_jax.compile.counter import CompileCounter
from aither_jax.compile.scope import CompileScope, current
from aither_jax.compile.services import services
from aither_jax.compile.step_jit import step_jit


@step_jit(static_argnames=("k",))
def scale(x, *, k):
    return x * k + 1


def test_a_release_drops_its_own_scopes_executables_and_no_others():
    a, b = CompileScope("a"), CompileScope("b")
    x = np.ones(4, np.float32)
    for s in (a, b):
        with s.active():
            assert current() is s
            np.testing.assert_array_equal(scale(x, k=2), 3)
    assert current() is None
    assert a.jit(scale) is a.jit(scale) and a.jit(scale) is not b.jit(scale)
    assert scale.jitted is not a.jit(scale)  # outside any scope: the process-wide jit object
    before = CompileCounter.count()
    assert a.release() and a.num_releases == 1 and b.num_releases == 0
    with b.active():
        np.testing.assert_array_equal(scale(x, k=2), 3)
        assert scale.lower(x, k=2).compile()(x) is not None  # `.lower` goes to the scope's jit object too
    assert CompileCounter.count() == before + 1  # b ran from its executable; lower().compile() compiled anew
    with a.active():
        np.testing.assert_array_equal(scale(x, k=2), 3)
    assert CompileCounter.count() == before + 2  # a's was dropped: it compiled again


def test_a_scope_is_active_on_its_own_thread_only():
    a = CompileScope("a")
    seen = []
    with a.active():
        thread = threading.Thread(target=lambda: seen.append(current()))
        thread.start()
        thread.join()
    assert seen == [None]


def test_engines_of_one_configuration_share_a_scope_and_other_configurations_do_not(tiny_f32, llm_f32):
    from aither_jax.core.engine import Engine

    again = Engine(tiny_f32.model, max_num_seqs=1, max_model_len=64, num_pages=6, kv_cache_dtype="fp32")
    assert again.compile_scope is tiny_f32.engine.compile_scope
    assert tiny_f32.engine.compile_scope is not llm_f32.engine.compile_scope
    assert services().scope(tiny_f32.model.config, "ignored") is tiny_f32.engine.compile_scope


def test_without_jaxs_cache_internals_a_scope_release_drops_nothing(monkeypatch):
    """A JAX that moved `clear_all_caches`: the release says it dropped nothing, and the code
    budget then clears every executable instead (code_maps.CodeMapBudget.release_if_over)."""
    a = CompileScope("a")
    x = np.ones(4, np.float32)
    with a.active():
        scale(x, k=3)
    monkeypatch.setattr(scope_module, "jax_util", None)
    before = CompileCounter.count()
    assert not a.release() and a.num_releases == 0
    with a.active():
        np.testing.assert_array_equal(scale(x, k=3), 4)
    assert CompileCounter.count() == before


def test_the_budget_drops_the_steps_of_the_scope_that_compiled(monkeypatch):
    """Whichever engine looks first after a compilation, the scope whose compilations took the
    count over is the one released; with none since the last look, the caller's."""
    a, b = CompileScope("a"), CompileScope("b")
    x = np.ones(3, np.float32)
    maps = iter([1000, 100, 1000, 100])  # over (before a release), then far under
    monkeypatch.setattr(code_maps, "map_count", lambda: next(maps))
    budget = code_maps.CodeMapBudget(limit=1200, high_water=0.5)
    with b.active():
        scale(x, k=7)  # b compiles a new shape
    assert b.num_compiles >= 1
    assert budget.release_if_over(a)  # a looks first
    assert (a.num_releases, b.num_releases) == (0, 1)
    assert budget.release_if_over(a)  # nothing compiled since: the caller's own
    assert (a.num_releases, b.num_releases) == (1, 1)


def test_clearing_a_step_function_drops_its_code_in_every_scope():
    a = CompileScope("a")
    x = np.ones(5, np.float32)
    with a.active():
        scale(x, k=2)
    scale(x, k=2)
    before = CompileCounter.count()
    scale.clear_cache()
    with a.active():
        scale(x, k=2)
    scale(x, k=2)
    assert CompileCounter.count() == before + 2
