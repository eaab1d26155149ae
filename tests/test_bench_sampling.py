"""scripts/bench_sampling.py: argument checks, the sampler timing and the BENCHMARKS row."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
import bench_sampling  # noqa: E402


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        bench_sampling.parse_args(["--repeats", "0"])
    with pytest.raises(SystemExit):
        bench_sampling.parse_args(["--rows", "0"])


def test_sampler_timing_is_a_positive_duration():
    assert bench_sampling.time_sampler(2, 0.8, 0.9, vocab=512) > 0


def test_row_lists_every_setting_by_rows(monkeypatch):
    rows = []
    monkeypatch.setattr(bench_sampling, "append_row", lambda header, columns, row: rows.append(row))
    report = {
        "sampler_ms": [
            {"rows": r, "temperature": t, "top_p": p, "ms": ms}
            for (t, p), ms in zip(bench_sampling.SETTINGS, (0.5, 12.0), strict=True)
            for r in (1, 8)
        ],
        "decode_tok_s": [
            {"rows": r, "temperature": t, "top_p": p, "tok_s": tps}
            for (t, p), tps in zip(bench_sampling.SETTINGS, (200.0, 130.0), strict=True)
            for r in (1, 8)
        ],
        "env": {"date": "2026-11-25", "device": "cpu", "jax": "0.10.2", "python": "3.11.7"},
    }
    bench_sampling.record(report, "python scripts/bench_sampling.py")
    cells = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert cells[2:6] == ["1: 0.50, 8: 0.50", "1: 12.00, 8: 12.00", "1: 200, 8: 200", "1: 130, 8: 130"]
