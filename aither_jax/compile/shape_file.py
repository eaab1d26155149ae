"""Step-shape files: which step shapes a run compiled, so that the next run compiles them first.

Every distinct shape of a step call (rows, tokens and pages per row, sampling mode, ...) is
its own XLA program, compiled the first time a step of that shape runs. A serving workload
meets its shapes one at a time, each one holding up the step that needs it (on the H200's
host about 13 s a shape). `Engine.step_shapes()` lists the shapes an engine has run, as
records; `Engine.precompile(records)` compiles them up front on several threads. This module
keeps the records in a JSON file between runs:

    {"format": "aither-jax step shapes", "version": 1, "shapes": [{"kind": "forward", ...}, ...]}

`python -m aither_jax.serve --compile-shapes FILE` reads the file at start-up (when it exists),
compiles its shapes before serving, and adds every new shape it runs to it. Shapes depend on
the engine's settings (max_num_seqs, max_model_len, the KV format, ...), not on the model's
weights or the device, so a file recorded on one machine serves another with the same flags;
the records a server cannot use are skipped with a warning.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

FORMAT = "aither-jax step shapes"
VERSION = 1
MAX_FILE_BYTES = 16 << 20  # far above any real file (a record is ~150 bytes)
FILE_MODE = 0o644


def load(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The shape records in `path`. Raises ValueError, naming the file, for anything that is
    not a step-shapes file (the records' fields are checked by `Engine.precompile`)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ValueError(f"{path}: {size} bytes is too large for a step-shapes file")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a step-shapes file ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a step-shapes file (expected an object with format {FORMAT!r})")
    if data.get("version") != VERSION:
        raise ValueError(f"{path}: step-shapes file version {data.get('version')!r}, this reader knows {VERSION}")
    shapes = data.get("shapes")
    if not isinstance(shapes, list):
        raise ValueError(f"{path}: 'shapes' must be a list of shape records")
    return shapes


def save(path: str | os.PathLike, shapes: list[dict[str, Any]], **info: Any) -> None:
    """Writes `shapes` (and `info`, e.g. the settings they were recorded with) to `path`
    atomically: a crash mid-write leaves the previous file whole."""
    path = Path(path)
    head = json.dumps({"format": FORMAT, "version": VERSION, **info})[:-1]
    lines = ",\n".join("  " + json.dumps(shape) for shape in shapes)  # one record a line: readable diffs
    text = f'{head}, "shapes": [\n{lines}\n]}}\n' if shapes else f'{head}, "shapes": []}}\n'
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, FILE_MODE)  # mkstemp's file is private to its owner
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
