"""The fidelity eval's comparison (identical replies, common prefixes, factual questions a
format breaks, replies side by side) and its prompt-set checks; the shipped prompt set."""

from __future__ import annotations

import json

import pytest

from aither_jax.quant.fidelity import PROMPTS, FormatAnswers, compare, load_prompts, table

CHAT = ["a", "b", "c", "d"]
FACTUAL = [
    {"question": "capital of France?", "answers": ["Paris"]},
    {"question": "days in a week?", "answers": ["7", "seven"]},
    {"question": "largest planet?", "answers": ["Jupiter"]},
]


def test_compare_counts_identical_replies_prefixes_and_broken_facts():
    ref = FormatAnswers(
        "fp32", [[1, 2, 3], [4, 5], [6], [7, 8]], ["r0", "r1", "r2", "r3"], ["Paris.", "Seven days", "Mars"]
    )
    fmt = FormatAnswers("tq4", [[1, 2, 9], [4, 5], [0], [7, 8]], ["x0", "r1", "x2", "r3"], ["Lyon.", "7", "Jupiter"])
    row = compare(ref, fmt, CHAT, FACTUAL)
    assert (row["identical"], row["prompts"]) == (2, 4)
    assert row["mean_common_prefix"] == pytest.approx((2 + 2 + 0 + 2) / 4)
    # fp32 knows France and the week (not the planet); the format loses France, keeps the week,
    # and its right answer about the planet is no credit: the reference did not know it.
    assert (row["factual_known_by_reference"], row["factual_kept"]) == (2, 1)
    assert row["factual_broken"] == ["capital of France?"]
    assert [d["prompt"] for d in row["differing"]] == ["a", "c"] and row["differing"][0]["format"] == "x0"
    report = {"model": "m", "max_tokens": 3, "reference": "fp32", "rows": [{**row, "compression_vs_bf16": 4.0}]}
    assert "tq4" in table(report) and "2/4" in table(report)


def test_prompt_sets_are_checked(tmp_path):
    chat, factual = load_prompts()
    assert len(chat) >= 32 and len(factual) >= 16 and str(PROMPTS).endswith("fidelity_prompts.json")
    bad = tmp_path / "bad.json"
    for body, message in (
        ("{", "not a readable JSON prompt set"),
        (json.dumps({"chat": []}), "non-empty list of strings"),
        (json.dumps({"chat": ["x"], "factual": [{"question": "q"}]}), "needs a"),
    ):
        bad.write_text(body)
        with pytest.raises(ValueError, match=message):
            load_prompts(bad)


@pytest.mark.parametrize("model", ["smollm2-135m"])
def test_the_default_format_keeps_the_models_answers(model, tmp_path):
    """The default (`auto`) KV format answers as the unquantized cache does: no factual
    question the float32 cache gets right is lost, and the chat replies agree. (The measured
    per-layer TurboQuant format loses "What is the capital of France?".)"""
    from aither_jax.quant.fidelity import run_fidelity

    chat, factual = load_prompts()
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"chat": chat[:8], "factual": factual[:12]}))
    (row,) = run_fidelity(model, ["auto"], prompts=small, max_tokens=16)["rows"]
    assert row["factual_known_by_reference"] >= 6 and row["factual_broken"] == [], row["factual_broken"]
    # How many of the 8 replies agree word for word depends on the CPU's matmul kernels,
    # whose rounding decides near ties: 7 where this was first measured, 6 on an AMD EPYC
    # Zen 3 (AVX2 only), with no factual answer lost on either.
    assert row["identical"] >= 6, row["differing"]
