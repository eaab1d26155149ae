"""scripts/bench_decode.py's recorded rows, without a model: one per batch size, keyed on the
configuration and the HF peer's mode, so a run of ours alone does not replace a row with HF."""

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_decode  # noqa: E402
import bench_record  # noqa: E402


def report(ours: dict[int, float], hf: dict[int, float] | None, date: str = "2026-11-26T10:00:00+00:00") -> dict:
    parameters = {
        "dtype": "float32", "kv_cache_dtype": "fp32", "prompt_len": 128, "decode_tokens": 64, "max_model_len": 208,
        "num_scheduler_steps": 1, "hf": hf is not None, "hf_compile": False,
    }  # fmt: skip
    results = []
    for batch, tok_s in ours.items():
        theirs = None if hf is None else {"prefill_tok_s": 600.0, "decode_tok_s": hf[batch]}
        ratio = {"prefill": None, "decode": None if hf is None else tok_s / hf[batch]}
        results.append({"batch": batch, "ours": {"prefill_tok_s": 1154.4, "decode_tok_s": tok_s}, "hf": theirs})
        results[-1]["ratio"] = ratio
    return {
        "date": date, "command": "python scripts/bench_decode.py", "commit": "abc1234", "model": "smollm2-135m",
        "device": {"summary": "AMD EPYC (2 cores)"}, "parameters": parameters, "results": results,
        "versions": {"python": "3.11.7", "jax": "0.10.2", "jaxlib": "0.10.2", "torch": None, "transformers": None},
        "tokens_match": None if hf is None else True, "ours_compilations": 12, "ours_compile_seconds": 30.0,
    }  # fmt: skip


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    log, markdown = tmp_path / "log.jsonl", tmp_path / "BENCHMARKS.md"
    markdown.write_text("# Benchmarks\n\n<!-- bench:decode:begin -->\n<!-- bench:decode:end -->\n")
    monkeypatch.setattr(bench_record, "LOG", log)
    monkeypatch.setattr(bench_record, "MARKDOWN", markdown)

    def read() -> tuple[list[list[str]], list[dict]]:
        rows = [line.split(" | ") for line in markdown.read_text().splitlines() if line.startswith("| AMD")]
        return rows, [json.loads(line) for line in log.read_text().splitlines()]

    return read


def test_each_batch_is_a_row_and_ours_alone_is_kept_apart_from_a_run_with_hf(recorded):
    bench_decode.record(report({1: 63.52, 8: 209.4}, hf={1: 24.9, 8: 121.0}))
    bench_decode.record(report({8: 215.0}, hf=None, date="2026-11-27T10:00:00+00:00"))
    rows, logged = recorded()
    assert [r[1:14] for r in rows] == [
        ["smollm2-135m", "float32", "fp32", "1", "128+64", "208", "1", "eager", "1,154", "600", "63.5", "24.9", "2.55"],
        ["smollm2-135m", "float32", "fp32", "8", "128+64", "208", "1", "eager", "1,154", "600", "209", "121", "1.73"],
        ["smollm2-135m", "float32", "fp32", "8", "128+64", "208", "1", "–", "1,154", "–", "215", "–", "–"],
    ]
    assert rows[0][14:16] == ["2026-11-26", "python 3.11.7, jax 0.10.2, jaxlib 0.10.2"]
    assert [e["commit"] for e in logged] == ["abc1234"] * 3
    assert logged[0]["details"]["ours"]["decode_tok_s"] == 63.52 and logged[0]["details"]["ours_compilations"] == 12
