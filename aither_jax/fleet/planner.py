"""The memory planner: one device budget split into zones for every model served in a process.

Each model brings fixed zones (its weights, its DFlash draft's weights, activation and compile
headroom for its largest step) and a KV pool sized in pages of the model's own format (the
target's pages plus the draft's context pools, which share page ids). The planner subtracts
every fixed zone from the budget, then shares what is left between the KV pools: a model given
an explicit page count takes exactly that, the others split the rest by `kv_share` (equal by
default), each capped at the pages it can use (`max_pages`: every sequence at full length) with
what a capped model leaves going to the others. A budget that cannot hold a fixed zone, or
leaves a model fewer pages than one sequence of its full length needs, is refused with a
message naming the zone. The host tier is a zone of host memory, listed but not charged to
the device.

`ModelNeeds` is plain numbers, so the plan is a pure function; `aither_jax.fleet.fleet`
measures the numbers from loaded models and compares the plan with what the engines then
allocate.
"""

from __future__ import annotations

import dataclasses

MIB = 1 << 20
# Bytes per token of a step's live activations beyond the logits, per unit of model width (an
# estimate: residual, normed input, q/k/v/o and MLP intermediates at the activation dtype).
ACTIVATION_WIDTHS = 8
COMPILE_HEADROOM_BYTES = 64 * MIB  # per model: XLA scratch and the executables themselves


class PlanError(ValueError):
    """The budget does not fit; the message names the zone."""


@dataclasses.dataclass(frozen=True)
class ModelNeeds:
    """What one model needs of the device, in bytes (and pages)."""

    name: str
    weight_bytes: int
    page_bytes: int  # one KV page over every pool sharing page ids (target and draft)
    min_pages: int  # one sequence of the model's full length, plus the null page
    max_pages: int  # every sequence at full length, plus the null page: more is never used
    activation_bytes: int = 0
    kv_fixed_bytes: int = 0  # the cache's part that does not grow with pages (sequence slots, codecs)
    draft_weight_bytes: int = 0
    draft_page_bytes: int = 0  # of page_bytes, the draft's context pools
    num_pages: int | None = None  # fixed by the operator instead of shared
    kv_share: float = 1.0  # weight of this model's share of the memory left for KV pools
    host_bytes: int = 0  # the host tier (host memory, not charged to the device)

    def __post_init__(self):
        if self.page_bytes <= 0 or self.min_pages < 2 or self.max_pages < self.min_pages:
            raise ValueError(f"{self.name}: page_bytes > 0 and 2 <= min_pages <= max_pages are required")
        if not self.kv_share > 0:
            raise ValueError(f"{self.name}: kv_share must be positive, got {self.kv_share!r}")


@dataclasses.dataclass(frozen=True)
class Zone:
    owner: str  # the model's name
    name: str  # weights | draft_weights | activations | kv_pool | draft_pool | host_tier
    bytes: int
    device: bool = True
    detail: str = ""


@dataclasses.dataclass
class MemoryPlan:
    """The zones of a budget and each model's KV pages."""

    budget: int
    zones: list[Zone]
    num_pages: dict[str, int]
    moves: list = dataclasses.field(default_factory=list)  # the balloon's, as applied (balloon.Move)

    @property
    def device_bytes(self) -> int:
        return sum(z.bytes for z in self.zones if z.device)

    @property
    def unassigned_bytes(self) -> int:
        return self.budget - self.device_bytes

    def zone(self, owner: str, name: str) -> Zone | None:
        return next((z for z in self.zones if z.owner == owner and z.name == name), None)

    def to_json(self) -> dict:
        return {
            "budget_bytes": self.budget,
            "device_bytes": self.device_bytes,
            "unassigned_bytes": self.unassigned_bytes,
            "num_pages": dict(self.num_pages),
            "zones": [dataclasses.asdict(z) for z in self.zones],
            "moves": [m.to_json() for m in self.moves],
        }

    def table(self) -> str:
        """The zones as a fixed-width table, device zones first, with the budget's total."""
        rows = [("model", "zone", "MiB", "share", "")]
        for z in sorted(self.zones, key=lambda z: not z.device):
            share = f"{z.bytes / self.budget:6.1%}" if z.device else "host"
            rows.append((z.owner, z.name, f"{z.bytes / MIB:,.1f}", share, z.detail))
        rows.append(
            ("", "unassigned", f"{self.unassigned_bytes / MIB:,.1f}", f"{self.unassigned_bytes / self.budget:6.1%}", "")
        )
        rows.append(("", "budget", f"{self.budget / MIB:,.1f}", "100.0%", ""))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = []
        for r in rows:
            cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].rjust(widths[2]), r[3].rjust(widths[3])]
            lines.append("  ".join(cells + [r[4]]).rstrip())
        return "\n".join(lines)


def plan_memory(budget: int, needs: list[ModelNeeds]) -> MemoryPlan:
    """Splits `budget` device bytes between `needs` (see the module docstring).

    Raises:
        PlanError: a fixed zone does not fit, or a KV pool would be smaller than one sequence.
    """
    if not needs:
        raise ValueError("plan_memory needs at least one model")
    if len({n.name for n in needs}) != len(needs):
        raise ValueError("model names in a plan must differ")
    zones: list[Zone] = []
    used = 0
    for n in needs:
        for name, size in (
            ("weights", n.weight_bytes),
            ("draft_weights", n.draft_weight_bytes),
            ("activations", n.activation_bytes),
            ("kv_pool", n.kv_fixed_bytes),  # listed below with the pages
        ):
            if not size:
                continue
            used += size
            if used > budget:
                what = "fixed part of the KV cache" if name == "kv_pool" else name.replace("_", " ")
                raise PlanError(
                    f"the memory budget of {budget / MIB:,.1f} MiB does not hold the {what} of {n.name} "
                    f"({size / MIB:,.1f} MiB; the zones before it take {(used - size) / MIB:,.1f} MiB)"
                )
            if name != "kv_pool":
                zones.append(Zone(n.name, name, size))
    for n in needs:  # pools of a fixed size come before shares
        if n.num_pages is not None:
            used += n.num_pages * n.page_bytes
            if used > budget:
                raise PlanError(
                    f"the memory budget of {budget / MIB:,.1f} MiB does not hold the KV pool of {n.name} "
                    f"({n.num_pages} pages, {n.num_pages * n.page_bytes / MIB:,.1f} MiB) after the other zones"
                )
    pages = _share_pages(budget - used, needs)
    for n in needs:
        got = pages[n.name]
        if got < n.min_pages:
            raise PlanError(
                f"the KV pool of {n.name} would get {got} pages ({got * n.page_bytes / MIB:,.1f} MiB) of the "
                f"{(budget - used) / MIB:,.1f} MiB left after the other zones; one sequence of its full length "
                f"needs {n.min_pages}: raise the budget, or lower max_model_len or the other pools"
            )
        zones += _pool_zones(n, got)
    return MemoryPlan(budget, zones, pages)


def _pool_zones(n: ModelNeeds, pages: int) -> list[Zone]:
    """The KV zones of model `n` with a pool of `pages` pages."""
    zones = [
        Zone(n.name, "kv_pool", pages * (n.page_bytes - n.draft_page_bytes) + n.kv_fixed_bytes, detail=f"{pages} pages")
    ]
    if n.draft_page_bytes:
        zones.append(Zone(n.name, "draft_pool", pages * n.draft_page_bytes, detail=f"{pages} pages"))
    if n.host_bytes:
        zones.append(Zone(n.name, "host_tier", n.host_bytes, device=False))
    return zones


def repage(plan: MemoryPlan, needs: list[ModelNeeds], pages: dict[str, int]) -> None:
    """Restates in place the KV zones of the models in `pages` for their new pool sizes (the
    balloon's moves); every other zone stays. The caller keeps the device total within the
    budget."""
    by_name = {n.name: n for n in needs}
    zones: list[Zone] = []
    for z in plan.zones:
        if z.owner not in pages or z.name not in _POOL_ZONES:
            zones.append(z)
        elif z.name == "kv_pool":  # the first of a model's pool zones
            zones += _pool_zones(by_name[z.owner], pages[z.owner])
    plan.zones, plan.num_pages = zones, {**plan.num_pages, **pages}  # each swapped whole: readers see one or the other


_POOL_ZONES = ("kv_pool", "draft_pool", "host_tier")


def _share_pages(free: int, needs: list[ModelNeeds]) -> dict[str, int]:
    """Pages per model: fixed counts as given (`free` is what is left after them), the rest
    by share, water-filled below each model's `max_pages` (what a capped model cannot use goes
    to the others)."""
    pages = {n.name: n.num_pages for n in needs if n.num_pages is not None}
    open_ = [n for n in needs if n.num_pages is None]
    while open_:
        total_share = sum(n.kv_share for n in open_)
        capped = [n for n in open_ if max(free, 0) * n.kv_share / total_share >= n.max_pages * n.page_bytes]
        if not capped:
            for n in open_:
                pages[n.name] = int(max(free, 0) * n.kv_share / total_share // n.page_bytes)
            break
        for n in capped:
            pages[n.name] = n.max_pages
            free -= n.max_pages * n.page_bytes
            open_.remove(n)
    return pages
