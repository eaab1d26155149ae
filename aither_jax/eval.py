"""Evaluation entry points: `python -m aither_jax.eval <command>`.

    capacity   KV bytes per token for each --kv-cache-dtype of a model, and how many tokens fit
               in a memory budget.

Exit codes: 0 success, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys

from models.config import ModelConfig
from models.gguf_file import GGUFError, GGUFFile
from models.kv_spec import KVSpec, parse_kv_spec
from models.registry import DEFAULT_MODEL, MODELS, resolve_model


def capacity_rows(cfg: ModelConfig, specs: list[KVSpec], memory_bytes: int) -> list[dict]:
    """One row per format: bytes per token, compression against bf16, tokens in the budget."""
    bf16 = parse_kv_spec("bf16").bytes_per_token(cfg)
    rows = []
    for spec in specs:
        per_token = spec.bytes_per_token(cfg)
        rows.append(
            {
                "kv_cache_dtype": spec.name,
                "bytes_per_token": per_token,
                "compression_vs_bf16": round(bf16 / per_token, 3),
                "tokens_in_budget": memory_bytes // per_token,
                "budget_bytes": memory_bytes,
            }
        )
    return rows


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 < value <= 1 << 20:
        raise argparse.ArgumentTypeError(f"must be in (0, 1048576] GiB, got {text}")
    return value


def _kv_spec(text: str) -> KVSpec:
    try:
        return parse_kv_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m aither_jax.eval", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    cap = sub.add_parser("capacity", help="KV bytes per token and tokens per memory budget")
    cap.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"registered name ({', '.join(sorted(MODELS))}) or a .gguf path"
    )
    cap.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        type=_kv_spec,
        default=[parse_kv_spec(n) for n in ("bf16", "tq8", "tq6", "tq-k6v4", "tq4", "tq3", "tq2")],
        help="one or more formats: bf16, fp32, tq<bits>, tq-k<bits>v<bits>, with -qjlk/-qjlv/-qjl",
    )
    cap.add_argument("--memory-gib", type=_positive_float, default=1.0, help="KV memory budget in GiB")
    cap.add_argument("--json", action="store_true", help="print one JSON object per format")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = ModelConfig.from_gguf(GGUFFile(resolve_model(args.model)))
    except (ValueError, GGUFError) as e:
        parser.error(str(e))
    rows = capacity_rows(cfg, args.kv_cache_dtype, int(args.memory_gib * (1 << 30)))
    if args.json:
        for row in rows:
            print(json.dumps({"model": args.model, **row}))
        return 0
    print(
        f"{args.model}: {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x head_dim {cfg.head_dim}, "
        f"budget {args.memory_gib:g} GiB"
    )
    print(f"{'kv_cache_dtype':<16} {'bytes/token':>12} {'vs bf16':>8} {'tokens in budget':>17}")
    for r in rows:
        print(
            f"{r['kv_cache_dtype']:<16} {r['bytes_per_token']:>12,} {r['compression_vs_bf16']:>7.2f}x "
            f"{r['tokens_in_budget']:>17,}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
