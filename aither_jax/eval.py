"""Evaluation entry points: `python -m aither_jax.eval <command>`.

    perplexity  quality of KV cache formats on a text: perplexity with every position attending
                to the cache as stored, and against bf16 KV in the same run the perplexity
                change, mean KL divergence and top-1 agreement; a table, JSON and a plot.
    codec       TurboQuant codec quality on random unit vectors: per-vector MSE, inner-product
                error and the ratio to the 4^-b lower bound.
    allocate    per-layer key/value bits for compression targets: measures each layer's
                sensitivity, allocates bits greedily, scores the result.
    capacity    KV bytes per token for each --kv-cache-dtype of a model, and how many tokens fit
                in a memory budget.
    acceptance  speculative decoding on chat prompts: mean tau (tokens committed per target
                verify pass, bonus included), its histogram, draft and accepted counts, and the
                wall-clock speedup over plain decoding of the same prompts in the same run.
    fidelity    greedy chat answers with KV cache formats against an unquantized cache.
    residency   bounded residency: KL divergence and top-1 agreement against the full cache
                on a long text for each resident share and scorer, and passkey retrieval; a
                table, JSON and a plot.

Exit codes: 0 success, 2 bad usage, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import sys
import time

import numpy as np
from tqdm.auto import tqdm

from aither_jax.cli_args import (
    PLOT_SUFFIXES,
    HelpFormatter,
    add_json_argument,
    add_model_argument,
    add_version_argument,
    float_in,
    input_file,
    int_in,
    kv_spec_or_auto,
    output_file,
)
from aither_jax.cli_output import INTERRUPTED, emit_json, run_command, run_info, write_file
from aither_jax.context.prompt import file_prompts, read_prompts, text_prompt
from aither_jax.quant.scoring import FormatScorer
from models.config import ModelConfig
from models.gguf_file import GGUFError, GGUFFile
from models.kv_spec import MAX_SINK_TOKENS, KVSpec, parse_kv_spec
from models.registry import resolve_model

PROG = "python -m aither_jax.eval"


def capacity_rows(
    cfg: ModelConfig,
    specs: list[KVSpec],
    memory_bytes: int,
    *,
    context_length: int = 4096,
    num_seqs: int = 1,
    host_bytes: int = 0,
    disk_bytes: int = 0,
) -> list[dict]:
    """One row per format: bytes per token (the issue's formula), compression against bf16 per
    token and at `context_length` tokens of one sequence (sink tokens are a fixed cost per
    sequence), the tokens that fit in the device budget beside `num_seqs` sequences' fixed
    costs, and the tokens the host and disk tiers address (they keep pages in their stored
    format, so a quantized format multiplies them too; sinks stay on the device)."""
    bf16 = parse_kv_spec("bf16").bytes_per_token(cfg)
    rows = []
    for spec in specs:
        per_token, per_seq = spec.bytes_per_token(cfg), spec.bytes_per_sequence(cfg)
        rows.append(
            {
                "kv_cache_dtype": spec.name,
                "bytes_per_token": per_token,
                "bytes_per_sequence": per_seq,  # sink tokens, per slot
                "compression_vs_bf16": round(bf16 / per_token, 3),
                "context_length": context_length,
                "compression_at_context": round(bf16 * context_length / (per_token * context_length + per_seq), 3),
                "num_seqs": num_seqs,
                "tokens_in_budget": max(0, memory_bytes - num_seqs * per_seq) // per_token,
                "budget_bytes": memory_bytes,
                "host_tokens": host_bytes // per_token,
                "disk_tokens": disk_bytes // per_token,
            }
        )
    return rows


def calibration_text() -> str:
    """The default fitting text: the standard library's docstring paragraphs (those the draft
    trainer draws prompts from, aither_jax/train_draft.py), in a fixed order. Not the license
    texts that the quality measurements use."""
    from aither_jax.speculative.train.prompts import stdlib_docs

    return "\n\n".join(para for _, _, para in stdlib_docs())


def resolve_specs(specs: list[KVSpec | str], model: str, cfg: ModelConfig | None = None) -> list[KVSpec]:
    """--kv-cache-dtype values with "auto" and "turboquant" replaced by the model's formats;
    with `cfg`, each checked against the model first (ValueError for a layer it lacks)."""
    from models.registry import KV_ALIASES, resolve_kv_cache_dtype

    resolved = [parse_kv_spec(resolve_kv_cache_dtype(s, model)) if s in KV_ALIASES else s for s in specs]
    for spec in resolved if cfg is not None else ():
        spec.bytes_per_token(cfg)  # resolves each layer's bits
    return resolved


def run_perplexity(args) -> tuple[list[dict], int]:
    """(a row per format, how many were asked for): Ctrl-C after the first row ends the run
    with the rows scored so far."""
    scorer = FormatScorer(args.model, args.dtype, args.text_file, args.max_tokens, args.chunk, args.attention)
    specs = resolve_specs(args.kv_cache_dtype, args.model, scorer.llm.config)  # checked before scoring
    rows = []
    try:
        for spec in tqdm(specs, desc="scoring KV formats", unit="format"):
            rows.append(scorer.score(spec))
    except KeyboardInterrupt:
        if not rows:
            raise
    return rows, len(specs)


def plot_label(name: str) -> str:
    """Per-layer formats are long: label them by their base widths, starred."""
    return name if "@" not in name else re.match(r"tq(-k\d+v\d+|\d)", name).group(0) + "*"


def write_plot(rows: list[dict], path: str) -> None:
    """Quality (perplexity change, KL) against bytes per token, one point per format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in (
        (axes[0], "perplexity_change_pct", "perplexity change vs bf16 KV (%)"),
        (axes[1], "kl_divergence", "mean KL divergence vs bf16 KV"),
    ):
        for r in rows:
            ax.scatter(r["bytes_per_token"], r[key])
            ax.annotate(plot_label(r["kv_cache_dtype"]), (r["bytes_per_token"], r[key]), fontsize=8)
        ax.set_xlabel("KV bytes per token")
        ax.set_ylabel(label)
        ax.set_xscale("log")
        # Formats span orders of magnitude in quality; symlog keeps the near-lossless ones apart.
        ax.set_yscale("symlog", linthresh=0.5 if key == "perplexity_change_pct" else 0.005)
        if key == "kl_divergence":
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(f"{rows[0]['model']}: KV cache formats, {rows[0]['num_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


KV_FORMATS_HELP = (
    "one or more formats: auto (the model's default), turboquant (its measured per-layer TurboQuant format), "
    "bf16, fp32, tq<bits>, tq-k<bits>v<bits>, "
    "with -qjlk/-qjlv/-qjl and the modifiers -b<n>, -s<n>, -k<bits>@<layers>, -v<bits>@<layers>"
)


def add_text_arguments(parser: argparse.ArgumentParser, *, several: bool = False) -> None:
    """The arguments of commands that score KV formats on a text (checked by `run_on_text`);
    with `several`, --text-file takes one or more texts."""
    text = input_file("--text-file", utf8=True)
    if several:
        parser.add_argument("--text-file", nargs="+", type=text, required=True, help="UTF-8 texts to fit on")
    else:
        parser.add_argument("--text-file", type=text, required=True, help="UTF-8 text to score")
    parser.add_argument(
        "--max-tokens", type=int_in("--max-tokens", 2, 8192), default=1024, help="tokens of the text to use"
    )
    parser.add_argument("--chunk", type=int_in("--chunk", 16, 1024), default=256, help="prefill chunk (power of two)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    add_version_argument(p)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)
        parser.set_defaults(parser=parser)  # its usage errors print its own usage line
        return parser

    ppl = command("perplexity", "quality of KV cache formats against bf16 KV on a text")
    add_model_argument(ppl)
    ppl.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        type=kv_spec_or_auto,
        required=True,
        help=KV_FORMATS_HELP,
    )
    add_text_arguments(ppl)
    ppl.add_argument(
        "--attention",
        choices=("reference", "xla", "pallas", "auto"),
        default="reference",
        help="how quantized pages are read: decoded (reference), or in the rotated domain as LLM reads them "
        "(xla: jnp; pallas: the kernels, interpreted on CPU; auto: LLM's choice for this backend)",
    )
    ppl.add_argument(
        "--plot", type=output_file("--plot", PLOT_SUFFIXES, empty_skips=True), default=None, metavar="FILE",
        help="write the quality plot (perplexity change and KL against bytes per token) here ('': none)",
    )  # fmt: skip
    add_json_argument(ppl, "one object per format as JSON lines")
    alloc = command("allocate", "per-layer key/value bits for a compression target, from measurements")
    add_model_argument(alloc)
    add_text_arguments(alloc, several=True)
    alloc.add_argument(
        "--held-out-file",
        nargs="+",
        type=input_file("--held-out-file", utf8=True),
        default=[],
        help="texts the plans are also scored on, never used to fit them",
    )
    alloc.add_argument(
        "--compression",
        type=float_in("--compression", 1.0, 8.0),
        nargs="+",
        default=[3.0],
        help="one or more targets: bf16 bytes / format bytes",
    )
    alloc.add_argument("--min-bits", type=int_in("--min-bits", 2, 8), default=3, help="fewest bits any layer gets")
    alloc.add_argument("--probe-key-bits", type=int_in("--probe-key-bits", 2, 8), default=4)
    alloc.add_argument("--probe-value-bits", type=int_in("--probe-value-bits", 2, 8), default=3)
    alloc.add_argument(
        "--key-transform", action="store_true", help="allocate for the -pc formats (keys through the fitted transform)"
    )
    alloc.add_argument(
        "--sink-tokens",
        type=int_in("--sink-tokens", 0, MAX_SINK_TOKENS),
        default=0,
        help="probe and plan with the first N tokens of each sequence unquantized (the -s<N> suffix)",
    )
    alloc.add_argument(
        "--probes-file",
        type=output_file("--probes-file"),
        help="JSON lines file: each probe's result is appended as it is measured, and a rerun with the "
        "same texts and settings reuses the ones found (resumes an interrupted run)",
    )
    add_json_argument(alloc, "the probes and plans")
    codec = command("codec", "TurboQuant codec quality on random unit vectors")
    codec.add_argument("--head-dim", type=int_in("--head-dim", 8, 1024), default=128, help="a power of two")
    codec.add_argument(
        "--bits", type=_codec_bits, nargs="+", default=[2, 3, 4], help="1..8, or 1.5..7.5 for the split-group format"
    )
    codec.add_argument("--rotation", choices=("haar", "hadamard"), default="haar")
    codec.add_argument("--codebook", choices=("exact", "gaussian"), default="exact")
    codec.add_argument("--qjl", action="store_true", help="add the 1-bit QJL residual")
    codec.add_argument("--num-vectors", type=int_in("--num-vectors", 100, 1_000_000), default=10_000)
    add_json_argument(codec, "one object per bit width as JSON lines")
    acc = command("acceptance", "speculative decoding: tau and speedup over plain decoding")
    add_model_argument(acc)
    acc.add_argument("--speculative", choices=("dflash", "ngram"), required=True)
    acc.add_argument(
        "--prompts",
        type=input_file("--prompts"),
        required=True,
        help='JSON lines, each {"messages": [...]} or {"prompt": "..."}',
    )
    acc.add_argument("--block-size", type=int_in("--block-size", 2, 64), default=None, help="drafts + 1 per step")
    acc.add_argument("--steps", type=int_in("--steps", 1, 63), default=None, help="dflash denoising steps (default 1)")
    acc.add_argument(
        "--adaptive", action="store_true", help="choose drafts per step (up to the block) from measured speed"
    )
    acc.add_argument(
        "--prompt-lookup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="dflash: rows with an n-gram match take prompt lookup's drafts (default on; off: the draft alone)",
    )
    acc.add_argument(
        "--tree",
        type=int_in("--tree", 0, 63),
        default=None,
        help="dflash: verify a tree of this many drafted nodes; 0: a chain (default: 3 on CPU, else a chain)",
    )
    acc.add_argument(
        "--draft",
        type=input_file("--draft"),
        default=None,
        help="dflash draft file (default: the one shipped for the model)",
    )
    acc.add_argument("--max-tokens", type=int_in("--max-tokens", 1), default=128)
    acc.add_argument("--max-prompts", type=int_in("--max-prompts", 1), default=None)
    acc.add_argument("--temperature", type=float_in("--temperature", 0.0, 100.0), default=0.0)
    acc.add_argument("--batch-size", type=int_in("--batch-size", 1, 256), default=1, help="sequences decoded together")
    acc.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    acc.add_argument("--kv-cache-dtype", type=kv_spec_or_auto, default="auto")
    add_json_argument(acc, "the report")
    fid = command("fidelity", "greedy chat answers with KV cache formats against unquantized KV")
    add_model_argument(fid)
    fid.add_argument("--kv-cache-dtype", nargs="+", type=kv_spec_or_auto, required=True, help=KV_FORMATS_HELP)
    fid.add_argument(
        "--prompts",
        type=input_file("--prompts"),
        default=None,
        help='prompt set: a JSON object {"chat": [prompt, ...], "factual": [{"question": ..., "answers": [...]}]} '
        "(default: aither_jax/quant/fidelity_prompts.json)",
    )
    fid.add_argument("--max-tokens", type=int_in("--max-tokens", 1, 512), default=24, help="reply tokens compared")
    fid.add_argument("--batch", type=int_in("--batch", 1, 64), default=8, help="requests decoded together")
    add_json_argument(fid, "the report (every differing reply too)")
    res = command("residency", "bounded residency: KL and passkey retrieval against the full cache")
    add_model_argument(res)
    res.add_argument(
        "--text-file",
        type=input_file("--text-file", utf8=True),
        default=None,
        help="long UTF-8 text (default: the Python language reference)",
    )
    res.add_argument("--num-tokens", type=int_in("--num-tokens", 256, 1 << 20), default=4096)
    res.add_argument(
        "--residency", type=float_in("--residency", 0.0, 1.0, low_open=True), nargs="+", default=[0.1, 0.25, 0.5],
        help="resident shares of the context to measure",
    )  # fmt: skip
    scorers = ["attention", "qk", "lru", "window"]
    res.add_argument("--scorer", nargs="+", choices=scorers, default=scorers, help="residency scorers to measure")
    res.add_argument("--tau", type=int_in("--tau", 1), default=64, help="reselect every this many tokens")
    res.add_argument("--stride", type=int_in("--stride", 1), default=4, help="score every this many positions")
    res.add_argument(
        "--passkey-lengths", type=int_in("--passkey-lengths", 64), nargs="*", default=[2048, 4096],
        help="prompt lengths of the passkey test (kept where the full cache retrieves at every depth)",
    )  # fmt: skip
    res.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    add_json_argument(res, "the report")
    res.add_argument(
        "--plot", type=output_file("--plot", PLOT_SUFFIXES, empty_skips=True), default=None, metavar="FILE",
        help="plot KL against the resident share here",
    )  # fmt: skip
    fit = command("fit-key-transform", "fit the query-aware key transform of the -pc KV formats")
    add_model_argument(fit)
    fit.add_argument(
        "--text-file", type=input_file("--text-file", utf8=True), default=None,
        help="fitting text (default: standard-library docstrings)",
    )  # fmt: skip
    fit.add_argument("--max-tokens", type=int_in("--max-tokens", 64, 8192), default=2048)
    where = fit.add_mutually_exclusive_group()
    where.add_argument(
        "--out", type=output_file("--out", (".npz",)), default=None, metavar="FILE",
        help="where to write it (default: out/kv_transforms/<model>.npz)",
    )  # fmt: skip
    where.add_argument(
        "--install",
        action="store_true",
        help="write it where the model's -pc formats load it from: models/assets/kv_transforms/<name>.npz for a "
        "registered model (replacing the shipped one), <file>.gguf.npz for a model file",
    )
    add_json_argument(fit, "the report")
    cap = command("capacity", "KV bytes per token and tokens per memory budget")
    add_model_argument(cap)
    cap.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        type=kv_spec_or_auto,
        default=["auto", *(parse_kv_spec(n) for n in ("bf16", "tq8", "tq6", "tq-k6v4", "tq4", "tq3", "tq2"))],
        help=KV_FORMATS_HELP,
    )
    cap.add_argument(
        "--memory-gib",
        type=float_in("--memory-gib", 0, 1 << 20, low_open=True),
        default=1.0,
        help="KV memory budget in GiB",
    )
    cap.add_argument(
        "--context-length",
        type=int_in("--context-length", 1, 1 << 24),
        default=4096,
        help="tokens per sequence for the compression that counts per-sequence bytes (sink tokens)",
    )
    cap.add_argument(
        "--num-seqs",
        type=int_in("--num-seqs", 1, 1 << 20),
        default=1,
        help="sequences whose fixed bytes (sink tokens) come out of the budget first",
    )
    cap.add_argument(
        "--host-gib", type=float_in("--host-gib", 0, 1 << 20), default=0.0, help="host tier (--kv-offloading-size)"
    )
    cap.add_argument(
        "--disk-gib", type=float_in("--disk-gib", 0, 1 << 30), default=0.0, help="disk tier (--kv-disk-size)"
    )
    add_json_argument(cap, "one object per format as JSON lines")
    return p


def fit_key_transform_main(parser: argparse.ArgumentParser, args) -> int:
    """Fits M per layer and KV head on the text's post-RoPE queries and keys (float32 weights)
    and writes it with its provenance; prints the predicted score-error ratio per layer."""
    import jax.numpy as jnp

    import aither_jax as aj
    from models.kv_transform import fit_key_transforms, transform_path
    from models.llama import queries_and_keys

    out = transform_path(args.model) if args.install else args.out or default_transform_out(args.model)
    try:
        output_file("--install" if args.install else "--out", (".npz",))(str(out))  # before the work
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    try:
        llm = aj.LLM(args.model, dtype="float32", kv_cache_dtype="bf16", max_num_seqs=1, max_model_len=64)
    except ValueError as e:
        parser.error(str(e))
    if args.text_file is None:
        text, source = calibration_text(), "standard-library docstrings (aither_jax/train_draft.py stdlib_docs)"
    else:
        with open(args.text_file, encoding="utf-8") as f:
            text, source = f.read(), os.path.basename(args.text_file)
    ids = text_prompt(llm.tokenizer, text).ids[: args.max_tokens]
    cfg = llm.config
    q, k = (np.asarray(a) for a in queries_and_keys(llm.engine.weights, jnp.asarray(ids, jnp.int32), cfg=cfg))
    m, ratios = fit_key_transforms(q, k, cfg.num_heads // cfg.num_kv_heads)
    command = f"{PROG} fit-key-transform --model {args.model} --max-tokens {args.max_tokens}"
    if args.text_file is not None:
        command += f" --text-file {args.text_file}"
    write_file(
        out,
        lambda tmp: np.savez(
            tmp, key_transform=m.astype(np.float16), source=np.asarray(source), num_tokens=np.asarray(len(ids)),
            command=np.asarray(command),
        ),
    )  # fmt: skip
    report = {
        "model": args.model,
        "out": str(out),
        "source": source,
        "num_tokens": len(ids),
        "score_error_ratio_mean": float(ratios.mean()),
        "score_error_ratio_per_layer": [round(float(r), 4) for r in ratios.mean(1)],
    }
    if args.json:
        report_json(args, report)
    if args.json != "-":
        print(f"{args.model}: key transform from {len(ids)} tokens of {source} -> {out}")
        print(f"predicted score error vs identity: {report['score_error_ratio_mean']:.3f} (mean over layers and heads)")
        if not args.install:
            print(f"the -pc formats read {transform_path(args.model)}; --install writes there")
    return 0


def default_transform_out(model: str) -> pathlib.Path:
    """out/kv_transforms/<model>.npz; a model file is named by its stem."""
    name = pathlib.Path(model).stem if model.endswith(".gguf") else model
    return pathlib.Path("out", "kv_transforms", f"{name}.npz")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv
    commands = {
        "perplexity": perplexity_main,
        "codec": codec_main,
        "allocate": allocate_main,
        "acceptance": acceptance_main,
        "fit-key-transform": fit_key_transform_main,
        "fidelity": fidelity_main,
        "residency": residency_main,
        "capacity": capacity_main,
    }
    return commands[args.command](args.parser, args)


def report_json(args, objects: dict | list[dict]) -> None:
    """`--json [FILE]`: the report with the run that made it (cli_output.run_info)."""
    emit_json(args.json, objects, run_info(PROG, args.argv))


def capacity_main(parser: argparse.ArgumentParser, args) -> int:
    try:
        cfg = ModelConfig.from_gguf(GGUFFile(resolve_model(args.model)))
        # "auto" names one of the listed formats for most models: one row each.
        specs = list({spec.name: spec for spec in resolve_specs(args.kv_cache_dtype, args.model)}.values())
        rows = capacity_rows(
            cfg, specs, int(args.memory_gib * (1 << 30)), context_length=args.context_length,
            num_seqs=args.num_seqs, host_bytes=int(args.host_gib * (1 << 30)),
            disk_bytes=int(args.disk_gib * (1 << 30)),
        )  # fmt: skip
    except (ValueError, GGUFError) as e:  # a format naming layers the model lacks, a bad model file
        parser.error(str(e))
    if args.json:
        report_json(args, [{"model": args.model, **row} for row in rows])
    if args.json == "-":
        return 0
    print(
        f"{args.model}: {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x head_dim {cfg.head_dim}, "
        f"budget {args.memory_gib:g} GiB for {args.num_seqs} sequence(s), host {args.host_gib:g} GiB, "
        f"disk {args.disk_gib:g} GiB; "
        f"'at N': compression with the per-sequence bytes at {args.context_length:,} tokens"
    )
    w = max(16, *(len(r["kv_cache_dtype"]) for r in rows))
    print(
        f"{'kv_cache_dtype':<{w}} {'bytes/token':>12} {'vs bf16':>8} {'at N':>7} {'tokens in budget':>17} "
        f"{'bytes/sequence':>15} {'host tokens':>14} {'disk tokens':>15}"
    )
    for r in rows:
        print(
            f"{r['kv_cache_dtype']:<{w}} {r['bytes_per_token']:>12,} {r['compression_vs_bf16']:>7.2f}x "
            f"{r['compression_at_context']:>6.2f}x {r['tokens_in_budget']:>17,} {r['bytes_per_sequence']:>15,} "
            f"{r['host_tokens']:>14,} {r['disk_tokens']:>15,}"
        )
    return 0


def _codec_bits(text: str) -> int | float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--bits must be a number, got {text!r}") from None
    if value * 2 != int(value * 2) or not 1 <= value <= 8:
        raise argparse.ArgumentTypeError(f"--bits must be 1..8 or a half-integer between them, got {text}")
    return int(value) if value == int(value) else value


def codec_main(parser: argparse.ArgumentParser, args) -> int:
    from pallas_kernels.turboquant import SplitTurboQuant, TurboQuant, is_split_bits

    if args.head_dim & (args.head_dim - 1):
        parser.error(f"--head-dim must be a power of two, got {args.head_dim}")
    codecs = []  # built before any is measured, so a bad combination fails at once
    for bits in args.bits:
        if is_split_bits(bits) and ((args.rotation, args.codebook) != ("haar", "exact") or args.head_dim < 16):
            parser.error("the split-group format (half-integer --bits) uses Haar rotations, exact codebooks, d >= 16")
        try:
            if is_split_bits(bits):
                codecs.append((bits, SplitTurboQuant(head_dim=args.head_dim, bits=bits, qjl=args.qjl)))
            else:
                codecs.append(
                    (
                        bits,
                        TurboQuant(args.head_dim, bits, rotation=args.rotation, codebook=args.codebook, qjl=args.qjl),
                    )
                )
        except ValueError as e:
            parser.error(f"--head-dim {args.head_dim} --bits {bits}: {e}")
    reports = []
    for bits, tq in codecs:
        report = {"head_dim": args.head_dim, "bits": bits, "rotation": args.rotation, "codebook": args.codebook}
        report |= {"qjl": args.qjl, **tq.validate(num_vectors=args.num_vectors)}
        reports.append(report)
        if args.json != "-":
            print(
                f"d={args.head_dim} {bits} bit{'s' if bits > 1 else ''} ({args.rotation}, {args.codebook}"
                f"{', qjl' if args.qjl else ''}): mse {report['mse']:.5f} = {report['mse_ratio']:.2f} x 4^-b, "
                f"inner-product rmse {report['inner_product_rmse']:.5f}, {report['bytes_per_vector']} B/vector"
            )
    if args.json:
        report_json(args, reports)
    return 0


def run_on_text(parser: argparse.ArgumentParser, args, run):
    """Checks the text-scoring arguments, then `run(args)`; bad input exits with code 2."""
    if args.chunk & (args.chunk - 1):
        parser.error(f"--chunk must be a power of two, got {args.chunk}")
    try:
        return run(args)
    except (ValueError, GGUFError) as e:
        parser.error(str(e))


def allocate_main(parser: argparse.ArgumentParser, args) -> int:
    from aither_jax.quant.allocation import run_allocate

    report = run_on_text(parser, args, run_allocate)
    if args.json:
        report_json(args, report)
    if args.json == "-":
        return 0
    print(f"{args.model}: fitted on the first {args.max_tokens} tokens of {', '.join(report['texts'])}")
    print(
        f"per-layer KL at the probe widths (keys {args.probe_key_bits} bits, values {args.probe_value_bits} bits),"
        " mean over the texts:"
    )
    for side in ("k", "v"):
        kls = [p["kl_divergence"] for p in report["probes"] if p["side"] == side]
        print(f"  {side}: " + " ".join(f"{x:.4f}" for x in kls))
    for plan in report["plans"]:
        print(
            f"{plan['kv_cache_dtype']}\n  target {plan['target_compression']:g}x: {plan['bytes_per_token']:,} B/token "
            f"({plan['compression_vs_bf16']:.2f}x), predicted KL {plan['predicted_kl_divergence']:.4f}"
        )
        for row in plan["by_text"]:
            print(
                f"    {'held out' if row['held_out'] else 'fitted':8s} {os.path.basename(row['text_file'])}: KL "
                f"{row['kl_divergence']:.4f}, perplexity change {row['perplexity_change_pct']:+.2f}%, "
                f"top-1 {row['top1_agreement']:.1%}"
            )
    return 0


def fidelity_main(parser: argparse.ArgumentParser, args) -> int:
    from aither_jax.quant import fidelity

    prompts = args.prompts or fidelity.PROMPTS
    try:
        fidelity.load_prompts(prompts)  # the prompt set and every format are checked before any decoding
        cfg = ModelConfig.from_gguf(GGUFFile(resolve_model(args.model)))
        resolve_specs(args.kv_cache_dtype, args.model, cfg)
        requested = [f if isinstance(f, str) else f.name for f in args.kv_cache_dtype]  # "auto" stays "auto"
        report = fidelity.run_fidelity(
            args.model, requested, prompts=prompts, max_tokens=args.max_tokens,
            batch=args.batch, progress=True,
        )  # fmt: skip
    except (ValueError, GGUFError) as e:
        parser.error(str(e))
    if args.json:
        report_json(args, report)
    if args.json != "-":
        print(fidelity.table(report))
    if args.json not in (None, "-"):
        print(f"report: {args.json}")
    return 0


def residency_main(parser: argparse.ArgumentParser, args) -> int:
    from aither_jax import residency_eval

    settings = residency_eval.ResidencySettings(
        model=args.model, num_tokens=args.num_tokens, fractions=tuple(args.residency), scorers=tuple(args.scorer),
        tau=args.tau, stride=args.stride, passkey_lengths=tuple(args.passkey_lengths), dtype=args.dtype,
    )  # fmt: skip
    if args.text_file is not None:
        settings.text = pathlib.Path(args.text_file).read_text(encoding="utf-8")
        settings.source = os.path.basename(args.text_file)
    try:
        report = residency_eval.run(settings, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError as e:
        parser.error(str(e))
    if args.json:
        report_json(args, report)
    if args.json != "-":
        print(residency_eval.table(report))
    if args.json not in (None, "-"):
        print(f"report: {args.json}")
    if args.plot:
        write_file(args.plot, lambda tmp: residency_eval.plot(report, tmp))
        print(f"plot: {args.plot}", file=sys.stderr if args.json == "-" else sys.stdout)
    return 0


def perplexity_main(parser: argparse.ArgumentParser, args) -> int:
    rows, asked = run_on_text(parser, args, run_perplexity)
    if args.json:
        report_json(args, rows)
    if args.json != "-":
        print_perplexity_table(args, rows)
    if args.plot:
        write_file(args.plot, lambda tmp: write_plot(rows, tmp))
        print(f"plot: {args.plot}", file=sys.stderr if args.json == "-" else sys.stdout)
    if len(rows) < asked:
        print(f"interrupted: {len(rows)} of {asked} formats scored", file=sys.stderr)
        return INTERRUPTED
    return 0


def print_perplexity_table(args, rows: list[dict]) -> None:
    print(
        f"{args.model}: {rows[0]['num_tokens']} tokens of {args.text_file}, weights {rows[0]['weights_dtype']}, "
        f"{rows[0]['attention']} attention, perplexity with bf16 KV {rows[0]['perplexity_bf16']:.4f}"
    )
    w = max(16, *(len(r["kv_cache_dtype"]) for r in rows))
    print(
        f"{'kv_cache_dtype':<{w}} {'bytes/token':>11} {'vs bf16':>8} {'ppl':>9} {'ppl change':>11} "
        f"{'KL':>8} {'top-1':>7}"
    )
    for r in rows:
        print(
            f"{r['kv_cache_dtype']:<{w}} {r['bytes_per_token']:>11,} {r['compression_vs_bf16']:>7.2f}x "
            f"{r['perplexity']:>9.4f} {r['perplexity_change_pct']:>+10.2f}% {r['kl_divergence']:>8.4f} "
            f"{r['top1_agreement']:>6.1%}"
        )


def timed_decode(llm, ids: list[list[int]], params, batch_size: int, before_timing=None) -> tuple[list, float]:
    """Decodes `ids` in groups of batch_size once everything it runs is compiled; (outputs,
    seconds). The warm-up compiles every decode (and draft and verify) shape up to the
    longest prompt plus max_tokens on several threads, then each prompt's prefill, then one
    whole untimed run of the first group, as a server does before it serves; otherwise a
    configuration that runs more shapes (adaptive drafts) would be timed compiling them.
    `before_timing()` is called just before the timed runs. How long the warm-up took goes to
    stderr (on a GPU, most of a run)."""
    t0 = time.perf_counter()
    max_len = min(max(map(len, ids)) + params.max_tokens, llm.engine.max_model_len)
    shapes = llm.warmup(max_len, sampling=params.temperature > 0)
    print(f"  warm-up: {shapes} shapes compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    for i in range(0, len(ids), batch_size):
        llm.generate(ids[i : i + batch_size], dataclasses.replace(params, max_tokens=1), use_tqdm=False)
    llm.generate(ids[:batch_size], params, use_tqdm=False)  # shapes only a whole run reaches
    print(f"  warm-up with prefills: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    if before_timing is not None:
        before_timing()
    outs, t0 = [], time.perf_counter()
    for i in tqdm(range(0, len(ids), batch_size), desc="decoding", leave=False):
        outs += llm.generate(ids[i : i + batch_size], params, use_tqdm=False)
    return outs, time.perf_counter() - t0


# Logit gaps (nats) below which two greedy runs may part for float rounding alone: a verify
# pass computes many tokens per call where plain decoding computes one, XLA's CPU matmuls sum
# in a different order for different row counts, and the last bit of a key can flip its bf16
# or codebook rounding.
NEAR_TIE_NATS = 0.01


def divergence_gap(llm, plain, spec) -> float | None:
    """The target's logit gap (nats) between the plain and the speculative token where two
    greedy outputs first differ, from one forward pass over their shared prefix; 0.0 when
    they are identical, None when one output is a prefix of the other (one stopped early)."""
    if plain.token_ids == spec.token_ids:
        return 0.0
    i = next((j for j, (a, b) in enumerate(zip(plain.token_ids, spec.token_ids, strict=False)) if a != b), None)
    if i is None:
        return None
    logits = llm.logits(plain.prompt_token_ids + plain.token_ids[:i])[-1]
    return float(abs(logits[plain.token_ids[i]] - logits[spec.token_ids[i]]))


def speculative_row(llm, ids, params, batch_size: int, baseline: tuple[list, float]) -> dict:
    """Decodes `ids` speculatively and compares with the plain `baseline` (outputs, seconds)."""
    before: dict = {}  # the counters once the warm-up runs are done: theirs do not count
    spec_outs, spec_s = timed_decode(llm, ids, params, batch_size, lambda: before.update(llm.engine.spec_stats()))
    stats = llm.engine.spec_stats()
    hist = np.asarray(stats["tau_histogram"]) - np.asarray(before["tau_histogram"])
    passes = int(hist.sum())
    drafts, draft_tokens, accepted, lookup = (
        stats[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_lookup_drafts")
    )
    base_outs, base_s = baseline
    base_tokens = sum(len(o.token_ids) for o in base_outs)
    spec_tokens = sum(len(o.token_ids) for o in spec_outs)
    spec = llm.engine.speculative
    gaps = None
    if params.temperature == 0:
        gaps = [divergence_gap(llm, a, b) for a, b in zip(base_outs, spec_outs, strict=True)]
    return {
        "speculative": spec.method,
        "block_size": llm.engine.num_speculative_tokens + 1,
        "steps": spec.steps if spec.method == "dflash" else None,
        "num_prompts": len(ids),
        "tau_mean": float((hist * np.arange(hist.size)).sum() / max(passes, 1)),
        "tau_histogram": {str(i): int(c) for i, c in enumerate(hist) if i and c},
        "num_verify_passes": passes,
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "identical_outputs": sum(a.token_ids == b.token_ids for a, b in zip(base_outs, spec_outs, strict=True)),
        # Greedy only: the largest logit gap where an output parted from plain decoding (None
        # if one stopped early); up to NEAR_TIE_NATS it is float rounding, not a lost token.
        "max_divergence_gap": None if gaps is None or None in gaps else max(gaps),
        "spec_tokens": spec_tokens,
        "baseline_tokens": base_tokens,
        "spec_seconds": round(spec_s, 3),
        "baseline_seconds": round(base_s, 3),
        "spec_tokens_per_second": spec_tokens / spec_s,
        "baseline_tokens_per_second": base_tokens / base_s,
        "speedup": (spec_tokens / spec_s) / (base_tokens / base_s),
        "adaptive": spec.adaptive,
        # dflash's options; ngram has neither (it is prompt lookup alone, drafting a chain).
        "prompt_lookup": spec.prompt_lookup if spec.method == "dflash" else None,
        "tree": spec.tree if spec.method == "dflash" else None,
        # dflash with prompt_lookup: verify passes of a row whose drafts came from prompt lookup.
        "num_lookup_drafts": lookup,
        # Adaptive drafts per step: timed steps that ran each option (0 = a plain step).
        "draft_length_steps": None
        if stats["draft_length_steps"] is None
        else {k: n - before["draft_length_steps"][k] for k, n in stats["draft_length_steps"].items()},
    }


def run_acceptance(args) -> dict:
    import aither_jax as aj
    from aither_jax.llm import resolve_dtype

    prompts = read_prompts(args.prompts)[: args.max_prompts]
    spec = {"method": args.speculative}
    if args.block_size is not None:
        spec["num_speculative_tokens"] = args.block_size - 1
    if args.adaptive:
        spec["adaptive"] = True
    if args.prompt_lookup is not None:
        spec["prompt_lookup"] = args.prompt_lookup
    if args.tree is not None:
        spec["tree"] = args.tree
    if args.speculative == "dflash":
        spec["steps"] = args.steps or 1
        if args.draft:
            spec["model"] = str(args.draft)
    dtype = resolve_dtype(args.dtype)
    kv = getattr(args.kv_cache_dtype, "name", args.kv_cache_dtype)
    common = dict(dtype=dtype, kv_cache_dtype=kv, max_num_seqs=args.batch_size, progress=False)
    fast = aj.LLM(args.model, speculative=spec, **common)  # first, so a bad draft fails before any decoding
    plain = aj.LLM(args.model, **common)
    params = aj.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
    ids = [p.ids for p in file_prompts(plain.tokenizer, prompts)]
    baseline = timed_decode(plain, ids, params, args.batch_size)
    row = speculative_row(fast, ids, params, args.batch_size, baseline)
    return {
        "model": args.model,
        "dtype": dtype,
        "kv_cache_dtype": fast.kv_spec.name,
        "temperature": args.temperature,
        "batch_size": args.batch_size,
        "max_tokens": args.max_tokens,
        **row,
    }


def acceptance_main(parser: argparse.ArgumentParser, args) -> int:
    if args.draft and args.speculative != "dflash":
        parser.error("--draft is for --speculative dflash")
    if args.tree is not None and args.speculative != "dflash":
        parser.error("--tree is for --speculative dflash")
    if args.prompt_lookup is not None and args.speculative != "dflash":
        parser.error("--prompt-lookup is for --speculative dflash (ngram is prompt lookup alone)")
    if args.steps is not None and args.speculative != "dflash":
        parser.error("--steps is for --speculative dflash (ngram drafts in one lookup)")
    try:
        r = run_acceptance(args)
    except (ValueError, GGUFError, UnicodeDecodeError) as e:
        parser.error(str(e))
    if args.json:
        report_json(args, r)
    if args.json == "-":
        return 0
    print(
        f"{r['model']} {r['speculative']} block {r['block_size']}"
        + (f" steps {r['steps']}" if r["steps"] else "")
        + f", {r['num_prompts']} prompts, temperature {r['temperature']:g}, batch {r['batch_size']}"
    )
    print(f"tau mean {r['tau_mean']:.2f} over {r['num_verify_passes']} verify passes; histogram {r['tau_histogram']}")
    if r["prompt_lookup"]:
        print(f"prompt lookup drafted {r['num_lookup_drafts']} of {r['num_drafts']} verify passes with drafts")
    print(
        f"drafts {r['num_drafts']}, draft tokens {r['num_draft_tokens']}, accepted {r['num_accepted_tokens']} "
        f"({100 * r['acceptance_rate']:.1f}%); identical outputs {r['identical_outputs']}/{r['num_prompts']}"
    )
    if r["identical_outputs"] < r["num_prompts"] and r["max_divergence_gap"] is not None:
        tie = "a near-tie (float rounding)" if r["max_divergence_gap"] <= NEAR_TIE_NATS else "NOT a near-tie"
        print(
            f"outputs part where the target's top choices differ by at most {r['max_divergence_gap']:.4f} nats: {tie}"
        )
    elif r["identical_outputs"] < r["num_prompts"] and r["temperature"] == 0:
        print("an output stopped before the other parted from it: no logit gap to compare")
    print(
        f"speculative {r['spec_tokens_per_second']:.1f} tok/s vs plain {r['baseline_tokens_per_second']:.1f} tok/s: "
        f"{r['speedup']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
