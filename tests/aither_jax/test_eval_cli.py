"""`python -m aither_jax.eval capacity`: the table, JSON rows, and usage errors."""

from __future__ import annotations

import json

import pytest

from aither_jax import eval as aj_eval


def test_capacity_json_rows(capsys):
    assert aj_eval.main(["capacity", "--kv-cache-dtype", "bf16", "tq4", "tq-k6v4", "--memory-gib", "2", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["kv_cache_dtype"] for r in rows] == ["bf16", "tq4", "tq-k6v4"]
    by = {r["kv_cache_dtype"]: r for r in rows}
    assert by["bf16"]["bytes_per_token"] == 23040 and by["tq4"]["bytes_per_token"] == 6480
    assert by["tq4"]["compression_vs_bf16"] == pytest.approx(23040 / 6480, abs=1e-3)
    assert by["tq4"]["tokens_in_budget"] == (2 << 30) // 6480


def test_capacity_table(capsys):
    assert aj_eval.main(["capacity"]) == 0
    out = capsys.readouterr().out
    assert "tq4" in out and "3.56x" in out and "46,603" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["capacity", "--kv-cache-dtype", "tq9"], "bits must be in 2..8"),
        (["capacity", "--kv-cache-dtype", "int8"], "unknown kv cache dtype 'int8'"),
        (["capacity", "--memory-gib", "0"], "must be in (0, 1048576]"),
        (["capacity", "--model", "nope"], "unknown model 'nope'"),
        ([], "command"),
    ],
)
def test_bad_usage_exits_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        aj_eval.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
