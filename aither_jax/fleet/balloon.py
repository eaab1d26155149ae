"""The balloon: KV memory moves between the pools of models resident together as load shifts.

The planner (planner.py) sizes each model's KV pool once. The balloon then lends idle pages of
one model to another whose waiting requests lack pages, and once the lender's load is gone
gives them back toward the plan. Memory moves in bytes: the lender cuts whole pages of its own
format off the top of its pool, and the borrower grows by as many pages of its format as those
bytes hold, so the device never holds more than the plan's budget (what a page size leaves
over stays unassigned).

A lender keeps its floor (one sequence of full length, `ModelNeeds.min_pages`) and every page
its running sequences may still grow into; a borrower never grows past the pages it can use
(`ModelNeeds.max_pages`). A resize happens between steps (`Engine.resize_pool`); the pool
size is part of every step's shapes, so the steps are compiled for the new size first
(`Fleet.prepare`) and each size holds its own code: a move is worth it only when large, at
least `min_move_pages` of the borrower's pages, or everything the borrower lacks if that is less.
And a pool only takes sizes on its grid, its plan plus or minus whole steps (by default one
full-length sequence's pages or an eighth of the plan, `Fleet(balloon_step=...)`): under
shifting load the sizes repeat, so a long-running server compiles a bounded set of them and
then nothing.

`PoolState` is plain numbers and `next_move` a pure function of them; `pool_state` reads an
engine between its steps, and `aither_jax.fleet.fleet.Fleet` prepares and applies a move.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class PoolState:
    """One model's KV pool as the balloon sees it, in that model's pages."""

    name: str
    num_pages: int  # now, the null page included
    planned_pages: int  # what the memory plan gave it
    min_pages: int  # its floor
    max_pages: int  # more is never used
    page_bytes: int  # one page over every pool sharing page ids
    spare: int  # pages it could give up now
    short: int  # pages its waiting requests lack
    busy: bool  # has running or waiting requests
    step: int = 1  # its sizes are the plan plus or minus whole steps (`on_grid`)


@dataclasses.dataclass(frozen=True)
class Move:
    """Pages from `lender`'s pool to `borrower`'s (each counted in its own format's pages)."""

    lender: str
    borrower: str
    lender_pages: int
    borrower_pages: int
    bytes: int  # the borrower's share of the bytes the lender freed
    reason: str  # "demand": the borrower's requests lacked pages; "return": back toward the plan
    at: float = 0.0  # time.time() when applied
    compile_s: float = 0.0  # spent compiling the steps for the new pool sizes before it (Fleet.prepare)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def pool_state(
    engine, *, name: str, planned_pages: int, min_pages: int, max_pages: int, page_bytes: int, step: int = 1
) -> PoolState:
    """`engine`'s pool between its steps. Its room is the pages free or held only by the prefix
    cache, less what its running sequences may still take; its waiting requests' full lengths
    beyond the room are short, the room beyond them spare, as far as a shrink can reach (the
    floor, and above the highest page in use)."""
    sched = engine.scheduler

    def full(seq) -> int:  # pages of `seq` at its full length
        return sched.pages_needed(len(seq.prompt_ids) + seq.max_tokens + sched.lookahead)

    room = sched.num_free_pages - sum(max(full(s) - len(s.pages), 0) for s in sched.running)
    waiting = sum(full(s) for s in sched.waiting)
    num_pages = engine.num_pages
    spare = room - waiting
    if spare > 0:  # as far as a shrink reaches: the floor, above pages in use (a scan of the pool)
        spare = min(spare, num_pages - max(min_pages, sched.min_pool_size()))
    return PoolState(
        name=name, num_pages=num_pages, planned_pages=planned_pages, min_pages=min_pages, max_pages=max_pages,
        page_bytes=page_bytes, spare=max(spare, 0), short=max(waiting - max(room, 0), 0),
        busy=sched.has_unfinished(), step=step,
    )  # fmt: skip


def next_move(states: Sequence[PoolState], *, min_move_pages: int, unassigned: int = 0) -> Move | None:
    """The one move worth making now, or None.

    Demand first: the model lacking the most bytes borrows from the one with the most spare
    bytes (neither short itself). With nobody short, a model above its plan and idle gives back
    to one below its plan. A borrower also takes the budget's `unassigned` bytes (what earlier
    moves' page sizes left over)."""
    short = sorted((s for s in states if s.short), key=lambda s: -s.short * s.page_bytes)
    for borrower in short:
        want = min(borrower.short, borrower.max_pages - borrower.num_pages)
        lenders = [s for s in states if s is not borrower and not s.short and s.spare]
        move = _best(lenders, borrower, want, min(min_move_pages, want), "demand", unassigned)
        if move is not None:
            return move
    if short:
        return None
    for borrower in (s for s in states if s.num_pages < s.planned_pages):
        want = borrower.planned_pages - borrower.num_pages
        lenders = [s for s in states if s is not borrower and not s.busy and s.num_pages > s.planned_pages]
        lenders = [dataclasses.replace(s, spare=min(s.spare, s.num_pages - s.planned_pages)) for s in lenders]
        move = _best(lenders, borrower, want, 1, "return", unassigned)
        if move is not None:
            return move
    return None


def on_grid(state: PoolState, size: int, *, up: bool) -> int:
    """The size on `state`'s grid (its plan plus or minus whole steps) nearest `size`: at or
    above it if `up`, else at or below."""
    offset = size - state.planned_pages
    steps = -(-offset // state.step) if up else offset // state.step
    return state.planned_pages + steps * state.step


def _best(
    lenders: list[PoolState], borrower: PoolState, want: int, least: int, reason: str, unassigned: int
) -> Move | None:
    """The move from the lender with the most spare bytes that gives `borrower` at least
    `least` (and at most `want`, rounded up to its grid) of its pages, or None. Both pools end
    on their grids: the bytes a lender frees beyond the borrower's last whole step stay
    unassigned."""
    if want <= 0 or least <= 0:
        return None
    top = on_grid(borrower, borrower.max_pages, up=False)  # never past the pages it can use
    want = min(on_grid(borrower, borrower.num_pages + want, up=True), top) - borrower.num_pages
    least = min(least, want)
    if want <= 0:
        return None
    for lender in sorted(lenders, key=lambda s: -s.spare * s.page_bytes):
        need = max(-(-(want * borrower.page_bytes - unassigned) // lender.page_bytes), 1)
        lowest = on_grid(lender, lender.num_pages - lender.spare, up=True)  # as far as it can shrink
        give = lender.num_pages - max(on_grid(lender, lender.num_pages - need, up=False), lowest)
        reach = borrower.num_pages + (give * lender.page_bytes + unassigned) // borrower.page_bytes
        gain = min(on_grid(borrower, reach, up=False) - borrower.num_pages, want)
        if give > 0 and gain >= least:
            return Move(lender.name, borrower.name, give, gain, gain * borrower.page_bytes, reason)
    return None


def stamped(move: Move, lender_pages: int, borrower_pages: int, borrower_page_bytes: int) -> Move:
    """`move` as applied: the pages each pool actually changed by, and when."""
    return dataclasses.replace(
        move, lender_pages=lender_pages, borrower_pages=borrower_pages,
        bytes=borrower_pages * borrower_page_bytes, at=time.time(),
    )  # fmt: skip
