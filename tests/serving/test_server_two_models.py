"""Two models served from one process: Gemma-3-270M (real weights) beside SmolLM2-135M.

Gemma's completions equal in-process greedy decoding (BOS included), streamed or not, and its
chat uses its family's turn format; `/v1/models` lists both; `model: "auto"` routes by effort
(an explicit `reasoning_effort` wins) and the response names the model that served; the memory
plan is served as JSON and gauges; concurrent requests to both through the `openai` client."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest

import aither_jax as aj
from tests.serving.conftest import start_server

GEMMA, SMOL = "gemma3-270m", "smollm2-135m"
PROMPT = "The three primary colors are"
MAX_TOKENS = 12
SETTINGS = dict(dtype="float32", kv_cache_dtype="bf16", max_model_len=256, max_num_seqs=2)


@pytest.fixture(scope="module")
def server():
    s = start_server(
        "--model", GEMMA, "--model", SMOL, "--memory-budget", "4", "--dtype", "float32", "--kv-cache-dtype", "bf16",
        "--max-model-len", "256", "--max-num-seqs", "2",
    )  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gemma():
    return aj.LLM(GEMMA, **SETTINGS, progress=False)


def test_completion_equals_in_process_greedy_decoding(server, gemma):
    expected = gemma.generate([PROMPT], aj.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]
    body = {"model": GEMMA, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["text"] == expected.text and out["model"] == GEMMA
    assert out["usage"]["prompt_tokens"] == len(expected.prompt_token_ids) == 6  # BOS + 5
    assert out["usage"]["completion_tokens"] == MAX_TOKENS

    streamed = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body | {"stream": True}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                streamed += [c["text"] for c in json.loads(line[6:])["choices"]]
    assert "".join(streamed) == expected.text


def test_chat_uses_the_family_turn_format(server, gemma):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    expected = gemma.chat([messages], aj.SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert expected.prompt_token_ids[:3] == [2, 105, 2364]  # <bos><start_of_turn>user
    body = {"model": GEMMA, "messages": messages, "max_tokens": 8, "temperature": 0}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected.text
    assert r.json()["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)


def test_models_memory_plan_and_unknown_names(server):
    ids = [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]]
    assert ids == [GEMMA, SMOL]
    plan = httpx.get(server.url + "/debug/memory", timeout=30).json()
    zones = {(z["owner"], z["name"]) for z in plan["zones"]}
    assert {(m, z) for m in (GEMMA, SMOL) for z in ("weights", "kv_pool", "activations")} <= zones
    assert plan["budget_bytes"] == 4 << 30 and plan["device_bytes"] <= plan["budget_bytes"]
    metrics = server.metrics()
    assert metrics['aither:memory_zone_bytes{zone="weights"}'] > 0  # one series per model (model_name dropped)
    r = httpx.post(server.url + "/v1/completions", json={"model": "llama", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and GEMMA in r.json()["error"]["message"] and "auto" in r.json()["error"]["message"]


def test_auto_routes_by_effort_and_names_the_serving_model(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def ask(text: str, **kw) -> str:
        messages = [{"role": "user", "content": text}]
        kw = {"max_tokens": 2} | kw
        return client.chat.completions.create(model="auto", messages=messages, temperature=0, **kw).model

    assert ask("hi, how are you?") == SMOL  # light: the smaller model
    assert ask("Prove that there are infinitely many prime numbers.") == GEMMA  # more parameters: heavy
    assert ask("hi, how are you?", reasoning_effort="high") == GEMMA
    with pytest.raises(openai.BadRequestError, match=f"model `{GEMMA}`"):  # refused after routing: not counted
        ask("hi, how are you?", reasoning_effort="high", max_tokens=10**6)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert 'aither:routed_requests_total{effort="5",model_name="gemma3-270m",reason="reasoning_effort"} 1.0' in text

    def complete(prompt) -> httpx.Response:
        body = {"model": "auto", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        return httpx.post(server.url + "/v1/completions", json=body, timeout=300)

    light = ["hi, how are you?", "Good morning!"]
    assert complete(light).json()["model"] == SMOL
    heavy = complete([*light, "Prove that there are infinitely many prime numbers."])  # the most demanding decides
    assert heavy.status_code == 200 and heavy.json()["model"] == GEMMA and len(heavy.json()["choices"]) == 3
    r = complete([1, 2, 3])  # token ids belong to one model's vocabulary
    assert r.status_code == 400 and "name the model" in r.json()["error"]["message"]


def test_concurrent_requests_to_both_models(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def complete(model: str) -> str:
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
        assert out.model == model
        return out.choices[0].text

    alone = {m: complete(m) for m in (GEMMA, SMOL)}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        models = [GEMMA, SMOL] * 3
        together = list(pool.map(complete, models))
    assert together == [alone[m] for m in models]
