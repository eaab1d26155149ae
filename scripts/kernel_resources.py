"""What the TurboQuant attention kernel needs on an NVIDIA Hopper GPU, found without one.

jax lowers a Pallas kernel to Triton IR on any host (`lower(lowering_platforms=("cuda",))`).
This script captures that IR and builds it for sm_90 with the `triton` wheel's compiler,
whose bundled ptxas reports what the kernel needs per thread and per program: registers,
bytes spilled to local memory, shared memory. It also counts the main instructions of the
PTX (FMAs, tensor-core MMAs, shared-memory loads) and times the build.

A kernel that spills or needs more shared memory than an SM has (227 KiB on an H100 or H200)
runs slowly or not at all, and one that spills heavily also takes minutes to build: the
kind of failure a GPU run shows only as a stalled warm-up. Here it shows in seconds, on CPU.

The GPU machine's jaxlib builds the same IR with the Triton inside XLA, whose version
differs from the wheel's, so the figures are close to, not identical with, what runs there.
The timings that count still come from `scripts/bench_attention.py` on a GPU.

    pip install triton==3.5.0      # once (Linux x86-64; the `test` extra installs it)
    python scripts/kernel_resources.py
    python scripts/kernel_resources.py --tokens 1 256 --dot-precision float32 bf16x3 --bits 6:5
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

ROOT = pathlib.Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "scripts"):  # run as a script or imported from the tests
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench_attention import bit_pair, positive_int  # noqa: E402

from pallas_kernels.tq_attention import DOT_PRECISIONS, tq_paged_attention  # noqa: E402
from pallas_kernels.turboquant import TurboQuant  # noqa: E402

# Shared memory one thread block may use on an H100 or H200 (228 KiB per SM, 1 KiB reserved).
MAX_SHARED_BYTES = 227 * 1024
# PTX instructions counted in the report: what a kernel loop spends its issue slots on.
_COUNTED = {
    "fma": r"fma\.rn\.f32",
    "mma": r"(?:mma|wgmma)\.",
    "ld_shared": r"ld\.shared\.",
    "ld_global": r"ld\.global\.",
    "cp_async": r"cp\.async\.(?:ca|cg)\.",
}


@contextlib.contextmanager
def _captured_modules():
    """Collects the Triton module text of every Pallas kernel lowered inside the block."""
    from jax._src.pallas.triton import lowering

    modules: list[str] = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        yield modules
    finally:
        lowering.lower_jaxpr_to_triton_module = original


def triton_kernels(fn, *args) -> list[dict]:
    """The Pallas kernels of `jax.jit(fn)(*args)` as lowered for CUDA: for each, its name,
    Triton IR text, num_warps and num_stages."""
    with _captured_modules() as modules:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    params = re.findall(r'name = "([^"]*)"[^}]*?num_stages = (\d+)[^}]*?num_warps = (\d+)', text)
    if len(params) != len(modules):
        raise RuntimeError(f"found {len(modules)} Triton modules but {len(params)} kernel calls in the lowered text")
    return [
        {"name": name, "ir": ir, "num_stages": int(stages), "num_warps": int(warps)}
        for ir, (name, stages, warps) in zip(modules, params, strict=True)
    ]


def compile_sm90(kernel: dict, *, timeout: float = 300.0) -> dict:
    """Builds one captured kernel for sm_90 in a child process (a heavily spilling kernel can
    take many minutes; past `timeout` seconds the build is reported as timed out)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / f"{kernel['name']}.ttir"
        path.write_text(kernel["ir"])
        cmd = [sys.executable, __file__, "--build", str(path), str(kernel["num_warps"]), str(kernel["num_stages"])]
        start = time.perf_counter()
        # A session of its own: a build past its time is ended with its ptxas, not just the child.
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            return {"error": f"build timed out after {timeout:.0f} s", "seconds": timeout}
        seconds = time.perf_counter() - start
    if child.returncode:
        return {"error": (stderr.strip().splitlines() or ["build failed"])[-1][:300], "seconds": seconds}
    return {**json.loads(stdout.strip().splitlines()[-1]), "seconds": round(seconds, 2)}


def _build(path: str, num_warps: int, num_stages: int) -> dict:
    """The child process of `compile_sm90`: Triton's pipeline to PTX, then ptxas's report."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    compiled = triton.compile(
        path, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        report = subprocess.run(
            [get_ptxas().path, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    finally:
        os.unlink(f.name)
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if registers is None or spills is None:
        raise RuntimeError(f"unexpected ptxas report: {report[-300:]}")
    result = {
        "registers": int(registers.group(1)),
        "spill_store_bytes": int(spills.group(1)),
        "spill_load_bytes": int(spills.group(2)),
        "shared_bytes": int(compiled.metadata.shared),
        "num_warps": num_warps,
        "num_stages": num_stages,
        "triton": triton.__version__,
    }
    result.update({name: len(re.findall(r"^\s*" + pattern, ptx, re.M)) for name, pattern in _COUNTED.items()})
    return result


def attention_case(tokens: int, k_bits: int, v_bits: int, *, batch: int, pages: int, kv_heads: int = 3,
                   group: int = 3, head_dim: int = 64, page_size: int = 16, **knobs):  # fmt: skip
    """`tq_paged_attention` of `tokens` new tokens per row over `pages` stored pages, as a
    function and its arguments (zeros: only shapes matter here)."""
    kc = TurboQuant(head_dim=head_dim, bits=k_bits, seed=0)
    vc = TurboQuant(head_dim=head_dim, bits=v_bits, seed=1)
    pool_shape = (batch * pages + 1, 1, page_size, kv_heads, head_dim)
    k_pool, v_pool = kc.encode_tree(jnp.zeros(pool_shape)), vc.encode_tree(jnp.zeros(pool_shape))
    new = jnp.zeros((batch, tokens, kv_heads, head_dim))
    k_new, v_new = kc.encode_tree(new), vc.encode_tree(new)
    q = jnp.zeros((batch, tokens, kv_heads * group, head_dim))
    table = jnp.zeros((batch, pages), jnp.int32)
    lens = jnp.full((batch,), pages * page_size, jnp.int32)
    num_new = jnp.full((batch,), tokens, jnp.int32)

    def fn(q, k_pool, v_pool):
        return tq_paged_attention(
            q, k_new, v_new, k_pool, v_pool, table, 0, lens, num_new, k_codec=kc, v_codec=vc, interpret=False, **knobs
        )

    return fn, (q, k_pool, v_pool)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=positive_int, nargs="+", default=[1, 16, 256],
                   help="new tokens per row: 1 decodes, 16 verifies a draft block, 256 is a prefill chunk")  # fmt: skip
    p.add_argument("--bits", type=bit_pair, nargs="+", default=[(6, 5), (4, 4)], help="K:V bit pairs")
    p.add_argument("--dot-precision", nargs="+", choices=DOT_PRECISIONS, default=list(DOT_PRECISIONS))
    p.add_argument("--query-rows", type=positive_int, nargs="+", default=[None],
                   help="query rows per program (default: the kernel's own for the precision)")  # fmt: skip
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--pages", type=positive_int, default=64, help="stored pages per row")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one build may take")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "out" / "kernel_resources.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 5 and sys.argv[1] == "--build":
        print(json.dumps(_build(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        return 0
    args = parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SystemExit("this needs the triton wheel: pip install triton==3.5.0 (Linux x86-64)") from None
    rows = []
    header = f"{'tokens':>6} {'bits':>4} {'precision':>9} {'rows':>4} {'regs':>4} {'spill B':>8} {'shared KiB':>10} "
    print(header + f"{'fma':>5} {'mma':>4} {'ld.shared':>9} {'build s':>7}")
    for tokens, (kb, vb), precision, query_rows in itertools.product(
        args.tokens, args.bits, args.dot_precision, args.query_rows
    ):
        knobs = {"dot_precision": precision, **({"query_rows": query_rows} if query_rows else {})}
        fn, fn_args = attention_case(tokens, kb, vb, batch=args.batch, pages=args.pages, **knobs)
        [kernel] = [k for k in triton_kernels(fn, *fn_args) if k["name"].startswith("tq_paged_attention")]
        found = compile_sm90(kernel, timeout=args.timeout)
        row = {"tokens": tokens, "k_bits": kb, "v_bits": vb, "dot_precision": precision, "query_rows": query_rows}
        rows.append({**row, **found})
        shown = query_rows or "dflt"
        if "error" in found:
            print(f"{tokens:>6} {kb}:{vb:<2} {precision:>9} {shown:>4} {found['error']}")
            continue
        spill = found["spill_store_bytes"] + found["spill_load_bytes"]
        print(
            f"{tokens:>6} {kb}:{vb:<2} {precision:>9} {shown:>4} {found['registers']:>4} {spill:>8} "
            f"{found['shared_bytes'] / 1024:>10.0f} {found['fma']:>5} {found['mma']:>4} {found['ld_shared']:>9} "
            f"{found['seconds']:>7.1f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"jax": jax.__version__, "target": "sm_90", "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
