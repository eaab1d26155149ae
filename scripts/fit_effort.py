"""Fits the effort scorer's four cuts (aither_jax/fleet/effort.py) on the labeled prompt sets and
writes them to aither_jax/fleet/effort_weights.json.

Prints, for every set, the fitted scorer's agreement with its labels at the routing threshold,
and its agreement when the set is left out of the fit (fitted on all the other sets): the
figure to expect on prompts nobody has labeled. `--hold-out` keeps sets out of the fit
altogether (their agreement is then held-out by construction); `--dry-run` writes nothing.

    .venv/bin/python scripts/fit_effort.py [--hold-out effort_blind8 ...] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aither_jax.fleet.effort import L2, WEIGHTS, EffortScorer, fit_cuts  # noqa: E402

# The development set, and the tests' labeled sets (tests/aither_jax/fleet/test_router.py).
PROMPT_SETS = (
    ROOT / "aither_jax" / "fleet" / "effort_prompts.json",
    *sorted((ROOT / "tests" / "aither_jax" / "fleet").glob("effort_*.json")),
)


def load_sets(paths=PROMPT_SETS) -> dict[str, tuple[list[str], list[int]]]:
    """Set name (file stem) -> (texts, labeled efforts)."""
    sets = {}
    for path in paths:
        prompts = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))["prompts"]
        sets[pathlib.Path(path).stem] = ([p["text"] for p in prompts], [int(p["effort"]) for p in prompts])
    return sets


def fit_on(sets: dict, names) -> dict:
    """The cuts fitted on the sets `names`, with the names recorded."""
    texts = [t for n in names for t in sets[n][0]]
    efforts = [e for n in names for e in sets[n][1]]
    return {"fitted_on": sorted(names), **fit_cuts(texts, efforts)}


def left_out_agreement(sets: dict, names, threshold: int = 3) -> dict[str, float]:
    """Each set's agreement under cuts fitted on the other sets among `names`."""
    return {n: EffortScorer(fit_on(sets, [m for m in names if m != n])).agreement(*sets[n], threshold) for n in names}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hold-out", nargs="*", default=[], help="set names (file stems) kept out of the fit")
    p.add_argument("--threshold", type=int, default=3)
    p.add_argument("--dry-run", action="store_true", help="print the figures, write nothing")
    args = p.parse_args(argv)
    sets = load_sets()
    unknown = set(args.hold_out) - set(sets)
    if unknown:
        p.error(f"no labeled set named {', '.join(sorted(unknown))} (sets: {', '.join(sets)})")
    names = [n for n in sets if n not in args.hold_out]
    if len(names) < 2:
        p.error("leave at least two sets in the fit (each is also left out of it once)")
    if not 2 <= args.threshold <= 5:
        p.error(f"--threshold must be an effort from 2 to 5, got {args.threshold}")
    fitted = fit_on(sets, names)
    scorer = EffortScorer(fitted)
    left_out = left_out_agreement(sets, names, args.threshold)
    print(f"fitted on {len(names)} sets ({sum(len(sets[n][0]) for n in names)} prompts), L2 {L2}")
    print(f"{'set':24s} {'prompts':>7s} {'fitted':>7s} {'left out':>8s}")
    for n, (texts, _) in sets.items():
        out = f"{100 * left_out[n]:7.1f}%" if n in left_out else "held out"
        print(f"{n:24s} {len(texts):7d} {100 * scorer.agreement(*sets[n], args.threshold):6.1f}% {out:>8s}")
    mean = sum(left_out.values()) / len(left_out)
    print(f"left out, mean over sets: {100 * mean:.1f}%, lowest {100 * min(left_out.values()):.1f}%")
    if not args.dry_run:
        WEIGHTS.write_text(json.dumps(fitted, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {WEIGHTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
