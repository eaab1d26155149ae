"""The balloon's choice of move (aither_jax/fleet/balloon.py), on plain numbers: bytes convert
between page sizes, floors and ceilings hold, small moves wait, pages go back toward the plan
only from an idle pool, and pools with a step keep to their grids."""

from __future__ import annotations

import numpy as np

from aither_jax.fleet.balloon import PoolState, next_move, on_grid

KIB = 1024


def pool(name, num_pages, *, planned=20, spare=0, short=0, busy=False, page_kib=48, min_pages=9, max_pages=33, step=1):
    return PoolState(
        name=name, num_pages=num_pages, planned_pages=planned, min_pages=min_pages, max_pages=max_pages,
        page_bytes=page_kib * KIB, spare=spare, short=short, busy=busy or bool(short), step=step,
    )  # fmt: skip


def test_a_short_pool_borrows_the_bytes_of_the_one_with_most_spare():
    small = pool("small", 20, short=10, page_kib=48)
    big = pool("big", 20, spare=6, page_kib=64)  # 6 x 64 KiB = 8 pages of 48 KiB
    other = pool("other", 20, spare=2, page_kib=64)
    move = next_move([small, other, big], min_move_pages=4)
    assert (move.lender, move.borrower, move.lender_pages, move.borrower_pages) == ("big", "small", 6, 8)
    assert move.bytes == 8 * 48 * KIB and move.reason == "demand"
    # It takes only what it lacks: 3 pages of 48 KiB need 3 of 64 KiB (2.25, rounded up).
    move = next_move([pool("small", 20, short=3), big], min_move_pages=4)
    assert (move.lender_pages, move.borrower_pages) == (3, 3)
    # Unassigned bytes count toward the borrower's pages: with 32 KiB left over by earlier moves, 2 pages of
    # 48 KiB (not 3) make 2 of 64 KiB.
    move = next_move([pool("small", 20, spare=5), pool("big", 20, short=2, page_kib=64)], min_move_pages=1,
                     unassigned=32 * KIB)  # fmt: skip
    assert (move.lender, move.lender_pages, move.borrower_pages) == ("small", 2, 2)


def test_no_move_when_it_would_be_too_small_or_past_what_the_borrower_can_use():
    assert next_move([pool("a", 20, short=10), pool("b", 20, spare=2)], min_move_pages=4) is None
    # Fewer missing than the minimum move: everything missing is enough.
    assert next_move([pool("a", 20, short=2), pool("b", 20, spare=2)], min_move_pages=4).borrower_pages == 2
    # At its ceiling a pool borrows nothing.
    assert next_move([pool("a", 33, short=10), pool("b", 20, spare=9)], min_move_pages=1) is None
    assert next_move([pool("a", 30, short=10), pool("b", 20, spare=9)], min_move_pages=1).borrower_pages == 3
    # A short pool never lends, even with spare pages of its own.
    assert next_move([pool("a", 20, short=4), pool("b", 20, short=4, spare=9)], min_move_pages=1) is None


def test_pages_go_back_toward_the_plan_only_from_an_idle_pool_and_only_its_surplus():
    lent = pool("lent", 12, planned=20, spare=3)
    borrowed = pool("borrowed", 30, planned=20, spare=15)
    move = next_move([lent, borrowed], min_move_pages=9)  # a return is never too small
    assert (move.lender, move.borrower, move.reason) == ("borrowed", "lent", "return")
    assert (move.lender_pages, move.borrower_pages) == (8, 8)
    # Its surplus over the plan bounds what it gives, whatever its spare.
    move = next_move([pool("lent", 12, planned=20), pool("borrowed", 23, planned=20, spare=15)], min_move_pages=1)
    assert (move.lender_pages, move.borrower_pages) == (3, 3)
    # A busy pool keeps what it borrowed.
    assert next_move([lent, pool("borrowed", 30, planned=20, spare=15, busy=True)], min_move_pages=1) is None
    # Both at their plan: nothing to do.
    assert next_move([pool("a", 20, spare=5), pool("b", 20, spare=5)], min_move_pages=1) is None


def test_pools_with_a_step_move_between_sizes_on_their_grids_only():
    """A borrower takes what it lacks rounded up to whole steps, a lender gives whole steps,
    and the bytes beyond the borrower's last whole step stay unassigned."""
    assert [on_grid(pool("a", 20, step=5), n, up=up) for n, up in ((23, True), (23, False), (20, True), (9, True))] == [
        25, 20, 20, 10,
    ]  # fmt: skip
    move = next_move([pool("small", 20, short=3, step=5), pool("big", 20, spare=9, step=5)], min_move_pages=1)
    assert (move.lender_pages, move.borrower_pages) == (5, 5)  # 3 rounded up to a step
    # 5 pages of 48 KiB need 4 of 64 KiB: the lender gives a whole step of 5; the 80 KiB left
    # after the borrower's 5 pages stay unassigned.
    small, big = pool("small", 20, short=5, step=5), pool("big", 20, spare=9, page_kib=64, step=5)
    move = next_move([small, big], min_move_pages=1)
    assert (move.lender_pages, move.borrower_pages, move.bytes) == (5, 5, 5 * 48 * KIB)
    # Spare short of a whole step: nothing to give. A ceiling of 33 stops the borrower at 30.
    assert next_move([small, pool("big", 20, spare=4, step=5)], min_move_pages=1) is None
    move = next_move([pool("small", 25, short=20, step=5), pool("big", 20, spare=11, step=5)], min_move_pages=1)
    assert (move.lender_pages, move.borrower_pages) == (5, 5)
    # Whatever the load, a pool starting on its grid ends on it.
    rng = np.random.default_rng(0)
    for _ in range(500):
        step = int(rng.integers(1, 8))
        states = []
        for name in ("a", "b"):
            size = 20 + step * int(rng.integers(-1, 3))
            short = int(rng.integers(0, 2)) * int(rng.integers(1, 30))
            spare, busy, page_kib = (
                int(rng.integers(0, size - 8)),
                bool(rng.integers(0, 2)),
                int(rng.choice([32, 48, 64])),
            )
            states.append(
                pool(name, size, step=step, spare=spare, short=short, busy=busy, page_kib=page_kib, max_pages=40)
            )
        move = next_move(states, min_move_pages=int(rng.integers(1, 10)), unassigned=int(rng.integers(0, 64)) * KIB)
        if move is not None:
            lender, borrower = (next(s for s in states if s.name == n) for n in (move.lender, move.borrower))
            for size in (lender.num_pages - move.lender_pages, borrower.num_pages + move.borrower_pages):
                assert (size - 20) % step == 0, (states, move)
            assert lender.num_pages - move.lender_pages >= lender.num_pages - lender.spare
            assert borrower.num_pages + move.borrower_pages <= borrower.max_pages
