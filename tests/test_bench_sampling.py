"""scripts/bench_sampling.py: argument checks, the sampler timing and the recorded rows."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
import bench_record  # noqa: E402
import bench_sampling  # noqa: E402


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        bench_sampling.parse_args(["--repeats", "0"])
    with pytest.raises(SystemExit):
        bench_sampling.parse_args(["--rows", "0"])


def test_sampler_timing_is_a_positive_duration():
    assert bench_sampling.time_sampler(2, 0.8, 0.9, vocab=512) > 0


def test_each_setting_is_a_row_of_its_figures_by_rows(tmp_path, monkeypatch):
    log, markdown = tmp_path / "log.jsonl", tmp_path / "BENCHMARKS.md"
    markdown.write_text("# Benchmarks\n\n<!-- bench:sampling:begin -->\n<!-- bench:sampling:end -->\n")
    monkeypatch.setattr(bench_record, "LOG", log)
    monkeypatch.setattr(bench_record, "MARKDOWN", markdown)
    report = {
        "config": {"model": "smollm2-135m"},
        "sampler_ms": [
            {"rows": r, "temperature": t, "top_p": p, "ms": ms * r}
            for (t, p), ms in zip(bench_sampling.SETTINGS, (0.5, 12.0), strict=True)
            for r in (1, 8)
        ],
        "decode_tok_s": [
            {"rows": r, "temperature": t, "top_p": p, "tok_s": tps * r}
            for (t, p), tps in zip(bench_sampling.SETTINGS, (200.0, 130.0), strict=True)
            for r in (1, 8)
        ],
        "env": {"date": "2026-11-25", "device": "cpu", "jax": "0.10.2", "python": "3.11.7"},
    }
    bench_sampling.record(report, "python scripts/bench_sampling.py")
    rows = [line.split(" | ")[1:6] for line in markdown.read_text().splitlines() if line.startswith("| cpu")]
    assert rows == [
        ["smollm2-135m", "float32 / fp32", "temperature 1", "1: 0.5, 8: 4.0", "1: 200, 8: 1,600"],
        ["smollm2-135m", "float32 / fp32", "temperature 0.8, top-p 0.9", "1: 12.0, 8: 96.0", "1: 130, 8: 1,040"],
    ]
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["details"]["sampler_ms"] for e in logged] == [report["sampler_ms"][:2], report["sampler_ms"][2:]]
