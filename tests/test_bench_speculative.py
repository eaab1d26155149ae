"""scripts/bench_speculative.py without a model: its step-shape files (one per configuration,
compiled before the configuration's warm-up and written back after it)."""

import pathlib
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
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
