"""KV cache format names and their bytes per token (SPEC section 3's formula and figures)."""

from __future__ import annotations

import pytest

from aither_jax.turboquant import make_codec
from models.config import ModelConfig
from models.kv_spec import parse_kv_spec

SMOLLM2 = ModelConfig("llama", 30, 576, 1536, 9, 3, 64, 49152, 8192)


@pytest.mark.parametrize(
    "name, k, v, kq, vq",
    [
        ("bf16", None, None, False, False),
        ("tq4", 4, 4, False, False),
        ("tq-k6v4", 6, 4, False, False),
        ("tq3-qjlk", 3, 3, True, False),
        ("tq-k4v2-qjlv", 4, 2, False, True),
        ("tq2-qjl", 2, 2, True, True),
        ("tq3.5", 3.5, 3.5, False, False),
        ("tq-k4.5v3-qjlk", 4.5, 3, True, False),
    ],
)
def test_parse(name, k, v, kq, vq):
    spec = parse_kv_spec(name)
    assert (spec.key_bits, spec.value_bits, spec.key_qjl, spec.value_qjl) == (k, v, kq, vq)


@pytest.mark.parametrize(
    "name", ["tq1", "tq9", "tq-k9v4", "tq4-qjlx", "int8", "", "TQ4", "tq-k4", "tq8.5", "tq1.5", "tq3.7", "tq4-k9.5@1"]
)
def test_bad_names_list_the_accepted_forms(name):
    with pytest.raises(ValueError, match=r"bits must be in 2\.\.8|unknown kv cache dtype|unknown modifier"):
        parse_kv_spec(name)


@pytest.mark.parametrize(
    "name, expected",
    [("bf16", 23040), ("fp32", 46080), ("tq4", 6120), ("tq2", 3240), ("tq3", 4680), ("tq3.5", 5760), ("tq2.5", 4320)],
)
def test_smollm2_bytes_per_token_match_spec(name, expected):
    assert parse_kv_spec(name).bytes_per_token(SMOLLM2) == expected


@pytest.mark.parametrize("name", ["tq4", "tq-k6v4", "tq3-qjlk", "tq-k4v2-qjlv", "tq3.5", "tq-k4.5v3-qjlk"])
def test_bytes_agree_with_the_codec(name):
    spec = parse_kv_spec(name)
    k = make_codec(64, spec.key_bits, qjl=spec.key_qjl).bytes_per_vector
    v = make_codec(64, spec.value_bits, qjl=spec.value_qjl).bytes_per_vector
    assert spec.bytes_per_token(SMOLLM2) == 30 * 3 * (k + v)


def test_boundary_layers_and_overrides_resolve_per_layer():
    spec = parse_kv_spec("tq-k5v4-b2-k8@2,10-vbf16@15-k3@1")
    k, v = spec.layer_bits("k", 30), spec.layer_bits("v", 30)
    assert k[:3] == (None, 3, 8) and k[10] == 8 and k[28:] == (None, None) and k[5] == 5
    assert k[27] == 5  # only the last two layers are boundary layers
    assert v[:2] == (None, None) and v[15] is None and v[2] == 4 and v[28:] == (None, None)
    # bf16 layers cost 128 B per vector; TurboQuant ones codes + a float16 norm.
    expected = 3 * sum((64 * 2 if b is None else 64 * b // 8 + 2) for b in k + v)
    assert spec.bytes_per_token(SMOLLM2) == expected


@pytest.mark.parametrize(
    "name, message",
    [
        ("tq4-k9@1", "bits must be in 2..8"),
        ("tq4-k8@", "unknown modifier"),
        ("tq4-x3", "unknown modifier"),
        ("tq4-k8@1,,2", "unknown modifier"),
        ("tq4-s0", "sink tokens must be in 1..64"),
        ("tq4-s65", "sink tokens must be in 1..64"),
    ],
)
def test_bad_modifiers(name, message):
    with pytest.raises(ValueError, match=message):
        parse_kv_spec(name)


def test_override_past_the_last_layer_names_the_layer_count():
    with pytest.raises(ValueError, match="names layer 30, but the model has 30 layers"):
        parse_kv_spec("tq4-k8@30").bytes_per_token(SMOLLM2)


def test_sink_tokens_do_not_change_bytes_per_token():
    spec = parse_kv_spec("tq-k6v4-s4")
    assert spec.sink_tokens == 4 and parse_kv_spec("tq-k6v4").sink_tokens == 0
    assert spec.bytes_per_token(SMOLLM2) == parse_kv_spec("tq-k6v4").bytes_per_token(SMOLLM2)


@pytest.mark.parametrize(
    "name, k, v", [("tq4", "haar", "haar"), ("tq4-hadk", "hadamard", "haar"), ("tq-k6v4-hadv-s2", "haar", "hadamard")]
)
def test_rotation_modifiers(name, k, v):
    spec = parse_kv_spec(name)
    assert (spec.key_rotation, spec.value_rotation) == (k, v)
    assert parse_kv_spec("tq4-had").rotation("k") == parse_kv_spec("tq4-had").rotation("v") == "hadamard"
    assert spec.bytes_per_token(SMOLLM2) == parse_kv_spec(
        name.replace("-hadk", "").replace("-hadv", "")
    ).bytes_per_token(SMOLLM2)


@pytest.mark.parametrize("name", ["tq3.5-had", "tq-k4.5v4-hadk", "tq4-hadv-v2.5@3"])
def test_hadamard_needs_integer_bits(name):
    with pytest.raises(ValueError, match="Hadamard rotation is for integer bit widths"):
        parse_kv_spec(name)
