"""`python -m aither_jax.train_draft` as a command: flags out of range stop it at parse time with
exit code 2, and a tiny run on the real target writes data and checkpoints, exports a draft that
loads, resumes from both, and refuses a run directory made for another draft."""

import functools
import json
import logging
import re
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import models.weights
from aither_jax.speculative.train import prompts
from aither_jax.speculative.train.run import main, parse_args
from models.draft import DraftConfig
from models.draft_io import load_draft

# The cheapest run of every stage: 2 docstring + 2 chat prompts answered with 8 tokens each, in
# two shards of 2; a one-layer draft with a 256-token head trained on soft and hard labels.
TINY = [
    "--num-prompts", "2", "--num-chat-prompts", "2", "--max-new-tokens", "8", "--max-len", "96",
    "--gen-batch", "4", "--shard-size", "2", "--num-layers", "1", "--intermediate-size", "64", "--num-taps", "1",
    "--block-size", "4", "--draft-vocab-size", "256", "--teacher-top-k", "4", "--batch-seqs", "2", "--anchors", "2",
    "--warmup", "0", "--log-every", "1", "--save-every", "1", "--val-fraction", "0",
]  # fmt: skip


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--gamma", "0"),
        ("--gamma", "nan"),
        ("--lr", "-1"),
        ("--lr", "0"),
        ("--shard-size", "0"),
        ("--gen-batch", "0"),
        ("--reveal-prob", "2"),
        ("--num-layers", "0"),
        ("--block-size", "1"),
        ("--block-size", "65"),
        ("--intermediate-size", "0"),
        ("--num-taps", "0"),
        ("--draft-vocab-size", "-1"),
        ("--steps", "0"),
        ("--stop-after", "-1"),
        ("--time-limit", "-5"),
        ("--time-limit", "inf"),
        ("--warmup", "-1"),
        ("--max-len", "1"),
        ("--num-chat-prompts", "100000"),
        ("--print-prompts", "-1"),
        ("--val-fraction", "0.5"),
        ("--val-fraction", "nan"),
        ("--seed", "-1"),
        ("--num-prompts", "two"),
    ],
)
def test_out_of_range_flags_exit_with_code_2_naming_the_flag(tmp_path, flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--out", str(tmp_path), flag, value])
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value",
    [("--draft-vocab-size", "49153"), ("--teacher-top-k", "49153"), ("--num-taps", "28")],
)
def test_flags_beyond_the_target_stop_before_any_work(tmp_path, flag, value, capsys):
    """SmolLM2-135M: 49152 tokens, 30 layers (taps spread over layers 1..27)."""
    out = tmp_path / "run"
    assert f"{flag} must be <= " in _usage_error(["--out", str(out), *TINY, "--steps", "1", flag, value], capsys)
    assert not out.exists()


def _usage_error(argv, capsys) -> str:
    """main(argv) stops with exit code 2 (a usage error); its message."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def _log(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--init-draft", "missing.npz"], "--init-draft: no such file"),
        (["--init-draft", __file__, "--init-from-target", "last"], "give one"),
    ],
)
def test_starting_points_are_checked(tmp_path, extra, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--out", str(tmp_path), *extra])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.fixture
def read_once(monkeypatch):
    """The standard library's docstrings and the target's weights read once for all the runs of a
    test (each run reads them again otherwise): the same values every time."""
    monkeypatch.setattr(prompts, "stdlib_docs", functools.cache(prompts.stdlib_docs))
    load, loaded = models.weights.load_weights, {}

    def load_weights(gguf, cfg, *args, **kwargs):
        key = (gguf.path, repr(cfg), args, tuple(sorted(kwargs.items())))
        if key not in loaded:
            loaded[key] = load(gguf, cfg, *args, **kwargs)
        return loaded[key]

    monkeypatch.setattr(models.weights, "load_weights", load_weights)


def test_tiny_run_writes_exports_resumes_and_refuses_another_draft(tmp_path, caplog, read_once, capsys):
    caplog.set_level(logging.INFO, logger="aither_jax.train_draft")
    out, first, second, third = (tmp_path / name for name in ("run", "first.npz", "second.npz", "third.npz"))
    argv = ["--out", str(out), *TINY, "--steps", "4"]

    # Stages 1 + 2 under a time limit that has passed once the data is written: no step, no export.
    assert main([*argv, "--time-limit", "1e-6", "--export", str(first)]) == 0
    assert "nothing to export: no training step was taken" in " ".join(caplog.messages)
    assert not first.exists() and ocp.CheckpointManager((out / "checkpoints").absolute()).latest_step() is None

    # Stage 3 from those shards: the schedule spans 4 steps, the run stops after 2.
    assert main([*argv, "--stop-after", "2", "--export", str(first)]) == 0
    shards = sorted((out / "data").glob("*.npz"))
    assert [p.name for p in shards] == ["shard0000.npz", "shard0001.npz"]
    cfg = DraftConfig.from_json((out / "draft_config.json").read_text())
    assert (cfg.num_layers, cfg.block_size, cfg.draft_vocab_size, len(cfg.target_layers)) == (1, 4, 256, 1)
    assert [r["step"] for r in _log(out)] == [1, 2]
    assert ocp.CheckpointManager((out / "checkpoints").absolute()).latest_step() == 2

    cfg1, params1, meta, vocab = load_draft(first)
    assert cfg1 == cfg and vocab is not None and len(vocab) == 256
    assert meta["model"] == "smollm2-135m" and (meta["data_sequences"], meta["steps"], meta["schedule_steps"]) == (
        4,
        2,
        4,
    )
    assert meta["command"].startswith("python -m aither_jax.train_draft --out ")
    assert "--stop-after 2" in meta["command"] and "--num-layers 1" in meta["command"]

    # A rerun whose time limit has passed by the end of the (reused) data stage takes no step
    # and exports the draft as checkpointed.
    caplog.clear()
    assert main([*argv, "--time-limit", "1e-6", "--export", str(third)]) == 0
    assert "the time limit was reached before training: no step taken (rerun to train)" in caplog.messages
    assert [r["step"] for r in _log(out)] == [1, 2]
    _, params3, meta3, _ = load_draft(third)
    assert (meta3["steps"], meta3["schedule_steps"]) == (2, 4)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params1), jax.tree.leaves(params3), strict=True))

    # The rerun reuses the shards (no target, nothing rewritten) and continues from step 2.
    mtimes = [p.stat().st_mtime_ns for p in shards]
    caplog.clear()
    assert main([*argv, "--export", str(second)]) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert "resumed from step 2" in messages
    assert not any(m.startswith("wrote ") for m in messages)
    assert [p.stat().st_mtime_ns for p in shards] == mtimes
    assert [r["step"] for r in _log(out)] == [1, 2, 3, 4]
    assert ocp.CheckpointManager((out / "checkpoints").absolute()).latest_step() == 4
    cfg2, params2, meta2, vocab2 = load_draft(second)
    assert (meta2["steps"], meta2["schedule_steps"]) == (4, 4)
    assert cfg2 == cfg and np.array_equal(vocab2, vocab)
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params1), jax.tree.leaves(params2), strict=True)]
    assert any(moved)  # two more steps changed the draft

    # Another draft shape on the same run directory: refused before any work, the config kept.
    saved = (out / "draft_config.json").read_text()
    assert "holds a different draft configuration; use a new --out" in _usage_error(
        [*argv, "--num-layers", "2"], capsys
    )
    assert (out / "draft_config.json").read_text() == saved

    # A new run started from the exported draft: its parameters and head, its origin recorded.
    warm, fourth = tmp_path / "warm", tmp_path / "fourth.npz"
    shutil.copytree(out / "data", warm / "data")  # the same flags make the same data
    warm_argv = ["--out", str(warm), *TINY, "--val-fraction", "0.25", "--steps", "1", "--lr", "1e-9"]
    warm_argv += ["--init-draft", str(second)]  # a head from this data would differ: a sequence is held out
    assert main([*warm_argv, "--export", str(fourth)]) == 0
    cfg4, params4, meta4, vocab4 = load_draft(fourth)
    assert cfg4 == cfg and np.array_equal(vocab4, vocab2)
    assert meta4["initialized_from"] == {
        "path": str(second),
        "command": meta2["command"],
        "steps": 4,
        "data_tokens": meta2["data_tokens"],
    }
    for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params4), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-3)  # float16 on disk, one tiny step
    fresh = tmp_path / "fresh.npz"
    shutil.copytree(out / "data", tmp_path / "fresh" / "data")
    assert main(["--out", str(tmp_path / "fresh"), *TINY, "--steps", "1", "--lr", "1e-9", "--export", str(fresh)]) == 0
    _, params5, _, _ = load_draft(fresh)
    assert not all(
        np.allclose(a, b, atol=1e-3) for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params5), strict=True)
    )
    err = _usage_error(["--out", str(tmp_path / "other"), *TINY, "--init-draft", __file__], capsys)
    assert re.search("--init-draft: .* not a draft file", err)
    other = [*warm_argv[:-2], "--out", str(tmp_path / "other"), "--num-layers", "2", "--init-draft", str(second)]
    assert "is a different draft (num_layers differ" in _usage_error(other, capsys)
    assert ocp.CheckpointManager((out / "checkpoints").absolute()).latest_step() == 4
