"""Batch invariance: do a request's greedy tokens depend on what shares its batch, or on
speculation? For each KV format, with and without `batch_invariant`: chat prompts answered
all at once (8 and 16 concurrent) against each alone, speculative (the model's DFlash draft,
else prompt lookup) against plain greedy, and what invariance costs in decode speed.

    .venv/bin/python scripts/bench_invariance.py [--model smollm2-135m] [--kv-cache-dtype bf16 tq-k8v6 turboquant]
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import shlex
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_record  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def greedy_replies(llm, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], float]:
    """Token ids of each prompt's greedy chat reply, all requests at once; and the seconds."""
    import aither_jax as aj

    params = aj.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    out = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    return [r.token_ids for r in out], time.perf_counter() - start


def measure(model: str, kv: str, invariant: bool, prompts: list[str], args) -> dict:
    import aither_jax as aj
    from models.registry import shipped_draft

    common = dict(kv_cache_dtype=kv, max_model_len=512, progress=False, batch_invariant=invariant)
    llm = aj.LLM(model, max_num_seqs=max(args.concurrency), **common)
    alone = []
    seconds_alone = 0.0
    for i, p in enumerate(prompts):
        ids, seconds = greedy_replies(llm, [p], args.max_tokens)
        alone.append(ids[0])
        seconds_alone += seconds if i else 0.0  # the first compiles
    row = {"kv_cache_dtype": llm.kv_spec.name, "batch_invariant": invariant}
    row["single stream tok/s"] = args.max_tokens * (len(prompts) - 1) / seconds_alone
    for n in args.concurrency:
        greedy_replies(llm, prompts[:n], 2)  # compiles the batch's shapes
        together, seconds = greedy_replies(llm, prompts[:n], args.max_tokens)
        same = sum(a == b for a, b in zip(together, alone[:n], strict=True))
        row[f"identical at {n}"] = same
        row[f"tok/s at {n}"] = args.max_tokens * n / seconds
    del llm
    gc.collect()
    method = "dflash" if shipped_draft(model) else "ngram"
    spec = aj.LLM(model, max_num_seqs=1, speculative=method, **common)
    k = args.speculative_prompts
    speculated = [greedy_replies(spec, [p], args.max_tokens)[0][0] for p in prompts[:k]]
    row["speculative"] = method
    row["speculative identical"] = sum(a == b for a, b in zip(speculated, alone[:k], strict=True))
    row["speculative prompts"] = k
    del spec
    gc.collect()
    return row


def main(argv=None) -> int:
    from aither_jax.quant.fidelity import load_prompts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-cache-dtype", nargs="+", default=["bf16", "tq-k8v6", "turboquant"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 16])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--speculative-prompts", type=int, default=8)
    p.add_argument("--modes", nargs="+", choices=("default", "invariant"), default=["default", "invariant"])
    p.add_argument("--out", type=pathlib.Path, default=None, help="default out/invariance-<model>.json")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    chat, factual = load_prompts()
    prompts = (chat + [f["question"] for f in factual])[: max(args.concurrency)]
    rows = []
    for kv in args.kv_cache_dtype:
        for invariant in [mode == "invariant" for mode in args.modes]:
            rows.append(measure(args.model, kv, invariant, prompts, args))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    env = bench_record.environment()
    out = args.out or ROOT / "out" / f"invariance-{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": env, "args": vars(args) | {"out": str(out)}, "rows": rows}, indent=2))
    if args.no_record:
        return 0
    command = "python " + " ".join(shlex.quote(a) for a in ["scripts/bench_invariance.py", *sys.argv[1:]])
    run = {"command": command, **bench_record.provenance(env)}
    entries = []
    for r in rows:
        label = "turboquant" if r["kv_cache_dtype"] not in args.kv_cache_dtype else r["kv_cache_dtype"]
        config = {"model": args.model, "kv_cache_dtype": label, "batch_invariant": r["batch_invariant"]}
        figures = {f"identical at {n}": f"{r[f'identical at {n}']}/{n}" for n in args.concurrency}
        figures["speculative = plain"] = f"{r['speculative identical']}/{r['speculative prompts']} ({r['speculative']})"
        figures["single stream tok/s"] = bench_record.rounded(r["single stream tok/s"])
        figures |= {f"tok/s at {n}": bench_record.rounded(r[f"tok/s at {n}"]) for n in args.concurrency}
        entries.append(bench_record.result("invariance", config, figures, details=r, **run))
    bench_record.record(entries)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
