"""The KV tiers (aither_jax/kv/tiers.py): time to first token from each tier against recompute,
multi-turn conversations on a small device pool, and decode throughput with the tiers on.

Three measurements on the default model (its default dtype and KV format):

* TTFT by prefix length (1K, 2K, 4K, 8K tokens): a prompt of a random prefix plus a 16-token
  question, 1 token out. "recompute": the prefix is new; "device": it is cached on the device;
  "host": its pages were demoted to the host tier; "disk": they were moved on to the disk
  tier. Median of `--repeats`, after an untimed round that compiles every shape.
* Multi-turn: `--conversations` conversations, round-robin for `--rounds` rounds; each round's
  prompt is every earlier round (prompt and answer) plus a new question (`--question-tokens`,
  64; the first round `--first-tokens`, 512, of context before it), 1 token out
  (vLLM's and SGLang's multi-turn method: it isolates prefill). The device pool holds a quarter
  of the conversations' final contexts. Mean TTFT and the share of prompt tokens served by
  each tier, tiers on against off, over rounds 2+ of a pass that follows an untimed pass over
  other tokens (which compiles every shape).
* Decode tok/s of 4 fresh 128-token prompts x 64 tokens (0% hits), tiers on against off.

Writes JSON (`--out`), a plot next to it (with matplotlib), and unless `--no-record` the
headline rows (scripts/bench_record.py: docs/benchmarks/log.jsonl, docs/BENCHMARKS.md).

    .venv/bin/python scripts/bench_tiers.py [--prefixes 1024 2048 4096 8000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_record  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = 16
QUESTION = 16
TIERS = ("recompute", "device", "host", "disk")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prefixes", type=int, nargs="+", default=[1024, 2048, 4096, 8000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--first-tokens", type=int, default=512, help="multi-turn: the first round's context")
    p.add_argument("--question-tokens", type=int, default=64, help="multi-turn: each round's new question")
    p.add_argument("--parts", nargs="+", choices=("ttft", "multi-turn"), default=["ttft", "multi-turn"])
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "out" / "bench_tiers.json")
    p.add_argument("--no-record", action="store_true", help="do not record the figures (scripts/bench_record.py)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.conversations < 2 or args.rounds < 2 or min(args.prefixes) < PAGE:
        p.error("--repeats >= 1, --conversations >= 2, --rounds >= 2 and prefixes >= 16 tokens")
    return args


def _ttft(llm, prompt: list[int]) -> float:
    import aither_jax as aj

    start = time.perf_counter()
    llm.generate([prompt], aj.SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return time.perf_counter() - start


def ttft_by_tier(args, cache_dir: str) -> list[dict]:
    """TTFT of each tier at each prefix length (seconds, median of the repeats)."""
    import numpy as np

    import aither_jax as aj

    longest = max(args.prefixes) + QUESTION + 1
    llm = aj.LLM(
        args.model, max_model_len=longest, max_num_seqs=1, num_pages=2 * (longest // PAGE + 2),
        enable_prefix_caching=True, kv_offloading_size=4.0, kv_cache_dir=cache_dir, kv_disk_size=8.0,
        kv_high_watermark=1.0, progress=False,
    )  # fmt: skip
    cache, tiers = llm.engine.scheduler.prefix_cache, llm.engine.tiers
    rng = np.random.default_rng(0)
    vocab = llm.config.vocab_size

    def ids(n: int) -> list[int]:
        return rng.integers(100, vocab - 100, n).tolist()

    def one_round(length: int) -> dict[str, float]:
        prefix = ids(length)
        out = {"recompute": _ttft(llm, prefix + ids(QUESTION))}
        out["device"] = _ttft(llm, prefix + ids(QUESTION))
        cache.evict(cache.num_evictable)  # every idle page to the host tier
        out["host"] = _ttft(llm, prefix + ids(QUESTION))
        cache.evict(cache.num_evictable)
        tiers.spill()  # and on to disk
        out["disk"] = _ttft(llm, prefix + ids(QUESTION))
        return out

    rows = []
    for length in args.prefixes:
        one_round(length)  # compiles this length's shapes
        runs = [one_round(length) for _ in range(args.repeats)]
        row = {"prefix": length} | {t: statistics.median(r[t] for r in runs) for t in TIERS}
        print(f"{length} tokens: " + ", ".join(f"{t} {row[t] * 1e3:.0f} ms" for t in TIERS), file=sys.stderr)
        rows.append(row)
    return rows


def multi_turn(args, *, tiers: bool, cache_dir: str) -> dict:
    """Mean TTFT and the share of prompt tokens from each tier over round-robin conversations."""
    import numpy as np

    import aither_jax as aj

    rng = np.random.default_rng(1)
    first, question = args.first_tokens, args.question_tokens
    final = first + args.rounds * (question + 1)
    pool = max(final // PAGE + 2, args.conversations * final // PAGE // 4)  # a quarter of the final contexts
    extra = dict(kv_offloading_size=4.0, kv_cache_dir=cache_dir) if tiers else {}
    llm = aj.LLM(
        args.model, max_model_len=final + 16, max_num_seqs=1, num_pages=pool + 1, enable_prefix_caching=True,
        progress=False, **extra,
    )  # fmt: skip
    vocab = llm.config.vocab_size
    params = aj.SamplingParams(max_tokens=1, temperature=0.0)

    def conversations() -> tuple[list[float], int]:
        history = [rng.integers(100, vocab - 100, first - question).tolist() for _ in range(args.conversations)]
        times, prompt_tokens = [], 0
        for r in range(args.rounds):
            for c in range(args.conversations):
                prompt = history[c] + rng.integers(100, vocab - 100, question).tolist()
                start = time.perf_counter()
                out = llm.generate([prompt], params, use_tqdm=False)[0]
                if r:  # round 0 has nothing to reuse
                    times.append(time.perf_counter() - start)
                    prompt_tokens += len(prompt)
                history[c] = prompt + out.token_ids
        return times, prompt_tokens

    conversations()  # untimed, on other tokens: compiles every shape the timed pass runs
    sched = llm.engine.scheduler
    c = llm.engine.tiers.counters if tiers else None
    before = (sched.num_prefix_hits, c.num_host_hits if c else 0, c.num_disk_hits if c else 0)
    times, prompt_tokens = conversations()
    hits, host, disk = (
        sched.num_prefix_hits - before[0],
        (c.num_host_hits if c else 0) - before[1],
        (c.num_disk_hits if c else 0) - before[2],
    )
    report = {"tiers": tiers, "device_pages": pool, "mean_ttft_s": statistics.mean(times)}
    report["device_hit_share"] = (hits - (host + disk) * PAGE) / prompt_tokens
    report["host_hit_share"] = host * PAGE / prompt_tokens
    report["disk_hit_share"] = disk * PAGE / prompt_tokens
    report["decode_tok_s"] = decode_rate(llm)
    return report


def decode_rate(llm) -> float:
    """Decode tok/s of 4 fresh prompts (no prefix hits), 64 tokens each after the first."""
    import numpy as np

    import aither_jax as aj

    rng = np.random.default_rng(2)
    vocab = llm.config.vocab_size

    def run(n: int) -> float:
        prompts = [rng.integers(100, vocab - 100, 128).tolist() for _ in range(4)]
        params = aj.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        for p in prompts:  # one at a time: max_num_seqs is 1
            llm.generate([p], params, use_tqdm=False)
        return time.perf_counter() - start

    run(1), run(65)
    rates = []
    for _ in range(3):
        t1, t65 = run(1), run(65)
        rates.append(4 * 64 / (t65 - t1))
    return statistics.median(rates)


def bench(args) -> dict:
    report = {"config": {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as d:
        if "ttft" in args.parts:
            report["ttft"] = ttft_by_tier(args, d + "/ttft")
        if "multi-turn" in args.parts:
            report["multi_turn"] = [multi_turn(args, tiers=t, cache_dir=d + "/turns") for t in (False, True)]
            for m in report["multi_turn"]:
                print(json.dumps(m), file=sys.stderr)
    return report


def plot(report: dict, path: pathlib.Path) -> None:
    """TTFT by prefix length, one line per tier; skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["prefix"] for r in report["ttft"]]
    for tier in TIERS:
        ax.plot(xs, [r[tier] * 1e3 for r in report["ttft"]], marker="o", label=tier)
    ax.set(xscale="log", yscale="log", xlabel="prefix tokens", ylabel="time to first token (ms)")
    ax.set_title(f"{report['config']['model']}: TTFT by where the prefix's KV is ({report['env']['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def record(report: dict, command: str) -> None:
    run = {"command": command, **bench_record.provenance(report["env"])}
    model = report["config"]["model"]
    entries = []
    for tier in TIERS if "ttft" in report else ():
        figures = {"TTFT ms by prefix": {str(r["prefix"]): bench_record.rounded(r[tier] * 1e3) for r in report["ttft"]}}
        if tier != "recompute":
            figures["x recompute by prefix"] = {
                str(r["prefix"]): bench_record.rounded(r[tier] / r["recompute"], 3) for r in report["ttft"]
            }
        config = {"model": model, "measure": "TTFT", "KV from": tier}
        entries.append(bench_record.result("tiers", config, figures, details=report["ttft"], **run))
    if "multi_turn" not in report:
        bench_record.record(entries)
        return
    off, on = report["multi_turn"]
    figures = {
        "mean TTFT ms (tiers off / on)": f"{off['mean_ttft_s'] * 1e3:.0f} / {on['mean_ttft_s'] * 1e3:.0f}",
        "x faster with tiers": bench_record.rounded(off["mean_ttft_s"] / on["mean_ttft_s"], 2),
        "hit share device / host / disk (on)": (
            f"{on['device_hit_share']:.2f} / {on['host_hit_share']:.2f} / {on['disk_hit_share']:.2f}"
        ),
        "hit share device (off)": f"{off['device_hit_share']:.2f}",
        "decode tok/s (off / on)": f"{off['decode_tok_s']:.1f} / {on['decode_tok_s']:.1f}",
        "decode on / off": bench_record.rounded(on["decode_tok_s"] / off["decode_tok_s"], 3),
    }
    c = report["config"]
    config = {
        "model": model,
        "measure": f"multi-turn, {c['conversations']} conversations x {c['rounds']} rounds, "
        f"{c['first_tokens']} + {c['question_tokens']}-token questions",
    }
    entries.append(bench_record.result("tiers", config, figures, details=report["multi_turn"], **run))
    bench_record.record(entries)


def main(argv=None) -> int:
    args = parse_args(argv)
    report = bench(args)
    report["env"] = bench_record.environment()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    if "ttft" in report:
        plot(report, args.out.with_suffix(".png"))
    if not args.no_record:
        record(report, "python " + " ".join(shlex.quote(a) for a in ["scripts/bench_tiers.py", *sys.argv[1:]]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
