"""Sampled decoding: the in-step sampler alone and whole sampled decode, on the default model.

Two measurements, each under two settings (temperature 1 with no top-k/top-p, the OpenAI
default; temperature 0.8 with top-p 0.9):

* sampler: `sampling.sample_tokens` jitted alone on [rows, vocab] logits drawn as normal * 3
  (rows 1, 8 and 128: 128 is what an 8-row, 16-token verify pass draws), median of 20 calls;
* decode: `LLM.generate` of 65 tokens after 128 random prompt tokens (float32 weights and KV,
  end-of-sequence ignored, one seed per row), decode tok/s = rows * 64 / (t65 - t1), the median
  of `--repeats` pairs after one untimed pair.

Writes JSON (`--out`) and, unless `--no-record`, records the figures (scripts/bench_record.py:
docs/benchmarks/log.jsonl and the sampling table of docs/BENCHMARKS.md). To compare two
versions of the sampler, run this file against each checkout:
`PYTHONPATH=<checkout> python scripts/bench_sampling.py --no-record --out ...`.

    .venv/bin/python scripts/bench_sampling.py [--rows 1 8] [--repeats 5] [--out out/bench_sampling.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_record  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
SETTINGS = ((1.0, 1.0), (0.8, 0.9))  # (temperature, top_p)
DTYPE, KV = "float32", "fp32"  # the decode measurement's weights and KV cache


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    p.add_argument("--sampler-rows", type=int, nargs="+", default=[1, 8, 128])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "out" / "bench_sampling.json")
    p.add_argument("--no-record", action="store_true", help="do not record the figures (scripts/bench_record.py)")
    args = p.parse_args(argv)
    if args.repeats < 1 or min(args.rows + args.sampler_rows) < 1:
        p.error("--repeats, --rows and --sampler-rows must be at least 1")
    return args


def time_sampler(rows: int, temperature: float, top_p: float, vocab: int) -> float:
    """Median ms of one jitted `sample_tokens` call on [rows, vocab] logits."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from aither_jax.device.sampling import SamplingBatch, sample_tokens

    logits = jnp.asarray(np.random.default_rng(0).standard_normal((rows, vocab)).astype(np.float32) * 3)
    batch = SamplingBatch(
        jnp.full(rows, temperature, jnp.float32),
        jnp.zeros(rows, jnp.int32),
        jnp.full(rows, top_p, jnp.float32),
        jnp.arange(rows, dtype=jnp.uint32),
    )
    fn = jax.jit(sample_tokens, static_argnames="greedy_only")
    positions = jnp.zeros(rows, jnp.int32)
    jax.block_until_ready(fn(logits, batch, positions, greedy_only=False))
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(logits, batch, positions, greedy_only=False))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def time_decode(llm, rows: int, temperature: float, top_p: float, repeats: int) -> float:
    """Median decode tok/s of `rows` sampled sequences (64 decode steps after the first token)."""
    import numpy as np

    import aither_jax as aj

    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(100, llm.config.vocab_size - 100, 128)] for _ in range(rows)]

    def run(n: int) -> float:
        params = [
            aj.SamplingParams(max_tokens=n, temperature=temperature, top_p=top_p, seed=i, ignore_eos=True)
            for i in range(rows)
        ]
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    run(1), run(65)
    rates = []
    for _ in range(repeats):
        t1, t65 = run(1), run(65)
        rates.append(rows * 64 / (t65 - t1))
    return statistics.median(rates)


def bench(args) -> dict:
    import aither_jax as aj

    llm = aj.LLM(args.model, dtype=DTYPE, kv_cache_dtype=KV, max_num_seqs=max(args.rows), progress=False)
    report = {"config": {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}}
    report["sampler_ms"], report["decode_tok_s"] = [], []
    for temperature, top_p in SETTINGS:
        for rows in args.sampler_rows:
            ms = time_sampler(rows, temperature, top_p, llm.config.vocab_size)
            report["sampler_ms"].append({"rows": rows, "temperature": temperature, "top_p": top_p, "ms": ms})
            print(f"sampler, {rows} rows, T={temperature} top-p {top_p}: {ms:.2f} ms", file=sys.stderr)
        for rows in args.rows:
            rate = time_decode(llm, rows, temperature, top_p, args.repeats)
            report["decode_tok_s"].append({"rows": rows, "temperature": temperature, "top_p": top_p, "tok_s": rate})
            print(f"decode, {rows} rows, T={temperature} top-p {top_p}: {rate:.1f} tok/s", file=sys.stderr)
    return report


def setting_name(temperature: float, top_p: float) -> str:
    return f"temperature {temperature:g}" + ("" if top_p == 1 else f", top-p {top_p:g}")


def record(report: dict, command: str) -> None:
    """Records one result per sampling setting (bench_record): the sampler's ms and the decode
    tok/s, each by rows."""
    run = {"command": command, **bench_record.provenance(report["env"])}
    entries = []
    for setting in SETTINGS:
        sampler = [r for r in report["sampler_ms"] if (r["temperature"], r["top_p"]) == setting]
        decode = [r for r in report["decode_tok_s"] if (r["temperature"], r["top_p"]) == setting]
        config = {"model": report["config"]["model"], "weights / KV": f"{DTYPE} / {KV}"}
        config["setting"] = setting_name(*setting)
        figures = {
            "sampler ms by rows": {str(r["rows"]): bench_record.rounded(r["ms"], 2) for r in sampler},
            "decode tok/s by rows": {str(r["rows"]): bench_record.rounded(r["tok_s"], 0) for r in decode},
        }
        details = {"sampler_ms": sampler, "decode_tok_s": decode}
        entries.append(bench_record.result("sampling", config, figures, details=details, **run))
    bench_record.record(entries)


def main(argv=None) -> int:
    args = parse_args(argv)
    report = bench(args)
    report["env"] = bench_record.environment()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    if not args.no_record:
        record(report, "python " + " ".join(shlex.quote(a) for a in ["scripts/bench_sampling.py", *sys.argv[1:]]))
    print(json.dumps(report["decode_tok_s"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
