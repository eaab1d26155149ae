"""What the command-line entry points write: JSON with the run that made it, files written
whole or not at all, and an interrupted run that ends with a message instead of a traceback."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import shlex
import sys
import tempfile
from collections.abc import Callable, Sequence

INTERRUPTED = 130  # the shell's code for a command ended by Ctrl-C (128 + SIGINT)


def run_info(prog: str, argv: Sequence[str] | None = None) -> dict:
    """Where a result came from: the command line, the software versions, the device, the time.
    The device is named only where the run started a backend: a command that computed on none
    (capacity arithmetic) does not start one (on a GPU that would take its memory)."""
    import jax

    from aither_jax import __version__

    started = _backends_started()
    return {
        "command": shlex.join([*prog.split(), *(sys.argv[1:] if argv is None else argv)]),
        "aither_jax": __version__,
        "jax": jax.__version__,
        "backend": jax.default_backend() if started else None,
        "device": jax.devices()[0].device_kind if started else None,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge

        return xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # moved in a later JAX: name the device anyway
        return True


def write_file(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Calls `write(tmp)` to make the file under a temporary name in its folder, then renames it
    over `path`: a crash or Ctrl-C leaves the old file (or none), never half of the new one.
    The name keeps `path`'s suffix, which plotting libraries read the format from."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The suffix in lower case: np.savez appends ".npz" to a name not ending in exactly that.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=path.suffix.lower(), dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        if not os.path.getsize(tmp):
            raise OSError(f"nothing was written for {path}")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as an ordinary file would be, not mkstemp's 0600
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    write_file(path, lambda tmp: pathlib.Path(tmp).write_text(text, encoding="utf-8"))


def emit_json(destination: str | os.PathLike, objects: dict | list[dict], run: dict) -> None:
    """Writes a report with `run` (run_info) in it: `destination` "-" prints to stdout, else a
    file. One object is written whole (indented in a file); a list as JSON lines, each object
    carrying `run`, so every line says where it came from."""
    if isinstance(objects, dict):
        text = json.dumps({**objects, "run": run}, indent=None if destination == "-" else 2, ensure_ascii=False)
    else:
        text = "\n".join(json.dumps({**o, "run": run}, ensure_ascii=False) for o in objects)
    if destination == "-":
        print(text, flush=True)
    else:
        write_text(destination, text + "\n")


def run_command(main: Callable[[], int]) -> int:
    """Runs a `__main__` entry point: Ctrl-C ends it with a one-line message and exit code 130.
    It exits at once (os._exit) rather than through interpreter shutdown, which can crash
    while XLA compiles on other threads; what was printed is flushed first."""
    try:
        return main()
    except KeyboardInterrupt:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        print("\ninterrupted", file=sys.stderr, flush=True)
        os._exit(INTERRUPTED)
