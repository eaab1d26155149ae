"""argparse value parsers shared by the command-line entry points: each names the flag and
what is allowed in its error."""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Callable

from models.kv_spec import KVSpec, parse_kv_spec
from models.registry import DEFAULT_MODEL, MODELS


def int_in(name: str, low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"{name} must be {bound}, got {value}")
        return value

    return parse


def float_in(name: str, low: float, high: float, low_open: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not (low < value if low_open else low <= value) or not value <= high:
            interval = f"{'(' if low_open else '['}{_number(low)}, {_number(high)}]"
            raise argparse.ArgumentTypeError(f"{name} must be in {interval}, got {text}")
        return value

    return parse


def nonempty_path(name: str) -> Callable[[str], pathlib.Path]:
    """A path that names something: an empty one (an unset shell variable) would be the working
    directory."""

    def parse(text: str) -> pathlib.Path:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{name} must name a directory, got an empty path")
        return pathlib.Path(text)

    return parse


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def kv_spec(text: str) -> KVSpec:
    try:
        return parse_kv_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def kv_spec_or_auto(text: str) -> KVSpec | str:
    """A format name, or "auto" / "turboquant" (resolved once the model is known)."""
    return text if text in ("auto", "turboquant") else kv_spec(text)


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"registered name ({', '.join(sorted(MODELS))}) or a .gguf path"
    )


def speculative_config(text: str):
    """--speculative-config: a JSON object of SpeculativeConfig fields, checked at parse time."""
    from aither_jax.speculative.config import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_residency_args(parser) -> None:
    """Bounded residency's flags (aither_jax/core/bounded.py), shared by the server and the CLIs."""
    parser.add_argument(
        "--max-resident-tokens",
        type=int_in("--max-resident-tokens", 1),
        default=None,
        metavar="N",
        help="keep at most N tokens of each request's KV on the device (sinks, protected system/identity pages, "
        "a tail window and the best-scored rest); the rest waits in host memory, byte-exact, so a context may "
        "outgrow the device pool (default: off)",
    )
    parser.add_argument(
        "--residency-tau",
        type=int_in("--residency-tau", 1),
        default=64,
        help="with --max-resident-tokens, reselect the resident pages every this many tokens (at least history/45)",
    )
    parser.add_argument(
        "--residency-scorer",
        choices=("attention", "qk", "lru", "window"),
        default="attention",
        help="which pages stay resident: attention (their recent attention mass plus the qk estimate), qk (the "
        "newest query's estimated attention share from each page's mean key), lru (most recently written) or "
        "window (sinks and the newest pages only)",
    )


def residency_kwargs(args) -> dict:
    """`aj.LLM` keywords of the residency flags."""
    return dict(
        max_resident_tokens=args.max_resident_tokens,
        residency_tau=args.residency_tau,
        residency_scorer=args.residency_scorer,
    )
