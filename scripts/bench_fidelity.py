"""Answer-level fidelity of KV cache formats (aither_jax/quant/fidelity.py): greedy chat replies
with each format against the same model with an unquantized cache, as headline rows.

    .venv/bin/python scripts/bench_fidelity.py [--model smollm2-135m] [--kv-cache-dtype auto tq8 bf16]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_record  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    from aither_jax.quant import fidelity
    from models.registry import MODELS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto", "tq8", "tq-k8v6", "tq-k8v4", "bf16"])
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--out", type=pathlib.Path, default=None, help="default out/fidelity-<model>.json")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    report = fidelity.run_fidelity(args.model, args.kv_cache_dtype, max_tokens=args.max_tokens)
    print(fidelity.table(report), file=sys.stderr)
    out = args.out or ROOT / "out" / f"fidelity-{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, ensure_ascii=False), encoding="utf-8")
    if args.no_record:
        return 0
    env = bench_record.environment()
    command = "python " + " ".join(shlex.quote(a) for a in ["scripts/bench_fidelity.py", *sys.argv[1:]])
    run = {"command": command, **bench_record.provenance(env)}
    turboquant = MODELS[args.model].turboquant_kv if args.model in MODELS else None
    entries = []
    for r in report["rows"]:
        label = "turboquant" if r["kv_cache_dtype"] == turboquant else r["kv_cache_dtype"]
        config = {"model": args.model, "kv_cache_dtype": label, "reply tokens": args.max_tokens}
        figures = {
            "vs bf16": f"{r['compression_vs_bf16']:.2f}x",
            "identical replies": f"{r['identical']}/{r['prompts']} ({r['identical_share']:.0%})",
            "mean common prefix": bench_record.rounded(r["mean_common_prefix"], 1),
            "factual kept": f"{r['factual_kept']}/{r['factual_known_by_reference']}",
        }
        details = {k: v for k, v in r.items() if k != "differing"} | {"differing": r["differing"][:8]}
        entries.append(bench_record.result("fidelity", config, figures, details=details, **run))
    bench_record.record(entries)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
