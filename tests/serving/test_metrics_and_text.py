"""Host-only pieces of the server: the Prometheus exposition, streamed text deltas, logprobs, the
contexts kept per tenant."""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest

from aither_jax.core.output import TextStream, top_logprobs
from models.gguf_file import GGUFFile
from models.registry import resolve_model
from models.tokenizer import Tokenizer
from serving.api import LogprobStream, TokenOffsets, _drop_context, _on_first, validation_message
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
    # A counter with labels has only labelled series, those it is declared with at 0.
    m.counter("aither:routed_requests_total", "routed", labels=[])
    m.counter("vllm:request_aborts_total", "aborted", labels=[{"why": "client"}])
    lines = m.render().splitlines()
    assert not [line for line in lines if line.startswith("aither:routed_requests_total")]
    assert 'vllm:request_aborts_total{model_name="demo",why="client"} 0.0' in lines
    assert 'vllm:request_aborts_total{model_name="demo"} 0.0' not in lines


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


def test_token_offsets_count_characters_not_the_pieces_of_split_ones(tokenizer):
    text = "a 🥳 b 🥴 日本"
    ids = tokenizer.encode(text)
    spans = TokenOffsets(tokenizer).add(ids)
    assert len(tokenizer.decode(ids)) == len(text) == spans[-1][1]
    for (start, end), i in zip(spans, ids, strict=True):
        assert 0 <= start <= end <= len(text)
        whole = tokenizer.decode([i])
        if "\ufffd" not in whole:  # a token of whole characters spans exactly them
            assert text[start:end] == whole
    assert [s for s, _ in spans] == sorted(s for s, _ in spans)
    eos = tokenizer.eos_token_id
    assert TokenOffsets(tokenizer).add([*ids, eos])[-1] == (len(text), len(text))  # no characters


@pytest.mark.parametrize("stops", [(), ("Blue",), ("b 🥴",)])
def test_streamed_logprobs_follow_the_text_they_make(tokenizer, stops):
    # Tokens go one per update, as the engine sends them, until one completes a stop string.
    ids = tokenizer.encode("Red, Green. Blue and b 🥴 日本 end")
    last = next((k for k in range(len(ids)) if any(x in tokenizer.decode(ids[: k + 1]) for x in stops)), len(ids) - 1)
    final = tokenizer.decode(ids[: last + 1])
    final = final[: min([final.find(x) for x in stops if x in final], default=len(final))]
    stream, held = TextStream(tokenizer, stops), LogprobStream(tokenizer)
    sent, released = "", []
    for k in range(last + 1):
        delta = stream.finish(final) if k == last else stream.delta(ids[: k + 1])
        held.add([ids[k]], [(-0.5, [])])
        tokens, _, starts = held.take(None if k == last else len(stream.sent))
        sent += delta
        released += tokens
        if k < last:  # the logprobs sent never run ahead of the text sent
            made = b"".join(tokenizer.token_bytes(t) for t in released).decode("utf-8", errors="ignore")
            assert sent.startswith(made)
            assert all(start <= len(sent) for start in starts)
    assert sent == final and released == ids[: last + 1]  # every token once, in order, by the end
    if stops:  # the held-back text held its tokens' logprobs back too
        assert tokenizer.decode(ids[: last + 1]) != final


def test_validation_errors_name_the_parameter_as_the_client_wrote_it():
    union = [
        {"type": "int_type", "loc": ("body", "temperature", "int"), "msg": "Input should be a valid integer"},
        {"type": "float_type", "loc": ("body", "temperature", "float"), "msg": "Input should be a valid number"},
    ]
    assert validation_message(union) == (
        "temperature: Input should be a valid integer; Input should be a valid number",
        "temperature",
    )
    nested = [{"type": "string_type", "loc": ("body", "messages", 0, "content", "str"), "msg": "Input should be"}]
    assert validation_message(nested)[1] == "messages.0.content"
    too_many = "List should have at most 16"
    stop = [{"type": "too_long", "loc": ("body", "stop", "list[constrained-str]"), "msg": too_many}]
    assert validation_message(stop) == (f"stop: {too_many}", "stop")
    model_level = [{"type": "value_error", "loc": ("body",), "msg": "Value error, echo is not supported"}]
    assert validation_message(model_level) == ("echo is not supported", "echo")
    ctx = {"error": "Expecting value"}
    broken = [{"type": "json_invalid", "loc": ("body", 66), "msg": "JSON decode error", "ctx": ctx}]
    assert validation_message(broken) == ("the request body is not valid JSON at character 66: Expecting value", None)
    not_json = [{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary"}]
    assert "Content-Type: application/json" in validation_message(not_json)[0]
