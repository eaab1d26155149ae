"""argparse value parsers shared by the command-line entry points: each names the flag and
what is allowed in its error."""

from __future__ import annotations

import argparse
import copy
import os
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


def output_file(
    name: str, suffixes: tuple[str, ...] = (), *, empty_skips: bool = False
) -> Callable[[str], pathlib.Path | None]:
    """A file the command will write, checked before any work starts (a run must not end in an
    error about where its results go): not empty, not a directory, its nearest existing folder
    writable, and ending in one of `suffixes` when given. With `empty_skips`, an empty path
    means none (None): the file is not written."""

    def parse(text: str) -> pathlib.Path | None:
        if not text and empty_skips:
            return None
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{name} must name a file, got an empty path")
        path = pathlib.Path(text).expanduser()
        if suffixes and path.suffix.lower() not in suffixes:
            raise argparse.ArgumentTypeError(f"{name} must end in {' or '.join(suffixes)}, got {text!r}")
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{name} {text!r} is a directory; name a file in it")
        folder = path.absolute().parent
        while not folder.exists():
            folder = folder.parent
        if not folder.is_dir():
            raise argparse.ArgumentTypeError(f"{name} {text!r}: {folder} is a file, not a folder")
        if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise argparse.ArgumentTypeError(f"{name} {text!r} is not writable")
        return path

    return parse


def input_file(name: str, *, utf8: bool = False) -> Callable[[str], pathlib.Path]:
    """A file the command will read: it exists and is a file (a folder is named as one); with
    `utf8`, a text that decodes as UTF-8 (the error names the file and where it fails)."""

    def parse(text: str) -> pathlib.Path:
        path = pathlib.Path(text).expanduser()
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{name} {text!r} is a directory, not a file")
        if not path.is_file():
            raise argparse.ArgumentTypeError(f"{name} {text!r} does not exist")
        try:
            if utf8:
                path.read_bytes().decode("utf-8")
            else:
                path.open("rb").close()
        except OSError as e:
            raise argparse.ArgumentTypeError(f"{name} {text!r} cannot be read ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise argparse.ArgumentTypeError(f"{name} {text!r} is not UTF-8 text (byte {e.start})") from None
        return path

    return parse


_NO_HELP = "\x00"


class HelpFormatter(argparse.HelpFormatter):
    """--help shows each option's default where it has one and its help does not say it."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and _shown_default(action) is not None:  # argparse skips options without help
            action = copy.copy(action)
            action.help = _NO_HELP  # a help for argparse to format, which _get_help_string drops
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        help, shown = (action.help or "").replace(_NO_HELP, ""), _shown_default(action)
        if shown is None or "(default" in help or "%(default)" in help:
            return help
        shown = shown.replace("%", "%%")
        return f"{help} (default: {shown})" if help else f"default: {shown}"


def _shown_default(action: argparse.Action) -> str | None:
    default = action.default
    if default is None or default is False or default is argparse.SUPPRESS or default == []:
        return None
    if not action.option_strings or action.nargs == 0:  # positionals, flags
        return None
    if isinstance(default, list | tuple):
        return " ".join(str(getattr(d, "name", d)) for d in default)
    return str(getattr(default, "name", default))


PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def add_json_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """`--json [FILE]`, the same in every command: alone, `what` goes to stdout as JSON in place
    of the table; with FILE, the table prints and the JSON is written there."""
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        type=lambda text: text if text == "-" else output_file("--json")(text),
        metavar="FILE",
        help=f"JSON output, {what}: on stdout in place of the table, or with FILE written there beside it",
    )


def add_version_argument(parser: argparse.ArgumentParser) -> None:
    from aither_jax import __version__

    parser.add_argument("--version", action="version", version=f"aither-jax {__version__}")


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
