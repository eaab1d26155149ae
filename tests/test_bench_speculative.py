"""scripts/bench_speculative.py without a model: its step-shape files (one per configuration,
compiled before the configuration's warm-up and written back after it) and the recorded rows
(one per configuration)."""

import json
import pathlib
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_record  # noqa: E402
import bench_speculative  # noqa: E402

from aither_jax.compile import shape_file  # noqa: E402


class FakeEngine:
    max_num_seqs = 1

    def __init__(self, ran: list[dict]):
        self.ran, self.precompiled = ran, []

    def precompile(self, shapes):
        self.precompiled.append(list(shapes))
        return len(shapes)

    def step_shapes(self):
        return self.ran


def fake_llm(ran: list[dict]):
    return types.SimpleNamespace(
        engine=FakeEngine(ran), config=types.SimpleNamespace(name="m"), kv_spec=types.SimpleNamespace(name="fp32")
    )


def test_each_configuration_has_its_own_file(tmp_path):
    args = bench_speculative.parse_args(["--compile-shapes", str(tmp_path), "--kv-cache-dtype", "auto"])
    specs = [
        None,
        {"method": "dflash", "prompt_lookup": False, "num_speculative_tokens": 15, "steps": 1},
        {"method": "dflash", "prompt_lookup": True, "steps": 1, "tree": 15},
        {"method": "ngram", "num_speculative_tokens": 8},
    ]
    paths = [bench_speculative.shapes_file(args, spec) for spec in specs]
    assert len(set(paths)) == len(specs) and all(p.parent == tmp_path and p.suffix == ".json" for p in paths)
    assert all(c.isalnum() or c in "._-" for p in paths for c in p.name)
    no_dir = bench_speculative.parse_args([])
    assert bench_speculative.shapes_file(no_dir, None) is None


def test_recorded_shapes_compile_first_and_the_run_is_written_back(tmp_path, capsys):
    path = tmp_path / "plain.json"
    first = {"kind": "steps", "rows": 1, "pages": 8, "greedy": True, "num_steps": 8}
    ran = [first, {"kind": "forward", "rows": 1, "tokens": 64, "pages": 0}]
    llm = fake_llm(ran)
    with bench_speculative.recorded_shapes(llm, path):  # no file yet: nothing to compile
        assert llm.engine.precompiled == []
    assert shape_file.load(path) == ran

    again = fake_llm(ran + [{"kind": "copy", "rows": 2}])
    with bench_speculative.recorded_shapes(again, path):
        assert again.engine.precompiled == [ran]  # before the block runs
    assert shape_file.load(path) == ran + [{"kind": "copy", "rows": 2}]
    assert "2 of 2 recorded step shapes compiled" in capsys.readouterr().err

    with bench_speculative.recorded_shapes(fake_llm([]), None):  # without --compile-shapes
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.json"]


def test_shapes_from_needs_compile_shapes(tmp_path):
    args = bench_speculative.parse_args(["--shapes-from", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench_speculative.prepare_shapes(args)


def row(method: str, tau: float, speedup: float, **spec) -> dict:
    block = 9 if method == "ngram" else 16
    return {
        "speculative": method, "block_size": block, "steps": 1 if method == "dflash" else None, "num_prompts": 12,
        "tau_mean": tau, "speedup": speedup, "identical_outputs": 5, "baseline_tokens_per_second": 54.04, **spec,
    }  # fmt: skip


def test_each_configuration_is_a_row_and_a_rerun_replaces_only_its_own(tmp_path, monkeypatch):
    log, markdown = tmp_path / "log.jsonl", tmp_path / "BENCHMARKS.md"
    markdown.write_text("# Benchmarks\n")
    monkeypatch.setattr(bench_record, "LOG", log)
    monkeypatch.setattr(bench_record, "MARKDOWN", markdown)
    config = {"model": "smollm2-135m", "dtype": "float32", "kv_cache_dtype": "fp32", "max_tokens": 96, "batch_size": 1}
    env = {"date": "2026-11-27", "device": "AMD EPYC (2 cores)", "jax": "0.10.2", "python": "3.11.7"}
    first = [
        row("dflash", 1.414, 0.6912),
        row("ngram", 1.2, 1.06),
        row("dflash", 1.71, 1.05, prompt_lookup=True, tree=3),
    ]
    bench_speculative.record({"config": config, "env": env, "rows": first}, "python scripts/bench_speculative.py")
    rerun = {"config": config, "env": env | {"date": "2026-11-28"}, "rows": [row("dflash", 1.5, 0.7)]}
    bench_speculative.record(rerun, "again")
    rows = [line.split(" | ") for line in markdown.read_text().splitlines() if line.startswith("| AMD")]
    assert [r[6:11] for r in rows] == [
        ["dflash S=1 k=15", "1.5", "0.7", "54.0", "5/12"],
        ["ngram k=8", "1.2", "1.06", "54.0", "5/12"],
        ["dflash S=1 tree 3 +lookup", "1.71", "1.05", "54.0", "5/12"],
    ]
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["config"]["method"] for e in logged] == ["dflash S=1 k=15", "ngram k=8", "dflash S=1 tree 3 +lookup"] + [
        "dflash S=1 k=15"
    ]
    assert logged[0]["details"]["tau_mean"] == 1.414 and logged[0]["figures"]["tau"] == 1.41
