"""The balloon under shifting load: two models under a budget whose pools each hold about
half of one model's batch, load alternating between them, with the balloon off and on.

One process loads both models once; each configuration builds its fleet on those weights
(`aj.Fleet`, balloon off or on) and runs the same cycles: a batch of `--batch` requests to
the first model while the second is idle, then one to the second. Every prompt is about 360
tokens and decodes `--max-tokens` greedy, so a batch needs `--batch` x its pages at once;
without the balloon the rest of a batch waits for pages. The first cycle includes compiling
(and, with the balloon, recompiling for each new pool size); later cycles find every shape
compiled, since the pools take the same sizes each cycle (prompts differ per cycle, so no
cycle reads another's cached prefix). Reported per configuration and cycle:
wall time, tokens per second, balloon moves, and compilations.

Writes JSON (`--out`) and unless `--no-record` the headline rows (scripts/bench_record.py).

    .venv/bin/python scripts/bench_balloon.py [--batch 8] [--max-tokens 64] [--cycles 3] [--kv-fraction 0.5]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_record  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = ("smollm2-135m", "gemma3-270m")
MAX_MODEL_LEN = 512
TEXT = " ".join(f"Line {i}: the harbour master logs ship {i * 7 % 31} arriving." for i in range(25))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8, help="requests per batch (and max_num_seqs)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--kv-fraction", type=float, default=0.5, help="each pool's share of the pages its batch needs")
    p.add_argument("--kv-cache-dtype", default="bf16")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the models' weights")
    p.add_argument("--balloon-step", type=int, default=None, help="pages per step of a pool's sizes (Fleet default)")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "out" / "bench_balloon.json")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    if args.balloon_step is not None and args.balloon_step < 1:
        p.error("--balloon-step must be >= 1")
    if args.batch < 1 or args.max_tokens < 1 or args.cycles < 1 or not 0 < args.kv_fraction <= 1:
        p.error("need a batch, max tokens and cycles >= 1 and a KV fraction in (0, 1]")
    return args


def main(argv=None) -> int:
    import aither_jax as aj
    from aither_jax.compile.counter import CompileCounter
    from aither_jax.fleet.fleet import model_needs
    from models.registry import load_model

    args = parse_args(argv)
    options = dict(
        dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=args.batch,
        max_prefill_chunk=128, enable_prefix_caching=True, progress=False,
    )  # fmt: skip
    handles = {m: load_model(m, args.dtype) for m in MODELS}  # kept alive: both fleets share these weights
    needs = [model_needs(m, handles[m], options) for m in MODELS]
    params = aj.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    batch = lambda c: [f"{c}.{i} {TEXT}" for i in range(args.batch)]  # noqa: E731 - new prompts each cycle
    request_pages = -(-(len(handles[MODELS[0]].tokenizer.encode(batch(0)[0])) + args.max_tokens) // 16)
    fixed = sum(n.weight_bytes + n.activation_bytes + n.kv_fixed_bytes for n in needs)
    kv = sum(int(args.kv_fraction * args.batch * request_pages) * n.page_bytes for n in needs)
    budget_gib = (fixed + kv) / (1 << 30)
    runs = {}
    for balloon in (False, True):
        fleet = aj.Fleet(
            list(MODELS), memory_budget_gib=budget_gib, balloon=balloon, balloon_step=args.balloon_step, **options
        )
        print(fleet.plan.table(), file=sys.stderr)
        cycles = []
        for c in range(args.cycles):
            for name in MODELS:
                moves, compiles = len(fleet.moves), CompileCounter.count()
                start = time.perf_counter()
                outs = fleet.generate(batch(c), params, model=name)
                wall = time.perf_counter() - start
                tokens = sum(len(o.token_ids) for o in outs)
                cycles.append(
                    {
                        "cycle": c, "model": name, "wall_s": wall, "tok_s": tokens / wall, "tokens": tokens,
                        "moves": [m.to_json() for m in fleet.moves[moves:]],
                        "compiles": CompileCounter.count() - compiles,
                        "pages": dict(fleet.plan.num_pages),
                    }
                )  # fmt: skip
                print(f"balloon {'on ' if balloon else 'off'} cycle {c} {name}: {wall:6.1f} s "
                      f"{tokens / wall:6.1f} tok/s, {len(fleet.moves) - moves} move(s), "
                      f"{cycles[-1]['compiles']} compiles, pages {cycles[-1]['pages']}", file=sys.stderr)  # fmt: skip
        runs["on" if balloon else "off"] = {"plan": fleet.plan.to_json(), "phases": cycles}
        del fleet
    report = {
        "config": {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()},
        "budget_gib": budget_gib,
        "request_pages": request_pages,
        "runs": runs,
        "env": bench_record.environment(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    if not args.no_record:
        record(report, "python " + " ".join(shlex.quote(a) for a in ["scripts/bench_balloon.py", *sys.argv[1:]]))
    return 0


def steady(run: dict) -> float:
    """Tokens per second over the last cycle (every shape already compiled)."""
    last = max(p["cycle"] for p in run["phases"])
    phases = [p for p in run["phases"] if p["cycle"] == last]
    return sum(p["tokens"] for p in phases) / sum(p["wall_s"] for p in phases)


def record(report: dict, command: str) -> None:
    c, runs = report["config"], report["runs"]
    first = {k: sum(p["wall_s"] for p in r["phases"] if p["cycle"] == 0) for k, r in runs.items()}
    figures = {
        "tok/s, balloon off": bench_record.rounded(steady(runs["off"]), 1),
        "tok/s, balloon on": bench_record.rounded(steady(runs["on"]), 1),
        "on / off": bench_record.rounded(steady(runs["on"]) / steady(runs["off"]), 2),
        "first cycle s, off / on": f"{first['off']:.0f} / {first['on']:.0f}",
        "moves per cycle": len([m for p in runs["on"]["phases"] if p["cycle"] == c["cycles"] - 1 for m in p["moves"]]),
    }
    config = {
        "models": " + ".join(MODELS),
        "workload": (
            f"{c['batch']} requests x ~{report['request_pages']} pages per batch, {c['max_tokens']} tokens each, "
            f"batches alternating; pools hold {c['kv_fraction']:.0%} of a batch; KV {c['kv_cache_dtype']}"
        ),
    }
    run = {"command": command, **bench_record.provenance(report["env"])}
    bench_record.record([bench_record.result("balloon", config, figures, details=report, **run)])


if __name__ == "__main__":
    raise SystemExit(main())
