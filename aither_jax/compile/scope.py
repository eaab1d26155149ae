"""Compile scopes: each model's compiled steps, kept apart from every other model's.

Two models in one process (a fleet) each compile their own step programs, and the process's
code budget (code_maps.py) may have to drop compiled code. `jax.clear_caches` drops every
function's, so one model nearing the limit would cost the other all its warm steps. A scope
holds a jit object of its own for each step function (`step_jit.StepFunction`), and dropping
one scope's code leaves the others' steps in place:

- a jit object keeps the executables of the shapes it has run in its own entries of JAX's C++
  dispatch cache, and `clear_cache()` on it drops only those;
- JAX's Python-level caches (traced jaxprs, lowerings, the in-memory compilation cache) hold
  executables too, every function's; a release clears them as well, which frees what no jit
  object still holds. Another scope's jit objects still hold their executables and dispatch
  them as before: nothing retraces or compiles.

What a release also drops: shapes precompiled (`Engine.precompile`) but never run, in any
scope, since only JAX's Python-level caches hold those; they compile again on first use, or
load from the persistent cache.

A scope counts the compilations made while it is active (`num_compiles`; JAX reports each on
the compiling thread), so the code budget knows whose code took the process over its limit.
Engines of one model configuration share a scope (`CompileServices.scope`): their programs
are the same ones. Steps dispatch through the scope active on the calling thread
(`CompileScope.active`, which the engine sets around each of its calls, `in_scope`); outside
any scope a step function uses one process-wide jit object.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from jax import monitoring

try:  # JAX's internals: where they moved, a release falls back to clearing everything
    from jax._src import util as jax_util
except ImportError:
    jax_util = None


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_active: contextvars.ContextVar[CompileScope | None] = contextvars.ContextVar("compile_scope", default=None)
_scopes: weakref.WeakSet[CompileScope] = weakref.WeakSet()  # every live scope (`live`)
_lock = threading.Lock()


def current() -> CompileScope | None:
    """The scope active on this thread (in this context), or None."""
    return _active.get()


def live() -> list[CompileScope]:
    """Every scope still in use."""
    with _lock:
        return list(_scopes)


def _count_compile(event: str, duration: float, **kwargs) -> None:
    # JAX reports a compilation (or a load from the persistent cache) on the thread that
    # compiles, so the scope active there is the one whose code it adds.
    if event == COMPILE_EVENT and (scope := _active.get()) is not None:
        with scope._count_lock:  # not `_lock`: `jit` holds it while making a jit object, which may compile
            scope.num_compiles += 1


monitoring.register_event_duration_secs_listener(_count_compile)


def _clear_shared_caches() -> Callable[[], None] | None:
    """JAX's function clearing its Python-level caches (all but the C++ dispatch caches), or
    None in a JAX that has none by that name."""
    return getattr(jax_util, "clear_all_caches", None) if jax_util is not None else None


class CompileScope:
    """One model's jit objects of the step functions, released together.

    Args:
        name: what logs call it (the model's name).
    """

    def __init__(self, name: str):
        self.name = name
        self._jits: dict[Any, Any] = {}  # StepFunction -> its jit object in this scope
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()
        self.num_releases = 0
        self.num_compiles = 0  # compilations while it was active (`run_in`: on other threads too)
        with _lock:
            _scopes.add(self)

    def jit(self, step) -> Any:
        """This scope's jit object of a step function (`StepFunction.new_jit`), made on first use."""
        jitted = self._jits.get(step)
        if jitted is None:
            with self._lock:
                jitted = self._jits.get(step)
                if jitted is None:
                    jitted = self._jits[step] = step.new_jit()
        return jitted

    def forget(self, step) -> None:
        """Drops this scope's jit object of `step`, its traces and executables with it."""
        with self._lock:
            jitted = self._jits.pop(step, None)
        if jitted is not None and hasattr(jitted, "clear_cache"):
            jitted.clear_cache()

    @contextlib.contextmanager
    def active(self) -> Iterator[CompileScope]:
        """Step functions called on this thread inside the block dispatch through this scope."""
        token = _active.set(self)
        try:
            yield self
        finally:
            _active.reset(token)

    def run_in(self, fun: Callable[[], Any]) -> Callable[[], Any]:
        """`fun` made to run inside this scope on whichever thread calls it (a thread pool's)."""

        def scoped():
            with self.active():
                return fun()

        return scoped

    def release(self) -> bool:
        """Drops the executables of every step this scope has run, and JAX's Python-level
        caches (see the module doc); other scopes keep their steps. Returns False, dropping
        nothing, in a JAX without a way to clear one function's code (the caller then clears
        everything)."""
        clear = _clear_shared_caches()
        with self._lock:
            jits = list(self._jits.values())
        if clear is None or not all(hasattr(j, "clear_cache") for j in jits):
            return False
        for jitted in jits:
            jitted.clear_cache()
        clear()
        self.num_releases += 1
        return True


def in_scope(method: Callable) -> Callable:
    """Runs an engine method inside the engine's compile scope (`self.compile_scope`)."""

    @functools.wraps(method)
    def scoped(self, *args, **kwargs):
        with self.compile_scope.active():
            return method(self, *args, **kwargs)

    return scoped
