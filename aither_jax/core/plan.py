"""What one engine step runs."""

from __future__ import annotations

import dataclasses

from aither_jax.core.sequence import Sequence


@dataclasses.dataclass
class StepPlan:
    """What one engine step runs: (sequence, new tokens) rows, and the page copies to make
    first (`PageStore` applies them to every pool). Pages that move between tiers have moved
    by the time the plan exists (the scheduler's lookups promote them, its evictions demote)."""

    prefill: list[tuple[Sequence, list[int]]]
    decode: list[tuple[Sequence, list[int]]]
    copies: list[tuple[int, int]]  # (source page, destination page), both on the device
    # Sequences admitted on cached pages that cover sink positions, with the tokens whose
    # sink keys/values their slot needs recomputed before they run (see `Scheduler`).
    sink_refills: list[tuple[Sequence, list[int]]] = dataclasses.field(default_factory=list)
