"""The balloon in the server: a thread that lets the models' KV pools trade pages as load shifts.

Every `interval` seconds it asks the fleet for its next move (aither_jax/fleet/balloon.py),
reading each model's pool and resizing it on that model's engine loop thread, between steps
(`AsyncEngine.call`), so no step ever sees a pool change under it. Moves are counted in the
metrics of both models and listed at /debug/memory with the plan they changed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from aither_jax.fleet.fleet import Fleet
from serving.async_engine import AsyncEngine, EngineDeadError

log = logging.getLogger(__name__)

INTERVAL_SECONDS = 0.5


class BalloonLoop:
    """Runs `fleet.rebalance` every `interval` seconds over `engines` (model name -> the
    AsyncEngine that owns that model's engine) until stopped."""

    def __init__(self, fleet: Fleet, engines: Mapping[str, AsyncEngine], *, interval: float = INTERVAL_SECONDS):
        self.fleet = fleet
        self.engines = dict(engines)
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-balloon", daemon=True)
        for engine in self.engines.values():
            engine.metrics.counter(
                "aither:kv_balloon_moves_total",
                "Pages moved between models' KV pools by the balloon, by direction (lent or borrowed) and reason "
                "(demand or return).",
            )

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def step(self):
        """One check (and move, if due); returns the move or None."""
        move = self.fleet.rebalance(run=lambda model, fn: self.engines[model].call(fn))
        if move is not None:
            self.engines[move.lender].metrics.inc(
                "aither:kv_balloon_moves_total", move.lender_pages, direction="lent", reason=move.reason
            )
            self.engines[move.borrower].metrics.inc(
                "aither:kv_balloon_moves_total", move.borrower_pages, direction="borrowed", reason=move.reason
            )
        return move

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.step()
            except EngineDeadError:
                continue  # a dead engine neither lends nor borrows; /health reports it
            except Exception:  # noqa: BLE001 - the balloon only saves memory: it must not stop the server
                log.exception("kv balloon: a move failed; pools stay as they are")
