"""KV cache format names and their bytes per token (SPEC section 3's formula and figures)."""

from __future__ import annotations

import pytest

from aither_jax.turboquant import TurboQuant
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
    ],
)
def test_parse(name, k, v, kq, vq):
    spec = parse_kv_spec(name)
    assert (spec.key_bits, spec.value_bits, spec.key_qjl, spec.value_qjl) == (k, v, kq, vq)


@pytest.mark.parametrize("name", ["tq1", "tq9", "tq-k9v4", "tq4-qjlx", "int8", "", "TQ4", "tq-k4"])
def test_bad_names_list_the_accepted_forms(name):
    with pytest.raises(ValueError, match=r"bits must be in 2\.\.8|unknown kv cache dtype|unknown modifier"):
        parse_kv_spec(name)


@pytest.mark.parametrize(
    "name, expected", [("bf16", 23040), ("fp32", 46080), ("tq4", 6480), ("tq2", 3600), ("tq3", 5040)]
)
def test_smollm2_bytes_per_token_match_spec(name, expected):
    assert parse_kv_spec(name).bytes_per_token(SMOLLM2) == expected


@pytest.mark.parametrize("name", ["tq4", "tq-k6v4", "tq3-qjlk", "tq-k4v2-qjlv"])
def test_bytes_agree_with_the_codec(name):
    spec = parse_kv_spec(name)
    k = TurboQuant(head_dim=64, bits=spec.key_bits, qjl=spec.key_qjl).bytes_per_vector
    v = TurboQuant(head_dim=64, bits=spec.value_bits, qjl=spec.value_qjl).bytes_per_vector
    assert spec.bytes_per_token(SMOLLM2) == 30 * 3 * (k + v)
