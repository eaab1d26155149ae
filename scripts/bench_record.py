"""The one writer of benchmark results: docs/benchmarks/log.jsonl and the tables of docs/BENCHMARKS.md.

Every benchmark script hands its results to `record`, which appends one JSON object per result
to the log and then regenerates the headline table of each area it touched. The log is the
history; a table is a view of it: for each configuration and device, the figures of the
latest result (by date, then by position in the log). A table sits between two marker lines,

    <!-- bench:decode:begin -->
    | device | model | ... |
    <!-- bench:decode:end -->

so the prose around it is never touched; an area with no markers gets a new section at the
end of the file. A log entry:

    {"kind": "result", "area": "decode", "date": "2026-11-27", "device": "AMD EPYC (2 cores)",
     "config": {"model": "smollm2-135m", "batch": 8, ...},     # what the row is keyed on
     "figures": {"ours decode tok/s": 222, ...},               # the row's headline numbers
     "command": "python scripts/bench_decode.py", "versions": {"jax": "0.10.2", ...},
     "commit": "5c2b135", "details": {...}}                    # details: the rest of the report

Entries of kind "note" are history that no table shows: ablations, profiles, runs of earlier
code, with the text that explains them in `note`, their figures in `figures` where they were
taken apart, and in `section` the title that docs and code comments cite them by.

    python scripts/bench_record.py rebuild                  # every table again, from the log
    python scripts/bench_record.py note decode "text" [--section T] [--device D] [--command C]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import pathlib
import platform
import re
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOG = ROOT / "docs" / "benchmarks" / "log.jsonl"
MARKDOWN = ROOT / "docs" / "BENCHMARKS.md"

KINDS = ("result", "note")
AREA = re.compile(r"[a-z0-9][a-z0-9-]*")
MARKER = re.compile(r"^<!-- bench:([^:\s]+):(begin|end) -->$")
# Columns every row has after its configuration and figures; no config or figure key may take these names.
TRAILING = ("date", "versions", "command")
RESERVED = ("device", *TRAILING)


# -- building entries ---------------------------------------------------------------------------


def device_name() -> str:
    """The accelerator's kind (e.g. "NVIDIA H200"), or the CPU's model name and core count."""
    import jax

    device = jax.devices()[0]
    if device.platform != "cpu":
        return device.device_kind
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.lower().startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    return f"{platform.processor() or 'CPU'} ({os.cpu_count()} cores)"


def git_commit() -> str | None:
    """The working tree's commit (`-dirty` when it has uncommitted changes), or None outside git."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7", "--exclude", "*"],
            cwd=ROOT, capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment() -> dict[str, Any]:
    """Where and with what a benchmark runs: device, platform, versions, today's date and the commit."""
    import jax
    import jaxlib

    return {
        "device": device_name(),
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", None),
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
    }


def provenance(env: dict[str, Any]) -> dict[str, Any]:
    """`result`'s device, date, versions and commit from an `environment()` dict (a report's `env`)."""
    versions = {k: env[k] for k in ("jax", "jaxlib", "python") if env.get(k)}
    return {"device": env["device"], "date": env["date"], "versions": versions, "commit": env.get("commit")}


def rounded(x: float | None, digits: int | None = None) -> float | int | None:
    """`x` for a table: `digits` decimals, or by default one decimal below 100 and none from 100 up."""
    if x is None or not math.isfinite(x):
        return None
    if digits is None:
        digits = 1 if abs(x) < 100 else 0
    return int(round(x)) if digits == 0 else round(x, digits)


def result(
    area: str,
    config: dict[str, Any],
    figures: dict[str, Any],
    *,
    device: str,
    date: str,
    versions: dict[str, str],
    command: str | None,
    commit: str | None = None,
    details: Any = None,
    note: str | None = None,
) -> dict[str, Any]:
    """One result: `config` names the configuration a table row is kept for (with `device`),
    `figures` are the row's numbers (a number, a string, None, or {label: number} for figures
    by rows or by concurrency), `details` anything else worth keeping from the report."""
    entry = {"kind": "result", "area": area, "date": date[:10], "device": device, "config": config}
    entry |= {"figures": figures, "command": command, "versions": versions, "commit": commit}
    if details is not None:
        entry["details"] = details
    if note:
        entry["note"] = note
    check_entry(entry, "a new entry")
    return entry


def check_entry(entry: Any, where: str) -> None:
    """Raises ValueError saying what is wrong with `entry` (read from `where`)."""

    def fail(what: str) -> None:
        raise ValueError(f"{where}: {what}")

    if not isinstance(entry, dict):
        fail(f"a log entry must be a JSON object, got {type(entry).__name__}")
    kind = entry.get("kind")
    if kind not in KINDS:
        fail(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not isinstance(entry.get("area"), str) or not AREA.fullmatch(entry["area"]):
        fail(f"area must be lowercase letters, digits and '-', got {entry.get('area')!r}")
    if not isinstance(entry.get("date"), str) or not re.fullmatch(r"\d{4}-\d{2}-\d{2}", entry["date"]):
        fail(f"date must be YYYY-MM-DD, got {entry.get('date')!r}")
    if kind == "note":
        if not entry.get("note") and not entry.get("figures"):
            fail("a note needs a `note` text or `figures`")
        return
    if not isinstance(entry.get("device"), str) or not entry["device"]:
        fail("a result needs its device")
    for key in ("config", "figures"):
        if not isinstance(entry.get(key), dict) or not entry[key]:
            fail(f"a result needs a non-empty `{key}` object")
    config, figures = set(entry["config"]), set(entry["figures"])
    clash = (config & figures) | ((config | figures) & set(RESERVED))
    if clash:
        fail(f"config and figures keys must differ from each other and from {', '.join(RESERVED)}: {sorted(clash)}")


# -- the log ------------------------------------------------------------------------------------


def read_log(path: pathlib.Path) -> list[dict[str, Any]]:
    """Every entry of the log at `path` (none if it does not exist yet), each checked."""
    if not path.exists():
        return []
    entries = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {n}: not valid JSON ({e.msg} at column {e.colno})") from None
        check_entry(entry, f"{path}, line {n}")
        entries.append(entry)
    return entries


def _finite(value: Any) -> Any:
    """`value` with NaN and infinities as None: the log stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def log_line(entry: dict[str, Any]) -> str:
    return json.dumps(_finite(entry), ensure_ascii=False, allow_nan=False, default=str) + "\n"


# -- tables -------------------------------------------------------------------------------------


def row_key(entry: dict[str, Any]) -> tuple[str, str]:
    return entry["device"], json.dumps(entry["config"], sort_keys=True)


def latest(entries: Iterable[dict[str, Any]], area: str) -> list[dict[str, Any]]:
    """The area's latest result per configuration and device, grouped by device (devices and,
    within one, configurations in the order they first appear in the log)."""
    results = [e for e in entries if e["kind"] == "result" and e["area"] == area]
    best: dict[tuple[str, str], tuple[str, int]] = {}  # in the order keys first appear
    for i, e in enumerate(results):
        key = row_key(e)
        if key not in best or (e["date"], i) >= best[key]:
            best[key] = (e["date"], i)
    devices = list(dict.fromkeys(e["device"] for e in results))
    keys = sorted(best, key=lambda k: devices.index(k[0]))  # stable: first appearance within a device
    return [results[best[k][1]] for k in keys]


def cell(value: Any) -> str:
    """A figure or config value as table text: None as "–", numbers with thousands separators,
    {label: number} as "label: number, ..."."""
    if value is None:
        text = "–"
    elif isinstance(value, bool):
        text = "yes" if value else "no"
    elif isinstance(value, int):
        text = f"{value:,}"
    elif isinstance(value, float):
        text = f"{value:,.0f}" if value.is_integer() and abs(value) >= 100 else f"{value:,}"
    elif isinstance(value, dict):
        text = ", ".join(f"{k}: {cell(v)}" for k, v in value.items())
    elif isinstance(value, list | tuple):
        text = ", ".join(cell(v) for v in value)
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of `rows` (results of one area): device, the configuration's keys and
    the figures' keys (in the order they first appear), date, versions, command."""
    config = list(dict.fromkeys(k for r in rows for k in r["config"]))
    figures = list(dict.fromkeys(k for r in rows for k in r["figures"]))
    lines = ["| " + " | ".join(["device", *config, *figures, *TRAILING]) + " |"]
    lines.append("|" + "---|" * (1 + len(config) + len(figures) + len(TRAILING)))
    for r in rows:
        versions = ", ".join(f"{k} {v}" for k, v in (r.get("versions") or {}).items()) or None
        command = f"`{r['command']}`" if r.get("command") else None
        cells = [r["device"], *(r["config"].get(k) for k in config), *(r["figures"].get(k) for k in figures)]
        cells += [r["date"], versions, command]
        lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def marker(area: str, end: str) -> str:
    return f"<!-- bench:{area}:{end} -->"


def table_spans(text: str, where: pathlib.Path) -> dict[str, tuple[int, int]]:
    """{area: (line index of its begin marker, of its end marker)}; ValueError for a marker
    without its pair, one out of order, or an area marked twice."""
    opened: dict[str, int] = {}
    spans: dict[str, tuple[int, int]] = {}
    for i, line in enumerate(text.splitlines()):
        m = MARKER.match(line.strip())
        if not m:
            continue
        area, end = m.groups()
        if end == "begin":
            if area in opened or area in spans:
                raise ValueError(f"{where}, line {i + 1}: a second {marker(area, 'begin')}")
            if opened:
                other = next(iter(opened))
                raise ValueError(f"{where}, line {i + 1}: {marker(area, 'begin')} inside the table of {other!r}")
            opened[area] = i
        elif area not in opened:
            raise ValueError(f"{where}, line {i + 1}: {marker(area, 'end')} without {marker(area, 'begin')} before it")
        else:
            spans[area] = (opened.pop(area), i)
    for area, i in opened.items():
        raise ValueError(f"{where}, line {i + 1}: {marker(area, 'begin')} has no {marker(area, 'end')} after it")
    return spans


def with_tables(text: str, tables: dict[str, str], where: pathlib.Path) -> str:
    """`text` with each area's table replaced between its markers, or added in a new section
    (`## <area>`) at the end."""
    spans = table_spans(text, where)
    lines = text.splitlines(keepends=True)
    for area, (begin, end) in sorted(((a, spans[a]) for a in tables if a in spans), key=lambda s: -s[1][0]):
        lines[begin + 1 : end] = [tables[area]]
    out = "".join(lines)
    for area in (a for a in tables if a not in spans):
        out = out.rstrip("\n") + f"\n\n## {area}\n\n{marker(area, 'begin')}\n{tables[area]}{marker(area, 'end')}\n"
    return out


def _write(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def record(
    entries: list[dict[str, Any]], *, log: pathlib.Path | None = None, markdown: pathlib.Path | None = None
) -> None:
    """Appends `entries` to the log and regenerates the tables of their areas in the markdown.
    Both files are read and checked first, so a malformed log line or a broken marker stops it
    before anything is written."""
    log, markdown = log or LOG, markdown or MARKDOWN
    for i, e in enumerate(entries):
        check_entry(e, f"entry {i + 1} to record")
    history = read_log(log)
    text = markdown.read_text() if markdown.exists() else "# Benchmarks\n"
    table_spans(text, markdown)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.writelines(log_line(e) for e in entries)
    areas = dict.fromkeys(e["area"] for e in entries if e["kind"] == "result")
    everything = history + [json.loads(log_line(e)) for e in entries]
    _write(markdown, with_tables(text, {a: table(latest(everything, a)) for a in areas}, markdown))
    tables = f"; the {', '.join(areas)} table(s) of {markdown}" if areas else ""
    print(f"recorded {len(entries)} result(s) in {log}{tables}", file=sys.stderr)


def rebuild(*, log: pathlib.Path | None = None, markdown: pathlib.Path | None = None) -> list[str]:
    """Regenerates every area's table from the log; returns the areas."""
    log, markdown = log or LOG, markdown or MARKDOWN
    entries = read_log(log)
    areas = list(dict.fromkeys(e["area"] for e in entries if e["kind"] == "result"))
    text = markdown.read_text() if markdown.exists() else "# Benchmarks\n"
    _write(markdown, with_tables(text, {a: table(latest(entries, a)) for a in areas}, markdown))
    return areas


def add_note(
    area: str,
    text: str,
    *,
    section: str | None = None,
    device: str | None = None,
    date: str | None = None,
    command: str | None = None,
    figures: dict[str, Any] | None = None,
    log: pathlib.Path | None = None,
) -> dict[str, Any]:
    """Appends a note (history no table shows) to the log; returns it."""
    log = log or LOG
    entry = {"kind": "note", "area": area, "date": date or datetime.date.today().isoformat()}
    entry |= {k: v for k, v in (("section", section), ("device", device), ("command", command)) if v}
    entry |= {"note": text} | ({"figures": figures} if figures else {})
    check_entry(entry, "the new note")
    read_log(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(log_line(entry))
    return entry


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("rebuild", help="regenerate every table of docs/BENCHMARKS.md from the log")
    n = sub.add_parser("note", help="append a note (history, analysis) to the log")
    n.add_argument("area")
    n.add_argument("text")
    n.add_argument("--section", help="a title to cite the note by")
    n.add_argument("--device")
    n.add_argument("--date", help="YYYY-MM-DD (default: today)")
    n.add_argument("--command", dest="bench_command", help="the command that took the figures")
    args = p.parse_args(argv)
    try:
        if args.command == "rebuild":
            print(f"rebuilt the tables of {', '.join(rebuild()) or 'no area'} in {MARKDOWN}")
        else:
            add_note(
                args.area, args.text, section=args.section, device=args.device, date=args.date,
                command=args.bench_command,
            )  # fmt: skip
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
