"""`python -m aither_jax.eval residency`: its prompts, bounds and usage errors (the measurement
itself is scripts/bench_residency.py's, on the real model)."""

from __future__ import annotations

import pytest

from aither_jax import eval as aj_eval
from aither_jax import residency_eval
from models.registry import load_model


def test_passkey_prompts_bury_the_key_at_their_depth_within_their_length():
    tokenizer = load_model("smollm2-135m", "float32", progress=False, num_layers=1).tokenizer
    text, source = residency_eval.default_text()
    assert "language reference" in source and len(text) > 200_000
    filler = tokenizer.encode(text)[:3000]
    for depth in residency_eval.DEPTHS:
        ids = residency_eval.passkey_prompt(tokenizer, filler, 1024, depth, 40817)
        assert abs(len(ids) - 1024) <= 8
        decoded = tokenizer.decode(ids)
        where = decoded.index("The pass key is 40817.") / len(decoded)
        assert abs(where - depth) < 0.08, (depth, where)
        assert decoded.rstrip().endswith(residency_eval.PASSKEY_QUESTION) or residency_eval.PASSKEY_QUESTION in decoded


def test_bounds_are_whole_pages_of_the_share():
    assert residency_eval.bound_tokens(0.25, 4096) == 1024
    assert residency_eval.bound_tokens(0.1, 4096) == 400
    assert residency_eval.bound_tokens(0.001, 4096) == 16


@pytest.mark.parametrize(
    "argv, message",
    [
        (["residency", "--residency", "0"], "--residency"),
        (["residency", "--scorer", "random"], "invalid choice"),
        (["residency", "--text-file", "/nonexistent.txt"], "does not exist"),
        (["residency", "--num-tokens", "16"], "--num-tokens"),
        # Found before the full cache's run (the bounded engine refuses a bound that small).
        (["residency", "--num-tokens", "512", "--residency", "0.05", "0.5"], "resident share 0.05 of 512 tokens"),
        (["residency", "--plot", "out/kl.txt"], "--plot must end in"),
    ],
)
def test_bad_usage_exits_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        aj_eval.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "full cache" not in err  # refused before the full cache's run
