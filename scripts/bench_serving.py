"""Serving benchmark: throughput and latency of `python -m aither_jax.serve` under load.

It starts the server itself (twice: prefix caching on, and off for the shared-prefix
comparison), on loopback, and drives it with streaming `/v1/completions` requests:

* concurrency sweep (`--concurrency 1,4,16`): `--num-requests` requests with distinct prompts,
  `--max-tokens` tokens each (end of sequence ignored, greedy), at most c in flight.
  Throughput = generated tokens / wall time of the sweep point.
* request-rate sweep (`--rates 1,4`): requests arrive as a Poisson process at r per second.
* shared prefix (`--shared-requests 32 --shared-prefix-tokens 1000`): every request is one long
  system text (fresh for each server, so both start cold) plus its own question, all sent at
  once; mean time to first token with caching on against caching off.

TTFT is the time from sending a request to its first streamed token; inter-token latency the
gaps between later chunks; e2e the time to the end of the stream. Each server first runs one
untimed pass of every workload and of every batch-size bucket (1, 2, 4, ... concurrent
requests) so compilation is excluded.

With `--compile-shapes DIR` each server keeps a step-shapes file in DIR (one per server
configuration, `serve --compile-shapes`): it compiles the file's shapes on several threads
before serving, and its warm-ups then compile only the shapes the file lacks, which it adds.
`--shapes-from SRC` first copies SRC's files into DIR (those already in DIR are kept): the
GPU stage starts from files recorded on CPU (`scripts/data/step_shapes/`) and brings the
grown ones back.

Writes a JSON report (`--out`), a plot next to it, prints a table and records the figures
(unless `--no-record`): scripts/bench_record.py adds them to docs/benchmarks/log.jsonl and to
the serving table of docs/BENCHMARKS.md.

    python scripts/bench_serving.py                         # defaults: SmolLM2, default KV format
    python scripts/bench_serving.py --kv-cache-dtype bf16 --concurrency 1,8,32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import bench_record
import httpx
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Model load, plus compiling a step-shapes file's shapes with --compile-shapes.
STARTUP_SECONDS = 600
WORDS = "river stone light garden paper window silver orchard lantern meadow harbor candle forest".split()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated in-flight limits; empty to skip")
    p.add_argument("--num-requests", type=int, default=32, help="requests per concurrency point (at least 2 x c)")
    p.add_argument("--rates", default="1,4", help="comma-separated request rates (per second); empty to skip")
    p.add_argument("--rate-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=48, help="length of each distinct prompt, in words")
    p.add_argument("--shared-requests", type=int, default=32)
    p.add_argument("--shared-prefix-tokens", type=int, default=1000)
    p.add_argument("--shared-max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eviction-policy", choices=("advisor", "lru"), help="the caching server's (default: the server's)")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "out" / "bench_serving.json")
    p.add_argument("--server-log", type=pathlib.Path, default=None, help="keep the servers' logs in this file")
    p.add_argument("--no-record", action="store_true", help="do not record the figures (scripts/bench_record.py)")
    add_shape_args(p, "each server's step-shapes file in DIR (serve --compile-shapes): compiled before serving")
    return p.parse_args(argv)


def add_shape_args(p: argparse.ArgumentParser, compile_help: str) -> None:
    """`--compile-shapes DIR` (what DIR keeps: `compile_help`) and `--shapes-from SRC`."""
    p.add_argument("--compile-shapes", type=pathlib.Path, default=None, metavar="DIR", help="keep " + compile_help)
    p.add_argument(
        "--shapes-from",
        type=pathlib.Path,
        default=None,
        metavar="SRC",
        help="copy the step-shapes files of SRC into --compile-shapes DIR first (files in DIR are kept)",
    )


# -- the server -------------------------------------------------------------------------------


# The server's running totals of XLA compilations, their seconds, and the seconds spent lowering
# steps (where jaxlib >= 0.10.3 builds the Pallas kernels).
COMPILE_METRICS = (
    "aither:xla_compilations_total",
    "aither:xla_compile_seconds_total",
    "aither:xla_lowering_seconds_total",
)


def compilations_since(server: Server, before: float) -> int:
    """The server's compilations since it counted `before`; warns when there were any."""
    n = int(server.metric(COMPILE_METRICS[0]) - before)
    if n:
        print(f"  warning: {n} compilation(s) during a timed workload: its figures include them", file=sys.stderr)
    return n


def shapes_file(args: argparse.Namespace, caching: bool) -> pathlib.Path:
    """The step-shapes file of a server configuration in `args.compile_shapes`."""
    name = f"{pathlib.Path(args.model).stem}_{args.kv_cache_dtype}_seqs{args.max_num_seqs}_len{args.max_model_len}"
    return args.compile_shapes / shapes_file_name(f"{name}_{'caching' if caching else 'nocaching'}")


def shapes_file_name(name: str) -> str:
    """`name` as a step-shapes file's name: letters, digits, '.', '-' and '_' only (as the GPU
    machine sends files back), then .json."""
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in name) + ".json"


def prepare_shapes(args: argparse.Namespace) -> None:
    """Creates `--compile-shapes` DIR and copies in `--shapes-from` files it does not have."""
    if args.compile_shapes is None:
        if args.shapes_from is not None:
            sys.exit("--shapes-from needs --compile-shapes")
        return
    args.compile_shapes.mkdir(parents=True, exist_ok=True)
    if args.shapes_from is not None:
        if not args.shapes_from.is_dir():
            sys.exit(f"--shapes-from: no such directory: {args.shapes_from}")
        for src in sorted(args.shapes_from.glob("*.json")):
            dst = args.compile_shapes / src.name
            if not dst.exists():
                dst.write_bytes(src.read_bytes())


class Server(contextlib.AbstractContextManager):
    def __init__(self, args: argparse.Namespace, *flags: str, caching: bool = True):
        """Starts the server; its log (stderr) goes to `args.server_log` when given (appended),
        else to a temporary file. A failure inside the `with` block prints the log's tail.
        `start_seconds` is the time until it answered /health (model load, and with
        `--compile-shapes` the compilation of the file's shapes)."""
        start = time.monotonic()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "aither_jax.serve", "--model", args.model, "--port", str(self.port)]
        cmd += ["--kv-cache-dtype", args.kv_cache_dtype, "--max-num-seqs", str(args.max_num_seqs)]
        cmd += ["--max-model-len", str(args.max_model_len), "--max-queue", "256", "--log-level", "warning", *flags]
        if args.compile_shapes is not None:
            cmd += ["--compile-shapes", str(shapes_file(args, caching))]
        # A file, not a pipe: nobody reads the server's log while it runs, and a full pipe would stall it.
        self.log = open(args.server_log, "a+") if args.server_log else tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited: {self.log.read()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    self.start_seconds = time.monotonic() - start
                    print(f"server up in {self.start_seconds:.1f} s", flush=True)
                    return
            time.sleep(0.5)
        self.proc.kill()
        raise RuntimeError(f"server did not start in {STARTUP_SECONDS} s")

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def __exit__(self, exc_type, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if exc_type is not None:
            self.log.flush()
            self.log.seek(0)
            print(f"server log (last 4000 characters):\n{self.log.read()[-4000:]}", file=sys.stderr)
        self.log.close()


# -- the load generator -----------------------------------------------------------------------


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    stamps, usage = [], None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # the server ends a stream it cannot finish with an error event
                raise RuntimeError(f"error event in the stream: {chunk['error'].get('message')!r}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter())
    end = time.perf_counter()
    return {
        "ttft": stamps[0] - sent if stamps else end - sent,
        "itl": list(np.diff(stamps)),
        "e2e": end - sent,
        "tokens": usage["completion_tokens"] if usage else 0,
        "cached": usage["prompt_tokens_details"]["cached_tokens"] if usage else 0,
    }


async def run_closed_loop(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> tuple[list[dict], float]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:

        async def gated(prompt: str) -> dict:
            async with gate:
                return await one_request(client, url, prompt, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(gated(p) for p in prompts))
        return list(results), time.perf_counter() - start


async def run_open_loop(
    url: str, prompts: list[str], max_tokens: int, rate: float, seed: int
) -> tuple[list[dict], float]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=len(prompts) + 8)) as client:
        start = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.ensure_future(one_request(client, url, p, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def summarize(results: list[dict], wall: float) -> dict:
    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else float("nan")

    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    e2e = [r["e2e"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    out = {"requests": len(results), "output_tokens": tokens, "wall_s": wall, "throughput_tok_s": tokens / wall}
    for name, values in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        out[f"{name}_mean_s"] = statistics.fmean(values) if values else float("nan")
        for q in (50, 90, 99):
            out[f"{name}_p{q}_s"] = pct(values, q)
    return out


def distinct_prompts(n: int, words: int, rng: random.Random) -> list[str]:
    return [f"Note {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


def shared_prompts(n: int, prefix_tokens: int, tag: str, rng: random.Random) -> list[str]:
    # About one token per word for these common words (checked by the server's usage block).
    system = f"Library handbook {tag}. " + " ".join(rng.choice(WORDS) for _ in range(prefix_tokens - 8))
    return [f"{system}\nQuestion {i}: which word comes first in the handbook?" for i in range(n)]


# -- the workloads ----------------------------------------------------------------------------


def bench(args: argparse.Namespace, save=lambda report: None) -> dict:
    """Runs the workloads; `save(report)` is called after each, so a run cut off keeps the
    rows it finished."""
    rng = random.Random(args.seed)
    levels = [int(c) for c in args.concurrency.split(",") if c]
    rates = [float(r) for r in args.rates.split(",") if r]
    report: dict = {"concurrency": [], "rates": [], "shared_prefix": {}}
    policy = () if args.eviction_policy is None else ("--eviction-policy", args.eviction_policy)
    with Server(args, *policy) as server:
        report["server_start_seconds"] = {"caching": server.start_seconds}
        print("warm-up (compiles every shape the workloads use) ...", flush=True)
        warm_up = report["warm_up"] = {}

        def phase(server: Server, name: str, workload) -> None:
            """Runs one warm-up workload (a coroutine) on `server`: its wall time, and the
            compilations in it (the server's count)."""
            before = [server.metric(m) for m in COMPILE_METRICS]
            _, wall = asyncio.run(workload)
            count, seconds, lowering = (server.metric(m) - b for m, b in zip(COMPILE_METRICS, before, strict=True))
            warm_up[name] = {
                "seconds": wall,
                "compilations": int(count),
                "compile_seconds": seconds,
                "lowering_seconds": lowering,
            }
            print(
                f"  {name}: {wall:.1f} s, {int(count)} compilations taking {seconds:.1f} s, lowering {lowering:.1f} s",
                flush=True,
            )

        # The same request count as the timed run: its tail (the last few rows, the second
        # wave's prefill) has step shapes a smaller warm-up never reaches. First, since it is
        # the only workload that runs the shared-prefix attention: a failure there shows early.
        warm = shared_prompts(args.shared_requests, args.shared_prefix_tokens, "warm-up", rng)
        phase(server, "shared prefix", run_closed_loop(server.url, warm, args.shared_max_tokens, len(warm)))
        # No levels (`--concurrency ""`): no concurrency sweep, and no warm-up of its buckets.
        buckets = sorted({1 << i for i in range(max(levels + [args.max_num_seqs]).bit_length())} | set(levels))
        for c in buckets if levels else []:
            prompts = distinct_prompts(c, args.prompt_words, rng)
            phase(server, f"concurrency {c}", run_closed_loop(server.url, prompts, args.max_tokens, c))
        for r in rates:
            prompts = distinct_prompts(args.rate_requests, args.prompt_words, rng)
            phase(server, f"rate {r}", run_open_loop(server.url, prompts, args.max_tokens, r, args.seed))
        save(report)
        for c in levels:
            n = max(args.num_requests, 2 * c)
            compiled = server.metric(COMPILE_METRICS[0])
            results, wall = asyncio.run(
                run_closed_loop(server.url, distinct_prompts(n, args.prompt_words, rng), args.max_tokens, c)
            )
            # Compilations inside a timed workload (the warm-up missed a shape) are in its figures.
            row = {"concurrency": c, **summarize(results, wall), "compilations": compilations_since(server, compiled)}
            report["concurrency"].append(row)
            save(report)
            print(f"concurrency {c:3d}: {row['throughput_tok_s']:8.1f} tok/s, TTFT p50 {row['ttft_p50_s']:.3f} s")
        for r in rates:
            prompts = distinct_prompts(args.rate_requests, args.prompt_words, rng)
            compiled = server.metric(COMPILE_METRICS[0])
            results, wall = asyncio.run(run_open_loop(server.url, prompts, args.max_tokens, r, args.seed))
            row = {"rate": r, **summarize(results, wall), "compilations": compilations_since(server, compiled)}
            report["rates"].append(row)
            save(report)
            print(f"rate {r:5.2f}/s: {row['throughput_tok_s']:8.1f} tok/s, TTFT p50 {row['ttft_p50_s']:.3f} s")
        hits0 = server.metric("vllm:prefix_cache_hits_total")
        shared0 = server.metric("aither:shared_prefix_attention_steps_total")
        on = shared_prompts(args.shared_requests, args.shared_prefix_tokens, "cold-on", rng)
        results, wall = asyncio.run(run_closed_loop(server.url, on, args.shared_max_tokens, len(on)))
        report["shared_prefix"]["on"] = summarize(results, wall) | {
            "cache_hit_tokens": server.metric("vllm:prefix_cache_hits_total") - hits0,
            "shared_prefix_attention_steps": server.metric("aither:shared_prefix_attention_steps_total") - shared0,
        }
        save(report)
    with Server(args, "--no-enable-prefix-caching", caching=False) as server:
        report["server_start_seconds"]["no caching"] = server.start_seconds
        warm = shared_prompts(args.shared_requests, args.shared_prefix_tokens, "warm-off", rng)
        phase(server, "shared prefix, no caching", run_closed_loop(server.url, warm, args.shared_max_tokens, len(warm)))
        off = shared_prompts(args.shared_requests, args.shared_prefix_tokens, "cold-off", rng)
        results, wall = asyncio.run(run_closed_loop(server.url, off, args.shared_max_tokens, len(off)))
        report["shared_prefix"]["off"] = summarize(results, wall)
    sp = report["shared_prefix"]
    sp["ttft_speedup"] = sp["off"]["ttft_mean_s"] / sp["on"]["ttft_mean_s"]
    print(
        f"shared prefix: mean TTFT {sp['on']['ttft_mean_s']:.2f} s cached vs {sp['off']['ttft_mean_s']:.2f} s "
        f"uncached ({sp['ttft_speedup']:.1f}x)"
    )
    return report


def plot(report: dict, path: pathlib.Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = report["concurrency"]
    if rows:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        xs = [r["concurrency"] for r in rows]
        axes[0].plot(xs, [r["throughput_tok_s"] for r in rows], "o-")
        axes[0].set(xscale="log", xlabel="concurrent requests", ylabel="generated tok/s", title="Throughput")
        axes[0].set_xticks(xs, [str(x) for x in xs])
        for q in (50, 90, 99):
            axes[1].plot(xs, [r[f"ttft_p{q}_s"] for r in rows], "o-", label=f"TTFT p{q}")
        axes[1].plot(xs, [r["itl_p50_s"] for r in rows], "s--", label="ITL p50")
        axes[1].set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="seconds", title="Latency")
        axes[1].set_xticks(xs, [str(x) for x in xs])
        axes[1].legend()
    else:  # `--concurrency ""`: the shared-prefix comparison alone
        fig, ax = plt.subplots(figsize=(6, 4.2))
        axes = [None, None, ax]
    sp = report["shared_prefix"]
    axes[2].bar(["caching off", "caching on"], [sp["off"]["ttft_mean_s"], sp["on"]["ttft_mean_s"]], color=["C3", "C2"])
    axes[2].set(
        ylabel="mean TTFT (s)",
        title=f"{report['config']['shared_requests']} requests, shared "
        f"{report['config']['shared_prefix_tokens']}-token prefix ({sp['ttft_speedup']:.1f}x)",
    )
    fig.suptitle(
        f"aither-jax serving, {report['config']['model']} ({report['config']['kv_cache_dtype']} KV), "
        f"{report['env']['device']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def record(report: dict, command: str) -> None:
    """Records the report (bench_record): throughput and TTFT by concurrency and the
    shared-prefix comparison, keyed on the model, KV format and workloads configured. A run
    cut off before a workload records what it measured, with the rest as None."""
    rows, sp, cfg = report["concurrency"], report["shared_prefix"], report["config"]
    if not rows and "ttft_speedup" not in sp:
        print("no concurrency rows and no shared-prefix comparison in the report: nothing to record", file=sys.stderr)
        return
    shared = "ttft_speedup" in sp
    levels = [c.strip() for c in cfg["concurrency"].split(",") if c.strip()]
    config = {
        "model": cfg["model"],
        "KV": cfg["kv_cache_dtype"],
        "concurrency": ", ".join(levels) or None,
        "shared prefix": f"{cfg['shared_requests']} x {cfg['shared_prefix_tokens']} tokens",
    }
    ratio = rows[-1]["throughput_tok_s"] / rows[0]["throughput_tok_s"] if rows else None

    def by_concurrency(key: str, digits: int) -> dict | None:
        return {str(r["concurrency"]): bench_record.rounded(r[key], digits) for r in rows} or None

    figures = {
        "tok/s by concurrency": by_concurrency("throughput_tok_s", 0),
        "max/min concurrency (x)": bench_record.rounded(ratio, 1),
        "TTFT p50 by concurrency (s)": by_concurrency("ttft_p50_s", 2),
        "shared-prefix TTFT cached (s)": bench_record.rounded(sp["on"]["ttft_mean_s"], 2) if shared else None,
        "shared-prefix TTFT uncached (s)": bench_record.rounded(sp["off"]["ttft_mean_s"], 2) if shared else None,
        "TTFT speedup (x)": bench_record.rounded(sp["ttft_speedup"], 1) if shared else None,
    }
    details = {k: v for k, v in report.items() if k != "env"}
    run = {"command": command, **bench_record.provenance(report["env"])}
    bench_record.record([bench_record.result("serving", config, figures, details=details, **run)])


def main(argv=None) -> int:
    args = parse_args(argv)
    prepare_shapes(args)
    env = bench_record.environment()
    config = {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(report: dict) -> None:
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(report | {"config": config, "env": env}, indent=2))
        os.replace(tmp, args.out)

    report = bench(args, save)
    report["config"], report["env"] = config, env
    save(report)
    plot(report, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")
    if not args.no_record:
        record(report, "python scripts/bench_serving.py " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
