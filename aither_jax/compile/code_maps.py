"""Keeps the compiled steps' code under the kernel's limit on memory mappings.

XLA's CPU backend loads every kernel of an executable as its own object, about three memory
mappings each (code, constants, data). With 30 unrolled layers a SmolLM2 step shape holds
~450 kernels, so ~900-1,200 mappings, and a server compiles a shape per (rows, tokens, pages,
sampling) bucket it meets. Linux refuses a process more than `vm.max_map_count` mappings
(65,530 by default): past it LLVM cannot load the next kernel ("Cannot allocate memory") and
the process dies with a segmentation fault, on a default machine after ~60 shapes.

`CodeMapBudget.release_after_compiles` (called at the start of every engine step) reads the
count when something compiled since its last look. Once it passes `high_water` of the limit,
it drops the compiled executables of the models whose code took it there, those that compiled
since its last look (each model's steps compile in its own compile scope, scope.py, which
counts its compilations), which unmaps their code; another model's steps in the same process
stay compiled. Only if that leaves the count above `low_water` of the limit (the other models'
code holds so much that the dropped shapes would hardly fit again) does it drop every compiled
executable (`jax.clear_caches`). The shapes still in use compile again on their next call (or
load from the persistent cache, `aither_jax.compile.cache`). Warm-ups
(`Engine.warmup`, `Engine.precompile`) make the same check before compiling, so code compiled
for earlier shapes never stops them at their first shape. Raising `vm.max_map_count` makes all
of this rarer.
"""

from __future__ import annotations

import gc
import logging
import weakref

import jax

from aither_jax.compile import scope as scope_module
from aither_jax.compile.counter import CompileCounter
from aither_jax.compile.scope import CompileScope

log = logging.getLogger(__name__)

MAPS_PATH = "/proc/self/maps"
LIMIT_PATH = "/proc/sys/vm/max_map_count"
# Clear above this share of the limit; the rest is headroom for the compilations one step
# may add before the next check (a handful of shapes, a few thousand mappings each).
HIGH_WATER = 0.7
# A release of only the compiling models' steps must bring the count under this share: the
# headroom above it (a fifth of the limit) is where their shapes in use compile again.
LOW_WATER = 0.5


def map_limit() -> int | None:
    """`vm.max_map_count`, or None where the kernel does not say (not Linux)."""
    try:
        with open(LIMIT_PATH, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def map_count() -> int | None:
    """Memory mappings of this process now, or None where /proc is missing."""
    try:
        with open(MAPS_PATH, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


class CodeMapBudget:
    """Clears JAX's compiled executables when this process nears its mapping limit.

    Args:
        limit: the mapping limit (default: `vm.max_map_count`; no limit known, no clearing).
        high_water: share of `limit` above which `release_if_over` clears.
        low_water: share of `limit` (default LOW_WATER, at most `high_water`) that dropping
            the compiling models' steps must get under; above it, what is left (the other
            models' code) leaves them too little room to compile their shapes again, and every
            model's steps are dropped.
    """

    def __init__(self, limit: int | None = None, high_water: float = HIGH_WATER, low_water: float | None = None):
        if not 0.0 < high_water < 1.0:
            raise ValueError(f"high_water must be in (0, 1), got {high_water!r}")
        low_water = min(LOW_WATER, high_water) if low_water is None else low_water
        if not 0.0 < low_water <= high_water:
            raise ValueError(f"low_water must be in (0, high_water], got {low_water!r}")
        self.limit = map_limit() if limit is None else limit
        self.high_water, self.low_water = high_water, low_water
        self.num_releases = 0
        self._compiles_seen = -1  # the first look always reads the count
        self._scope_compiles = self._scope_counts()  # each scope's compilations at the last look

    @property
    def threshold(self) -> int | None:
        return None if self.limit is None else int(self.limit * self.high_water)

    def _count_if_over(self) -> int | None:
        """The map count when it is above the threshold, else None."""
        count = map_count() if self.limit is not None else None
        return count if count is not None and count > self.threshold else None

    def over(self) -> bool:
        """Whether the process holds more mappings than the threshold."""
        return self._count_if_over() is not None

    @staticmethod
    def _scope_counts() -> weakref.WeakKeyDictionary:
        return weakref.WeakKeyDictionary({s: s.num_compiles for s in scope_module.live()})

    def release_after_compiles(self, scope: CompileScope | None = None) -> bool:
        """`release_if_over`, but only when something compiled since the last look (the map
        count is a read of /proc, too slow for every decode step); returns whether it cleared."""
        compiles = CompileCounter.count()
        if compiles == self._compiles_seen:
            return False
        self._compiles_seen = compiles
        return self.release_if_over(scope)

    def release_if_over(self, scope: CompileScope | None = None) -> bool:
        """If `over()`, drops compiled code; returns whether it dropped any. With `scope` (the
        caller's), it drops the steps of the scopes that compiled since the last look (those
        whose code took the count over), or `scope`'s when none did; every compiled executable
        when that leaves the count above the low-water mark, or with no `scope`."""
        before = self._count_if_over()
        seen, self._scope_compiles = self._scope_compiles, self._scope_counts()
        if before is None:
            return False
        self.num_releases += 1
        if scope is not None:
            compiling = [s for s in scope_module.live() if s.num_compiles > seen.get(s, 0)]
            victims = compiling or [scope]
            names = ", ".join(sorted(s.name for s in victims))
            if all([s.release() for s in victims]):
                gc.collect()
                after = map_count()
                if after is None or after <= self.limit * self.low_water:
                    log.warning(
                        "compiled steps held %s of %s memory mappings (vm.max_map_count): dropped those of %s, now "
                        "%s; their shapes compile again on their next use, other models' stay compiled (raise "
                        "vm.max_map_count to keep more)",
                        before, self.limit, names, after,
                    )  # fmt: skip
                    return True
                log.warning(
                    "dropping the compiled steps of %s left %s of %s memory mappings, above %s: dropping every "
                    "model's",
                    names, after, self.limit, int(self.limit * self.low_water),
                )  # fmt: skip
        jax.clear_caches()
        gc.collect()
        after = map_count()
        log.warning(
            "compiled steps held %s of %s memory mappings (vm.max_map_count): dropped them all, now %s; "
            "shapes compile again on their next use (raise vm.max_map_count to keep more)",
            before,
            self.limit,
            after,
        )
        if after is not None and after > self.threshold:  # not compiled code: clearing again would not help
            log.warning("the mappings left are not compiled code: no further clearing")
            self.limit = None
        return True
