"""`python -m aither_jax.generate`: usage errors exit 2 with a clear message; --json output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from aither_jax import generate
from aither_jax.device.sampling import MAX_STOP_STRING_LEN, MAX_STOP_STRINGS
from models.registry import default_kv_cache_dtype

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "one of the arguments --prompt --prompts is required"),
        (["--prompt", "x", "--prompts", os.path.join(ROOT, "README.md")], "not allowed with argument"),
        (["--prompt", "x", "--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--prompt", "x", "--max-tokens", "ten"], "--max-tokens must be an integer"),
        (["--prompt", "x", "--temperature", "-0.5"], "--temperature must be in"),
        (["--prompt", "x", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--prompt", "x", "--top-k", "-5"], "--top-k must be >= -1"),
        (["--prompt", "x", "--seed", "-1"], "--seed must be in"),
        (["--prompt", "x", "--dtype", "float16"], "invalid choice"),
        (["--prompt", "x", "--system", "s"], "--system needs --chat"),
        (["--prompt", ""], "--prompt must not be empty"),
        (["--prompt", "x", "--model", "gpt-17"], "unknown model 'gpt-17'"),
        (["--prompt", "x", "--model", "/nonexistent/model.gguf"], "does not exist"),
        (["--prompt", "x", "--kv-cache-dtype", "int4"], "unknown kv cache dtype 'int4'"),
        (["--prompt", "x", "--stop", ""], "--stop must be a non-empty string"),
        (["--prompt", "x"] + ["--stop", "s"] * (MAX_STOP_STRINGS + 1), f"at most {MAX_STOP_STRINGS} of them"),
        (
            ["--prompt", "x", "--stop", "s" * (MAX_STOP_STRING_LEN + 1)],
            f"each --stop string must be at most {MAX_STOP_STRING_LEN}",
        ),
        (["--prompt", "x", "--top-k", "3000000000"], "--top-k must be -1, 0 (off) or a positive integer below 2**31"),
    ],
)
def test_bad_usage_exits_2_with_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        generate.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_malformed_model_file_is_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 16)
    with pytest.raises(SystemExit) as exc:
        generate.main(["--prompt", "x", "--model", str(bad)])
    assert exc.value.code == 2
    assert "broken.gguf" in capsys.readouterr().err


def _generate_json(*args: str) -> dict:
    """The JSON object `python -m aither_jax.generate --json *args` prints (run in a subprocess)."""
    return _generate_jsons(args)[0]


def _generate_jsons(*argvs: tuple[str, ...] | list[str]) -> list[dict]:
    """`_generate_json` of each argument list, the subprocesses run side by side (each loads
    and compiles on one core for most of its run)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "aither_jax.generate", "--json", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for args in argvs
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_json_output_in_a_subprocess():
    result = _generate_json(
        "--prompt", "The sky is", "--max-tokens", "6", "--dtype", "float32", "--max-model-len", "128",
        "--kv-cache-dtype", "tq-k6v4",
    )  # fmt: skip
    for key in ("text", "token_ids", "prompt_tokens", "completion_tokens", "tokens_per_second"):
        assert key in result
    assert result["completion_tokens"] == len(result["token_ids"]) <= 6
    assert result["prompt_tokens"] == 3 and result["tokens_per_second"] > 0
    assert result["kv_cache_dtype"] == "tq-k6v4"


def test_gemma_json_counts_its_bos():
    """The second model through the CLI: its prompt gets the BOS its file asks for (chat on it,
    in its family's turn format, is tested with the tokenizer and the two-model server)."""
    result = _generate_json(
        "--model", "gemma3-270m", "--prompt", "The three primary colors are", "--max-tokens", "6",
        "--temperature", "0", "--dtype", "float32", "--max-model-len", "64",
    )  # fmt: skip
    assert result["model"] == "gemma3-270m" and result["kv_cache_dtype"] == default_kv_cache_dtype("gemma3-270m")
    assert result["prompt_tokens"] == 6 and result["completion_tokens"] == 6
    assert result["text"].startswith(" red, blue, and yellow")


def test_speculative_json_reports_drafts():
    result = _generate_json(
        "--prompt", "1, 2, 3, 4, 1, 2, 3, 4, 1, 2,", "--max-tokens", "12", "--dtype", "float32",
        "--kv-cache-dtype", "bf16", "--speculative", "ngram",
    )  # fmt: skip
    spec = result["speculative"]
    assert spec["method"] == "ngram" and spec["verify_passes_with_drafts"] > 0
    assert 0 < spec["accepted_tokens"] <= spec["draft_tokens"]  # the repeating prompt is easy to look up


def test_dflash_json_reports_drafts_and_keeps_the_greedy_tokens():
    """--speculative dflash (the shipped draft) on a chat prompt: the JSON reports the drafts,
    and the tokens are those of the same command without speculation (greedy, float32, bf16 KV)."""
    args = ["--prompt", "Name three primary colours.", "--chat", "--max-tokens", "12", "--temperature", "0"]
    args += ["--dtype", "float32", "--kv-cache-dtype", "bf16"]
    plain, result = _generate_jsons(args, [*args, "--speculative", "dflash"])
    assert "speculative" not in plain
    spec = result["speculative"]
    assert spec["method"] == "dflash" and spec["verify_passes_with_drafts"] > 0 and spec["draft_tokens"] > 0
    assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    assert result["token_ids"] == plain["token_ids"] and result["text"] == plain["text"]
    assert result["completion_tokens"] == len(result["token_ids"]) > 0


def test_seeded_chat_sampling_in_a_subprocess_is_reproducible():
    args = ["--model", "smollm2-135m", "--prompt", "Name a colour.", "--chat", "--seed", "3", "--temperature", "0.8"]
    args += ["--top-p", "0.9", "--top-k", "20", "--max-tokens", "8"]
    results = _generate_jsons(args, args)
    for result in results:
        assert isinstance(result["text"], str) and all(isinstance(t, int) for t in result["token_ids"])
        assert result["completion_tokens"] == len(result["token_ids"]) <= 8
        assert result["prompt_tokens"] > 5 and result["tokens_per_second"] > 0  # the chat template adds tokens
    assert results[0]["token_ids"] == results[1]["token_ids"] and results[0]["text"] == results[1]["text"]


def test_several_prompts_report_the_drawn_seed_and_one_prompt_streams_the_same_text(tmp_path, capsys):
    """A --prompts file (a conversation and a completion) decoded together, sampled with no
    --seed: each JSON line reports the seed drawn; that seed given back on one prompt streams
    the very text to stdout (a seeded draw depends only on the seed and the position)."""
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"messages": [{"role": "user", "content": "Name a colour."}]}, {"prompt": "The sky is"}]
    prompts.write_text("\n".join(map(json.dumps, lines)), encoding="utf-8")
    common = ["--temperature", "0.8", "--max-tokens", "6", "--dtype", "float32", "--max-model-len", "128"]
    assert generate.main(["--prompts", str(prompts), *common, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and "Name a colour." in rows[0]["prompt"] and rows[1]["prompt"] == "The sky is"
    seed = rows[0]["sampling"]["seed"]
    assert isinstance(seed, int) and rows[1]["sampling"] == rows[0]["sampling"] | {"seed": (seed + 1) % 2**32}
    assert rows[0]["sampling"]["temperature"] == 0.8 and rows[0]["run"]["command"].startswith(
        "python -m aither_jax.generate --prompts"
    )
    assert generate.main(["--prompt", "Name a colour.", "--chat", "--seed", str(seed), *common]) == 0
    assert capsys.readouterr().out == rows[0]["text"] + "\n"


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "x"}', 'expected {"messages": [...]} or {"prompt": "..."}'),
        ("not json", "not JSON"),
        ('{"messages": [{"content": "Hi"}]}', 'each message needs a "role" and a "content"'),
    ],
)
def test_bad_prompt_files_exit_2(tmp_path, content, message, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text(content, encoding="utf-8")
    for argv in (["--prompts", str(path)], ["--prompts", str(path), "--chat"]):
        with pytest.raises(SystemExit) as exc:
            generate.main(argv)
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "--chat and --system are for --prompt" in err
