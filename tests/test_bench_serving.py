"""scripts/bench_serving.py without a server: the load generator's reading of a stream (an
error event fails the run with the server's message) and the recording of a report that a
time limit cut short."""

import asyncio
import json
import math
import pathlib
import sys

import httpx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_record  # noqa: E402
import bench_serving  # noqa: E402


def stream_of(*events: dict) -> httpx.MockTransport:
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.MockTransport(lambda request: httpx.Response(200, text=body))


def request(transport: httpx.MockTransport) -> dict:
    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await bench_serving.one_request(client, "http://server", "prompt", 4)

    return asyncio.run(go())


def test_a_stream_counts_its_tokens_and_usage():
    chunk = {"choices": [{"index": 0, "text": "a"}]}
    usage = {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 16}}}
    out = request(stream_of(chunk, chunk, usage))
    assert out["tokens"] == 2 and out["cached"] == 16 and len(out["itl"]) == 1


def test_an_error_event_fails_the_request_with_the_servers_message():
    chunk = {"choices": [{"index": 0, "text": "a"}]}
    error = {"error": {"message": "the engine has stopped: XlaRuntimeError()", "code": 503}}
    with pytest.raises(RuntimeError, match="the engine has stopped"):
        request(stream_of(chunk, error))


CONFIG = {"model": "smollm2-135m", "kv_cache_dtype": "auto", "concurrency": "1,4,16", "shared_requests": 32}
CONFIG |= {"shared_prefix_tokens": 1000}
WHOLE = {"on": {"ttft_mean_s": 0.1}, "off": {"ttft_mean_s": 0.8}, "ttft_speedup": 8.0}


def report(shared: dict) -> dict:
    rows = [
        {"concurrency": 1, "throughput_tok_s": 100.0, "ttft_p50_s": 0.05},
        {"concurrency": 16, "throughput_tok_s": 900.0, "ttft_p50_s": 0.2},
    ]
    env = {"date": "2026-11-26", "device": "NVIDIA H200", "jax": "0.11.2", "python": "3.12.3"}
    return {"concurrency": rows, "rates": [], "shared_prefix": shared, "env": env, "config": dict(CONFIG)}


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """The recorder's log and markdown, in tmp_path; returns a reader of the H200 table rows."""
    log, markdown = tmp_path / "log.jsonl", tmp_path / "BENCHMARKS.md"
    markdown.write_text("# Benchmarks\n")
    monkeypatch.setattr(bench_record, "LOG", log)
    monkeypatch.setattr(bench_record, "MARKDOWN", markdown)

    def rows() -> tuple[list[str], list[dict]]:
        logged = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        return [r for r in markdown.read_text().splitlines() if "H200" in r], logged

    return rows


def test_a_report_cut_short_records_its_rows_and_a_full_run_replaces_it(recorded):
    bench_serving.record(report({}), "cmd")
    [row], _ = recorded()
    assert "| 1: 100, 16: 900 | 9.0 | 1: 0.05, 16: 0.2 | – | – | – |" in row
    bench_serving.record(report(WHOLE), "cmd")
    [row], logged = recorded()  # the same configuration measured again: one row
    assert "| 1: 100, 16: 900 | 9.0 | 1: 0.05, 16: 0.2 | 0.1 | 0.8 | 8.0 |" in row and "`cmd`" in row
    assert [e["figures"]["TTFT speedup (x)"] for e in logged] == [None, 8.0]
    assert logged[1]["config"] == {
        "model": "smollm2-135m", "KV": "auto", "concurrency": "1, 4, 16", "shared prefix": "32 x 1000 tokens"
    }  # fmt: skip
    assert logged[1]["details"]["shared_prefix"] == WHOLE and logged[1]["area"] == "serving"


def test_a_report_without_rows_records_nothing(recorded, capsys):
    bench_serving.record(report({}) | {"concurrency": []}, "cmd")
    assert recorded() == ([], [])
    assert "nothing to record" in capsys.readouterr().err


def test_compilations_in_a_timed_workload_are_counted_and_warned(capsys):
    class FakeServer:
        total = 12.0

        def metric(self, name):
            assert name == "aither:xla_compilations_total"
            return self.total

    server = FakeServer()
    assert bench_serving.compilations_since(server, 12.0) == 0
    assert capsys.readouterr().err == ""
    server.total = 15.0
    assert bench_serving.compilations_since(server, 12.0) == 3
    assert "3 compilation(s) during a timed workload" in capsys.readouterr().err


def test_a_shared_prefix_only_run_records_its_comparison_and_plots_it(recorded, tmp_path):
    """`--concurrency "" --rates ""`: a row of its own (no concurrency levels) with the
    shared-prefix figures beside a full run's; the plot is the comparison alone."""
    bench_serving.record(report(WHOLE), "full")
    only = report(WHOLE) | {"concurrency": []}
    only["config"]["concurrency"] = ""
    bench_serving.record(only, "shared")
    full, shared = recorded()[0]
    assert "| 1, 4, 16 |" in full and "`full`" in full
    assert "| – | 32 x 1000 tokens | – | – | – | 0.1 | 0.8 | 8.0 |" in shared and "`shared`" in shared
    bench_serving.plot(only, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 1000


def test_no_concurrency_levels_skip_the_sweep_and_its_warm_ups(monkeypatch):
    """With no levels the bench runs only the shared-prefix workload (on, then off), and its
    warm-up: no bucket warm-ups, no sweep rows."""
    sent = []

    class FakeServer:
        url = "http://server"
        start_seconds = 2.0

        def __init__(self, args, *flags, caching=True):
            self.flags = flags

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def metric(self, name):
            return 1.0

    async def closed_loop(url, prompts, max_tokens, concurrency):
        sent.append((len(prompts), concurrency))
        return [{"ttft": 0.1, "itl": [0.01], "e2e": 0.2, "tokens": max_tokens}] * len(prompts), 1.0

    monkeypatch.setattr(bench_serving, "Server", FakeServer)
    monkeypatch.setattr(bench_serving, "run_closed_loop", closed_loop)
    monkeypatch.setattr(bench_serving, "summarize", lambda results, wall: {"ttft_mean_s": 0.5})
    args = bench_serving.parse_args(["--concurrency", "", "--rates", "", "--shared-requests", "4"])
    out = bench_serving.bench(args)
    assert out["concurrency"] == [] and out["rates"] == []
    assert list(out["warm_up"]) == ["shared prefix", "shared prefix, no caching"]
    assert out["server_start_seconds"] == {"caching": 2.0, "no caching": 2.0}
    assert sent == [(4, 4)] * 4  # warm-up and timed run, on and off
    assert out["shared_prefix"]["ttft_speedup"] == 1.0


def test_step_shape_files_are_named_per_server_and_seeded_without_overwriting(tmp_path):
    src, dst = tmp_path / "recorded", tmp_path / "run"
    src.mkdir()
    args = bench_serving.parse_args(["--compile-shapes", str(dst), "--shapes-from", str(src)])
    on, off = bench_serving.shapes_file(args, True), bench_serving.shapes_file(args, False)
    assert on.parent == dst and on != off
    assert on.name == "smollm2-135m_auto_seqs16_len2048_caching.json"
    args.kv_cache_dtype = "tq-k6v5-k5@0,6-pc"
    assert bench_serving.shapes_file(args, True).name == "smollm2-135m_tq-k6v5-k5_0_6-pc_seqs16_len2048_caching.json"
    (src / on.name).write_text("recorded on")
    (src / off.name).write_text("recorded off")
    dst.mkdir()
    (dst / off.name).write_text("grown off")  # a file already there is kept
    bench_serving.prepare_shapes(args)
    assert (dst / on.name).read_text() == "recorded on" and (dst / off.name).read_text() == "grown off"
    with pytest.raises(SystemExit, match="no such directory"):
        bench_serving.prepare_shapes(bench_serving.parse_args(["--compile-shapes", str(dst), "--shapes-from", "/nope"]))
    with pytest.raises(SystemExit, match="needs --compile-shapes"):
        bench_serving.prepare_shapes(bench_serving.parse_args(["--shapes-from", str(src)]))


def test_summaries_give_throughput_and_latency_percentiles():
    results = [{"ttft": 0.1 * (i + 1), "itl": [0.01 * (i + 1)] * 3, "e2e": 1.0 + i, "tokens": 4} for i in range(10)]
    s = bench_serving.summarize(results, wall=8.0)
    assert s["requests"] == 10 and s["output_tokens"] == 40 and s["throughput_tok_s"] == 5.0
    assert s["ttft_mean_s"] == pytest.approx(0.55) and s["ttft_p50_s"] == pytest.approx(0.55)
    assert s["ttft_p90_s"] == pytest.approx(0.91) and s["ttft_p99_s"] == pytest.approx(0.991)
    assert s["itl_p50_s"] == pytest.approx(0.055) and s["itl_mean_s"] == pytest.approx(0.055)
    assert s["e2e_p99_s"] == pytest.approx(9.91) and s["e2e_mean_s"] == pytest.approx(5.5)
    empty = bench_serving.summarize([], wall=1.0)
    assert empty["requests"] == 0 and empty["throughput_tok_s"] == 0 and math.isnan(empty["ttft_p50_s"])
