"""The eviction advisor against LRU on the workload LRU fails: a multi-tenant chat service on a
device pool under pressure, with a warm tier of limited size.

Several personas (a system message of identity and rules, ~200 tokens each) serve many
conversations, round-robin over `--rounds` rounds: each turn sends the conversation so far
plus a new user question (and every third turn a tool result before it), and the model answers
`--answer-tokens` tokens (greedy, kept in the history: long assistant turns). One persona
serves few conversations, so its system pages go unused for long stretches (the original
system's bug: LRU evicted exactly those and the model forgot who it was). The device pool
(`--num-pages`) holds a fraction of the working set; the host tier (`--host-gib`) a little more.

Reported per policy, over a pass that follows an untimed pass over other text (which compiles
most shapes): prompt tokens found cached by source tag (system, user, assistant, tool), the
follow-up turns' mean time to first token (turns that compiled a prefill shape the untimed pass
never ran are left out and counted: the policy decides the cached lengths, so the shapes), how
many turns had to recompute system tokens that
an earlier turn had computed (and how many tokens), the advisor's ranking time as a share of
the run, and decode tok/s of fresh prompts with the policy's thread running.

Writes JSON (`--out`) and unless `--no-record` the headline rows (scripts/bench_record.py).

    .venv/bin/python scripts/bench_eviction.py [--num-pages 160] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import shlex
import statistics
import sys
import time
from math import nan

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_record  # noqa: E402
from bench_tiers import decode_rate  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
POLICIES = ("lru", "advisor")
WORDS = (
    "tide moon salt wave reef kelp gull foam shell drift current harbor anchor sail storm calm depth "
    "coral squid whale plankton lagoon estuary delta swell breaker shoal buoy lighthouse compass"
).split()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--personas", type=int, default=3)
    p.add_argument("--conversations", type=int, default=10, help="conversations over all personas")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--answer-tokens", type=int, default=48)
    p.add_argument("--num-pages", type=int, default=160, help="the device pool (16-token pages)")
    p.add_argument("--host-gib", type=float, default=0.004, help="the warm tier")
    p.add_argument("--advisor-weights", default=None, help="JSON: the advisor's weights that differ from the defaults")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated; the TTFT ratio needs both")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "out" / "bench_eviction.json")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    if args.personas < 2 or args.conversations < args.personas or args.rounds < 2 or args.answer_tokens < 1:
        p.error("need >= 2 personas, a conversation per persona, >= 2 rounds, >= 1 answer token")
    args.policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    unknown = sorted(set(args.policies) - set(POLICIES))
    if unknown or not args.policies:
        p.error(f"--policies takes names from {', '.join(POLICIES)}, got {unknown or 'none'}")
    return args


def words(rng, n: int) -> str:
    return " ".join(rng.choice(WORDS, n))


def workload(args, seed: int) -> tuple[list[dict], list[int]]:
    """(personas' system messages, each conversation's persona): persona 0 serves one
    conversation, the rest share the others."""
    import numpy as np

    rng = np.random.default_rng(seed)
    personas = []
    for k in range(args.personas):
        name = ["Aither", "Brine", "Corvo", "Delphine", "Eddy"][k % 5] + (f"-{k}" if k >= 5 else "")
        identity = f"You are {name}, an assistant for {words(rng, 3)} research. Your name is {name}. "
        rules = "Rules: " + ". ".join(words(rng, 8) for _ in range(10)) + "."
        personas.append({"role": "system", "content": identity * 3 + rules})
    owners = [0] + [1 + i % (args.personas - 1) for i in range(args.conversations - 1)]
    return personas, owners


def run_pass(llm, args, seed: int, *, timed: bool) -> dict:
    import numpy as np

    import aither_jax as aj
    from aither_jax.context.prompt import chat_prompt

    rng = np.random.default_rng(seed + 1)
    personas, owners = workload(args, seed)
    history = [[personas[p]] for p in owners]
    params = aj.SamplingParams(max_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True)
    hit, seen = collections.Counter(), collections.Counter()
    turns, system_misses, system_tokens_recomputed = [], 0, 0
    persona_done = set()
    turn = 0
    for r in range(args.rounds):
        for c, p in enumerate(owners):
            if turn % 3 == 2:
                history[c].append({"role": "tool", "content": f"search results: {words(rng, 80)}"})
            history[c].append({"role": "user", "content": f"{words(rng, 30)}?"})
            spans = chat_prompt(llm.tokenizer, history[c]).sections
            compiles = llm.engine.num_compiles
            out = llm.chat([history[c]], params, use_tqdm=False)[0]
            history[c].append({"role": "assistant", "content": out.text})
            cached = out.num_cached_tokens
            for s in spans:
                seen[s.tag] += s.stop - s.start
                hit[s.tag] += max(0, min(s.stop, cached) - s.start)
            system = next(s for s in spans if s.tag == "system")
            full = system.stop // 16 * 16  # the system message's full pages
            if p in persona_done and cached < full:
                system_misses += 1
                system_tokens_recomputed += full - max(cached, 0)
            persona_done.add(p)
            compiled = llm.engine.num_compiles > compiles
            turns.append([r, c, len(out.prompt_token_ids), cached, round(out.time_to_first_token * 1e3, 1), compiled])
            turn += 1
    if not timed:
        return {}
    follow_ups = [t for t in turns if t[0]]
    return {
        "hit_rate_by_tag": {t: hit[t] / seen[t] for t in sorted(seen)},
        # A turn whose cached length makes a prefill shape the untimed pass never ran compiles
        # it: that time is the compiler's, not the policy's.
        "mean_followup_ttft_s": statistics.mean([t[4] / 1e3 for t in follow_ups if not t[5]] or [nan]),
        "mean_followup_ttft_all_s": statistics.mean(t[4] / 1e3 for t in follow_ups),
        "mean_ttft_by_round_s": [statistics.mean(t[4] for t in turns if t[0] == k) / 1e3 for k in range(args.rounds)],
        "followup_turns_compiled": sum(t[5] for t in follow_ups),
        "system_recompute_turns": system_misses,
        "system_tokens_recomputed": system_tokens_recomputed,
        "turns": turn,
        "per_turn": turns,  # [round, conversation, prompt tokens, cached tokens, TTFT ms, compiled?]
    }


def bench_policy(args, policy: str) -> dict:
    import aither_jax as aj

    llm = aj.LLM(
        args.model, max_model_len=1024, max_num_seqs=1, num_pages=args.num_pages, enable_prefix_caching=True,
        kv_offloading_size=args.host_gib, eviction_policy=policy, max_pinned_fraction=0.1, progress=False,
        advisor_weights=args.advisor_weights if policy == "advisor" else None,
    )  # fmt: skip
    run_pass(llm, args, seed=100, timed=False)  # other text: compiles every shape
    start = time.perf_counter()
    policy_obj = llm.engine.scheduler.policy
    ranking_before = getattr(policy_obj, "refresh_seconds", 0.0)
    report = run_pass(llm, args, seed=0, timed=True)
    wall = time.perf_counter() - start
    report["policy"] = policy
    report["ranking_share"] = (getattr(policy_obj, "refresh_seconds", 0.0) - ranking_before) / wall
    report["decode_tok_s"] = decode_rate(llm)
    evicted = getattr(policy_obj, "evicted_by_tag", {})
    report["evicted_by_tag"] = dict(evicted)
    tiers = llm.engine.tiers.counters
    report["host_hits"], report["demoted"] = tiers.num_host_hits, tiers.num_demoted
    print(json.dumps(report), file=sys.stderr)
    return report


def record(report: dict, command: str) -> None:
    run = {"command": command, **bench_record.provenance(report["env"])}
    c = report["config"]
    weights = c["advisor_weights"]
    entries = []
    for r in report["policies"]:
        figures = {
            "system turns recomputed": f"{r['system_recompute_turns']} of {r['turns']}",
            "system tokens recomputed": r["system_tokens_recomputed"],
            "hit rate system / user / assistant / tool": " / ".join(
                f"{r['hit_rate_by_tag'].get(t, 0):.2f}" for t in ("system", "user", "assistant", "tool")
            ),
            "follow-up TTFT ms": bench_record.rounded(r["mean_followup_ttft_s"] * 1e3),
            "TTFT ms by round": " / ".join(str(bench_record.rounded(t * 1e3)) for t in r["mean_ttft_by_round_s"]),
            "follow-up turns that compiled (left out)": r["followup_turns_compiled"],
            "ranking share of run": bench_record.rounded(r["ranking_share"], 4),
            "decode tok/s": bench_record.rounded(r["decode_tok_s"], 1),
        }
        config = {
            "model": c["model"],
            "policy": r["policy"] + (f" {weights}" if r["policy"] == "advisor" and weights else ""),
            "workload": f"{c['personas']} personas, {c['conversations']} conversations x {c['rounds']} rounds, "
            f"{c['num_pages']} device pages, {c['host_gib']} GiB host",
        }
        entries.append(bench_record.result("eviction", config, figures, details=r, **run))
    bench_record.record(entries)


def main(argv=None) -> int:
    args = parse_args(argv)
    report = {"config": {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}}
    report["policies"] = [bench_policy(args, p) for p in args.policies]
    by_name = {r["policy"]: r for r in report["policies"]}
    if len(by_name) == len(POLICIES):
        lru, advisor = by_name["lru"], by_name["advisor"]
        report["followup_ttft_lru_over_advisor"] = lru["mean_followup_ttft_s"] / advisor["mean_followup_ttft_s"]
        report["decode_advisor_over_lru"] = advisor["decode_tok_s"] / lru["decode_tok_s"]
        print(
            f"follow-up TTFT LRU / advisor {report['followup_ttft_lru_over_advisor']:.2f}x; "
            f"decode advisor / LRU {report['decode_advisor_over_lru']:.3f}",
            file=sys.stderr,
        )
    report["env"] = bench_record.environment()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    if not args.no_record:
        record(report, "python " + " ".join(shlex.quote(a) for a in ["scripts/bench_eviction.py", *sys.argv[1:]]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
