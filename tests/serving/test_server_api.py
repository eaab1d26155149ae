"""The server against real clients on loopback: the `openai` package, concurrent streams,
prefix caching, tenants, pins, multi-turn reuse and disconnect storms."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from models.registry import resolve_model
from models.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Count from one to five.",
    "What do bees make?",
    "Say hello in Spanish.",
    "What is two plus two?",
    "Name a large animal.",
    "What color is the sky?",
    "Give me a word that rhymes with cat.",
    "What is water made of?",
    "Name a planet.",
    "What do cows drink?",
    "Who wrote Hamlet?",
    "What is ice?",
    "Name a fruit that is yellow.",
    "How many legs does a spider have?",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from models.gguf_file import GGUFFile

    return Tokenizer.from_gguf(GGUFFile(resolve_model(MODEL)))


@pytest.fixture(scope="module")
def server_default(server_factory):
    """The default configuration (the model's measured KV format, prefix caching on)."""
    return server_factory("--max-num-seqs", "4")


@pytest.fixture(scope="module")
def client(server_default) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_default.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def server_no_cache(server_factory):
    return server_factory("--kv-cache-dtype", "fp32", "--max-num-seqs", "16", "--no-enable-prefix-caching")


def chat(
    url: str, question: str, *, system: str | None = None, max_tokens: int = 12, headers: dict | None = None, **extra
) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


async def stream_chat(client: httpx.AsyncClient, url: str, question: str, max_tokens: int = 12) -> str:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    parts = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    parts.append(choice["delta"].get("content") or "")
    return "".join(parts)


# -- the openai client ----------------------------------------------------------------------


def test_openai_client_models_chat_and_completions(client, tokenizer):
    assert [m.id for m in client.models.list()] == [MODEL]
    # Not "What is the capital of France?": its first token is a near-tie ("The" leads "L" by
    # 0.03 in float32), which KV quantization flips either way.
    messages = [{"role": "user", "content": "Name the capital city of France."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    text = r.choices[0].message.content
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
    assert "Paris" in text
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.choices[0].finish_reason in ("stop", "length")

    c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert c.usage.prompt_tokens == len(tokenizer.encode("The capital of France is"))
    assert c.usage.completion_tokens == 6 and c.choices[0].finish_reason == "length"
    assert "Paris" in c.choices[0].text


def test_openai_client_streaming_matches_non_streaming_with_usage(client):
    messages = [{"role": "user", "content": "Name three colors."}]
    # A tenant each, so neither starts from the other's (or an earlier test's) cached pages:
    # with a quantized KV format, a prompt prefilled in other chunks may round differently.
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, extra_headers={"X-Tenant-Id": "whole"}
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Tenant-Id": "streamed"},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]

    pieces = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=8, temperature=0, stream=True)
    streamed = "".join(ch.choices[0].text for ch in pieces if ch.choices)
    plain = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=8, temperature=0)
    assert streamed == plain.choices[0].text and streamed


def test_stop_strings_seed_n_and_logprobs(client):
    full = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=12, temperature=0).choices[0]
    stop = full.text.strip().split()[1]  # a word the greedy text contains after its first
    cut = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert full.text.startswith(cut.choices[0].text)

    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=10, temperature=1.0, seed=1234, n=3)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert len({c.text for c in a.choices}) > 1  # each choice samples with its own seed

    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the most likely
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_top_k_one_and_a_tiny_top_p_leave_only_the_greedy_token(server):
    # float32 KV (the `server` fixture), so the greedy and the sampled rows see the same logits.
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model=MODEL, prompt="The three largest cities of Italy are", max_tokens=8)
    greedy = client.completions.create(**kw, temperature=0).choices[0].text
    hot = [client.completions.create(**kw, temperature=1.5, seed=s).choices[0].text for s in range(4)]
    assert any(t != greedy for t in hot)  # sampling at this temperature does move
    for s in range(4):
        top_k = client.completions.create(**kw, temperature=1.5, seed=s, extra_body={"top_k": 1})
        top_p = client.completions.create(**kw, temperature=1.5, seed=s, top_p=1e-6)
        assert top_k.choices[0].text == greedy and top_p.choices[0].text == greedy


def test_completion_logprobs_in_the_legacy_format(client):
    r = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=6, temperature=0, logprobs=3)
    choice, n = r.choices[0], r.usage.completion_tokens
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == n
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 1 <= len(top) <= 3
        assert top[token] == pytest.approx(value) == pytest.approx(max(top.values()))  # greedy: the top token


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "n": 99}, 400, "n"),
        ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "hi", "max_tokens": 5000}, 400, "maximum context length is 1024 tokens"),
        ({"prompt": "word " * 1100, "max_tokens": 1}, 400, "maximum context length is 1024 tokens"),
        ({"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
        ({"prompt": [], "max_tokens": 1}, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, fragment):
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == status
    error = r.json()["error"]
    assert fragment in error["message"] + str(error["param"]) and error["code"] == status


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
        ({"messages": HI, "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": HI, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ({"messages": HI, "top_logprobs": 2}, 400, "top_logprobs requires logprobs"),
        ({"messages": HI, "tools": [{"type": "function"}]}, 400, "tools are not supported"),
        ({"messages": HI, "logit_bias": {"1": 5}}, 400, "logit_bias"),
        ({"messages": [{"role": "user", "content": "word " * 1100}]}, 400, "maximum context length is 1024 tokens"),
        ({"messages": HI, "model": "gpt-4"}, 404, "does not exist"),
    ],
)
def test_bad_chat_requests_get_openai_errors(server, body, status, fragment):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"] + str(error["param"]) and error["code"] == status


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "word " * 1100, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "hi", "stop": ["a"] * 17}, "stop"),
        ("/v1/completions", {"prompt": [5, 10**6]}, "prompt"),
        ("/v1/chat/completions", {"messages": HI, "tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages.0"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 1100}]}, "messages"),
    ],
)
def test_errors_name_the_parameter_as_the_client_wrote_it(server, path, body, param):
    r = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert ".int" not in r.text and "constrained-str" not in r.text and "Value error" not in r.text


def test_nulls_take_defaults_and_bodies_that_are_not_json_objects_are_told_so(server):
    nulls = {"n": None, "stream": None, "logprobs": None, "top_logprobs": None, "tool_choice": None, "seed": None}
    history = [{"role": "assistant", "content": None}, {"role": "user", "content": "Hi"}]  # a tool-calling turn
    r = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": history, "max_tokens": 2, **nulls}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    body = {"prompt": "Hi", "max_tokens": 2, "n": None, "echo": None}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    url = server.url + "/v1/completions"
    bad = httpx.post(url, content=b'{"prompt": "x",', headers={"content-type": "application/json"}, timeout=60)
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    plain = httpx.post(url, content=b'{"prompt": "x"}', headers={"content-type": "text/plain"}, timeout=60)
    assert plain.status_code == 400 and "application/json" in plain.json()["error"]["message"]


def test_completions_default_to_16_tokens_and_models_can_be_retrieved(client):
    kw = dict(model=MODEL, prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_chat_logprobs_carry_each_tokens_raw_bytes(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Repeat exactly: 😀😃😄😁 日本語"}], max_tokens=12,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    made = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert made.startswith(r.choices[0].message.content)  # and then the end-of-turn token, if it came
    assert all(bytes(e.bytes).decode("utf-8", errors="replace") == e.token or "\ufffd" in e.token for e in content)


# -- batching -------------------------------------------------------------------------------


def test_sixteen_concurrent_streams_equal_one_at_a_time(server):
    async def run() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient() as c:
            together = await asyncio.gather(*(stream_chat(c, server.url, q) for q in QUESTIONS))
            alone = [await stream_chat(c, server.url, q) for q in QUESTIONS]
        return list(together), alone

    together, alone = asyncio.run(run())
    assert all(alone) and len(set(alone)) > 8
    assert together == alone


# -- prefix caching -------------------------------------------------------------------------

SYSTEM = "You are a careful assistant for a small library. " * 8 + "Answer in one short sentence."


def test_prefix_caching_on_and_off_give_identical_outputs_and_hits_move(server, server_no_cache):
    before = server.metrics()
    on = [chat(server.url, q, system=SYSTEM, headers={"X-Tenant-Id": "identical"}) for q in QUESTIONS[:6]]
    off = [chat(server_no_cache.url, q, system=SYSTEM) for q in QUESTIONS[:6]]
    after = server.metrics()
    assert [r["choices"][0]["message"]["content"] for r in on] == [r["choices"][0]["message"]["content"] for r in off]
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in on]
    assert cached[0] == 0 and min(cached[1:]) >= 64  # the shared system prompt spans > 4 pages
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] == sum(cached)
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    assert queries == sum(r["usage"]["prompt_tokens"] for r in on)
    assert server_no_cache.metrics()["vllm:prefix_cache_hits_total"] == 0


# The series vLLM's server exposes (as its Prometheus client writes them) that dashboards read.
VLLM_SERIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter",
    "vllm:num_preemptions_total": "counter",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:request_success_total": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:spec_decode_num_drafts_total": "counter",
    "vllm:spec_decode_num_draft_tokens_total": "counter",
    "vllm:spec_decode_num_accepted_tokens_total": "counter",
}


def test_metrics_carry_vllms_series_names_and_types(server):
    chat(server.url, "Name a river.")
    text = httpx.get(server.url + "/metrics", timeout=10).text
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert {name: types.get(name) for name in VLLM_SERIES} == VLLM_SERIES
    assert all(name.endswith("_total") for name, kind in types.items() if kind == "counter")
    m = server.metrics()
    assert m["vllm:generation_tokens_total"] > 0 and m["vllm:e2e_request_latency_seconds_count"] > 0


def test_metrics_count_the_servers_compilations(server):
    """The step shapes the server compiled (or loaded from the persistent cache) and their
    seconds, for telling compilation from serving in a cold run."""
    m = server.metrics()
    assert m["aither:xla_compilations_total"] >= 1 and m["aither:xla_compile_seconds_total"] > 0
    assert m["aither:xla_lowering_seconds_total"] > 0
    chat(server.url, "One more question about the library hours.")
    after = server.metrics()
    assert after["aither:xla_compilations_total"] >= m["aither:xla_compilations_total"]


def test_tenants_never_share_cached_pages(server):
    question = "Tell me about the weather on the moon, please, in detail."
    a1 = chat(server.url, question, system=SYSTEM + " Tenant test.", headers={"X-Tenant-Id": "alice"})
    b1 = chat(server.url, question, system=SYSTEM + " Tenant test.", headers={"X-Tenant-Id": "bob"})
    a2 = chat(server.url, question, system=SYSTEM + " Tenant test.", headers={"X-Tenant-Id": "alice"})
    assert a1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert b1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert a2["usage"]["prompt_tokens_details"]["cached_tokens"] >= a1["usage"]["prompt_tokens"] - 16
    assert a1["choices"][0]["message"]["content"] == b1["choices"][0]["message"]["content"]


def test_follow_up_turn_prefills_only_its_new_tokens(server, tokenizer):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a famous painter."}]
    headers = {"X-Tenant-Id": "multi-turn"}
    body = {"model": MODEL, "messages": messages, "max_tokens": 20, "temperature": 0.0}
    r1 = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=120).json()
    reply = r1["choices"][0]["message"]["content"]
    messages2 = messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And a sculptor?"}]
    before = server.metrics()["aither:prefill_tokens_total"]
    body2 = {"model": MODEL, "messages": messages2, "max_tokens": 8, "temperature": 0.0}
    r2 = httpx.post(server.url + "/v1/chat/completions", json=body2, headers=headers, timeout=120).json()
    prefilled = server.metrics()["aither:prefill_tokens_total"] - before

    # Turn 1's prompt and all its output but the last token (never fed back) are in the cache.
    computed = r1["usage"]["prompt_tokens"] + r1["usage"]["completion_tokens"] - 1
    turn2 = tokenizer.encode(tokenizer.apply_chat_template(messages2))
    turn1 = tokenizer.encode(tokenizer.apply_chat_template(messages))
    assert turn2[: len(turn1)] == turn1
    assert r2["usage"]["prompt_tokens"] == len(turn2)
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == computed
    assert prefilled == len(turn2) - computed
    assert prefilled < 20  # the new user message and the template's markers


def test_pinned_prefix_survives_pressure(server):
    """A pinned system prompt stays cached through pressure that evicts an unpinned prompt
    (a plain completion's, untagged: the eviction advisor would protect a system message)."""
    headers = {"X-Tenant-Id": "pins"}
    pinned_system = "Pinned instructions for the archive desk. " * 10
    loose_prompt = "Unpinned instructions for the front desk. " * 10

    def loose(question: str) -> dict:
        body = {"model": MODEL, "prompt": loose_prompt + question, "max_tokens": 2, "temperature": 0}
        rr = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=120)
        assert rr.status_code == 200, rr.text
        return rr.json()

    r = chat(server.url, "Hello.", system=pinned_system, headers=headers, pin_prefix=True, max_tokens=2)
    loose("Hello.")
    assert loose("Hi.")["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64  # cached before the pressure
    metrics = server.metrics()
    assert metrics["aither:pinned_pages"] >= r["usage"]["prompt_tokens"] // 16 - 2
    # Pressure: distinct long prompts that need more pages than the pool has free.
    filler_pages = 0
    for i in range(10):
        rr = httpx.post(
            server.url + "/v1/completions",
            json={
                "model": MODEL,
                "prompt": f"Document {i}: " + " ".join(f"item{i}x{j}" for j in range(150)),
                "max_tokens": 2,
                "temperature": 0,
            },
            headers={"X-Tenant-Id": "pressure"},
            timeout=120,
        )
        assert rr.status_code == 200
        filler_pages += rr.json()["usage"]["prompt_tokens"] // 16
    assert filler_pages > metrics["aither:kv_pages_total"]
    again = chat(server.url, "Hello again.", system=pinned_system, headers=headers, max_tokens=2)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * (r["usage"]["prompt_tokens"] // 16 - 1)
    assert loose("Hello again.")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the pressure was real


def test_unpin_releases_a_tenants_pin_and_no_other(server, server_no_cache):
    def unpin(body: dict, tenant: str = "unpins") -> httpx.Response:
        return httpx.post(server.url + "/v1/unpin", json=body, headers={"X-Tenant-Id": tenant}, timeout=60)

    system = "Instructions for the map room, pinned for a while and then released. " * 6
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hello."}]
    before = server.metrics()["aither:pinned_pages"]
    chat(server.url, "Hello.", system=system, headers={"X-Tenant-Id": "unpins"}, pin_prefix=True, max_tokens=2)
    pinned = server.metrics()["aither:pinned_pages"] - before
    assert pinned >= 4
    assert unpin({"messages": messages}, tenant="someone-else").json() == {"object": "unpin", "pages": 0}
    assert server.metrics()["aither:pinned_pages"] - before == pinned
    assert unpin({"messages": messages}).json() == {"object": "unpin", "pages": pinned}
    assert server.metrics()["aither:pinned_pages"] == before
    assert unpin({"messages": messages}).json()["pages"] == 0  # nothing left to release

    prompt = "Completion prompt pinned whole: " + " ".join(f"word{i}" for i in range(80))
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "pin_prefix": True},
        headers={"X-Tenant-Id": "unpins"},
        timeout=60,
    )
    full_pages = r.json()["usage"]["prompt_tokens"] // 16
    assert server.metrics()["aither:pinned_pages"] - before == full_pages
    assert unpin({"model": MODEL, "prompt": prompt}).json()["pages"] == full_pages
    assert server.metrics()["aither:pinned_pages"] == before

    for body, status in (({}, 400), ({"prompt": "a", "messages": messages}, 400), ({"prompt": "a", "model": "x"}, 404)):
        r = unpin(body)
        assert r.status_code == status and r.json()["error"]["code"] == status
    off = httpx.post(server_no_cache.url + "/v1/unpin", json={"prompt": prompt}, timeout=60)
    assert off.status_code == 400 and "prefix caching is off" in off.json()["error"]["message"]


# -- disconnects ----------------------------------------------------------------------------


async def open_and_hang_up(url: str, num_streams: int) -> None:
    """Opens sampled streams, waits until the running batch produces tokens, closes them all."""
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as c:
        streams = []
        for i in range(num_streams):
            body = {
                "model": MODEL,
                "prompt": f"Story number {i}: once upon a time",
                "max_tokens": 200,
                "temperature": 0.7,
                "seed": i,
                "stream": True,
                "ignore_eos": True,
            }
            streams.append(c.stream("POST", url + "/v1/completions", json=body))
        responses = [await s.__aenter__() for s in streams]
        assert all(r.status_code == 200 for r in responses)
        lines = responses[0].aiter_lines()
        while not (await anext(lines)).startswith("data: {"):
            pass
        for s in streams:
            await s.__aexit__(None, None, None)


def wait_idle(server, seconds: float) -> float:
    """Seconds until no request runs or waits (or `seconds` if that never happens)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        m = server.metrics()
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            break
        time.sleep(0.05)
    return time.monotonic() - start


def test_disconnecting_fifty_streams_returns_requests_and_pages(server):
    # Compile the sampled decode shapes first: a step that compiles delays the aborts queued behind it.
    asyncio.run(open_and_hang_up(server.url, 16))
    wait_idle(server, 60)
    baseline = server.metrics()
    assert baseline["vllm:num_requests_running"] == 0 and baseline["vllm:num_requests_waiting"] == 0

    asyncio.run(open_and_hang_up(server.url, 50))
    idle = wait_idle(server, 60)
    assert idle < 10, idle  # seconds from the last hang-up to an empty batch and queue
    m = server.metrics()
    # Counted in tokens, not seconds (a busy machine slows the engine and the clock alike):
    # finishing would generate 50 x 200 tokens; aborting stops them within a few steps.
    generated = m["vllm:generation_tokens_total"] - baseline["vllm:generation_tokens_total"]
    assert generated < 50 * 200 / 10, generated
    assert m["aither:kv_pages_free"] >= baseline["aither:kv_pages_free"] - 2  # only partial pages stay cached
    aborted = m['vllm:request_success_total{finished_reason="abort"}'] - baseline.get(
        'vllm:request_success_total{finished_reason="abort"}', 0
    )
    assert aborted == 50


def test_a_non_streaming_client_that_hangs_up_aborts_its_request(server):
    wait_idle(server, 60)
    before = server.metrics()
    body = {"model": MODEL, "prompt": "A long story:", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # httpx closes the connection
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=2.0))
    assert wait_idle(server, 60) < 10
    m = server.metrics()
    abort = 'vllm:request_success_total{finished_reason="abort"}'
    assert m[abort] - before.get(abort, 0) == 1
    assert m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 400


# -- the context pipeline through the openai client ----------------------------------------------

IDENTITY = "You are Aither, a research assistant for the harbour office. " * 6


def sectioned(knowledge: str, question: str) -> list[dict]:
    return [
        {"role": "system", "content": IDENTITY, "section": {"tag": "identity", "importance": 1.0}},
        {
            "role": "system",
            "content": [{"type": "text", "text": "Answer briefly.", "cache_control": {"type": "ephemeral"}}],
            "section": {"tag": "rules", "importance": 0.9},
        },
        {"role": "system", "content": knowledge, "section": {"tag": "knowledge", "importance": 0.3, "max_tokens": 40}},
        {"role": "user", "content": question, "section": {"tag": "question", "truncate": "never"}},
    ]


def test_sections_cache_control_and_prompt_cache_key_through_the_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    headers = {"X-Tenant-Id": "context"}
    extra = {"prompt_cache_key": "harbour", "context": {"report": True}}
    first = client.chat.completions.create(
        model=MODEL, messages=sectioned("Tide tables: " + "high water at dawn. " * 30, "When is high water?"),
        max_tokens=2, temperature=0, extra_body=extra, extra_headers=headers,
    )  # fmt: skip
    report = first.usage.model_extra["context"]
    tags = [s["tag"] for s in report["sections"]]
    assert tags == ["identity", "rules", "knowledge", "question"]
    knowledge = report["sections"][2]
    assert knowledge["kept"] <= 40 < knowledge["wanted"] or knowledge["wanted"] <= 40
    assert report["stable_tokens"] == report["sections"][1]["stop"]  # the breakpoint
    assert not report["stable_cached"] and report["prefill_tokens"] == report["num_tokens"]  # nothing cached yet
    pages = report["stable_tokens"] // 16
    assert server.metrics()["aither:pinned_pages"] >= pages  # pinned from the first request, at the breakpoint
    second = client.chat.completions.create(
        model=MODEL, messages=sectioned("Other news: the ferry is late.", "Is the ferry late?"),
        max_tokens=2, temperature=0, extra_body=extra, extra_headers=headers,
    )  # fmt: skip
    assert second.usage.prompt_tokens_details.cached_tokens >= 16 * pages
    again = second.usage.model_extra["context"]
    assert again["stable_hash"] == report["stable_hash"] and again["stable_cached_tokens"] == 16 * pages
    stream = client.chat.completions.create(
        model=MODEL, messages=sectioned("Other news: the ferry is late.", "Is the ferry late?"), max_tokens=2,
        temperature=0, extra_body=extra, extra_headers=headers, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage[-1].model_extra["context"]["stable_hash"] == report["stable_hash"]  # streamed, the report too


@pytest.mark.parametrize(
    ("section", "fragment"),
    [
        ({"tag": "knowledge", "truncate": "middle"}, "section 'knowledge': truncate must be one of"),
        ({"tag": "knowledge", "importance": -1}, "section 'knowledge': importance must be in [0, 1]"),
        ({"tag": "knowledge", "colour": "red"}, "unknown section fields ['colour']"),
        ({"tag": ["knowledge"]}, "message 0: a section's tag must be a non-empty string"),
        ({"tag": "knowledge", "stable": "false"}, "section 'knowledge': stable must be true or false"),
    ],
)
def test_bad_sections_get_a_400_naming_the_section(server, section, fragment):
    messages = [{"role": "system", "content": "Facts.", "section": section}, {"role": "user", "content": "Hi"}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages}, timeout=60)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text


def test_a_sectioned_request_pins_by_its_stable_sections_not_pin_prefix(server):
    messages = [{"role": "system", "content": "Facts.", "section": {"tag": "facts"}}, {"role": "user", "content": "Hi"}]
    body = {"model": MODEL, "messages": messages, "pin_prefix": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "pin_prefix", r.text


def test_budgets_that_cannot_hold_the_uncuttable_sections_get_a_400(server):
    messages = [
        {"role": "system", "content": "Rules. " * 50, "section": {"tag": "rules", "truncate": "never"}},
        {"role": "user", "content": "Hi"},
    ]
    body = {"model": MODEL, "messages": messages, "context": {"budget": 30}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "(rules" in r.json()["error"]["message"], r.text


def test_the_advisor_is_the_default_and_its_graph_dump_needs_it(server_default, server_no_cache):
    """Prefix caching brings the eviction advisor unless LRU is asked for; without prefix
    caching there is no graph to dump."""
    r = httpx.get(server_default.url + "/debug/kv_graph", timeout=10)
    assert r.status_code == 200 and {"nodes", "edges"} <= r.json().keys(), r.text
    r = httpx.get(server_no_cache.url + "/debug/kv_graph", timeout=10)
    assert r.status_code == 404 and "--eviction-policy lru or no prefix caching" in r.json()["error"]["message"]
