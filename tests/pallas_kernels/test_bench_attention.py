"""scripts/bench_attention.py on a tiny case: it checks every path against the reference
before timing, so a wrong path stops the benchmark instead of being timed."""

import json
import sys

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "scripts"))
import bench_attention  # noqa: E402

TINY = ["--cases", "2x32", "--bits", "3:2", "--pages-per-split", "1", "--repeats", "1", "--inner", "2"]
TINY += ["--copies", "2", "--bandwidth-mib", "1", "--page-size", "8", "--no-record", "--dot-precision", "float32"]


def test_tiny_run_reports_every_path(tmp_path):
    out = tmp_path / "attn.json"
    assert bench_attention.main([*TINY, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (r,) = report["results"]
    assert set(r["timings"]) == {"xla", "pallas/1", "bf16"}
    assert all(t["seconds"] > 0 for t in r["timings"].values())
    assert r["timings"]["pallas/1"]["max_abs_diff"] < 2e-3
    # 3 + 2 bits per coordinate of 64, plus a float16 norm per key and per value, per KV head.
    assert r["tq_bytes"] == 2 * 32 * 3 * ((3 + 2) * 64 // 8 + 2 * 2)
    assert r["bf16_bytes"] == 2 * 32 * 3 * 64 * 2 * 2
    assert report["bandwidth_bytes_per_second"] > 0


def test_pages_per_step_adds_a_timed_path_where_it_divides_the_split(tmp_path):
    out = tmp_path / "attn.json"
    argv = [*TINY, "--pages-per-split", "2", "--pages-per-step", "1", "2", "4", "--out", str(out)]
    assert bench_attention.main(argv) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert set(r["timings"]) == {"xla", "pallas/2", "pallas/2x1", "pallas/2x2", "bf16"}
    assert all(r["timings"][k]["max_abs_diff"] < 2e-3 for k in ("pallas/2x1", "pallas/2x2"))


def test_code_loads_variants_are_timed_and_one_that_fails_to_build_is_reported(tmp_path, monkeypatch):
    out = tmp_path / "attn.json"
    argv = [*TINY, "--code-loads", "gather", "planes", "--out", str(out)]
    assert bench_attention.main(argv) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert set(r["timings"]) == {"xla", "pallas/1", "pallas/1-planes", "bf16"}
    assert r["timings"]["pallas/1-planes"]["max_abs_diff"] < 2e-3

    real = bench_attention.tq_paged_attention

    def broken(*a, code_loads="gather", **kw):
        if code_loads == "planes":
            raise RuntimeError("ptxas: too many resources requested")
        return real(*a, code_loads=code_loads, **kw)

    monkeypatch.setattr(bench_attention, "tq_paged_attention", broken)
    assert bench_attention.main(argv) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert "too many resources" in r["timings"]["pallas/1-planes"]["error"]
    assert r["kernel_best"] == "pallas/1"


def test_dot_precisions_are_timed_under_their_own_names_at_the_default_split(tmp_path, monkeypatch):
    """Without --pages-per-split the kernel's own split is timed (`default_pages_per_split`:
    4 pages for 2 rows of 32 tokens); each precision but float32 gets a suffix, and bf16 is
    held to its own, looser bound."""
    from pallas_kernels.tq_attention import default_pages_per_split

    out = tmp_path / "attn.json"
    split_at = TINY.index("--pages-per-split")
    argv = TINY[:split_at] + TINY[split_at + 2 : -2]  # no split, no precision
    argv += ["--dot-precision", "float32", "bf16x3", "bf16", "--out", str(out)]
    assert bench_attention.main(argv) == 0
    (r,) = json.loads(out.read_text())["results"]
    split = default_pages_per_split(2, 3, 32 // 8)
    names = {f"pallas/{split}", f"pallas/{split}-bf16x3", f"pallas/{split}-bf16"}
    assert set(r["timings"]) == {"xla", "bf16"} | names
    assert r["timings"][f"pallas/{split}-bf16x3"]["max_abs_diff"] < 2e-3
    assert 1e-4 < r["timings"][f"pallas/{split}-bf16"]["max_abs_diff"] < 2e-2

    real = bench_attention.tq_paged_attention

    def broken(*a, dot_precision="float32", **kw):
        if dot_precision == "bf16":
            raise RuntimeError("failed to legalize bf16 dot")
        return real(*a, dot_precision=dot_precision, **kw)

    monkeypatch.setattr(bench_attention, "tq_paged_attention", broken)
    assert bench_attention.main(argv) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert "legalize" in r["timings"][f"pallas/{split}-bf16"]["error"]
    assert r["kernel_best"] in names - {f"pallas/{split}-bf16"}


def test_chained_calls_cycle_the_copies_and_depend_on_each_other():
    def step(q, pools):
        return q + pools

    copies = (jnp.float32(1e30), jnp.float32(5))
    q = jnp.float32(0)
    # 2 calls: copy 0 gives 1e30, whose 1e-30 share (1) feeds the call on copy 1: 1 + 5.
    assert abs(float(bench_attention.chained(step, 2)(q, copies)) - 6) < 1e-5
    # A third call is back on copy 0.
    assert float(bench_attention.chained(step, 3)(q, copies)) == pytest.approx(1e30, rel=1e-6)


def test_a_wrong_path_stops_before_timing(monkeypatch, tmp_path):
    right = bench_attention.tq_paged_attention_xla

    def off_by_a_little(*args, **kwargs):
        return right(*args, **kwargs) + jnp.float32(0.01)

    monkeypatch.setattr(bench_attention, "tq_paged_attention_xla", off_by_a_little)
    with pytest.raises(SystemExit, match="xla at 2x32"):
        bench_attention.main([*TINY, "--no-kernel", "--out", str(tmp_path / "a.json")])


@pytest.mark.parametrize(
    "argv, message",
    [(["--cases", "32"], "BATCHxCONTEXT"), (["--bits", "9:4"], "1..8"), (["--cases", "2x30"], "multiple of")],
)
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_attention.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def attention_report(us: float, code_loads: list[str], no_kernel: bool = False) -> dict:
    timings = {"xla": {"seconds": 400e-6}, "bf16": {"seconds": 330e-6}}
    result = {"batch": 32, "context": 8192, "k_bits": 6, "v_bits": 5, "timings": timings}
    if not no_kernel:
        seconds = us * 1e-6
        result |= {"kernel_best": "pallas/64", "kernel_seconds": seconds, "kernel_speedup_vs_bf16": 330e-6 / seconds}
        result["kernel_bytes_per_second"] = 70e6 / seconds
    env = {"date": "2026-11-26", "device": "NVIDIA H200", "jax": "0.11.2", "python": "3.12.3"}
    config = {"no_kernel": no_kernel, "code_loads": code_loads, "dot_precision": ["float32"]}
    return {"env": env, "kernel_interpreted": False, "bandwidth_bytes_per_second": 4.1e12, "config": config} | {
        "results": [result]
    }


def test_a_row_per_case_and_the_variants_timed(tmp_path, monkeypatch):
    """A run of other kernel variants gets a row of its own; the same variants again replace theirs."""
    import bench_record

    markdown = tmp_path / "BENCHMARKS.md"
    markdown.write_text("# Benchmarks\n")
    monkeypatch.setattr(bench_record, "LOG", tmp_path / "log.jsonl")
    monkeypatch.setattr(bench_record, "MARKDOWN", markdown)
    bench_attention.record(attention_report(566.7, ["gather"]), "first")
    bench_attention.record(attention_report(530.4, ["gather", "planes"]), "planes")
    bench_attention.record(attention_report(535.9, ["gather"]), "again")
    bench_attention.record(attention_report(0, [], no_kernel=True), "xla only")
    rows = [line.split(" | ")[1:12] for line in markdown.read_text().splitlines() if line.startswith("| NVIDIA")]
    assert rows == [
        ["32 x 8192", "6:5", "gather", "float32", "535.9", "pallas/64", "400", "330", "0.62", "131", "3"],
        ["32 x 8192", "6:5", "gather, planes", "float32", "530.4", "pallas/64", "400", "330", "0.62", "132", "3"],
        ["32 x 8192", "6:5", "–", "–", "–", "–", "400", "330", "–", "–", "–"],
    ]
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 4
