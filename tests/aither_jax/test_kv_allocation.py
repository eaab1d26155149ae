"""Greedy per-layer bit allocation and the format names it produces."""

from __future__ import annotations

import pytest

from aither_jax.kv_allocation import allocate_bits, probe_name, spec_name
from models.kv_spec import parse_kv_spec

VECTOR_BYTES = {side: {b: 64 * b // 8 + 2 for b in range(2, 9)} for side in "kv"}


def test_budget_is_respected_and_bits_go_to_the_sensitive_layers():
    sensitivity = {("k", i): 0.001 for i in range(4)} | {("v", i): 0.001 for i in range(4)}
    sensitivity[("k", 2)] = 0.1
    bits, predicted, used = allocate_bits(sensitivity, {"k": 4, "v": 3}, {"k": 3, "v": 3}, VECTOR_BYTES, 8 * 36, 1)
    assert used <= 8 * 36 and used == sum(VECTOR_BYTES[s][b] for (s, _), b in bits.items())
    assert bits[("k", 2)] == max(bits.values()) and bits[("k", 2)] >= 6
    assert predicted == pytest.approx(
        sum(sensitivity[k] * 4.0 ** ({"k": 4, "v": 3}[k[0]] - b) for k, b in bits.items())
    )
    # More budget never predicts more KL.
    _, more, _ = allocate_bits(sensitivity, {"k": 4, "v": 3}, {"k": 3, "v": 3}, VECTOR_BYTES, 8 * 44, 1)
    assert more < predicted


def test_budget_below_the_minimum_is_an_error():
    sensitivity = {("k", 0): 0.1, ("v", 0): 0.1}
    with pytest.raises(ValueError, match="below the minimum"):
        allocate_bits(sensitivity, {"k": 4, "v": 4}, {"k": 4, "v": 4}, VECTOR_BYTES, 40, 1)


def test_spec_name_round_trips_through_the_parser():
    bits = {("k", i): b for i, b in enumerate([5, 5, 8, 6, 5, 5])} | {
        ("v", i): b for i, b in enumerate([4, 3, 4, 4, 6, 4])
    }
    name = spec_name(bits, 6)
    assert name == "tq-k5v4-k6@3-k8@2-v3@1-v6@4"
    spec = parse_kv_spec(name)
    assert list(spec.layer_bits("k", 6)) == [bits[("k", i)] for i in range(6)]
    assert list(spec.layer_bits("v", 6)) == [bits[("v", i)] for i in range(6)]


def test_probe_quantizes_exactly_one_layer_side():
    spec = parse_kv_spec(probe_name("v", 3, 3, 30))
    assert spec.layer_bits("k", 30) == (None,) * 30
    v = spec.layer_bits("v", 30)
    assert v[3] == 3 and sum(b is not None for b in v) == 1
