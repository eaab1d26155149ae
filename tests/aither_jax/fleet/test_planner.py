"""The memory planner: zones, shares, caps, fixed pools, and budgets refused by zone."""

from __future__ import annotations

import pytest

from aither_jax.fleet import fleet
from aither_jax.fleet.planner import MIB, ModelNeeds, PlanError, plan_memory


def needs(name: str, **kw) -> ModelNeeds:
    base = dict(weight_bytes=100 * MIB, page_bytes=1 * MIB, min_pages=5, max_pages=1000, activation_bytes=10 * MIB)
    return ModelNeeds(name, **{**base, **kw})


def test_fixed_zones_first_then_pages_shared_by_weight():
    plan = plan_memory(1000 * MIB, [needs("a"), needs("b", kv_share=3.0, kv_fixed_bytes=2 * MIB)])
    # 1000 - 2 x (100 + 10) - 2 = 778 MiB for pages, a quarter and three quarters.
    assert plan.num_pages == {"a": 194, "b": 583}
    assert plan.zone("b", "kv_pool").bytes == 583 * MIB + 2 * MIB
    assert plan.zone("a", "weights").bytes == 100 * MIB
    assert plan.device_bytes + plan.unassigned_bytes == plan.budget
    assert 0 <= plan.unassigned_bytes < 2 * MIB  # only rounding to whole pages is left


def test_a_capped_model_leaves_the_rest_to_the_other_and_fixed_counts_are_kept():
    plan = plan_memory(1000 * MIB, [needs("a", max_pages=50), needs("b")])
    assert plan.num_pages == {"a": 50, "b": 1000 - 220 - 50}
    plan = plan_memory(1000 * MIB, [needs("a", num_pages=7), needs("b", draft_page_bytes=MIB // 4, page_bytes=MIB)])
    assert plan.num_pages["a"] == 7
    assert plan.zone("b", "draft_pool").bytes == plan.num_pages["b"] * MIB // 4
    assert plan.zone("b", "kv_pool").bytes == plan.num_pages["b"] * 3 * MIB // 4


def test_budgets_that_do_not_fit_are_refused_naming_the_zone():
    with pytest.raises(PlanError, match="does not hold the weights of b"):
        plan_memory(150 * MIB, [needs("a"), needs("b")])
    with pytest.raises(PlanError, match="does not hold the activations of a"):
        plan_memory(105 * MIB, [needs("a")])
    with pytest.raises(PlanError, match="the KV pool of b would get 4 pages"):
        plan_memory(230 * MIB, [needs("a", num_pages=6), needs("b")])
    with pytest.raises(PlanError, match=r"does not hold the KV pool of a \(20 pages"):
        plan_memory(230 * MIB, [needs("a", num_pages=20), needs("b")])
    with pytest.raises(ValueError, match="differ"):
        plan_memory(1000 * MIB, [needs("a"), needs("a")])


def test_the_table_and_json_list_every_zone_and_the_host_tier_is_not_charged():
    plan = plan_memory(1000 * MIB, [needs("a", host_bytes=64 * MIB), needs("b", draft_weight_bytes=8 * MIB)])
    assert plan.zone("a", "host_tier").device is False
    assert plan.device_bytes == sum(z.bytes for z in plan.zones if z.name != "host_tier")
    table = plan.table()
    for z in plan.zones:
        assert z.name in table
    assert "unassigned" in table and "budget" in table and "1,000.0" in table
    js = plan.to_json()
    assert js["budget_bytes"] == 1000 * MIB and len(js["zones"]) == len(plan.zones)


def test_an_explicit_budget_is_refused_above_what_the_accelerator_has_free(monkeypatch):
    class Device:
        device_kind = "NVIDIA H200"

        def memory_stats(self):
            return {"bytes_limit": 10 * fleet.GIB, "bytes_in_use": 2 * fleet.GIB}

    monkeypatch.setattr(fleet.jax, "devices", lambda: [Device()])
    assert fleet.device_budget(8, None) == 8 * fleet.GIB
    with pytest.raises(ValueError, match="more than the 8.00 GiB free on NVIDIA H200"):
        fleet.device_budget(8.5, None)
    assert fleet.device_budget(None, 0.5) == 3 * fleet.GIB  # half the memory, less what is in use


def test_parameters_are_counted_whatever_the_dtype_and_a_tied_array_once():
    import jax.numpy as jnp

    embed = jnp.zeros((10, 4), jnp.bfloat16)
    tree = {"embed": embed, "head": embed, "w": jnp.zeros((4, 4), jnp.float32)}
    assert fleet.tree_params(tree) == 56
    assert fleet.tree_bytes(tree) == 10 * 4 * 2 + 16 * 4
