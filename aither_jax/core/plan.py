"""What one engine step runs."""

from __future__ import annotations

import dataclasses

from aither_jax.core.sequence import Sequence
from aither_jax.kv.store import PageMove


@dataclasses.dataclass
class StepPlan:
    """What one engine step runs: (sequence, new tokens) rows, and the page copies and moves
    between tiers to make first (`PageStore` applies both to every pool)."""

    prefill: list[tuple[Sequence, list[int]]]
    decode: list[tuple[Sequence, list[int]]]
    copies: list[tuple[int, int]]  # (source page, destination page), both on the device
    # Sequences admitted on cached pages that cover sink positions, with the tokens whose
    # sink keys/values their slot needs recomputed before they run (see `Scheduler`).
    sink_refills: list[tuple[Sequence, list[int]]] = dataclasses.field(default_factory=list)
    moves: list[PageMove] = dataclasses.field(default_factory=list)
