"""Decode attention over paged KV: the TurboQuant rotated-domain kernel against bf16 paged attention.

For each case (batch x context tokens) and each K/V bit pair, one layer of SmolLM2's shape
(3 KV heads of 64, 9 query heads, pages of 16 tokens) is filled with random vectors and every
row owns `context / page_size` pages in a shuffled order, as the allocator hands them out.
One decode token per row attends to its context and to itself. Three ways are timed:

* `pallas`: `tq_paged_attention`, the Pallas kernel over the packed pages (interpreted on
  CPU, so CPU figures of this path say nothing about speed), once per `--pages-per-split`
  (`pallas/16`; default: the kernel's own choice), and once more per `--pages-per-step` that
  divides it (`pallas/16x2`: tiles of 2 pages), for each `--code-loads` (`pallas/16-planes`)
  and each `--dot-precision` (`pallas/16-bf16x3`; float32 has no suffix). A variant other
  than gathers in float32 that fails to build is reported and skipped;
* `xla`: `tq_paged_attention_xla`, the same rotated-domain algorithm in jnp;
* `bf16`: what the engine does for an unquantized layer: gather the row's bf16 pages through
  the block table, then `paged_attention_reference` in bf16.

Before any timing, each TurboQuant path is checked against `tq_paged_attention_reference`
(which decodes the pages) and bf16 against a float32 run of the same reference; the largest
differences are in the report. A time is the median over `--repeats` of one jitted run of
`--inner` calls chained back to back (each call's query depends on the previous output, so
none is skipped or overlapped), divided by `--inner`, after a warm-up run: compilation and
dispatch stay out. The chained calls cycle through `--copies` independent copies of the pools,
so that at 32 x 8192 (41-54 MB of packed context, about an H100's L2) a call reads memory, not
the cache. At 1 x 512 a call is latency-bound: launch and the combine of the splits, not bytes.
Memory bandwidth is measured in the same run as the time of summing a large uint32 array
(`--bandwidth-mib`); each path's effective bandwidth is the bytes of context it must read
(codes and norms, or bf16 values) over its time.

Writes JSON (`--out`) and, unless `--no-record`, records one result per case and bit pair
(scripts/bench_record.py: docs/benchmarks/log.jsonl and the attention table of docs/BENCHMARKS.md).

    python scripts/bench_attention.py                          # GPU: 32x8192 and 1x512
    python scripts/bench_attention.py --cases 2x64 --repeats 2 --inner 2 --no-record   # CPU smoke
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python scripts/bench_attention.py` without installing the package

import bench_record  # noqa: E402

from pallas_kernels.paged_attention import paged_attention_reference  # noqa: E402
from pallas_kernels.tq_attention import (  # noqa: E402
    CODE_LOADS,
    DOT_PRECISION,
    DOT_PRECISIONS,
    default_pages_per_split,
    tq_paged_attention,
    tq_paged_attention_reference,
    tq_paged_attention_xla,
)
from pallas_kernels.turboquant import TurboQuant  # noqa: E402


def _case(text: str) -> tuple[int, int]:
    try:
        batch, context = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a case is BATCHxCONTEXT, e.g. 32x8192, got {text!r}") from None
    if batch < 1 or context < 1:
        raise argparse.ArgumentTypeError(f"batch and context must be positive, got {text!r}")
    return batch, context


def bit_pair(text: str) -> tuple[int, int]:
    try:
        k, v = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bits are K:V, e.g. 4:4, got {text!r}") from None
    if not (1 <= k <= 8 and 1 <= v <= 8):
        raise argparse.ArgumentTypeError(f"bits must be in 1..8, got {text!r}")
    return k, v


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=_case, nargs="+", default=[(32, 8192), (1, 512)], help="BATCHxCONTEXT ...")
    p.add_argument("--bits", type=bit_pair, nargs="+", default=[(4, 4), (6, 5), (3, 3)], help="K:V bit pairs")
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--kv-heads", type=positive_int, default=3)
    p.add_argument("--group", type=positive_int, default=3, help="query heads per KV head")
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument(
        "--pages-per-split",
        type=positive_int,
        nargs="+",
        default=None,
        help="kernel split-K sizes (default: the kernel's own choice for each case, default_pages_per_split)",
    )
    p.add_argument(
        "--code-loads",
        nargs="+",
        choices=CODE_LOADS,
        default=["gather"],
        help="how the kernel loads its code tiles (pallas_kernels/tq_attention.py: CODE_LOADS); "
        "paths other than gather are named pallas/<split>-<loads>",
    )
    p.add_argument(
        "--dot-precision",
        nargs="+",
        choices=DOT_PRECISIONS,
        default=[DOT_PRECISION],
        help="how the kernel multiplies its tiles (DOT_PRECISIONS); paths other than float32 are named "
        "pallas/<split>-<precision>",
    )
    p.add_argument(
        "--pages-per-step",
        type=positive_int,
        nargs="+",
        default=[],
        help="also time the kernel with these tile sizes (pages per loop step; those dividing the split), "
        "besides its default",
    )
    p.add_argument("--no-kernel", action="store_true", help="skip the Pallas kernel (slow when interpreted)")
    p.add_argument("--repeats", type=positive_int, default=20)
    p.add_argument("--inner", type=positive_int, default=8, help="calls chained in one jitted run per timed repeat")
    p.add_argument(
        "--copies", type=positive_int, default=4, help="pool copies the chained calls cycle through (L2 is 50-60 MB)"
    )
    p.add_argument("--bandwidth-mib", type=positive_int, default=None, help="default: 2048 on GPU, 256 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "out" / "bench_attention.json")
    p.add_argument("--no-record", action="store_true", help="do not record the figures (scripts/bench_record.py)")
    args = p.parse_args(argv)
    for _, context in args.cases:
        if context % args.page_size:
            p.error(f"context {context} is not a multiple of --page-size {args.page_size}")
    if args.head_dim % 8:
        p.error("--head-dim must be a multiple of 8 (the packed layout's chunk)")
    return args


def time_call(fn, *, repeats: int, inner: int) -> float:
    """Median seconds per call (see the module doc); `fn` takes no arguments."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = [fn() for _ in range(inner)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def measure_bandwidth(mib: int, *, repeats: int) -> float:
    """Bytes per second of a read-only reduction over `mib` MiB of device memory."""
    n = mib * (1 << 20) // 4
    x = jax.random.bits(jax.random.key(0), (n,), jnp.uint32)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.uint32))
    return x.nbytes / time_call(lambda: total(x), repeats=repeats, inner=3)


def make_case(batch: int, context: int, k_bits: int, v_bits: int, args) -> dict:
    """One layer's pools, `--copies` times (TurboQuant and bf16), and a decode step's inputs."""
    rng = np.random.default_rng(args.seed)
    hkv, dh, s = args.kv_heads, args.head_dim, args.page_size
    pages_per_row = context // s
    num_pages = 1 + batch * pages_per_row  # page 0 is the allocator's null page
    table = rng.permutation(np.arange(1, num_pages)).reshape(batch, pages_per_row).astype(np.int32)
    k_codec = TurboQuant(head_dim=dh, bits=k_bits, seed=args.seed)
    v_codec = TurboQuant(head_dim=dh, bits=v_bits, seed=args.seed + 1)
    kq, kn, *pool_keys = jax.random.split(jax.random.key(args.seed), 2 + args.copies)
    tq_copies, bf16_copies = [], []
    for key in pool_keys:
        kk, kv = jax.random.split(key)
        k_f32 = jax.random.normal(kk, (num_pages, 1, s, hkv, dh), jnp.float32) * 2
        v_f32 = jax.random.normal(kv, (num_pages, 1, s, hkv, dh), jnp.float32)
        tq_copies.append((k_codec.encode_tree(k_f32), v_codec.encode_tree(v_f32)))
        bf16_copies.append((k_f32.astype(jnp.bfloat16), v_f32.astype(jnp.bfloat16)))
        del k_f32, v_f32
    new = jax.random.normal(kn, (2, batch, 1, hkv, dh), jnp.float32)
    return {
        "q": jax.random.normal(kq, (batch, 1, hkv * args.group, dh), jnp.float32),
        "tq_copies": tq_copies,
        "bf16_copies": bf16_copies,
        "k_new": k_codec.encode_tree(new[0] * 2),
        "v_new": v_codec.encode_tree(new[1]),
        "new_bf16": new.astype(jnp.bfloat16),
        "table": jnp.asarray(table),
        "ctx_lens": jnp.full((batch,), context, jnp.int32),
        "num_new": jnp.ones((batch,), jnp.int32),
        "codecs": {"k_codec": k_codec, "v_codec": v_codec},
    }


def tq_bytes(case: dict, batch: int, context: int) -> int:
    """Bytes of packed context (codes and norms of keys and values) the rows must read."""
    per_token = sum(a.nbytes // (a.shape[0] * a.shape[2]) for pool in case["tq_copies"][0] for a in pool.values())
    return per_token * batch * context


def bf16_attention(q, k_pool, v_pool, k_new, v_new, table, ctx_lens, num_new, dtype=jnp.bfloat16):
    """The engine's path for an unquantized layer: gather the rows' pages, then the reference."""
    b, np_ = table.shape

    def gather(pool):
        return pool[table, 0].reshape(b, np_ * pool.shape[2], *pool.shape[3:]).astype(dtype)

    return paged_attention_reference(
        q.astype(dtype), k_new.astype(dtype), v_new.astype(dtype), gather(k_pool), gather(v_pool), ctx_lens, num_new
    )


def chained(step, inner: int):
    """A jitted run of `inner` calls of `step(q, pools)` back to back, over the pool copies in
    turn. Each call's query depends on the previous call's output, so no call can be skipped,
    hoisted or overlapped with the next, and the run's time over `inner` is one call's."""

    @jax.jit
    def run(q, copies):
        out = step(q, copies[0])
        for i in range(1, inner):
            out = step(q + out.astype(q.dtype) * 1e-30, copies[i % len(copies)])
        return out

    return run


def run_case(batch: int, context: int, k_bits: int, v_bits: int, args) -> dict:
    c = make_case(batch, context, k_bits, v_bits, args)
    q, table, ctx_lens, num_new, codecs = c["q"], c["table"], c["ctx_lens"], c["num_new"], c["codecs"]

    def tq_step(impl, **knobs):
        return lambda q, pools: impl(q, c["k_new"], c["v_new"], *pools, table, 0, ctx_lens, num_new, **codecs, **knobs)

    ref = np.asarray(jax.jit(tq_step(tq_paged_attention_reference))(q, c["tq_copies"][0]))
    result = {"batch": batch, "context": context, "k_bits": k_bits, "v_bits": v_bits}
    result["tq_bytes"] = tq_bytes(c, batch, context)
    result["bf16_bytes"] = 2 * batch * context * args.kv_heads * args.head_dim * 2
    timed = {}

    def check_and_time(name, step, copies, expected, tol):
        out = np.asarray(jax.jit(step)(q, copies[0]), np.float32)
        err = float(np.max(np.abs(out - expected)))
        if not np.isfinite(out).all() or err > tol:
            raise SystemExit(f"{name} at {batch}x{context}, bits {k_bits}:{v_bits}: max |diff| {err:.3g} > {tol}")
        run = chained(step, args.inner)
        seconds = time_call(lambda: run(q, copies), repeats=args.repeats, inner=1) / args.inner
        timed[name] = {"seconds": seconds, "max_abs_diff": err}
        print(f"  {name:>10}: {seconds * 1e6:10.1f} us   (max |diff| {err:.2e})", file=sys.stderr)

    check_and_time("xla", tq_step(tq_paged_attention_xla), c["tq_copies"], ref, 2e-3)
    if not args.no_kernel:
        splits = args.pages_per_split or [default_pages_per_split(batch, args.kv_heads, context // args.page_size)]
        for loads, pps, precision in itertools.product(args.code_loads, splits, args.dot_precision):
            suffix = ("" if loads == "gather" else f"-{loads}") + ("" if precision == "float32" else f"-{precision}")
            for tile in [None, *(n for n in args.pages_per_step if pps % n == 0)]:
                name = f"pallas/{pps}{'' if tile is None else f'x{tile}'}{suffix}"
                knobs = {"pages_per_step": tile, "code_loads": loads, "dot_precision": precision}
                step = tq_step(tq_paged_attention, pages_per_split=pps, **knobs)
                tol = 2e-2 if precision == "bf16" else 2e-3  # bf16 rounds the operands (~1% of the output)
                try:
                    check_and_time(name, step, c["tq_copies"], ref, tol)
                except Exception as e:  # noqa: BLE001 (compiler errors have no common type)
                    if loads == "gather" and precision == "float32":  # the plainest variant must build
                        raise
                    timed[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    print(f"  {name:>10}: failed to build or run: {timed[name]['error']}", file=sys.stderr)
    k_new16, v_new16 = c["new_bf16"]

    def bf16_step(dtype=jnp.bfloat16):
        return lambda q, pools: bf16_attention(q, *pools, k_new16, v_new16, table, ctx_lens, num_new, dtype=dtype)

    bf_ref = np.asarray(jax.jit(bf16_step(jnp.float32))(q, c["bf16_copies"][0]), np.float32)
    check_and_time("bf16", bf16_step(), c["bf16_copies"], bf_ref, 0.05)
    result["timings"] = timed
    kernels = {k: v for k, v in timed.items() if k.startswith("pallas/") and "seconds" in v}
    if kernels:
        best = min(kernels, key=lambda k: kernels[k]["seconds"])
        result["kernel_best"] = best
        result["kernel_seconds"] = kernels[best]["seconds"]
        result["kernel_speedup_vs_bf16"] = timed["bf16"]["seconds"] / kernels[best]["seconds"]
        result["kernel_bytes_per_second"] = result["tq_bytes"] / kernels[best]["seconds"]
    result["xla_speedup_vs_bf16"] = timed["bf16"]["seconds"] / timed["xla"]["seconds"]
    result["bf16_bytes_per_second"] = result["bf16_bytes"] / timed["bf16"]["seconds"]
    return result


def record(report: dict, command: str) -> None:
    """Records one result per case and bit pair (bench_record), keyed on the kernel variants
    the run timed: a run of other variants does not replace a row."""
    cfg, bandwidth = report["config"], report["bandwidth_bytes_per_second"]
    run = {"command": command, **bench_record.provenance(report["env"])}
    entries = []
    for r in report["results"]:
        t, kernel = r["timings"], r.get("kernel_seconds")
        config = {"case": f"{r['batch']} x {r['context']}", "K:V bits": f"{r['k_bits']}:{r['v_bits']}"}
        config["code loads"] = None if cfg["no_kernel"] else ", ".join(cfg["code_loads"])
        config["products"] = None if cfg["no_kernel"] else ", ".join(cfg["dot_precision"])
        kernel_bps = r["kernel_bytes_per_second"] if kernel else None
        figures = {
            "kernel us": bench_record.rounded(kernel * 1e6 if kernel else None, 1),
            "kernel variant": r.get("kernel_best"),
            "xla us": bench_record.rounded(t["xla"]["seconds"] * 1e6, 1),
            "bf16 us": bench_record.rounded(t["bf16"]["seconds"] * 1e6, 1),
            "kernel vs bf16 (x)": bench_record.rounded(r.get("kernel_speedup_vs_bf16"), 2),
            "kernel GB/s": bench_record.rounded(kernel_bps / 1e9 if kernel else None, 0),
            "kernel share of measured (%)": bench_record.rounded(100 * kernel_bps / bandwidth if kernel else None, 0),
            "measured GB/s": bench_record.rounded(bandwidth / 1e9, 0),
        }
        details = r | {"bandwidth_bytes_per_second": bandwidth, "kernel_interpreted": report["kernel_interpreted"]}
        entries.append(bench_record.result("attention", config, figures, details=details, **run))
    bench_record.record(entries)


def main(argv=None) -> int:
    args = parse_args(argv)
    on_cpu = jax.default_backend() == "cpu"
    mib = args.bandwidth_mib or (256 if on_cpu else 2048)
    bandwidth = measure_bandwidth(mib, repeats=args.repeats)
    print(f"memory bandwidth (sum over {mib} MiB): {bandwidth / 1e9:.1f} GB/s", file=sys.stderr)
    results = []
    for batch, context in args.cases:
        for k_bits, v_bits in args.bits:
            print(f"batch {batch} x context {context}, K/V bits {k_bits}:{v_bits}", file=sys.stderr)
            results.append(run_case(batch, context, k_bits, v_bits, args))
    report = {
        "env": bench_record.environment(),
        "kernel_interpreted": on_cpu,
        "bandwidth_bytes_per_second": bandwidth,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(f"{'case':>14} {'bits':>5} {'kernel us':>10} {'xla us':>9} {'bf16 us':>9} {'kernel/bf16':>11} {'% bw':>6}")
    for r in results:
        k = r.get("kernel_seconds")
        print(
            f"{r['batch']:>5} x {r['context']:<6} {r['k_bits']}:{r['v_bits']:<3} "
            f"{k * 1e6 if k else float('nan'):>10.1f} {r['timings']['xla']['seconds'] * 1e6:>9.1f} "
            f"{r['timings']['bf16']['seconds'] * 1e6:>9.1f} {r.get('kernel_speedup_vs_bf16', float('nan')):>10.2f}x "
            f"{r['kernel_bytes_per_second'] / bandwidth if k else float('nan'):>6.0%}"
        )
    if not args.no_record:
        record(report, "python " + shlex.join(["scripts/bench_attention.py", *(argv or sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
