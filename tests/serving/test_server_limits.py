"""The server at its edges: fuzzed requests, overload, authentication and body limits, SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"

junk = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
small_ints = st.integers(-3, 8)
fields = {
    "model": st.sampled_from([MODEL, "other"]) | junk,
    "max_tokens": small_ints | junk,
    "temperature": st.floats(-1, 3) | junk,
    "top_p": st.floats(-0.5, 1.5) | junk,
    "top_k": small_ints | junk,
    "n": st.integers(-1, 12) | junk,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=3), max_size=20) | junk,
    "seed": st.integers(-5, 2**40) | junk,
    "logprobs": st.integers(-1, 25) | st.booleans() | junk,
    "top_logprobs": st.integers(-1, 25) | junk,
    "stream": st.booleans() | junk,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | junk,
    "ignore_eos": st.booleans() | junk,
    "unknown_field": junk,
}
prompts = (
    st.text(max_size=40) | st.lists(st.integers(-5, 60000), max_size=6) | st.lists(st.text(max_size=10), max_size=3)
)
messages = (
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "user", "assistant", "tool", "robot"]) | junk,
                "content": st.text(max_size=30) | junk,
            }
        ),
        max_size=3,
    )
    | junk
)


def check_error_shape(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert "error" in r.json(), (r.status_code, r.text)
        error = r.json()["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str)
        assert isinstance(error["code"], int) and "param" in error


def send(url: str, path: str, body, headers=None) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    with httpx.stream("POST", url + path, content=content, headers=headers, timeout=120) as r:
        r.read()
        if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]")
        else:
            check_error_shape(r)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    endpoint=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/unpin"]),
    body=st.fixed_dictionaries({}, optional=fields),
    prompt=prompts,
    conversation=messages,
    raw=st.none() | st.binary(max_size=64) | junk.map(lambda v: json.dumps(v).encode()),
    request_id=st.none() | st.text(max_size=200),
)
def test_fuzzed_requests_never_get_server_errors(server, endpoint, body, prompt, conversation, raw, request_id):
    body = dict(body)
    body.setdefault("max_tokens", 8)  # the default (the rest of the context) is slow on CPU
    if endpoint == "/v1/unpin":  # it refuses sampling fields: keep them out of most bodies
        body = {k: v for k, v in body.items() if k in ("model", "unknown_field")}
        body["prompt" if request_id is None else "messages"] = prompt if request_id is None else conversation
    elif endpoint == "/v1/completions":
        body["prompt"] = prompt
    else:
        body["messages"] = conversation
    headers = {} if request_id is None else {"X-Request-Id": request_id.encode("utf-8", "ignore").decode("latin-1")}
    try:
        send(server.url, endpoint, raw if raw is not None else body, headers)
    except (httpx.LocalProtocolError, UnicodeEncodeError):
        pass  # a header value httpx itself refuses to send


def test_server_still_answers_after_the_fuzz(server):
    huge_top_k = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "top_k": 2**31})
    assert huge_top_k.status_code == 400  # an int32 overflow in the step would kill the engine loop
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = httpx.post(
        server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0}, timeout=60
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_lone_surrogate_is_a_400_naming_where_it_is(server):
    """Valid JSON ("\\ud800" escapes a UTF-16 half) that is no text: refused at the edge."""
    for path, body in (
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'),
        ("/v1/completions", b'{"prompt": "\\udfff", "max_tokens": 2}'),
    ):
        r = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 400, r.text
        assert "lone UTF-16 surrogate" in r.json()["error"]["message"]
    error = httpx.post(
        server.url + "/v1/chat/completions",
        content=b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        headers={"Content-Type": "application/json"},
    ).json()["error"]
    assert error["message"].startswith("messages.0.content holds") and error["param"] == "messages.0.content"


# -- overload -------------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_overload_is_refused_fast_and_admitted_requests_complete(server_factory):
    s = server_factory("--kv-cache-dtype", "fp32", "--max-num-seqs", "2", "--max-queue", "2")

    async def burst() -> list[tuple[int, float, dict, dict]]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as c:

            async def one(i: int):
                t0 = time.monotonic()
                body = {"prompt": f"Request {i} says", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                r = await c.post(s.url + "/v1/completions", json=body)
                return r.status_code, time.monotonic() - t0, dict(r.headers), r.json()

            return await asyncio.gather(*(one(i) for i in range(24)))

    # Memory is read after each burst. A burst may still compile a step shape (which rows
    # happen to prefill together depends on timing), which grows the heap once; a leak per
    # refused request would grow it in every burst. So bursts go on until three in a row
    # compiled nothing, and memory must be flat over those three.
    rejected_total, rss, quiet = 0, [rss_kib(s.proc.pid)], 0
    compiles = s.metrics()["aither:xla_compilations_total"]
    for _ in range(12):
        results = asyncio.run(burst())
        ok = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] != 200]
        assert 1 <= len(ok) <= 4
        assert all(r[3]["usage"]["completion_tokens"] == 8 for r in ok)
        assert all(r[0] == 503 and r[2].get("retry-after") and r[3]["error"]["code"] == 503 for r in refused)
        assert max(r[1] for r in refused) < 2.0 < max(r[1] for r in ok) or max(r[1] for r in refused) < 0.5
        rejected_total += len(refused)
        now = s.metrics()["aither:xla_compilations_total"]
        quiet, compiles = (quiet + 1 if now == compiles else 0), now
        rss.append(rss_kib(s.proc.pid))
        if quiet == 3:
            break
    assert quiet == 3, f"step shapes kept compiling over {len(rss)} bursts"
    assert rss[-1] - rss[-4] < 50 * 1024, rss  # flat over the last three bursts, none of which compiled

    async def streaming_burst() -> list[tuple[int, dict, str]]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as c:

            async def one(i: int):
                body = {"prompt": f"Stream {i} says", "max_tokens": 4, "temperature": 0, "stream": True}
                async with c.stream("POST", s.url + "/v1/completions", json=body) as r:
                    return r.status_code, dict(r.headers), (await r.aread()).decode()

            return await asyncio.gather(*(one(i) for i in range(12)))

    # Capacity is taken when a request is accepted, not when its stream starts.
    streamed = asyncio.run(streaming_burst())
    ok = [r for r in streamed if r[0] == 200]
    assert 1 <= len(ok) <= 4 and all("data: [DONE]" in r[2] and '"error"' not in r[2] for r in ok)
    assert all(r[0] == 503 and r[1].get("retry-after") for r in streamed if r[0] != 200)
    rejected_total += len(streamed) - len(ok)
    assert httpx.get(s.url + "/health").status_code == 200
    assert s.metrics()["aither:requests_rejected_total"] == rejected_total
    assert s.metrics()["aither:compiled_code_releases_total"] == 0  # far below vm.max_map_count


# -- authentication, request ids, body size -------------------------------------------------


def test_api_key_request_id_and_body_limit(server, server_factory):
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2},
        headers={"X-Request-Id": "my-request-42"},
        timeout=60,
    )
    assert r.headers["x-request-id"] == "my-request-42" and "my-request-42" in r.json()["id"]
    assert len(httpx.get(server.url + "/v1/models").headers["x-request-id"]) == 32  # generated
    too_long = httpx.get(server.url + "/v1/models", headers={"X-Request-Id": "x" * 129})
    assert too_long.status_code == 400 and "X-Request-Id" in too_long.json()["error"]["message"]

    s = server_factory(
        "--kv-cache-dtype", "fp32", "--max-num-seqs", "2", "--api-key", "sekret", "--max-body-bytes", "2048"
    )
    good = {"Authorization": "Bearer sekret"}
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.request(method, s.url + path, headers=headers, json={"prompt": "Hi", "max_tokens": 1})
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
        r = httpx.request(method, s.url + path, headers=good, json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
        assert r.status_code == 200
    assert httpx.get(s.url + "/health").status_code == 200
    big = httpx.post(
        s.url + "/v1/completions", headers=good | {"X-Request-Id": "big-1"}, json={"prompt": "word " * 2000}
    )
    assert big.status_code == 413 and big.json()["error"]["code"] == 413 and big.headers["x-request-id"] == "big-1"

    def chunks():  # no Content-Length: the limit must hold on the bytes actually sent
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"word " * 20
        yield b'", "max_tokens": 1}'

    headers = good | {"Content-Type": "application/json"}
    chunked = httpx.post(s.url + "/v1/completions", headers=headers, content=chunks())
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == 413


# -- shutdown -------------------------------------------------------------------------------


def test_sigterm_lets_streams_finish_refuses_new_requests_and_exits_zero(server_factory):
    s = server_factory("--kv-cache-dtype", "fp32", "--max-num-seqs", "4", "--drain-timeout", "60")
    first_chunk = [threading.Event() for _ in range(3)]
    outcomes: list[dict] = [{} for _ in range(3)]

    def stream(i: int) -> None:
        body = {"prompt": f"Count slowly {i}:", "max_tokens": 16, "temperature": 0, "stream": True, "ignore_eos": True}
        text, finish, lines = [], None, []
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text.append(choice["text"])
                    finish = choice["finish_reason"] or finish
                    first_chunk[i].set()
        outcomes[i] = {"text": "".join(text), "finish": finish, "done": "data: [DONE]" in lines}

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in first_chunk)
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:
        late = httpx.post(s.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503
    except httpx.TransportError:
        pass  # the listening socket is already closed: refused too
    for t in threads:
        t.join(120)
    assert all(o["done"] and o["text"] and o["finish"] == "length" for o in outcomes), outcomes
    assert s.proc.wait(60) == 0


def test_sigterm_ends_streams_that_outlast_the_drain_timeout(server_factory):
    s = server_factory("--kv-cache-dtype", "fp32", "--max-num-seqs", "2", "--drain-timeout", "2")
    started, lines = threading.Event(), []

    def stream() -> None:
        body = {"prompt": "Count to ten:", "max_tokens": 900, "temperature": 0, "stream": True, "ignore_eos": True}
        with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", s.url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                lines.append(line)
                started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(120)
    s.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert s.proc.wait(60) == 0
    assert time.monotonic() - signalled < 30  # the drain timeout (2 s) and the shutdown, not 900 tokens
    t.join(60)
    tokens = sum(1 for line in lines if line.startswith("data: {"))
    assert 0 < tokens < 900 and "data: [DONE]" not in lines
