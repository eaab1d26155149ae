"""The server on the second model, Gemma-3-270M: completions equal in-process greedy decoding
(BOS included in the prompt), streamed or not; the chat endpoint explains that a base model has
no chat template."""

from __future__ import annotations

import json

import httpx
import pytest

import aither_jax as aj
from tests.serving.conftest import start_server

MODEL = "gemma3-270m"
PROMPT = "The three primary colors are"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server():
    s = start_server(
        "--model", MODEL, "--dtype", "float32", "--kv-cache-dtype", "bf16", "--max-model-len", "256",
        "--max-num-seqs", "2",
    )  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def expected():
    llm = aj.LLM(MODEL, dtype="float32", kv_cache_dtype="bf16", max_model_len=256, max_num_seqs=2, progress=False)
    return llm.generate([PROMPT], aj.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]


def test_completion_equals_in_process_greedy_decoding(server, expected):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["text"] == expected.text
    assert out["usage"]["prompt_tokens"] == len(expected.prompt_token_ids) == 6  # BOS + 5
    assert out["usage"]["completion_tokens"] == MAX_TOKENS

    streamed = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body | {"stream": True}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                streamed += [c["text"] for c in json.loads(line[6:])["choices"]]
    assert "".join(streamed) == expected.text


def test_chat_without_a_template_is_a_clear_400(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    assert "chat template" in r.json()["error"]["message"]
