"""Speculative decoding benchmark: tau and speedup of DFlash (S = 1, 2, 4) and prompt lookup
against plain decoding of the same chat prompts, in one run.

Plain decoding runs once; every speculative configuration is compared with it. Writes JSON
(one row per configuration, `python -m aither_jax.eval acceptance` fields), a plot (tau
histograms and speedups) and, unless `--no-record`, records each configuration's figures
(scripts/bench_record.py: docs/benchmarks/log.jsonl and the speculative table of docs/BENCHMARKS.md).

    .venv/bin/python scripts/bench_speculative.py [--prompts scripts/data/chat_eval.jsonl] \
        [--max-tokens 128] [--batch-size 1] [--steps 1 2 4] [--draft-tokens 1 3 7 15] \
        [--adaptive] [--prompt-lookup] [--tree 15] [--out out/bench_speculative.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
import time

import bench_record
from bench_serving import add_shape_args, prepare_shapes, shapes_file_name

ROOT = pathlib.Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", default=str(ROOT / "scripts" / "data" / "chat_eval.jsonl"))
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4], help="dflash denoising steps to try")
    p.add_argument(
        "--draft-tokens", type=int, nargs="+", default=None,
        help="dflash drafts per step to try (num_speculative_tokens; default: block size - 1)",
    )  # fmt: skip
    p.add_argument("--ngram-tokens", type=int, default=8, help="drafts per step for prompt lookup")
    p.add_argument(
        "--adaptive", action="store_true",
        help="also run dflash (first of --steps) with drafts per step chosen from measured speed, up to the block",
    )  # fmt: skip
    p.add_argument(
        "--prompt-lookup", action="store_true",
        help="also run dflash (first of --steps, full block) with prompt lookup's drafts on rows with an n-gram match",
    )  # fmt: skip
    p.add_argument(
        "--tree", type=int, nargs="*", default=[],
        help="also run dflash (S=1, with prompt lookup) verifying a tree of each of these many drafted nodes",
    )  # fmt: skip
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    add_shape_args(
        p,
        "each configuration's step-shapes file in DIR: its shapes are compiled on several threads before the "
        "configuration's warm-up, and the shapes it ran are written back",
    )
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "out" / "bench_speculative.json")
    p.add_argument("--plot", type=pathlib.Path, default=None, help="default: --out with .png")
    p.add_argument("--no-record", action="store_true", help="do not record the figures (scripts/bench_record.py)")
    args = p.parse_args(argv)
    if any(not 1 <= n <= 63 for n in args.tree):
        p.error("--tree sizes must be in [1, 63] (drafted nodes)")
    return args


def bench(args, save=None) -> dict:
    """Runs plain decoding, then every configuration; `save(report)` after each row, so a run
    cut off midway keeps the rows it finished."""
    import aither_jax as aj
    from aither_jax.context.prompt import file_prompts, read_prompts
    from aither_jax.eval import speculative_row, timed_decode
    from aither_jax.llm import resolve_dtype

    prepare_shapes(args)
    dtype = resolve_dtype(args.dtype)
    common = dict(dtype=dtype, kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=args.batch_size, progress=False)
    plain = aj.LLM(args.model, **common)
    ids = [p.ids for p in file_prompts(plain.tokenizer, read_prompts(args.prompts)[: args.max_prompts])]
    params = aj.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    print(f"plain decoding of {len(ids)} prompts ...", file=sys.stderr)
    with recorded_shapes(plain, shapes_file(args, None)):
        baseline = timed_decode(plain, ids, params, args.batch_size)
    kv = plain.kv_spec.name
    del plain
    draft_tokens = args.draft_tokens or [args.block_size - 1]
    # The draft model alone (its tau is the goal), then the additions to it.
    alone = {"method": "dflash", "prompt_lookup": False}
    configs = [alone | {"num_speculative_tokens": k, "steps": s} for s in args.steps for k in draft_tokens]
    # Prompt lookup alone before the additions, so a run cut off at a time limit keeps it.
    configs.append({"method": "ngram", "num_speculative_tokens": args.ngram_tokens})
    full = {"num_speculative_tokens": args.block_size - 1, "steps": args.steps[0]}
    if args.adaptive:
        configs.append(alone | full | {"adaptive": True})
    if args.prompt_lookup:
        configs.append({"method": "dflash", "prompt_lookup": True} | full)
    configs += [{"method": "dflash", "prompt_lookup": True, "steps": 1, "tree": n} for n in args.tree]
    rows = []
    report = {"config": {**vars(args), "dtype": dtype, "kv_cache_dtype": kv}, "rows": rows}
    for spec in configs:
        print(f"speculative {spec} ...", file=sys.stderr)
        llm = aj.LLM(args.model, speculative=spec, **common)
        with recorded_shapes(llm, shapes_file(args, spec)):
            row = speculative_row(llm, ids, params, args.batch_size, baseline)
        rows.append(row)
        print(
            f"  tau {row['tau_mean']:.2f}, {row['spec_tokens_per_second']:.1f} vs "
            f"{row['baseline_tokens_per_second']:.1f} tok/s ({row['speedup']:.2f}x), identical outputs "
            f"{row['identical_outputs']}/{row['num_prompts']}",
            file=sys.stderr,
        )
        del llm
        if save is not None:
            save(report)
    return report


def shapes_file(args: argparse.Namespace, spec: dict | None) -> pathlib.Path | None:
    """The step-shapes file of plain decoding (`spec` None) or of a speculative configuration
    in `args.compile_shapes` (None without it)."""
    if args.compile_shapes is None:
        return None
    config = "plain" if spec is None else "_".join(f"{k}-{v}" for k, v in sorted(spec.items()))
    name = f"speculative_{pathlib.Path(args.model).stem}_{args.kv_cache_dtype}_seqs{args.batch_size}_{config}"
    return args.compile_shapes / shapes_file_name(name)


@contextlib.contextmanager
def recorded_shapes(llm, path: pathlib.Path | None):
    """Compiles the step shapes recorded in `path` (when it exists) on several threads, then
    runs the block; afterwards writes every shape the engine ran back to `path`. The prefill
    shapes of the prompts, which the warm-up otherwise compiles one at a time, are among them."""
    from aither_jax.compile import shape_file

    if path is not None and path.exists():
        start = time.perf_counter()
        shapes = shape_file.load(path)
        n = llm.engine.precompile(shapes)
        seconds = time.perf_counter() - start
        print(f"  {n} of {len(shapes)} recorded step shapes compiled in {seconds:.1f} s", file=sys.stderr)
    yield
    if path is not None:
        engine = llm.engine
        settings = {"model": llm.config.name, "kv_cache_dtype": llm.kv_spec.name, "max_num_seqs": engine.max_num_seqs}
        shape_file.save(path, engine.step_shapes(), recorded_with=settings)


def label(row: dict) -> str:
    if row["speculative"] == "dflash":
        drafts = f"k<={row['block_size'] - 1} adaptive" if row.get("adaptive") else f"k={row['block_size'] - 1}"
        if row.get("tree"):
            drafts = f"tree {row['tree']}"
        return f"dflash S={row['steps']} {drafts}" + (" +lookup" if row.get("prompt_lookup") else "")
    return f"ngram k={row['block_size'] - 1}"


def plot(report: dict, path: pathlib.Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = report["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        hist = {int(k): v for k, v in row["tau_histogram"].items()}
        total = sum(hist.values())
        xs = sorted(hist)
        axes[0].bar([x + (i - len(rows) / 2 + 0.5) * width for x in xs], [hist[x] / total for x in xs], width,
                    label=f"{label(row)} (mean {row['tau_mean']:.2f})")  # fmt: skip
    axes[0].set(xlabel="tokens committed per target pass (tau)", ylabel="share of passes", title="tau histogram")
    axes[0].legend()
    names = [label(r) for r in rows]
    axes[1].bar(
        names, [r["speedup"] for r in rows], color=["C3" if r["speculative"] == "ngram" else "C0" for r in rows]
    )
    axes[1].tick_params(axis="x", labelrotation=25)
    for tick in axes[1].get_xticklabels():
        tick.set_horizontalalignment("right")
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[1].set(ylabel="speedup over plain decoding", title="single-stream wall clock")
    env = report["env"]
    cfg = report["config"]
    fig.suptitle(
        f"aither-jax speculative decoding, {cfg['model']}, {rows[0]['num_prompts']} held-out chat prompts, "
        f"{env['device']}\n{cfg['dtype']} weights, KV {cfg['kv_cache_dtype']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def record(report: dict, command: str) -> None:
    """Records one result per configuration (bench_record), keyed on its method label."""
    cfg, run = report["config"], {"command": command, **bench_record.provenance(report["env"])}
    entries = []
    for row in report["rows"]:
        config = {
            "model": cfg["model"],
            "weights": cfg["dtype"],
            "KV": cfg["kv_cache_dtype"],
            "prompts x tokens": f"{row['num_prompts']} x {cfg['max_tokens']}",
            "batch": cfg["batch_size"],
            "method": label(row),
        }
        figures = {
            "tau": bench_record.rounded(row["tau_mean"], 2),
            "speedup (x)": bench_record.rounded(row["speedup"], 2),
            "plain tok/s": bench_record.rounded(row["baseline_tokens_per_second"]),
            "identical outputs": f"{row['identical_outputs']}/{row['num_prompts']}",
        }
        entries.append(bench_record.result("speculative", config, figures, details=row, **run))
    bench_record.record(entries)


def main(argv=None) -> int:
    args = parse_args(argv)
    env = bench_record.environment()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(report: dict) -> None:
        report["config"] |= {"out": str(args.out), "plot": str(args.plot) if args.plot else None}
        report["env"] = env
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str))
        tmp.replace(args.out)

    report = bench(args, save)
    save(report)
    plot(report, args.plot or args.out.with_suffix(".png"))
    if not args.no_record:
        record(report, "python scripts/bench_speculative.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(json.dumps(report["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
