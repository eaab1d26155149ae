"""The server under hostile or heavy use: fuzzed bodies and headers, bursts over capacity,
SIGTERM with streams open, request ids, API keys and body limits."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
VOCAB = 49152
KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_ID_LEN = 128  # X-Request-Id and X-Tenant-Id
FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)

# -- strategies -----------------------------------------------------------------------------
#
# Each field has values the server must accept and values it must refuse. A fuzzed body is
# valid (must get 200), valid but for one refused field (must get 400/404 naming it), or any
# mix of the two and of random JSON (must get no 5xx). max_tokens is always present and never
# above 8 when valid: its default is the rest of the context, ~1000 tokens on CPU.

junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)  # json.dumps writes NaN / Infinity
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
words = st.text(min_size=1, max_size=3)
bad_bool = st.sampled_from(["true", 1, 0, [True]])
bad_count = st.integers(-3, 0) | st.integers(1 << 20, 1 << 62) | st.floats(1, 8) | st.text(max_size=3) | bad_bool
bad_penalty = st.floats(0.01, 2) | st.floats(-2, -0.01)

VALID = {
    "model": st.just(MODEL),
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2) | st.just(0),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 100),
    "n": st.sampled_from([1, 2, 3, 8]),
    "stop": words | st.lists(words, max_size=16),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4),
    "seed": st.integers(0, 2**32 - 1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.just(0),
    "frequency_penalty": st.just(0.0),
    "user": st.text(max_size=20),
    "unknown_field": junk,  # ignored
}
WRONG = {
    "model": st.sampled_from(["gpt-4", "", MODEL.upper()]) | st.integers() | st.lists(words, max_size=2),
    "max_tokens": bad_count,
    "temperature": st.floats(100, 1e300, exclude_min=True)
    | st.floats(-1e300, 0, exclude_max=True)
    | st.sampled_from([float("nan"), float("inf"), "hot", True]),
    "top_p": st.floats(1, 1e300, exclude_min=True) | st.floats(-1e300, 0) | st.sampled_from([float("nan"), "1"]),
    "top_k": st.integers(-(2**31), -2) | st.integers(2**31, 2**70) | st.floats(1, 50) | st.text(max_size=3),
    "n": st.integers(-2, 0) | st.integers(9, 2**40) | st.floats(1, 4) | st.text(max_size=2),
    "stop": st.lists(words, min_size=17, max_size=40)
    | st.sampled_from(["", [""], 7, [1, 2]])
    | st.text(min_size=257, max_size=300),
    "stop_token_ids": st.lists(st.integers(VOCAB, 2**40), min_size=1, max_size=3)
    | st.lists(st.integers(-5, -1), min_size=1, max_size=3)
    | st.lists(st.integers(0, 10), min_size=65, max_size=70)
    | words,
    "seed": st.integers(-(2**70), -1) | st.integers(2**32, 2**70) | st.floats(0, 10) | st.text(max_size=3),
    "stream": bad_bool,
    "stream_options": st.fixed_dictionaries({"include_usage": bad_bool}) | st.integers() | words,
    "ignore_eos": bad_bool,
    "presence_penalty": bad_penalty,
    "frequency_penalty": bad_penalty,
    "repetition_penalty": bad_penalty.map(lambda v: 1 + v),
    "logit_bias": st.dictionaries(st.integers(0, 100).map(str), st.integers(-100, 100), min_size=1, max_size=2),
    "best_of": st.integers(9, 20),
    "user": st.text(min_size=257, max_size=300) | st.integers(),
}
content_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}), max_size=2)
valid_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant"]),
        "content": st.text(max_size=40) | content_parts,
    }
)
bad_message = st.fixed_dictionaries({"role": st.sampled_from(["tool", "robot", "", None]), "content": st.text()}) | (
    st.fixed_dictionaries(
        {
            "role": st.just("user"),
            "content": st.integers() | st.lists(st.fixed_dictionaries({"type": st.just("image_url")}), min_size=1),
        }
    )
)
ENDPOINTS = {
    "/v1/completions": (
        {
            "prompt": st.text(min_size=1, max_size=40)
            | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
            | st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=2),
            "logprobs": st.integers(0, 20),
            "pin_prefix": st.booleans(),
        },
        {
            "prompt": st.sampled_from(["", [], [[]], [True], None, "word " * 1100])
            | st.lists(st.integers(VOCAB, 2**31 - 1), min_size=1, max_size=3)
            | st.lists(st.integers(-5, -1), min_size=1, max_size=3)
            | st.lists(words, min_size=17, max_size=20),
            "logprobs": st.integers(21, 1000) | st.integers(-5, -1) | bad_bool,
            "echo": st.just(True),
            "suffix": words,
            "pin_prefix": st.integers(-5, -1) | words | st.floats(0, 1),
        },
    ),
    "/v1/chat/completions": (
        {
            "messages": st.lists(valid_message, min_size=1, max_size=3),
            "max_completion_tokens": st.integers(1, 8),
            "logprobs": st.booleans(),
            "top_logprobs": st.integers(0, 20),
            "response_format": st.just({"type": "text"}),
            "pin_prefix": st.booleans(),
        },
        {
            "messages": st.sampled_from([[], "Hi", ["Hi"], {"role": "user", "content": "Hi"}])
            | st.lists(bad_message, min_size=1, max_size=2),
            "max_completion_tokens": bad_count,
            "logprobs": bad_bool,
            "top_logprobs": st.integers(21, 100) | st.integers(-5, -1) | words,
            "tools": st.lists(st.dictionaries(words, st.integers(), max_size=2), min_size=1, max_size=2),
            "response_format": st.fixed_dictionaries({"type": st.sampled_from(["json_object", "json_schema"])}),
            "pin_prefix": st.integers() | words,
        },
    ),
}
REQUIRED = {"/v1/completions": ("prompt", "max_tokens"), "/v1/chat/completions": ("messages", "max_tokens")}


def tidy(body: dict) -> dict:
    """Drops the options that are only allowed beside another one that is missing."""
    if body.get("stream") is not True:
        body.pop("stream_options", None)
    if body.get("logprobs") is not True:
        body.pop("top_logprobs", None)
    return body


COUNTS = ("max_tokens", "max_completion_tokens")


def spoil(body: dict, field: str, value) -> dict:
    """`body` with one field set wrong (a chat request's max_completion_tokens would override a
    wrong max_tokens, so it goes)."""
    body = {k: v for k, v in body.items() if not (field == "max_tokens" and k == "max_completion_tokens")}
    return {**body, field: value}


def fuzzed(path: str) -> st.SearchStrategy[tuple[str, str, dict, str | None]]:
    """(path, kind, body, wrong field): kind is 'valid', 'one wrong' or 'chaos'."""
    valid, wrong = {**VALID, **ENDPOINTS[path][0]}, {**WRONG, **ENDPOINTS[path][1]}
    required = REQUIRED[path]
    good = st.fixed_dictionaries(
        {k: valid[k] for k in required}, optional={k: v for k, v in valid.items() if k not in required}
    ).map(tidy)
    one_wrong = st.tuples(good, st.sampled_from(sorted(wrong))).flatmap(
        lambda bf: wrong[bf[1]].map(lambda v: (path, "one wrong", spoil(bf[0], bf[1], v), bf[1]))
    )
    # Anything goes, but a valid max_tokens stays the only one accepted (never null or large).
    mixed = {k: valid[k] | wrong.get(k, junk) | (st.nothing() if k in COUNTS else junk) for k in valid}
    chaos = st.fixed_dictionaries(
        {k: mixed[k] for k in required},
        optional={
            **{k: v for k, v in mixed.items() if k not in required},
            **{k: junk for k in wrong if k not in valid},
        },
    ).map(lambda b: (path, "chaos", b, None))
    return st.one_of(good.map(lambda b: (path, "valid", b, None)), one_wrong, chaos)


requests = fuzzed("/v1/completions") | fuzzed("/v1/chat/completions")
# Header values h11 will send (no NUL, CR, LF, VT, FF); the server sees them stripped of
# spaces and tabs at both ends.
header_text = st.characters(max_codepoint=0xFF, exclude_characters="\x00\r\n\x0b\x0c")
header_values = (
    st.none()
    | st.none()
    | st.none()
    | st.text(header_text, max_size=20)
    | st.text(header_text, min_size=126, max_size=300)
)


# -- checks ---------------------------------------------------------------------------------


def check_error(r: httpx.Response) -> dict:
    """Asserts an OpenAI error body whose code is the status; returns the error."""
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and "param" in error
    assert error["code"] == r.status_code
    return error


def read_stream(r: httpx.Response) -> tuple[list[dict], list[str]]:
    """The JSON events of a finished SSE response and its raw data lines."""
    lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
    events = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    return events, lines


def check_success(r: httpx.Response, body: dict) -> None:
    """A 200 answer to a fuzzed request: every choice finished, no more tokens than asked for."""
    limit = body.get("max_completion_tokens") or body["max_tokens"]
    if r.headers["content-type"].startswith("text/event-stream"):
        events, lines = read_stream(r)
        assert lines[-1] == "data: [DONE]"
        assert all("error" not in e for e in events), events
        finished = {c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]}
        assert finished and set(finished.values()) <= {"length", "stop"}
        assert sorted(finished) == list(range(len(finished)))  # every choice index, once
        usage = [e["usage"] for e in events if e.get("usage")]
        assert len(usage) == int(bool((body.get("stream_options") or {}).get("include_usage")))
        return
    out = r.json()
    assert out["choices"] and {c["finish_reason"] for c in out["choices"]} <= {"length", "stop"}
    assert [c["index"] for c in out["choices"]] == list(range(len(out["choices"])))
    assert 0 < out["usage"]["completion_tokens"] <= limit * len(out["choices"])


def post(url: str, path: str, content: bytes, headers: dict[str, str]) -> httpx.Response | None:
    """Sends a POST and reads the whole answer; None if httpx refuses to send the headers."""
    raw = {k: v.encode("latin-1") for k, v in headers.items()}
    try:
        with httpx.stream("POST", url + path, content=content, headers=raw, timeout=120) as r:
            r.read()
            return r
    except httpx.LocalProtocolError:
        return None


def request_id_ok(value: str | None) -> bool:
    return value is None or (0 < len(value.strip(" \t")) <= MAX_ID_LEN and value.strip(" \t").isprintable())


def tenant_ok(value: str | None) -> bool:
    return value is None or (len(value.strip(" \t")) <= MAX_ID_LEN and value.strip(" \t").isprintable())


def check_request_id(r: httpx.Response, sent: str | None) -> None:
    """A valid id comes back as sent (stripped), a missing one as 32 hex digits."""
    echoed = dict(r.headers.raw).get(b"x-request-id", b"").decode("latin-1")
    if sent is None:
        assert len(echoed) == 32 and int(echoed, 16) >= 0
    else:
        assert echoed == sent.strip(" \t")


# -- 1. fuzzing -----------------------------------------------------------------------------


@settings(FUZZ, max_examples=115)
@given(request=requests, request_id=header_values, tenant=header_values)
@example(
    request=(
        "/v1/chat/completions",
        "one wrong",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "model": "gpt-4"},
        "model",
    ),
    request_id=None,
    tenant=None,
)
@example(
    request=("/v1/completions", "one wrong", {"prompt": "Hi", "max_tokens": 2, "n": 9}, "n"),
    request_id=None,
    tenant=None,
)
@example(
    request=("/v1/completions", "valid", {"prompt": "Hi", "max_tokens": 2}, None), request_id="x" * 129, tenant=None
)
@example(
    request=("/v1/completions", "valid", {"prompt": "Hi", "max_tokens": 2}, None), request_id="bell\x07", tenant=None
)
@example(request=("/v1/completions", "valid", {"prompt": "Hi", "max_tokens": 2}, None), request_id=None, tenant="t\x7f")
@example(
    request=("/v1/completions", "one wrong", {"prompt": "Hi", "max_tokens": 2, "seed": 2**64}, "seed"),
    request_id=None,
    tenant=None,
)
@example(
    request=("/v1/completions", "one wrong", {"prompt": "Hi", "max_tokens": 2, "stop": ["a"] * 17}, "stop"),
    request_id=None,
    tenant=None,
)
@example(
    request=(
        "/v1/chat/completions",
        "valid",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "n": 8},
        None,
    ),
    request_id="r" * 128,
    tenant="acme",
)
@example(
    request=(
        "/v1/completions",
        "valid",
        {"prompt": ["a", "b"], "max_tokens": 4, "n": 8, "stream": True, "logprobs": 5, "seed": 2**32 - 1},
        None,
    ),
    request_id=None,
    tenant=None,
)
def test_fuzzed_requests_get_answers_or_openai_errors_never_5xx(server, request, request_id, tenant):
    path, kind, body, wrong_field = request
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    if tenant is not None:
        headers["X-Tenant-Id"] = tenant
    r = post(server.url, path, json.dumps(body).encode(), headers)
    if r is None:
        return
    event(f"{kind}: {r.status_code}{' stream' if body.get('stream') is True else ''}")
    assert r.status_code < 500, r.text
    if not request_id_ok(request_id):
        assert r.status_code == 400 and "X-Request-Id" in check_error(r)["message"]
        return
    check_request_id(r, request_id)
    if r.status_code >= 400:
        error = check_error(r)
    if not tenant_ok(tenant):
        assert r.status_code == 400
    elif kind == "valid":
        assert r.status_code == 200, r.text
    elif kind == "one wrong":
        assert r.status_code in (400, 404), r.text
        named = f"{error['message']} {error['param']}".lower()
        assert wrong_field in named or "maximum context length" in named, (wrong_field, error)
    if r.status_code == 200:
        check_success(r, body)


non_objects = junk.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode())


@settings(FUZZ, max_examples=35)
@given(
    path=st.sampled_from(sorted(ENDPOINTS)),
    content=st.binary(max_size=80) | non_objects | st.just(b'{"prompt": "Hi", "max_tokens": 1'),
    content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", None]),
)
@example(path="/v1/completions", content=b"", content_type="application/json")
@example(path="/v1/completions", content=b"\xff\xfe\x00", content_type="application/json")
@example(path="/v1/chat/completions", content=b"[]", content_type="application/json")
@example(path="/v1/completions", content=b'{"prompt": "Hi", "max_tokens": 1}', content_type="text/plain")
def test_bodies_that_are_not_json_objects_get_400(server, path, content, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = post(server.url, path, content, headers)
    assert r is not None and r.status_code == 400, r.text
    check_error(r)


def test_server_is_healthy_and_leak_free_after_the_fuzz(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    m = server.metrics()
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    # Every page is free or idle in the prefix cache, except pinned ones.
    assert m["aither:kv_pages_free"] + m["aither:pinned_pages"] == m["aither:kv_pages_total"]


# -- request ids ----------------------------------------------------------------------------


def test_request_id_is_echoed_in_header_and_response_ids_or_generated(server):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, headers={"X-Request-Id": "trace-42"}, timeout=60)
    assert r.headers["x-request-id"] == "trace-42" and r.json()["id"] == "chatcmpl-trace-42"

    body = {"prompt": "Hi", "max_tokens": 3, "stream": True}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers={"X-Request-Id": "s" * 128}, timeout=60
    ) as r:
        r.read()
    events, _ = read_stream(r)
    assert r.headers["x-request-id"] == "s" * 128 and events
    assert {e["id"] for e in events} == {"cmpl-" + "s" * 128}

    generated = []
    for _ in range(2):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
        rid = r.headers["x-request-id"]
        assert len(rid) == 32 and int(rid, 16) >= 0 and r.json()["id"] == "cmpl-" + rid
        generated.append(rid)
    assert generated[0] != generated[1]

    too_long = httpx.get(server.url + "/v1/models", headers={"X-Request-Id": "x" * 129}, timeout=10)
    assert too_long.status_code == 400 and "X-Request-Id" in check_error(too_long)["message"]


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/nope", 404), ("GET", "/v1/completions", 405)])
def test_unknown_routes_and_methods_get_openai_errors(server, method, path, status):
    r = httpx.request(method, server.url + path, timeout=10)
    assert r.status_code == status
    check_error(r)


# -- a small server: 2 running + 2 waiting, an API key, a 2 KiB body limit --------------------


@pytest.fixture(scope="module")
def small_server(server_factory):
    """Over-capacity, authentication and body-limit tests share this server (one start-up); it
    stops with the module so later modules get its memory back."""
    s = server_factory(
        *("--kv-cache-dtype", "fp32", "--max-num-seqs", "2", "--max-queue", "2", "--no-enable-prefix-caching"),
        *("--api-key", KEY, "--max-body-bytes", "2048"),
    )
    yield s
    s.stop()


def scrape(server, name: str) -> float:
    """One unlabelled series of /metrics (Server.metrics() sends no API key)."""
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    line = next(line for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " "))
    return float(line.rsplit(" ", 1)[1])


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


async def burst(url: str, body: dict, num: int) -> list[tuple[httpx.Response, float]]:
    """`num` simultaneous POSTs on already open connections: (answer, seconds to read it)."""
    limits = httpx.Limits(max_connections=num, max_keepalive_connections=num)
    async with httpx.AsyncClient(headers=AUTH, timeout=120, limits=limits) as c:
        # Open every connection first so the burst is not spread out by connection set-up.
        await asyncio.gather(*(c.get(url + "/v1/models") for _ in range(num)))

        async def one() -> tuple[httpx.Response, float]:
            start = time.monotonic()
            r = await c.post(url + "/v1/completions", json=body)
            return r, time.monotonic() - start

        return await asyncio.gather(*(one() for _ in range(num)))


# A burst that compiles a new step shape (which rows prefill together depends on arrival timing)
# takes seconds and adds ~80 MB of executables; a steady one takes ~1.2 s on 2 CPU cores.
COMPILING_BURST_SECONDS = 3.0


def test_bursts_over_capacity_are_refused_fast_and_memory_stays_flat(small_server):
    body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    rejected_before = scrape(small_server, "aither:requests_rejected_total")
    steady_rss, texts, num_rejected = [], set(), 0
    for _ in range(8):
        start = time.monotonic()
        results = asyncio.run(burst(small_server.url, body, 24))
        seconds = time.monotonic() - start
        admitted = [(r, t) for r, t in results if r.status_code == 200]
        refused = [(r, t) for r, t in results if r.status_code != 200]
        assert 1 <= len(admitted) <= 2 + 2, [r.status_code for r, _ in results]
        for r, _ in admitted:
            out = r.json()
            assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["finish_reason"] == "length"
            texts.add(out["choices"][0]["text"])
        for r, _ in refused:
            assert r.status_code in (429, 503) and int(r.headers["retry-after"]) >= 1
            check_error(r)
        slowest_refusal = max(t for _, t in refused)
        assert slowest_refusal < 2.0 and slowest_refusal < max(t for _, t in admitted)
        num_rejected += len(refused)
        # Memory is compared across consecutive bursts that compiled nothing.
        steady_rss = [*steady_rss, rss_mib(small_server.proc.pid)] if seconds < COMPILING_BURST_SECONDS else []
        if len(steady_rss) == 4:
            break
    assert len(steady_rss) == 4, "the step shapes never stopped compiling"
    assert steady_rss[-1] - steady_rss[0] < 25, steady_rss
    assert len(texts) == 1  # greedy: the same prompt gives the same text in any batch
    assert httpx.get(small_server.url + "/health", timeout=10).status_code == 200
    assert scrape(small_server, "aither:requests_rejected_total") - rejected_before == num_rejected
    assert scrape(small_server, "vllm:num_requests_running") == 0


def test_streams_over_capacity_are_refused_with_503(small_server):
    """Capacity is taken when a request is accepted, not when its stream starts: otherwise a burst
    of streams all pass the check and the late ones get 200 and then an error event."""
    body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "stream": True}
    results = asyncio.run(burst(small_server.url, body, 12))
    assert 1 <= sum(r.status_code == 200 for r, _ in results) <= 2 + 2
    for r, _ in results:
        if r.status_code == 200:
            events, lines = read_stream(r)
            assert lines[-1] == "data: [DONE]" and all("error" not in e for e in events), events
        else:
            assert r.status_code == 503 and r.headers.get("retry-after")


ROUTES = [
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
]


@pytest.mark.parametrize("method, path, body", ROUTES)
def test_every_route_but_health_needs_the_api_key(small_server, method, path, body):
    wrong = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}]
    wrong += [{"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"}]
    for headers in wrong:
        r = httpx.request(method, small_server.url + path, json=body, headers=headers, timeout=10)
        assert r.status_code == 401, headers
        assert check_error(r)["type"] == "AuthenticationError" and r.headers["x-request-id"]
    r = httpx.request(method, small_server.url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


def test_health_needs_no_key_and_bodies_over_the_limit_get_413(small_server):
    assert httpx.get(small_server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(small_server.url + "/health", headers={"Authorization": "Bearer wrong"}).status_code == 200
    big = {"prompt": "x" * 10_000, "max_tokens": 1}
    r = httpx.post(small_server.url + "/v1/completions", json=big, headers=AUTH, timeout=10)
    assert r.status_code == 413 and "2048" in check_error(r)["message"]
    just_under = {"prompt": "Hi", "max_tokens": 1, "padding": "x" * 1900}
    assert len(json.dumps(just_under)) < 2048
    r = httpx.post(small_server.url + "/v1/completions", json=just_under, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


def test_chunked_bodies_over_the_limit_get_413(small_server):
    """No Content-Length: the limit must hold on the bytes actually sent."""

    def chunks():
        yield b'{"max_tokens": 1, "prompt": "'
        yield b"x" * 10_000
        yield b'"}'

    headers = {**AUTH, "Content-Type": "application/json"}
    r = httpx.post(small_server.url + "/v1/completions", content=chunks(), headers=headers, timeout=10)
    assert r.request.headers["transfer-encoding"] == "chunked"
    assert r.status_code == 413
    check_error(r)


# -- 3. SIGTERM with streams open -----------------------------------------------------------


def test_sigterm_finishes_open_streams_refuses_new_requests_and_exits_zero(server_factory):
    s = server_factory("--kv-cache-dtype", "fp32", "--max-num-seqs", "4", "--drain-timeout", "60")
    num_streams, max_tokens = 3, 16
    first_chunk = [threading.Event() for _ in range(num_streams)]
    outcomes: list[dict] = [{} for _ in range(num_streams)]

    def stream(i: int) -> None:
        body = {"prompt": f"Story number {i}:", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        o = outcomes[i] = {"text": "", "finish": None, "last": None, "usage": None, "closed": False}
        try:
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
                o["status"] = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    o["last"] = line
                    if line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        o["usage"] = chunk.get("usage") or o["usage"]
                        for choice in chunk.get("choices", []):
                            o["text"] += choice["text"]
                            o["finish"] = choice["finish_reason"] or o["finish"]
                        first_chunk[i].set()
        except httpx.HTTPError as e:
            o["error"] = repr(e)
        o["closed"] = True

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(num_streams)]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in first_chunk), outcomes
    open_at_signal = sum(not o["closed"] for o in outcomes)
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # let the server's handler run
    try:
        late = httpx.post(s.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and check_error(late)
    except httpx.TransportError:
        pass  # the listening socket is closed: refused as well
    for t in threads:
        t.join(90)
    assert open_at_signal > 0  # otherwise nothing was drained
    for o in outcomes:
        assert "error" not in o and o["status"] == 200 and o["last"] == "data: [DONE]" and o["text"], o
        assert o["finish"] == "length" and o["usage"]["completion_tokens"] == max_tokens, o
    assert s.proc.wait(60) == 0
    assert "Traceback" not in s.log()


# -- last: were top_k to overflow again, it would kill the engine of small_server ------------


def test_top_k_beyond_int32_is_refused_and_the_engine_survives(small_server):
    """top_k is an int32 in the step's sampling arrays: a larger one used to overflow inside
    engine.step and stop the engine loop for good."""
    body = {"prompt": "Hi", "max_tokens": 1, "top_k": 2**31}
    r = httpx.post(small_server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code < 500, r.text
    assert httpx.get(small_server.url + "/health", timeout=10).status_code == 200
    ok = httpx.post(
        small_server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=AUTH, timeout=60
    )
    assert ok.status_code == 200
