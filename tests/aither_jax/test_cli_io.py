"""What every entry point shares (aither_jax/cli_args.py, cli_output.py): files checked before
the work, JSON that says where it came from, files written whole, Ctrl-C as exit 130; and the
usage errors of each command that used to end in a traceback or after the work."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from aither_jax import cli_args, cli_output
from aither_jax import eval as aj_eval


def test_output_files_are_checked_before_the_work(tmp_path):
    parse = cli_args.output_file("--json")
    assert parse(str(tmp_path / "new" / "deeper" / "r.json")) == tmp_path / "new" / "deeper" / "r.json"
    (tmp_path / "plain").write_text("x")
    for bad, message in (
        ("", "must name a file"),
        (str(tmp_path), "is a directory"),
        (str(tmp_path / "plain" / "r.json"), "is a file, not a folder"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(bad)
    with pytest.raises(argparse.ArgumentTypeError, match=r"must end in \.png or \.pdf or \.svg"):
        cli_args.output_file("--plot", cli_args.PLOT_SUFFIXES)(str(tmp_path / "plot.txt"))


def test_input_files_name_what_is_wrong(tmp_path):
    parse = cli_args.input_file("--text-file", utf8=True)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "ok.txt").write_text("café", encoding="utf-8")
    assert parse(str(tmp_path / "ok.txt")) == tmp_path / "ok.txt"
    for bad, message in (
        (tmp_path / "missing.txt", "does not exist"),
        (tmp_path, "is a directory, not a file"),
        (tmp_path / "latin1.txt", r"latin1.txt' is not UTF-8 text \(byte 3\)"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(str(bad))


def test_json_goes_to_stdout_or_whole_to_a_file_with_the_run(tmp_path, capsys):
    run = {"command": "python -m x", "jax": "0"}
    cli_output.emit_json("-", [{"a": 1}, {"a": 2}], run)
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line) for line in lines] == [{"a": 1, "run": run}, {"a": 2, "run": run}]
    path = tmp_path / "out" / "r.json"
    cli_output.emit_json(path, {"b": "é"}, run)
    assert json.loads(path.read_text(encoding="utf-8")) == {"b": "é", "run": run}
    assert os.listdir(path.parent) == ["r.json"]  # no temporary left beside it


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "r.json"
    path.write_text("old")

    def half_then_fail(tmp):
        with open(tmp, "w") as f:
            f.write("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cli_output.write_file(path, half_then_fail)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["r.json"]


def test_a_file_is_written_under_its_own_name_with_the_usual_mode(tmp_path):
    """np.savez appends .npz to a name not ending in exactly that: an upper-case suffix must
    still land under its own name; and the file gets the umask's mode, not mkstemp's 0600."""
    path = tmp_path / "M.NPZ"
    umask = os.umask(0o022)
    try:
        cli_output.write_file(path, lambda tmp: np.savez(tmp, a=np.arange(3)))
    finally:
        os.umask(umask)
    with np.load(path) as f:
        assert f["a"].tolist() == [0, 1, 2]
    assert os.listdir(tmp_path) == ["M.NPZ"] and path.stat().st_mode & 0o777 == 0o644
    with pytest.raises(OSError, match="nothing was written"):
        cli_output.write_file(tmp_path / "empty.json", lambda tmp: None)
    assert os.listdir(tmp_path) == ["M.NPZ"]


def test_run_info_names_the_command_versions_and_device():
    import jax

    jax.devices()  # the device is named once a backend has started
    info = cli_output.run_info("python -m aither_jax.eval", ["capacity", "--model", "a b"])
    assert info["command"] == "python -m aither_jax.eval capacity --model 'a b'"
    assert info["backend"] == "cpu" and info["aither_jax"] and info["jax"] and info["date"].endswith("+00:00")


def test_ctrl_c_ends_a_command_with_a_message_and_code_130():
    code = (
        "from aither_jax.cli_output import run_command\n"
        "def main():\n    print('partial', end='')\n    raise KeyboardInterrupt\n"
        "run_command(main)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == cli_output.INTERRUPTED
    assert done.stdout == "partial" and done.stderr.strip() == "interrupted" and "Traceback" not in done.stderr


def test_help_shows_defaults_and_version(capsys):
    parser = aj_eval.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["capacity", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "KV memory budget in GiB (default: 1.0)" in text
    assert "host tier (--kv-offloading-size) (default: 0.0)" in text
    assert "--json [FILE]" in text and "(default: None)" not in text
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("aither-jax ")


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        aj_eval.main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["capacity", "--kv-cache-dtype", "tq4-k3@99"], "names layer 99, but the model has 30 layers"),
        (["codec", "--head-dim", "4"], r"--head-dim must be in \[8, 1024\]"),
        (["perplexity", "--kv-cache-dtype", "bf16", "--text-file", "{text}", "--plot", "{tmp}/p.txt"], "must end in"),
        (["perplexity", "--kv-cache-dtype", "bf16", "--text-file", "{tmp}", "--json", "-"], "is a directory"),
        (["fit-key-transform", "--out", "{tmp}/kt"], r"--out must end in \.npz"),
        (["fit-key-transform", "--out", "{tmp}/kt.npz", "--install"], "not allowed with argument"),
        # The file --install writes (beside a model file) is checked before the model loads.
        (["fit-key-transform", "--model", "{tmp}/plain/m.gguf", "--install"], "is a file, not a folder"),
        (["fidelity", "--kv-cache-dtype", "bf16", "--prompts", "{tmp}/list.json"], "expected a JSON object"),
        (["fidelity", "--kv-cache-dtype", "bf16", "--prompts", "{tmp}/strings.json"], '"factual" item 0 needs'),
        (["fidelity", "--kv-cache-dtype", "tq4-v3@40", "--prompts", "{tmp}/ok.json"], "names layer 40"),
        (["acceptance", "--speculative", "ngram", "--prompts", "{tmp}/none.jsonl"], "does not exist"),
    ],
)
def test_usage_errors_exit_2_before_any_work_with_the_commands_usage(tmp_path, argv, message, capsys):
    (tmp_path / "text.txt").write_text("Some text to score.", encoding="utf-8")
    (tmp_path / "list.json").write_text('["Hi"]')
    (tmp_path / "strings.json").write_text('{"chat": ["Hi"], "factual": [{"question": "Q?", "answers": "Paris"}]}')
    (tmp_path / "ok.json").write_text('{"chat": ["Hi"]}')
    (tmp_path / "plain").write_text("a file where a folder would be")
    argv = [a.format(tmp=tmp_path, text=tmp_path / "text.txt") for a in argv]
    err = _usage_error(argv, capsys)
    assert f"usage: python -m aither_jax.eval {argv[0]}" in err
    assert any(line.startswith(f"python -m aither_jax.eval {argv[0]}: error:") for line in err.splitlines())
    assert re.search(message, err), err


def test_capacity_lists_a_format_once_when_auto_names_it(capsys):
    from models.registry import resolve_kv_cache_dtype

    auto = resolve_kv_cache_dtype("auto", "smollm2-135m")
    assert auto != "tq4"
    assert aj_eval.main(["capacity", "--kv-cache-dtype", "auto", auto, "tq4", "tq4", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["kv_cache_dtype"] for r in rows] == [auto, "tq4"]
    assert (
        rows[0]["run"]["command"] == f"python -m aither_jax.eval capacity --kv-cache-dtype auto {auto} tq4 tq4 --json"
    )


def test_capacity_writes_its_json_beside_the_table(tmp_path, capsys):
    path = tmp_path / "cap.jsonl"
    assert aj_eval.main(["capacity", "--kv-cache-dtype", "bf16", "tq4", "--json", str(path)]) == 0
    assert "tokens in budget" in capsys.readouterr().out
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["kv_cache_dtype"] for r in rows] == ["bf16", "tq4"] and all("device" in r["run"] for r in rows)
