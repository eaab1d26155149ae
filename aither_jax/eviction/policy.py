"""Eviction policies: given the idle pages of the prefix cache, which to drop first.

A policy sees each candidate's block record (aither_jax/kv/blocks.py: access clock, hits,
pins, and the metadata the context pipeline and the advisor fill in) and returns the victims
in order. `LRUPolicy` is the default: least recently used first, where a lookup touches a
chain's pages from its end to its start, so eviction takes a chain from its end and leaves a
usable prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

from aither_jax.kv.blocks import Block


class LRUPolicy:
    """Least recently used first."""

    name = "lru"

    def victims(self, candidates: Sequence[Block], n: int) -> list[Block]:
        return sorted(candidates, key=lambda b: b.last_access)[: max(n, 0)]


POLICIES = {"lru": LRUPolicy}


def make_policy(name: str):
    """The policy registered under `name` (ValueError naming the choices otherwise)."""
    if name not in POLICIES:
        raise ValueError(f"eviction policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]()
