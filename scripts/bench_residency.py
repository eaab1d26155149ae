"""Bounded residency (aither_jax/core/bounded.py): decode time per token at a fixed resident
bound as the context grows, the share of it spent moving and rescoring pages, and (with
--eval) the divergence and passkey report of `python -m aither_jax.eval residency`, as
headline rows.

    .venv/bin/python scripts/bench_residency.py [--model smollm2-135m] [--bound 1024]
        [--contexts 1024 2048 4096 8000] [--eval out/residency-smollm2.json]
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


def decode_rows(model: str, bound: int, contexts: list[int], new_tokens: int, scorer: str) -> list[dict]:
    """Per context length: one greedy request of that many prompt tokens (the Python language
    reference) and `new_tokens` decoded, bounded to `bound` resident tokens."""
    import aither_jax as aj
    from aither_jax.residency_eval import default_text

    text, _ = default_text()
    rows = []
    for n in contexts:
        llm = aj.LLM(
            model, max_num_seqs=1, max_model_len=n + new_tokens + 16, progress=False, max_resident_tokens=bound,
            residency_scorer=scorer,
        )  # fmt: skip
        ids = llm.tokenizer.encode(text)[:n]
        params = aj.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([ids[: bound + 256]], params, use_tqdm=False)  # compiles every shape the bound reaches
        bounded = llm.engine.bounded
        before = (bounded.num_reselections, bounded.num_paged_out, bounded.num_paged_in)
        start = time.perf_counter()
        out = llm.generate([ids], params, use_tqdm=False)[0]
        total = time.perf_counter() - start
        first = out.time_to_first_token
        decode_s = total - first
        row = {
            "context": n,
            "bound": bound,
            "scorer": scorer,
            "decode_ms_per_token": 1000 * decode_s / (len(out.token_ids) - 1),
            "prefill_s": first,
            "reselections": bounded.num_reselections - before[0],
            "pages_out": bounded.num_paged_out - before[1],
            "pages_in": bounded.num_paged_in - before[2],
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def overhead(model: str, bound: int, context: int, new_tokens: int, scorer: str) -> dict:
    """Decode of one request already past its bound, timed step by step: the share of decode
    time spent rescoring and moving pages (`reselect_due` and growth's page-outs)."""
    import aither_jax as aj
    from aither_jax.residency_eval import default_text

    text, _ = default_text()
    llm = aj.LLM(
        model, max_num_seqs=1, max_model_len=context + new_tokens + 16, progress=False, max_resident_tokens=bound,
        residency_scorer=scorer,
    )  # fmt: skip
    engine, bounded = llm.engine, llm.engine.bounded
    ids = llm.tokenizer.encode(text)[:context]
    seq = engine.add_request(ids, aj.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    while seq.prefilling or not seq.output_ids:
        engine.step()
    for _ in range(8):  # past compiling
        engine.step()
    res0, grow0, steps0 = bounded.reselect_seconds, bounded.grow_seconds, len(seq.output_ids)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - start
    moved = bounded.reselect_seconds - res0 + bounded.grow_seconds - grow0
    return {
        "context": context, "bound": bound, "scorer": scorer, "decode_tokens": len(seq.output_ids) - steps0,
        "decode_s": wall, "reselect_and_move_s": moved, "share": moved / wall,
    }  # fmt: skip


def eval_entries(report: dict, run: dict) -> list[dict]:
    """Headline rows of a `python -m aither_jax.eval residency` report: one per resident share."""
    entries = []
    for fraction in dict.fromkeys(r["residency"] for r in report["rows"]):
        by = {r["scorer"]: r for r in report["rows"] if r["residency"] == fraction}
        config = {"model": report["model"], "tokens": report["num_tokens"], "residency": f"{fraction:.0%}"}
        figures = {
            "KL": {s: bench_record.rounded(r["kl"], 4) for s, r in by.items()},
            "top-1": {s: bench_record.rounded(r["top1_agreement"], 3) for s, r in by.items()},
            "passkey": {s: f"{r['passkey_retrieved']}/{r['passkey_asked']}" for s, r in by.items()},
        }
        if "attention" in by and "lru" in by and "window" in by:
            figures["attention / lru, window"] = (
                f"{by['attention']['kl'] / by['lru']['kl']:.2f}, {by['attention']['kl'] / by['window']['kl']:.2f}"
            )
        entries.append(bench_record.result("residency", config, figures, details=by, **run))
    return entries


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--bound", type=int, default=1024)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8000])
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--scorer", default="attention")
    p.add_argument("--eval", type=pathlib.Path, default=None, help="a report of python -m aither_jax.eval residency")
    p.add_argument("--eval-only", action="store_true", help="record the --eval report's rows, measure nothing")
    p.add_argument("--out", type=pathlib.Path, default=None, help="default out/residency-decode-<model>.json")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    if args.eval_only and args.eval is None:
        p.error("--eval-only needs --eval")
    env = bench_record.environment()
    command = "python " + " ".join(shlex.quote(a) for a in ["scripts/bench_residency.py", *sys.argv[1:]])
    run = {"command": command, **bench_record.provenance(env)}
    entries = [] if args.eval is None else eval_entries(json.loads(args.eval.read_text(encoding="utf-8")), run)
    if not args.eval_only:
        rows = decode_rows(args.model, args.bound, args.contexts, args.new_tokens, args.scorer)
        last = args.contexts[-1] - 3 * args.new_tokens
        share = overhead(args.model, args.bound, last, 4 * args.new_tokens, args.scorer)
        print(json.dumps(share), file=sys.stderr)
        out = args.out or ROOT / "out" / f"residency-decode-{args.model}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"rows": rows, "overhead": share}, indent=2), encoding="utf-8")
        base = rows[0]["decode_ms_per_token"]
        config = {"model": args.model, "bound": args.bound, "scorer": args.scorer, "new tokens": args.new_tokens}
        figures = {
            "ms/token by context": {str(r["context"]): bench_record.rounded(r["decode_ms_per_token"]) for r in rows},
            "longest / shortest": f"{rows[-1]['decode_ms_per_token'] / base:.2f}x",
            "rescoring + moves": f"{share['share']:.1%} of decode",
        }
        details = {"rows": rows, "overhead": share}
        entries.append(bench_record.result("residency-decode", config, figures, details=details, **run))
    if not args.no_record:
        bench_record.record(entries)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
