"""Packs what the GPU machine lacks into `.gpu/` (git-ignored), for `scripts/gpu_check.py` there.

The GPU machine has jax, flax, optax, orbax, tokenizers, jinja2, torch and transformers, but
not `gguf`, the serving stack (fastapi, starlette, pydantic, uvicorn) or the model wheel, and
it cannot download anything. Every call to it carries the working tree plus named ignored
paths, 64 MiB in all, so:

* `.gpu/setup/`: wheels for Python 3.12 (manylinux x86-64) of the missing packages, at the
  versions installed here, and `model.json` (file name, size and SHA-256 of the model GGUF);
* `.gpu/model_1` .. `.gpu/model_N`: the SmolLM2 GGUF (98 MB), xz-compressed (90 MB) and cut
  into N parts (default 2), one per call of those just before and at the first stage that
  needs the model (`gpu_check.model_parts`). The machine keeps ignored paths between calls
  while it stays warm, so the parts meet there and `gpu_check.py setup` joins, decompresses
  and checks them once all have arrived.

    .venv/bin/python scripts/gpu_bundle.py            # then follow the printed calls
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import lzma
import math
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gpu_check import CALLS, call_command, model_parts  # noqa: E402

from models.registry import DEFAULT_MODEL, MODELS, resolve_model  # noqa: E402

# Missing on the GPU machine (its package list: /work/.library/device/KINDS.md); each goes
# at the version installed here, so both sides run the same code.
MISSING = ("gguf", "fastapi", "starlette", "pydantic", "pydantic-core", "annotated-types")
MISSING += ("typing-inspection", "opentelemetry-api", "uvicorn")
MISSING += ("typing-extensions",)  # there, but pydantic needs a recent one; it goes first on the path
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
CARRY_LIMIT = 64 << 20  # bytes one call may carry, working tree included


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=pathlib.Path, default=ROOT / ".gpu")
    p.add_argument("--parts", type=int, default=2, help="pieces of the model GGUF, one carried per call")
    p.add_argument("--no-wheels", action="store_true", help="only split the model")
    args = p.parse_args(argv)
    if args.parts < 1:
        p.error("--parts must be >= 1")
    return args


def download_wheels(dest: pathlib.Path) -> list[pathlib.Path]:
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):  # two versions of one package would stop the install there
        old.unlink()
    specs = [f"{name}=={importlib.metadata.version(name)}" for name in MISSING]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.run(cmd + specs, check=True)
    return sorted(dest.glob("*.whl"))


def split_model(model_path: pathlib.Path, out_dir: pathlib.Path, parts: int) -> dict:
    """Cuts the model, xz-compressed (98 -> 90 MB, which lets two parts carry it), into `parts`.
    The compressed stream is kept beside them and reused while the model is unchanged."""
    data = model_path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    packed = out_dir / "model.xz"
    stamp = out_dir / "model.xz.sha256"
    if not (packed.exists() and stamp.exists() and stamp.read_text() == digest):
        print(f"compressing {model_path.name} (xz, about a minute)", flush=True)
        packed.write_bytes(lzma.compress(data, preset=6))
        stamp.write_text(digest)
    stream = packed.read_bytes()
    size = math.ceil(len(stream) / parts)
    for i in range(parts):
        (out_dir / f"model_{i + 1}").write_bytes(stream[i * size : (i + 1) * size])
    for stale in out_dir.glob("model_*"):  # parts of an earlier, finer cut
        if stale.name.split("_")[1].isdigit() and int(stale.name.split("_")[1]) > parts:
            stale.unlink()
    return {
        "model": DEFAULT_MODEL,
        "package": MODELS[DEFAULT_MODEL].package,
        "filename": model_path.name,
        "size": len(data),
        "sha256": digest,
        "compression": "xz",
        "parts": parts,
    }


def tree_bytes() -> int:
    """Bytes of the working tree that travels: tracked plus untracked files git does not ignore."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        parts = model_parts(CALLS, args.parts)
    except ValueError as e:
        print(f"--parts {args.parts}: {e}", file=sys.stderr)
        return 1
    setup = args.dir / "setup"
    setup.mkdir(parents=True, exist_ok=True)
    wheels = [] if args.no_wheels else download_wheels(setup)
    info = split_model(pathlib.Path(resolve_model(DEFAULT_MODEL)), args.dir, args.parts)
    (setup / "model.json").write_text(json.dumps(info, indent=2) + "\n")
    tree = tree_bytes()
    setup_bytes = sum(f.stat().st_size for f in setup.iterdir())
    part_bytes = max((args.dir / f"model_{i + 1}").stat().st_size for i in range(args.parts))
    print(f"{len(wheels)} wheels + model.json in {setup} ({setup_bytes / 2**20:.1f} MiB)")
    print(f"model cut into {args.parts} parts of <= {part_bytes / 2**20:.1f} MiB in {args.dir}")
    first = tree + setup_bytes + part_bytes
    print(f"working tree {tree / 2**20:.1f} MiB; a call carries {first / 2**20:.1f} MiB of 64")
    if first > CARRY_LIMIT:
        print("too much for one call: raise --parts", file=sys.stderr)
        return 1
    rel = args.dir.relative_to(ROOT) if args.dir.is_relative_to(ROOT) else args.dir
    print("\nDevice calls, back to back (the machine stays warm for 30 s after each):")
    for i, stages in enumerate(CALLS):
        carry = [f"{rel}/setup"] + ([f"{rel}/model_{parts[i]}"] if i in parts else [])
        command = call_command(stages)
        print(f"  {i + 1}. carry {carry}:\n     {command}")
    print("docs/GPU_CHECKS.md says what each stage does.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
