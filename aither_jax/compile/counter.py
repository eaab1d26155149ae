"""Counts XLA compilations in this process."""

from __future__ import annotations

import threading

from jax import monitoring


class CompileCounter:
    """Counts XLA backend compilations in this process (all jitted functions) and the seconds
    they took. JAX reports an executable loaded from the persistent compilation cache
    (`aither_jax.compile.cache`) under the same event, so a load counts as the compilation it
    replaces (with the load's seconds).

    It also adds up the seconds spent lowering jaxprs to StableHLO, which the backend
    compilation does not include. From jaxlib 0.10.3 on, that is where a Pallas kernel's Triton
    IR is built into PTX (one build per kernel call, every time a step is lowered, the
    persistent cache's hits included); before, XLA built it inside the backend compilation.

    The engine reads it to warn when a step recompiles after warm-up; tests use it to prove
    that steady-state decoding does not.
    """

    _lock = threading.Lock()
    _count = 0
    _seconds = 0.0
    _lowering_seconds = 0.0
    _installed = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return
            cls._installed = True

        def listener(event: str, duration: float, **kwargs) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                with cls._lock:
                    cls._count += 1
                    cls._seconds += duration
            elif event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
                with cls._lock:
                    cls._lowering_seconds += duration

        monitoring.register_event_duration_secs_listener(listener)

    @classmethod
    def count(cls) -> int:
        cls.install()
        return cls._count

    @classmethod
    def seconds(cls) -> float:
        cls.install()
        return cls._seconds

    @classmethod
    def lowering_seconds(cls) -> float:
        cls.install()
        return cls._lowering_seconds


CompileCounter.install()
