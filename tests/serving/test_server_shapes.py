"""`serve --compile-shapes FILE`: a server records the step shapes it runs, and a server started
with the file compiles them before serving, so the same requests then compile nothing."""

import json
import subprocess
import sys

import httpx
import pytest

from aither_jax.compile import shape_file
from tests.serving.conftest import EXACT_FLAGS

COMPILES = "aither:xla_compilations_total"
# Unique pool size: no other server of the session compiles these programs.
FLAGS = (*EXACT_FLAGS, "--max-num-seqs", "4", "--num-pages", "97")


def _complete(url: str) -> list[str]:
    texts = []
    for prompt, n in (("The three primary colours are", 12), ("Count to five: one, two,", 20)):
        body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": n, "temperature": 0.0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    return texts


def test_shapes_recorded_by_one_server_compile_before_the_next_serves(tmp_path, server_factory):
    path = tmp_path / "shapes.json"
    first = server_factory(*FLAGS, "--compile-shapes", str(path))
    assert not path.exists()  # nothing has run yet
    before = first.metrics()[COMPILES]
    want = _complete(first.url)
    assert first.metrics()[COMPILES] > before  # a fresh process compiles what the requests need
    shapes = shape_file.load(path)
    assert {s["kind"] for s in shapes} == {"forward", "summaries"} and len(shapes) >= 3  # the advisor summarizes
    assert json.loads(path.read_text())["recorded_with"]["max_num_seqs"] == 4
    first.stop()

    second = server_factory(*FLAGS, "--compile-shapes", str(path))
    before = second.metrics()[COMPILES]
    assert _complete(second.url) == want
    assert second.metrics()[COMPILES] == before
    assert shape_file.load(path) == shapes  # no new shape to add


def test_bad_compile_shapes_file_exits_2(tmp_path):
    cmd = [sys.executable, "-m", "aither_jax.serve", "--compile-shapes", str(tmp_path / "missing" / "shapes.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--compile-shapes: no such directory" in r.stderr
    cmd[-1] = str(tmp_path)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "is a directory" in r.stderr
    bad = tmp_path / "shapes.json"
    bad.write_text(json.dumps({"format": shape_file.FORMAT, "version": 1, "shapes": [{"kind": "prefill"}]}))
    cmd[-1] = str(bad)
    r = subprocess.run([*cmd, "--max-model-len", "256"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "step shape 0: kind must be one of" in r.stderr, r.stderr[-2000:]


def test_a_compiler_failure_while_precompiling_leaves_the_server_serving(tmp_path, caplog):
    """A step shape that fails to compile up front is logged; the server starts anyway (its
    shapes compile on first use) and still records new ones. A malformed file still stops it."""
    import argparse
    import logging

    from aither_jax import serve

    class Engine:
        on_new_shape = None
        max_model_len = 256

        def __init__(self, error):
            self.error = error

        def precompile(self, shapes, progress):
            raise self.error

    class LLM:
        def __init__(self, error):
            self.engine = Engine(error)

    path = tmp_path / "shapes.json"
    shape_file.save(path, [{"kind": "copy", "pages": 4}])
    args = argparse.Namespace(compile_shapes=path, model="m", kv_cache_dtype="auto", max_num_seqs=2)
    llm = LLM(RuntimeError("ptxas died"))
    with caplog.at_level(logging.ERROR, logger="aither_jax.serve"):
        serve._use_shape_file(llm, args)
    assert "failed; they compile on first use" in caplog.text and "ptxas died" in caplog.text
    llm.engine.on_new_shape({"kind": "copy", "pages": 8})
    assert shape_file.load(path) == [{"kind": "copy", "pages": 4}, {"kind": "copy", "pages": 8}]
    with pytest.raises(ValueError, match="bad rows"):
        serve._use_shape_file(LLM(ValueError("step shape 0: bad rows 0")), args)
