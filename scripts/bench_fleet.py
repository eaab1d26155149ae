"""Two models resident on one device: throughput of both serving at once against the sum of each
alone, in one run; the memory plan's zones; and the share of a mixed workload each model gets
from effort routing.

Both models are loaded once under one memory plan (`aj.Fleet`). Each phase decodes the same
batch of prompts, greedy, `--max-tokens` tokens each: first each model alone (the other
resident and idle), then both at once, each engine stepped by its own thread (as the server's
engine loops run). Every shape is compiled by an untimed pass first. Routing share: the
labeled prompts of aither_jax/fleet/effort_prompts.json and the tests' sets through the router.

Writes JSON (`--out`) and unless `--no-record` the headline rows (scripts/bench_record.py).

    .venv/bin/python scripts/bench_fleet.py [--models smollm2-135m gemma3-270m] [--memory-budget 4]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_record  # noqa: E402
from fit_effort import load_sets  # noqa: E402  (the scorer's labeled sets)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    p.add_argument("--memory-budget", type=float, default=None, help="GiB (default: 0.9 of an accelerator; 4 on CPU)")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--batch", type=int, default=8, help="requests per model per phase")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "out" / "bench_fleet.json")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    if len(args.models) < 2 or args.batch < 1 or args.max_tokens < 1:
        p.error("need two or more models, a batch >= 1 and max tokens >= 1")
    return args


def prompts(n: int) -> list[str]:
    topics = ["the sea", "a library", "mountains", "a city at night", "an old clock", "rain", "bread", "a train"]
    return [f"Write a few sentences about {topics[i % len(topics)]}, number {i}:" for i in range(n)]


def run(llm, batch: list[str], params) -> int:
    """Generated tokens of one batch."""
    return sum(len(o.token_ids) for o in llm.generate(batch, params, use_tqdm=False))


def together(fleet, batch, params) -> tuple[float, dict[str, int]]:
    """Wall time and tokens per model with every model's engine stepped by its own thread."""
    tokens: dict[str, int] = {}
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            tokens[name] = run(fleet.llms[name], batch, params)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(m,)) for m in fleet.models]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start, tokens


def routing_share(router) -> dict:
    from aither_jax.fleet.effort import score_effort

    share, agree, total = {}, 0, 0
    for texts, efforts in load_sets().values():
        for text, effort in zip(texts, efforts, strict=True):
            route = router.route([{"role": "user", "content": text}], conversation="")
            share[route.model] = share.get(route.model, 0) + 1
            agree += (score_effort(text).level >= router.threshold) == (effort >= router.threshold)
            total += 1
    return {"requests": total, "share": {m: n / total for m, n in share.items()}, "label_agreement": agree / total}


def main(argv=None) -> int:
    import jax

    import aither_jax as aj

    args = parse_args(argv)
    budget = args.memory_budget
    if budget is None and jax.default_backend() == "cpu":
        budget = 4.0
    fleet = aj.Fleet(
        args.models, memory_budget_gib=budget, gpu_memory_utilization=0.9 if budget is None else None,
        kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=args.batch, max_model_len=512, progress=False,
    )  # fmt: skip
    print(fleet.plan.table(), file=sys.stderr)
    params = aj.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    batch = prompts(args.batch)
    for name in fleet.models:  # compiles every shape
        run(fleet.llms[name], batch, params)
    alone = {}
    for name in fleet.models:
        start = time.perf_counter()
        n = run(fleet.llms[name], batch, params)
        alone[name] = n / (time.perf_counter() - start)
        print(f"{name} alone: {alone[name]:.1f} tok/s", file=sys.stderr)
    wall, tokens = together(fleet, batch, params)
    both = sum(tokens.values()) / wall
    report = {
        "config": {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()},
        "alone_tok_s": alone,
        "together_tok_s": both,
        "together_over_sum_alone": both / sum(alone.values()),
        "plan": fleet.plan.to_json(),
        "routing": routing_share(fleet.router),
        "env": bench_record.environment(),
    }
    print(f"together {both:.1f} tok/s = {report['together_over_sum_alone']:.2f}x the sum alone", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    if not args.no_record:
        record(report, "python " + " ".join(shlex.quote(a) for a in ["scripts/bench_fleet.py", *sys.argv[1:]]))
    return 0


def record(report: dict, command: str) -> None:
    c, routing = report["config"], report["routing"]
    mib = 1 << 20
    zones = ", ".join(
        f"{z['owner']} {z['name']} {z['bytes'] / mib:,.0f}" for z in report["plan"]["zones"] if z["device"]
    )
    figures = {
        **{f"{m} alone tok/s": bench_record.rounded(v, 1) for m, v in report["alone_tok_s"].items()},
        "both at once tok/s": bench_record.rounded(report["together_tok_s"], 1),
        "both / sum alone": bench_record.rounded(report["together_over_sum_alone"], 2),
        "routed share": " / ".join(f"{m} {s:.0%}" for m, s in routing["share"].items()),
        "routing agrees with labels": f"{routing['label_agreement']:.0%} of {routing['requests']}",
    }
    config = {
        "models": " + ".join(c["models"]),
        "workload": f"{c['batch']} requests x {c['max_tokens']} tokens per model, KV {c['kv_cache_dtype']}",
        "zones MiB": zones,
    }
    run = {"command": command, **bench_record.provenance(report["env"])}
    bench_record.record([bench_record.result("fleet", config, figures, details=report, **run)])


if __name__ == "__main__":
    raise SystemExit(main())
