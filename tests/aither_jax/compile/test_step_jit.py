"""`step_jit`: the engine's steps compile with their CPU compiler options, and behave as `jax.jit`."""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aither_jax.compile import step_jit as sj
from aither_jax.device.steps import forward_step, sample_step, write_step


@pytest.fixture
def fresh_options():
    sj.compiler_options.cache_clear()
    yield
    sj.compiler_options.cache_clear()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the options are CPU-only")
def test_cpu_steps_compile_with_the_memory_optimized_scheduler(fresh_options, monkeypatch):
    assert sj.compiler_options() == {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
    seen = []
    real_jit = jax.jit

    def spy(fun, **kwargs):
        seen.append(kwargs.get("compiler_options"))
        return real_jit(fun, **kwargs)

    monkeypatch.setattr(sj.jax, "jit", spy)
    double = sj.step_jit(lambda x: 2 * x)
    np.testing.assert_array_equal(double(jnp.arange(3)), [0, 2, 4])
    assert seen == [sj.CPU_OPTIONS]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the options are CPU-only")
def test_cpu_steps_do_work_that_does_not_depend_on_a_layer_where_the_layer_needs_it(fresh_options):
    """Like a layer's page reads: `side` does not depend on x. The default scheduler runs every
    layer's `side` first; the steps' scheduler runs each next to its layer."""

    def layers(x, pool, w):
        for i in range(4):
            with jax.named_scope(f"side{i}"):
                side = jnp.exp(pool[i] @ w[i])
            with jax.named_scope(f"chain{i}"):
                x = jnp.tanh(x @ w[i]) @ side
        return x

    args = (jnp.ones((8, 64)), jnp.ones((4, 64, 64)), jnp.ones((4, 64, 64)))
    hlo = sj.step_jit(layers).lower(*args).compile().as_text()
    order = re.findall(r'op_name="jit\(layers\)/((?:side|chain)\d)', hlo.split("\nENTRY")[1])
    assert order, hlo[-2000:]
    first = {name: order.index(name) for name in set(order)}
    for i in range(1, 4):
        assert first[f"side{i}"] > first[f"chain{i - 1}"], order


def test_the_engine_steps_are_step_functions():
    for step in (forward_step, sample_step, write_step):
        assert isinstance(step, sj.StepFunction)
    assert forward_step.__name__ == "forward_step" and "greedy next token" in forward_step.__doc__


def test_an_option_the_compiler_rejects_is_dropped_with_a_warning(fresh_options, monkeypatch, caplog):
    if jax.default_backend() != "cpu":
        assert sj.compiler_options() == {}
        return
    monkeypatch.setattr(sj, "CPU_OPTIONS", {"xla_cpu_no_such_option_anywhere": True})
    with caplog.at_level(logging.WARNING, logger=sj.__name__):
        assert sj.compiler_options() == {}
    assert any("not accepted" in r.getMessage() for r in caplog.records)
    np.testing.assert_array_equal(sj.step_jit(lambda x: x + 1)(jnp.zeros(2)), [1, 1])


def test_step_jit_takes_jax_jit_arguments():
    @sj.step_jit(static_argnames=("power",), donate_argnames=("x",))
    def raise_to(x, *, power):
        return x**power

    np.testing.assert_allclose(raise_to(jnp.arange(4.0), power=3), [0, 1, 8, 27])
    lowered = raise_to.lower(jnp.arange(4.0), power=2)  # attributes of the jitted function pass through
    assert "f32[4]" in lowered.as_text() or "tensor<4xf32>" in lowered.as_text()
    with pytest.raises(AttributeError):
        _ = raise_to.no_such_attribute


@pytest.mark.parametrize("setting, want", [("3", 3), (" 1 ", 1)])
def test_compile_workers_from_the_environment(monkeypatch, setting, want):
    monkeypatch.setenv(sj.COMPILE_WORKERS_ENV, setting)
    assert sj.compile_workers() == want


@pytest.mark.parametrize("setting", ["0", "-2", "two", "1.5"])
def test_compile_workers_refuses_what_is_not_a_thread_count(monkeypatch, setting):
    monkeypatch.setenv(sj.COMPILE_WORKERS_ENV, setting)
    with pytest.raises(ValueError, match=sj.COMPILE_WORKERS_ENV):
        sj.compile_workers()


def test_compile_workers_defaults_to_the_cores_up_to_the_cap(monkeypatch):
    monkeypatch.delenv(sj.COMPILE_WORKERS_ENV, raising=False)
    monkeypatch.setattr(sj.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert sj.compile_workers() == sj.MAX_COMPILE_WORKERS
    monkeypatch.setattr(sj.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert sj.compile_workers() == 2
