"""Greedy per-layer bit allocation and the format names it produces."""

from __future__ import annotations

import pytest

from aither_jax.quant.allocation import allocate_bits, probe_name, spec_name
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


class _FakeScorer:
    """Stands in for `eval.FormatScorer`: a format's KL on a text is the sum over its quantized
    layer sides of that text's weight for the side, times 4^-(bits - 4)."""

    weights = {}  # text path -> {(side, layer): KL at 4 bits}
    scored = []  # (text path, format name), in order

    def __init__(self, model, dtype, text_file, max_tokens, chunk):
        from models.kv_spec import parse_kv_spec as parse

        self.text_file, self.parse, self.dtype = text_file, parse, dtype
        self.llm = type("L", (), {"config": type("C", (), {"num_layers": 2, "num_kv_heads": 1, "head_dim": 64})})()
        self.bf16_bytes = 2 * 2 * 64 * 2

    def score(self, spec):
        _FakeScorer.scored.append((self.text_file, spec.name))
        kl = 0.0
        for side in "kv":
            for layer, bits in enumerate(spec.layer_bits(side, 2)):
                if bits is not None:
                    kl += self.weights[self.text_file][(side, layer)] * 4.0 ** (4 - bits)
        row = {"model": "m", "kv_cache_dtype": spec.name, "bytes_per_token": 1, "compression_vs_bf16": 1.0}
        return row | {
            "kl_divergence": kl,
            "perplexity_change_pct": 0.0,
            "top1_agreement": 1.0,
            "text_file": self.text_file,
        }


def test_run_allocate_fits_on_the_mean_of_its_texts_and_only_scores_held_out_ones(monkeypatch):
    import aither_jax.quant.allocation as alloc

    # Text a finds key layer 0 sensitive, text b value layer 1; the held-out text would pull
    # every bit to key layer 1 if it were used for fitting.
    _FakeScorer.weights = {
        "a": {("k", 0): 0.08, ("k", 1): 0.001, ("v", 0): 0.001, ("v", 1): 0.001},
        "b": {("k", 0): 0.001, ("k", 1): 0.001, ("v", 0): 0.001, ("v", 1): 0.04},
        "held": {("k", 0): 0.0, ("k", 1): 1.0, ("v", 0): 0.0, ("v", 1): 0.0},
    }
    _FakeScorer.scored = []
    monkeypatch.setattr(alloc, "FormatScorer", _FakeScorer)
    report = alloc.run_allocate(_allocate_args())
    assert report["texts"] == ["a", "b"] and report["held_out"] == ["held"]
    # Probes ran on the fitted texts only, and their KL is the mean over them.
    probed = {text for text, name in _FakeScorer.scored[:-3]}
    assert probed == {"a", "b"} and len(_FakeScorer.scored) == 4 * 2 + 3
    by_probe = {(p["side"], p["layer"]): p for p in report["probes"]}
    assert by_probe[("k", 0)]["kl_divergence"] == pytest.approx((0.08 + 0.001) / 2)
    assert by_probe[("v", 1)]["kl_by_text"] == pytest.approx([0.001, 0.04])
    (plan,) = report["plans"]
    bits = parse_kv_spec(plan["kv_cache_dtype"])
    k_bits, v_bits = bits.layer_bits("k", 2), bits.layer_bits("v", 2)
    # 144 B/token buys five 8-byte steps over 3 bits everywhere: by the mean, three go to key
    # layer 0 and two to value layer 1 (the held-out text would have sent them to key layer 1).
    assert (k_bits, v_bits) == ((6, 3), (3, 5))
    rows = plan["by_text"]
    assert [(r["text_file"], r["held_out"]) for r in rows] == [("a", False), ("b", False), ("held", True)]
    assert plan["kl_divergence"] == pytest.approx((rows[0]["kl_divergence"] + rows[1]["kl_divergence"]) / 2)


def _allocate_args(**changes):
    from types import SimpleNamespace

    args = dict(model="m", dtype="float32", text_file=["a", "b"], held_out_file=["held"], max_tokens=16, chunk=16)
    args |= dict(probe_key_bits=4, probe_value_bits=4, min_bits=3, key_transform=False, sink_tokens=0)
    return SimpleNamespace(**(args | dict(compression=[512 / 144], probes_file=None) | changes))


def test_run_allocate_resumes_from_its_probes_file(monkeypatch, tmp_path):
    import aither_jax.quant.allocation as alloc

    monkeypatch.setattr(alloc, "FormatScorer", _FakeScorer)
    _FakeScorer.weights = {t: {(s, i): 0.01 * (i + 1) for s in "kv" for i in range(2)} for t in ("a", "b", "held")}
    probes = tmp_path / "probes.jsonl"
    _FakeScorer.scored = []
    first = alloc.run_allocate(_allocate_args(probes_file=str(probes)))
    assert len(_FakeScorer.scored) == 4 * 2 + 3 and len(probes.read_text().splitlines()) == 4
    # A crash mid-write leaves a torn line; another setting's rows must not be reused.
    lines = probes.read_text().splitlines()
    other = lines[0].replace('"max_tokens": 16', '"max_tokens": 32').replace("0.01", "0.5")
    probes.write_text("\n".join([other, *lines[:3], lines[3][:20]]) + "\n")
    _FakeScorer.scored = []
    second = alloc.run_allocate(_allocate_args(probes_file=str(probes)))
    # Three probes reused, the torn one measured again, then the plan on three texts.
    assert [t for t, _ in _FakeScorer.scored] == ["a", "b", "a", "b", "held"]
    assert second["probes"] == first["probes"] and second["plans"] == first["plans"]
