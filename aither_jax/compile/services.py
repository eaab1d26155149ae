"""Process-wide compile services, shared by every engine in the process.

Compiled code and its caches belong to the process, not to one engine: JAX's in-memory
executable cache, the persistent compilation cache on disk, and the memory mappings that
compiled CPU code holds. So there is one of each service per process (`services()`): the
persistent cache is turned on once, and one `CodeMapBudget` watches the mappings of every
engine's code. Two engines in one process (two models) therefore count their code against
one limit instead of each judging the process by itself. Each model's steps compile in its
own compile scope (`scope`, compile/scope.py), so when the budget must drop compiled code it
drops that of the models that compiled since it last looked, and another model's warm steps
stay compiled.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

from aither_jax.compile import cache
from aither_jax.compile.code_maps import CodeMapBudget
from aither_jax.compile.scope import CompileScope


class CompileServices:
    """The persistent cache directory (None when off) and the code-mapping budget."""

    def __init__(self, budget: CodeMapBudget | None = None):
        self.cache_dir = cache.enable()
        self.budget = CodeMapBudget() if budget is None else budget
        self._scopes: dict[Hashable, CompileScope] = {}
        self._lock = threading.Lock()

    def scope(self, key: Hashable, name: str) -> CompileScope:
        """The compile scope of the engines whose steps `key` fixes (their model configuration),
        made on first use and named `name` in logs."""
        with self._lock:
            if key not in self._scopes:
                self._scopes[key] = CompileScope(name)
            return self._scopes[key]


_lock = threading.Lock()
_services: CompileServices | None = None


def services() -> CompileServices:
    """This process's compile services, made on first use."""
    global _services
    with _lock:
        if _services is None:
            _services = CompileServices()
        return _services
