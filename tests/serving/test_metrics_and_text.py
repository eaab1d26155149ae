"""Host-only pieces of the server: the Prometheus exposition, streamed text deltas, logprobs, the
contexts kept per tenant."""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest

from aither_jax.core.output import top_logprobs
from models.gguf_file import GGUFFile
from models.registry import resolve_model
from models.tokenizer import Tokenizer
from serving.api import TextStream, _drop_context, _on_first
from serving.metrics import Metrics


def test_metrics_render_counters_gauges_and_cumulative_histograms():
    m = Metrics("demo")
    m.counter("vllm:request_success_total", "done")
    m.gauge("vllm:num_requests_running", "running", lambda: 3)
    m.histogram("vllm:time_to_first_token_seconds", "ttft", (0.1, 1.0))
    m.inc("vllm:request_success_total", finished_reason="stop")
    m.inc("vllm:request_success_total", 2, finished_reason="stop")
    for v in (0.05, 0.5, 0.5, 5.0):
        m.observe("vllm:time_to_first_token_seconds", v)
    lines = m.render().splitlines()
    assert "# TYPE vllm:request_success_total counter" in lines
    assert 'vllm:request_success_total{finished_reason="stop",model_name="demo"} 3.0' in lines
    assert 'vllm:num_requests_running{model_name="demo"} 3.0' in lines
    assert 'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="demo"} 1' in lines
    assert 'vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="demo"} 3' in lines
    assert 'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="demo"} 4' in lines
    assert 'vllm:time_to_first_token_seconds_count{model_name="demo"} 4' in lines
    assert m.value("vllm:request_success_total", finished_reason="stop") == 3
    with pytest.raises(KeyError):
        m.inc("vllm:num_requests_running")
    per_pos = [5, 2]
    m.counter_series("vllm:spec_decode_num_accepted_tokens_per_pos_total", "accepted", lambda: [
        ({"position": str(i)}, n) for i, n in enumerate(per_pos)
    ])  # fmt: skip
    per_pos[1] = 3  # read at render time
    lines = m.render().splitlines()
    assert "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter" in lines
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="demo",position="0"} 5.0' in lines
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="demo",position="1"} 3.0' in lines
    with pytest.raises(KeyError):
        m.inc("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0")
    # Prometheus clients name a counter's series <name>_total; dashboards query those names.
    with pytest.raises(ValueError, match="_total"):
        m.counter("vllm:prefix_cache_hits", "hits")
    with pytest.raises(ValueError, match="_total"):
        m.counter_series("vllm:spec_decode_num_accepted_tokens_per_pos", "accepted", list)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(resolve_model("smollm2-135m")))


@pytest.mark.parametrize("text", ["Hello, world! Ünïcödé ✓ and 🚀 emoji", "def f(x):\n    return x * 2  # done"])
@pytest.mark.parametrize("stops", [(), ("world",), ("never-appears", "x")])
def test_text_deltas_concatenate_to_the_text_and_never_run_past_a_stop(tokenizer, text, stops):
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer, stops)
    deltas = [stream.delta(ids[: i + 1]) for i in range(len(ids))]
    final = tokenizer.decode(ids)
    cut = min([final.find(s) for s in stops if s in final], default=len(final))
    assert "\ufffd" not in "".join(deltas)
    assert final[:cut].startswith("".join(deltas)[:cut])
    deltas.append(stream.finish(final[:cut]))
    assert "".join(deltas)[:cut] == final[:cut]


def test_top_logprobs_match_a_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=1000).astype(np.float32) * 4
    lp, top = top_logprobs(logits, 7, 5)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    assert lp == pytest.approx(ref[7])
    assert [t for t, _ in top] == list(np.argsort(-ref)[:5])
    assert [v for _, v in top] == pytest.approx(list(np.sort(ref)[::-1][:5]))
    assert top_logprobs(logits, 7, 0)[1] == []


def test_a_full_context_store_drops_from_the_tenant_holding_the_most():
    contexts = collections.OrderedDict()
    for i in range(3):
        contexts[(b"quiet", f"q{i}")] = i
    for i in range(6):  # one tenant cycling keys
        contexts[(b"busy", f"b{i}")] = i
    contexts.move_to_end((b"quiet", "q0"))
    _drop_context(contexts)
    assert (b"busy", "b0") not in contexts and len(contexts) == 8  # not the quiet tenant's older q1
    while sum(salt == b"busy" for salt, _ in contexts) > 3:
        _drop_context(contexts)
    _drop_context(contexts)  # three each: the least recently used of either
    assert list(contexts) == [(b"quiet", "q2"), (b"busy", "b3"), (b"busy", "b4"), (b"busy", "b5"), (b"quiet", "q0")]


def test_a_routed_request_counts_once_its_first_update_arrives():
    """The router records a turn only once the engine admitted the request (`_on_first`): a
    request refused after routing (no update, an error) is not counted."""
    calls = []

    async def refused():
        raise ValueError("the request needs 99 KV pages but the cache has 40")
        yield  # an async generator

    async def served():
        yield "a"
        yield "b"

    async def consume(gen):
        return [item async for item in _on_first(gen, lambda: calls.append(1))]

    with pytest.raises(ValueError, match="KV pages"):
        asyncio.run(consume(refused()))
    assert calls == []
    assert asyncio.run(consume(served())) == ["a", "b"] and calls == [1]
