"""The context pipeline (aither_jax/context/sections.py) against naive prompt assembly on a
50-turn agent-like trace, and the budget cascade of a pinned stable prefix.

The trace: fixed system layers (axioms, identity, rules, capabilities: about 2,000 tokens),
knowledge and memory sections that change every turn, and a conversation that grows by a
question and an answer per turn, under a context budget that forces the conversation to be
cut. Side by side, on one engine each (prefix caching on, the model's default KV format):

* pipeline: the system layers first as stable sections (pinned once seen), then the
  conversation (cut by whole steps of messages, so what is kept stays cache-stable), then the
  changing knowledge and memories, then the new question;
* naive: the changing knowledge and memories first, then the system layers and the
  conversation cut from its head token by token to fit (what many assemblers do).

Per turn: prompt tokens, tokens served from the prefix cache, tokens recomputed beyond what
changed this turn, time to first token (each mode after an untimed six-turn run that compiles
the shapes its first turns need). And the cascade: the tokens the downstream sections
may take at a fixed prefill budget with the stable prefix pinned against not pinned.

Writes JSON (`--out`), a plot next to it (with matplotlib), and unless `--no-record` the
headline rows (scripts/bench_record.py).

    .venv/bin/python scripts/bench_context.py [--turns 50] [--budget 3072] [--prefill-budget 2600]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_record  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = {  # tag: (text, importance), about 2,000 tokens together
    "axioms": ("You never invent facts. You say when you do not know. You protect the user's privacy. ", 1.0),
    "identity": ("You are Aither, the harbour office's research assistant, built to help with tides and ships. ", 1.0),
    "rules": ("Answer in at most three sentences. Prefer the knowledge section's facts. Cite dates exactly. ", 0.9),
    "capabilities": ("You can read tide tables, ship schedules, weather bulletins and the harbour log. ", 0.8),
}
REPEATS = {"axioms": 27, "identity": 25, "rules": 25, "capabilities": 27}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--turns", type=int, default=50)
    p.add_argument("--budget", type=int, default=3072, help="context budget (prompt tokens)")
    p.add_argument("--prefill-budget", type=int, default=2600, help="for the cascade measurement")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "out" / "bench_context.json")
    p.add_argument("--no-record", action="store_true", help="do not record the figures (scripts/bench_record.py)")
    args = p.parse_args(argv)
    if args.turns < 2 or args.budget < 2500:
        p.error("--turns >= 2 and --budget >= 2500 (the system layers take about 2,000 tokens)")
    return args


def system_sections():
    from aither_jax.context.sections import Section

    return [
        Section(tag, text * REPEATS[tag], importance=imp, stable=True, truncate="never")
        for tag, (text, imp) in LAYERS.items()
    ]


def turn_content(t: int) -> tuple[str, str, str]:
    knowledge = f"Bulletin {t}: high water at {5 + t % 7}:{t % 60:02d}, wind {10 + t % 9} knots from the west. " * 6
    memories = f"The user asked about the ferry {t % 5} times and prefers short answers. " * 3
    question = f"Question {t}: what should the pilot of ship {t} know before leaving?"
    return knowledge, memories, question


def pipeline_prompt(ctx, history: list[dict], t: int):
    from aither_jax.context.sections import Section

    knowledge, memories, question = turn_content(t)
    return ctx.assemble(
        [
            *system_sections(),
            Section("conversation", history or [{"role": "user", "content": "Hello."}], importance=0.6,
                    truncate="messages", step=8),
            Section("knowledge", knowledge, importance=0.5, max_tokens=400),
            Section("memories", memories, importance=0.3, max_tokens=200),
            Section("question", question, importance=1.0, role="user", truncate="never"),
        ]
    )  # fmt: skip


def naive_prompt(llm, history: list[dict], t: int, budget: int):
    """Changing content first, then the system layers, the conversation cut from its head."""
    from aither_jax.context.prompt import text_prompt

    knowledge, memories, question = turn_content(t)
    system = "".join(text * REPEATS[tag] for tag, (text, _) in LAYERS.items())
    messages = [{"role": "system", "content": knowledge + memories + system}, *history]
    messages.append({"role": "user", "content": question})
    ids = llm.tokenizer.encode_prompt(llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    head = llm.tokenizer.encode_prompt(llm.tokenizer.apply_chat_template(messages[:1], add_generation_prompt=False))
    over = len(ids) - budget
    if over > 0:  # cut the conversation's oldest tokens
        ids = ids[: len(head)] + ids[len(head) + over :]
    return text_prompt(llm.tokenizer, ids)


def run_trace(args, mode: str, turns: int | None = None) -> list[dict]:
    """One engine through the trace; per turn: prompt tokens, cached tokens, tokens recomputed
    beyond what changed this turn, time to first token."""
    import aither_jax as aj

    llm = aj.LLM(args.model, max_model_len=args.budget + 64, max_num_seqs=1, enable_prefix_caching=True, progress=False)
    ctx = llm.context(context_budget=args.budget)
    history: list[dict] = []
    rows = []
    params = aj.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for t in range(args.turns if turns is None else turns):
        prompt = pipeline_prompt(ctx, history, t) if mode == "pipeline" else naive_prompt(llm, history, t, args.budget)
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        # What changed this turn: the knowledge, memories and question, and the last answer.
        changed = sum(
            len(llm.tokenizer.encode(x)) for x in (*turn_content(t), history[-1]["content"] if history else "")
        )
        recomputed = len(prompt.ids) - out.num_cached_tokens
        rows.append(
            {
                "turn": t,
                "prompt_tokens": len(prompt.ids),
                "cached_tokens": out.num_cached_tokens,
                "changed_tokens": changed,
                "extra_recomputed": max(0, recomputed - changed),
                "ttft_s": out.time_to_first_token,
            }
        )
        question = turn_content(t)[2]
        history += [{"role": "user", "content": question}, {"role": "assistant", "content": out.text or "."}]
    return rows


def cascade(args) -> dict:
    """Downstream budget at the prefill budget with the stable prefix cached and not: the
    first assembly's prompt is run (one token), which leaves the prefix's pages cached, and
    the same sections are assembled again."""
    import aither_jax as aj
    from aither_jax.context.sections import Section

    llm = aj.LLM(args.model, max_model_len=args.budget + 64, max_num_seqs=1, enable_prefix_caching=True, progress=False)
    ctx = llm.context(context_budget=args.budget, prefill_budget=args.prefill_budget)
    sections = [*system_sections(), Section("knowledge", "Harbour notes. " * 2000, importance=0.5)]
    cold = ctx.assemble(sections)
    llm.generate(cold, aj.SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    warm = ctx.assemble(sections).report
    return {
        "stable_tokens": cold.report.stable_tokens,
        "stable_cached_tokens": warm.stable_cached_tokens,
        "prefill_budget": args.prefill_budget,
        "downstream_uncached": cold.report.downstream_budget,
        "downstream_cached": warm.downstream_budget,
        "ratio": warm.downstream_budget / max(1, cold.report.downstream_budget),
    }


def bench(args) -> dict:
    report = {"config": {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}}
    report["cascade"] = cascade(args)
    print(json.dumps(report["cascade"]), file=sys.stderr)
    for mode in ("pipeline", "naive"):
        run_trace(args, mode, turns=6)  # untimed: compiles the shapes the first turns need
        report[mode] = run_trace(args, mode)
        print(mode, json.dumps(summary(report[mode])), file=sys.stderr)
    return report


def summary(rows: list[dict]) -> dict:
    """Turns 2+ (the first has nothing cached)."""
    rows = rows[1:]
    prompt = sum(r["prompt_tokens"] for r in rows)
    rest = sum(r["prompt_tokens"] - r["changed_tokens"] for r in rows)
    half = len(rows) // 2
    return {
        "mean_ttft_ms": 1e3 * statistics.mean(r["ttft_s"] for r in rows),
        "ttft_first_half_ms": 1e3 * statistics.mean(r["ttft_s"] for r in rows[:half]),
        "ttft_second_half_ms": 1e3 * statistics.mean(r["ttft_s"] for r in rows[half:]),
        "cached_share": sum(r["cached_tokens"] for r in rows) / prompt,
        "extra_recomputed_share": sum(r["extra_recomputed"] for r in rows) / max(1, rest),
    }


def plot(report: dict, path: pathlib.Path) -> None:
    """TTFT per turn, pipeline against naive; skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("pipeline", "naive"):
        ax.plot([r["turn"] for r in report[mode]], [r["ttft_s"] * 1e3 for r in report[mode]], label=mode)
    ax.set(xlabel="turn", ylabel="time to first token (ms)", yscale="log")
    ax.set_title(f"{report['config']['model']}: a {report['config']['turns']}-turn trace ({report['env']['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def record(report: dict, command: str) -> None:
    run = {"command": command, **bench_record.provenance(report["env"])}
    entries = []
    for mode in ("pipeline", "naive"):
        s = report["summary"][mode]
        config = {"model": report["config"]["model"], "trace": f"{report['config']['turns']} turns", "assembly": mode}
        figures = {
            "mean TTFT ms": bench_record.rounded(s["mean_ttft_ms"]),
            "TTFT ms, first / second half": f"{s['ttft_first_half_ms']:.0f} / {s['ttft_second_half_ms']:.0f}",
            "prompt tokens from cache": bench_record.rounded(s["cached_share"], 3),
            "recomputed beyond the changes": bench_record.rounded(s["extra_recomputed_share"], 3),
        }
        if mode == "pipeline":
            c = report["cascade"]
            figures["downstream budget, pinned / not"] = f"{c['downstream_cached']} / {c['downstream_uncached']}"
        entries.append(bench_record.result("context", config, figures, details=s, **run))
    bench_record.record(entries)


def main(argv=None) -> int:
    args = parse_args(argv)
    report = bench(args)
    report["summary"] = {mode: summary(report[mode]) for mode in ("pipeline", "naive")}
    report["env"] = bench_record.environment()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plot(report, args.out.with_suffix(".png"))
    if not args.no_record:
        record(report, "python " + " ".join(shlex.quote(a) for a in ["scripts/bench_context.py", *sys.argv[1:]]))
    print(json.dumps(report["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
