"""The balloon in the server: a thread that lets the models' KV pools trade pages as load shifts.

Every `interval` seconds it asks the fleet for its next move (aither_jax/fleet/balloon.py),
reading each model's pool and resizing it on that model's engine loop thread, between steps
(`AsyncEngine.call`), so no step ever sees a pool change under it. A move to pool sizes the
models' steps are not compiled for is first prepared on a background thread (`Fleet.prepare`)
while both models keep serving at their old sizes, and made at a later check. Moves are
counted in the metrics of both models and listed at /debug/memory with the plan they changed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from concurrent.futures import Future

from aither_jax.fleet.fleet import Fleet
from serving.async_engine import AsyncEngine, EngineDeadError

log = logging.getLogger(__name__)

INTERVAL_SECONDS = 0.5


class BalloonLoop:
    """Checks the fleet's balloon every `interval` seconds over `engines` (model name -> the
    AsyncEngine that owns that model's engine) until stopped: `step` prepares and makes moves."""

    def __init__(self, fleet: Fleet, engines: Mapping[str, AsyncEngine], *, interval: float = INTERVAL_SECONDS):
        self.fleet = fleet
        self.engines = dict(engines)
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-balloon", daemon=True)
        self._preparing: Future | None = None  # compiling steps for a move's pool sizes
        self._prepared_for: tuple[str, str] | None = None  # the (lender, borrower) last prepared
        for engine in self.engines.values():
            engine.metrics.counter(
                "aither:kv_balloon_moves_total",
                "Pages moved between models' KV pools by the balloon, by direction (lent or borrowed) and reason "
                "(demand or return).",
                labels=[],
            )

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def preparing(self) -> bool:
        """Whether a move's compilation is in flight."""
        return self._preparing is not None and not self._preparing.done()

    def step(self):
        """One check; returns the move made, or None.

        A due move whose pool sizes the steps are not compiled for starts their compilation on
        a background thread and is made at the first check after it ends. If load has changed
        the move's sizes by then, it is made anyway (the new sizes compile as steps need them)
        rather than prepared again, so a shifting load cannot hold a move back."""
        if self._preparing is not None:
            if not self._preparing.done():
                return None
            preparing, self._preparing = self._preparing, None
            preparing.result()  # a failed compilation raises here (logged); the next check moves anyway
        run = lambda model, fn: self.engines[model].call(fn)  # noqa: E731
        move = self.fleet.next_move(run)
        if move is None:
            self._prepared_for = None
            return None
        direction = (move.lender, move.borrower)
        if self.fleet.prepare_moves and self._prepared_for != direction and not self.fleet.ready(move):
            self._prepared_for = direction
            self._preparing = _in_background(self.fleet.prepare, move)
            return None
        self._prepared_for = None
        move = self.fleet.apply(move, run)
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


def _in_background(fn, *args) -> Future:
    """`fn(*args)` on a daemon thread (a compilation in flight must not hold up the server's exit)."""
    future: Future = Future()

    def work() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever reads the future
            future.set_exception(e)

    threading.Thread(target=work, name="kv-balloon-compile", daemon=True).start()
    return future
