"""Step shape records: one JSON-able record per compiled step program, and the registry of the
shapes an engine has run or precompiled.

Every distinct shape of a step call (rows, tokens and pages per row, sampling mode, ...) is its
own XLA program. The registry names each one as a record (`shape_record`), so a run can say
which programs it needed (`Engine.step_shapes`), a later run can compile them first
(`Engine.precompile`, `shape_file.py`), and a step that compiles after warm-up is reported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

RETURN_LOGITS = ("none", "last", "all")  # which logits a forward step returns

# The step calls a shape record names and the fields that fix each one's compiled program
# (with the engine's own configuration):
# - forward: `forward_step` over [rows, tokens] (decode, or prefill chunks), its page reads,
#   which logits it returns ("none", "last", "all"), greedy-only sampling, the layers whose
#   hidden states it taps for a DFlash draft, and the pages it reads once for all rows;
# - steps: `decode_steps`, several decode steps in one call (num_scheduler_steps > 1);
# - verify: `verify_step` over [rows, tokens] of drafts (speculative decoding);
# - sinks: `refill_sinks` over [rows, tokens] (sink formats on prefix-cache hits);
# - copy: `copy_pages` of `pages` pages (prefix caching's copy on write);
# - summaries: `page_key_summaries` of `pages` pages at `layer` (the eviction advisor's and
#   bounded residency's mean keys of newly filled pages);
# - draft: the DFlash draft's drafting call over [rows, pages] page tables.
SHAPE_FIELDS: dict[str, tuple[str, ...]] = {
    "forward": ("rows", "tokens", "pages", "logits", "greedy", "taps", "shared_pages"),
    "steps": ("rows", "pages", "greedy"),
    "verify": ("rows", "tokens", "pages", "logits", "greedy"),
    "sinks": ("rows", "tokens"),
    "copy": ("pages",),
    "summaries": ("pages", "layer"),
    "draft": ("rows", "pages"),
}


def shape_record(kind: str, **fields: Any) -> dict[str, Any]:
    """A step shape record: `kind` and exactly its `SHAPE_FIELDS`, in that order (taps as a
    list, as JSON has them)."""
    names = SHAPE_FIELDS[kind]
    if set(fields) != set(names):
        raise TypeError(f"a {kind} shape has the fields {names}, got {sorted(fields)}")
    return {"kind": kind, **{f: list(fields[f]) if f == "taps" else fields[f] for f in names}}


def shape_key(record: dict[str, Any]) -> tuple:
    """A shape record as a hashable key: its kind and fields in `SHAPE_FIELDS` order."""
    return (
        record["kind"],
        *(tuple(v) if isinstance(v, list) else v for v in map(record.get, SHAPE_FIELDS[record["kind"]])),
    )


def checked_shape(index: int, record: Any) -> dict[str, Any]:
    """A well-formed copy of shape record `index` (its kind's fields only), or ValueError."""
    if not isinstance(record, dict):
        raise ValueError(f"step shape {index}: expected an object, got {type(record).__name__}")
    kind = record.get("kind")
    if kind not in SHAPE_FIELDS:
        raise ValueError(f"step shape {index}: kind must be one of {sorted(SHAPE_FIELDS)}, got {kind!r}")
    out: dict[str, Any] = {"kind": kind}
    for field in SHAPE_FIELDS[kind]:
        if field not in record:
            raise ValueError(f"step shape {index} ({kind}): missing {field!r}")
        value = record[field]
        if field == "greedy" or (field == "logits" and kind == "verify"):
            ok = isinstance(value, bool)
        elif field == "logits":
            ok = value in RETURN_LOGITS
        elif field == "taps":
            ok = isinstance(value, list | tuple) and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
            )
            value = list(value) if ok else value
        else:  # counts: rows and tokens from 1, pages and layers from 0
            low = 0 if field in ("pages", "shared_pages", "layer") else 1
            ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= 1 << 20
        if not ok:
            raise ValueError(f"step shape {index} ({kind}): bad {field} {value!r}")
        out[field] = value
    return out


class ShapeRegistry:
    """The step shapes one engine has run or precompiled, in first-seen order."""

    def __init__(self) -> None:
        self._records: dict[tuple, dict[str, Any]] = {}
        # Called with each shape record the first time a step of that shape runs (a server
        # appends it to its step-shapes file); not for shapes that precompile compiled.
        self.on_new_shape: Callable[[dict[str, Any]], None] | None = None
        self.warmed_up = False

    def note(self, kind: str, *, warmed: bool, **fields: Any) -> None:
        """Records a step shape about to run; warns when warm-up should have compiled it
        (`warmed`) and did not; tells `on_new_shape` about a shape not seen before."""
        record = shape_record(kind, **fields)
        key = shape_key(record)
        if key in self._records:
            return
        if self.warmed_up and warmed:
            log.warning("step shape %s was not compiled during warm-up: this step compiles", record)
        self._records[key] = record
        if self.on_new_shape is not None:
            self.on_new_shape(dict(record))

    def add(self, record: dict[str, Any]) -> None:
        """Records a precompiled shape (no warning, no `on_new_shape`)."""
        self._records.setdefault(shape_key(record), record)

    def records(self) -> list[dict[str, Any]]:
        """Copies of the records (safe beside another thread's `note`: the values are taken at once)."""
        return [dict(r) for r in list(self._records.values())]

    def clear(self) -> None:
        self._records.clear()
