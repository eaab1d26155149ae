"""`step_jit`: `jax.jit` for the engine's step functions, with the compiler options they want.

On XLA's CPU backend the steps compile with the memory-optimized HLO scheduler instead of
the default, concurrency-optimized one. The default orders operations breadth-first so that
as many as possible can run at once. A layer's reads of TurboQuant pages (page gather,
unpacking, codebook lookup) depend only on the cache and the block table, not on the
layer's activations, so it places the reads of all 30 layers at the start of the step: 60
unpacked code arrays (2.4 MB each at 16 rows x 192 slots) are live together, each long
before it is used. The memory-optimized scheduler orders depth-first, and each layer reads
its pages where it uses them. Decode steps over TurboQuant pages run 1.5-1.7x faster at 8-16
rows; fp32 pages, single rows and prefill are unchanged within noise (docs/BENCHMARKS.md,
decode section).

Other backends get no extra options. They are chosen when a step function first runs (the
backend is known then) and tried once on a tiny computation, so a jaxlib that does not know
an option costs a warning, not a failed step.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from aither_jax.compile import scope

log = logging.getLogger(__name__)

# Threads that compile warm-up shapes at once (`compile_workers`): each XLA compilation holds
# its module in host memory (~1 GB for a SmolLM2 step), and gains flatten past a few threads.
MAX_COMPILE_WORKERS = 8
COMPILE_WORKERS_ENV = "AITHER_JAX_COMPILE_WORKERS"

# What XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false sets.
CPU_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


@functools.cache
def compiler_options() -> dict[str, Any]:
    """The options the steps compile with on the default backend ({} off CPU)."""
    if jax.default_backend() != "cpu":
        return {}
    try:
        jax.jit(lambda x: x + 1, compiler_options=CPU_OPTIONS)(np.zeros(1, np.float32)).block_until_ready()
    except Exception as e:  # jaxlib rejects unknown option names with a runtime error
        log.warning("XLA CPU compiler options %s not accepted (%s); steps compile without them", CPU_OPTIONS, e)
        return {}
    return dict(CPU_OPTIONS)


class StepFunction:
    """A function jitted on first use with `compiler_options()`; otherwise a `jax.jit` object
    (`.lower`, `.trace` and the rest are forwarded to it). Inside a compile scope (scope.py)
    it dispatches through the scope's own jit object of the function."""

    def __init__(self, fun: Callable, jit_kwargs: dict[str, Any]):
        functools.update_wrapper(self, fun)
        self._fun = fun
        self._jit_kwargs = jit_kwargs
        self._jitted = None

    @property
    def jitted(self):
        """The active compile scope's jit object of the function, else the process-wide one."""
        active = scope.current()
        if active is not None:
            return active.jit(self)
        if self._jitted is None:
            self._jitted = self._jit(self._fun)
        return self._jitted

    def new_jit(self):
        """A jit object of its own (a compile scope's): it jits a new wrapper of the function,
        and JAX keys its caches by the function, so its executables are held apart."""
        fun = self._fun
        return self._jit(functools.wraps(fun)(lambda *args, **kwargs: fun(*args, **kwargs)))

    def clear_cache(self) -> None:
        """Drops this function's traces and executables everywhere: the process-wide jit
        object's and every compile scope's (a test that patches what it calls retraces it)."""
        if self._jitted is not None:
            self._jitted.clear_cache()
        for s in scope.live():
            s.forget(self)

    def _jit(self, fun: Callable):
        options = compiler_options()
        return jax.jit(fun, compiler_options=options or None, **self._jit_kwargs)

    def __call__(self, *args, **kwargs):
        return self.jitted(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_"):  # private names stay private (and `_jitted` must not recurse)
            raise AttributeError(name)
        return getattr(self.jitted, name)


def step_jit(fun: Callable | None = None, **jit_kwargs) -> Any:
    """`jax.jit` (same keyword arguments) that adds the step compiler options.

    Use as `@step_jit` or `@step_jit(static_argnames=..., donate_argnames=...)`.
    """
    if fun is None:
        return functools.partial(step_jit, **jit_kwargs)
    return StepFunction(fun, jit_kwargs)


def compile_workers() -> int:
    """Threads for compiling warm-up shapes: `$AITHER_JAX_COMPILE_WORKERS` if set, otherwise
    this process's CPU cores up to MAX_COMPILE_WORKERS."""
    setting = os.environ.get(COMPILE_WORKERS_ENV, "").strip()
    if setting:
        if not setting.isdigit() or int(setting) < 1:
            raise ValueError(f"{COMPILE_WORKERS_ENV} must be a whole number of threads >= 1, got {setting!r}")
        return int(setting)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_COMPILE_WORKERS, cores))
