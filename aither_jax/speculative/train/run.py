"""Stage 3 of draft training and the command line: the training loop (AdamW, checkpoints, the time
limit) and `main` for `python -m aither_jax.train_draft`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from aither_jax.cli_args import (
    HelpFormatter,
    add_model_argument,
    add_version_argument,
    float_in,
    int_in,
    output_file,
)
from aither_jax.speculative.train.data import Dataset, generate_data
from aither_jax.speculative.train.loss import loss_fn, position_weights
from aither_jax.speculative.train.prompts import EVAL_PROMPTS, build_prompts, chat_requests
from models.config import ModelConfig
from models.draft import (
    DraftConfig,
    DraftParams,
    copy_target_layers,
    init_params,
)
from models.gguf_file import GGUFError, GGUFFile

log = logging.getLogger("aither_jax.train_draft")

clock = time.monotonic  # what `--time-limit` is measured by


def check_soft_labels(args, dataset: Dataset) -> None:
    """Raises ValueError when `--soft-weight` asks for soft labels the data does not hold."""
    if args.soft_weight and dataset.top_ids is None:
        raise ValueError(
            "--soft-weight needs data with the target's top-k log probabilities "
            "(made with --teacher-top-k > 0; use a new --out, or --soft-weight 0)"
        )


def make_optimizer(args):
    import optax

    warmup = min(args.warmup, args.steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, max(args.steps, warmup + 1), args.lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))


def train(
    args,
    cfg: DraftConfig,
    dataset: Dataset,
    embed,
    lm_head,
    final_norm,
    out: pathlib.Path,
    vocab=None,
    start_layers=None,
    deadline: float | None = None,
    start_params: DraftParams | None = None,
) -> tuple[DraftParams, int]:
    """Trains (or resumes); returns the parameters and the step they are at. `vocab` restricts
    the head to those ids, `start_layers` (target `LayerWeights`, one per draft layer) start
    the layers from copies, `start_params` (a trained draft's parameters) start every
    parameter from them; a checkpoint in `out` takes precedence over both. With `deadline` (a
    `clock()` reading) no step starts after it, and the last step taken is validated and
    checkpointed as a final one."""
    import optax
    import orbax.checkpoint as ocp

    check_soft_labels(args, dataset)
    optimizer = make_optimizer(args)
    params = init_params(cfg, jax.random.PRNGKey(args.seed), final_norm=final_norm)
    if start_params is not None:
        if jax.tree.map(jnp.shape, start_params) != jax.tree.map(jnp.shape, params):  # layout and shapes
            raise ValueError("the starting parameters do not fit the draft configuration")
        params = jax.tree.map(lambda a, b: jnp.asarray(a, b.dtype), start_params, params)
    if start_layers is not None:
        params = copy_target_layers(params, cfg, start_layers)
    state = {"params": params, "opt": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}
    manager = ocp.CheckpointManager(
        (out / "checkpoints").absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    )
    if manager.latest_step() is not None:
        state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(state))
        log.info("resumed from step %d", int(state["step"]))
    weights = jnp.asarray(position_weights(cfg.block_size, args.gamma))
    inverse = None
    if vocab is not None:
        lm_head = jnp.asarray(lm_head)[vocab]
        inverse = jnp.full(cfg.vocab_size, -1, jnp.int32).at[vocab].set(jnp.arange(len(vocab), dtype=jnp.int32))

    @jax.jit
    def update(state, batch):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, metrics), grads = grad_fn(
            state["params"],
            batch,
            cfg=cfg,
            embed=embed,
            lm_head=lm_head,
            weights=weights,
            inverse=inverse,
            soft_weight=args.soft_weight,
        )
        updates, opt = optimizer.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt, "step": state["step"] + 1}, metrics

    @jax.jit
    def evaluate(params, batch):
        # Hard labels only: validation figures compare across --soft-weight.
        return loss_fn(params, batch, cfg=cfg, embed=embed, lm_head=lm_head, weights=weights, inverse=inverse)[1]

    def validate(params) -> dict[str, float]:
        """Metrics on fixed fully masked blocks of the held-out sequences."""
        totals = None
        for j in range(args.val_batches):
            rng = np.random.default_rng([args.seed, 2, j])
            m = evaluate(params, dataset.batch(rng, args.batch_seqs, args.anchors, 0.0, val=True))
            totals = m if totals is None else {k: totals[k] + m[k] for k in m}
        return {f"val_{k}": float(v) / args.val_batches for k, v in totals.items()}

    start = int(state["step"])
    stop = min(args.steps, args.stop_after or args.steps)
    log_path = out / "train_log.jsonl"
    ema, val = None, {}

    def out_of_time() -> bool:
        return deadline is not None and clock() >= deadline

    if start < stop and out_of_time():
        log.info("the time limit was reached before training: no step taken (rerun to train)")
        stop = start
    with (
        tqdm(total=args.steps, initial=start, desc="training draft", unit="step") as bar,
        log_path.open("a") as logf,
        contextlib.ExitStack() as finishing,
    ):
        # An interrupted run still completes the checkpoint being written (saves are asynchronous).
        finishing.callback(manager.wait_until_finished)
        for step in range(start, stop):
            rng = np.random.default_rng([args.seed, step])  # a resumed run sees the same batches
            batch = dataset.batch(rng, args.batch_seqs, args.anchors, args.reveal_prob)
            state, metrics = update(state, batch)
            final = step + 1 == stop or out_of_time()  # the time limit makes this step the last
            if final and step + 1 < stop:
                log.info("time limit reached: stopping at step %d of %d", step + 1, args.steps)
            validating = len(dataset.val_rows) and ((step + 1) % args.save_every == 0 or final)
            if validating:
                val = validate(state["params"])
            if (step + 1) % args.log_every == 0 or validating:
                m = {k: float(v) for k, v in metrics.items()}
                ema = m if ema is None else {k: 0.9 * ema[k] + 0.1 * m[k] for k in m}
                shown = {"loss": f"{ema['loss']:.3f}", "acc": f"{ema['accuracy']:.3f}", "tau": f"{ema['tau']:.2f}"}
                if val:
                    shown["val_tau"] = f"{val['val_tau']:.2f}"
                bar.set_postfix(shown)
                logf.write(
                    json.dumps({"step": step + 1, "time": time.time(), **m, **(val if validating else {})}) + "\n"
                )
                logf.flush()
            if (step + 1) % args.save_every == 0 or final:
                manager.save(step + 1, args=ocp.args.StandardSave(state))
            bar.update(1)
            if final:
                break
    return state["params"], int(state["step"])


def parse_start_layers(text: str, num_layers: int, intermediate_size: int, target: ModelConfig) -> list[int]:
    """`--init-from-target`: 'last' or comma-separated target layer indices, one per draft layer."""
    if text == "last":
        layers = list(range(target.num_layers - num_layers, target.num_layers))
    else:
        try:
            layers = [int(x) for x in text.split(",")]
        except ValueError:
            raise ValueError(f"expected 'last' or comma-separated layer indices, got {text!r}") from None
    if len(layers) != num_layers:
        raise ValueError(f"{len(layers)} layers given for a draft of {num_layers} layers (--num-layers)")
    if any(not 0 <= i < target.num_layers for i in layers):
        raise ValueError(f"layer indices must be in [0, {target.num_layers}), got {layers}")
    if intermediate_size != target.ffn_size:
        raise ValueError(
            f"copied layers need --intermediate-size {target.ffn_size} (the target's), got {intermediate_size}"
        )
    return layers


def check_target_flags(args, target: ModelConfig) -> str | None:
    """The error for a flag out of the range that `target` allows (checked once the model is
    known), or None."""
    limits = {
        "--draft-vocab-size": (args.draft_vocab_size, target.vocab_size),
        "--teacher-top-k": (args.teacher_top_k, target.vocab_size),
        # Taps spread over layers 1 .. L-3 (`DraftConfig.for_target`): more than that would repeat.
        "--num-taps": (args.num_taps, max(1, target.num_layers - 3)),
    }
    for flag, (value, high) in limits.items():
        if value > high:
            return f"{flag} must be <= {high} for {args.model}, got {value}"
    return None


DESCRIPTION = (
    "Train a DFlash draft for a target model: the target writes the training data (resumable under --out), "
    "the draft trains on it with checkpoints, and --export writes the draft that LLM(speculative='dflash') loads."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m aither_jax.train_draft", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    add_version_argument(p)
    add_model_argument(p)
    p.add_argument("--out", default="runs/dflash-smollm2", help="run directory: data, checkpoints, log")
    p.add_argument(
        "--export", type=output_file("--export", (".npz",)), help="write the trained draft here (.npz) for shipping"
    )
    p.add_argument("--split", choices=("train", "eval"), default="train", help=argparse.SUPPRESS)
    p.add_argument(
        "--print-prompts",
        type=int_in("--print-prompts", 0),
        default=0,
        help="print N prompts of --split as JSON lines and exit",
    )
    p.add_argument(
        "--num-prompts", type=int_in("--num-prompts", 1), default=768, help="prompts from standard-library docstrings"
    )
    p.add_argument(
        "--num-chat-prompts",
        type=int_in("--num-chat-prompts", 0, len(chat_requests())),
        default=768,
        help="general chat prompts (0: none)",
    )
    p.add_argument(
        "--num-self-prompts",
        type=int_in("--num-self-prompts", 0),
        default=0,
        help="requests the target writes itself (after the others; 0: none)",
    )
    p.add_argument(
        "--num-text-sequences",
        type=int_in("--num-text-sequences", 0),
        default=0,
        help="conversations answered with existing text (standard-library docstrings and source): "
        "no generation, the target's greedy next tokens as labels (0: none)",
    )
    p.add_argument(
        "--held-out-prompts",
        default=str(EVAL_PROMPTS),
        help="JSON lines whose prompts self-written requests must not copy (default: the chat evaluation set)",
    )
    p.add_argument("--max-new-tokens", type=int_in("--max-new-tokens", 1), default=256)
    p.add_argument("--max-len", type=int_in("--max-len", 2), default=640, help="longest prompt + continuation")
    p.add_argument("--gen-batch", type=int_in("--gen-batch", 1, 1024), default=32, help="sequences generated together")
    p.add_argument("--shard-size", type=int_in("--shard-size", 1), default=128, help="sequences per data shard")
    p.add_argument("--num-layers", type=int_in("--num-layers", 1), default=2)
    p.add_argument("--intermediate-size", type=int_in("--intermediate-size", 1), default=1024)
    p.add_argument(
        "--num-taps", type=int_in("--num-taps", 1), default=3, help="target layers whose hidden states feed the draft"
    )
    p.add_argument(
        "--init-from-target",
        metavar="LAYERS",
        help="start the draft layers from copies of these target layers: comma-separated indices, one per "
        "draft layer, or 'last' (needs --intermediate-size equal to the target's); default: random",
    )
    p.add_argument(
        "--init-draft",
        metavar="PATH",
        help="start from this trained draft (.npz, e.g. the shipped one): its parameters and its head's token "
        "list; its configuration must equal the flags' (default: a fresh draft)",
    )
    p.add_argument("--block-size", type=int_in("--block-size", 2, 64), default=16, help="drafts + 1 per step")
    p.add_argument(
        "--draft-vocab-size",
        type=int_in("--draft-vocab-size", 0),
        default=8192,
        help="token ids the draft proposes from (0: the whole vocabulary)",
    )
    p.add_argument("--steps", type=int_in("--steps", 1), default=3000)
    p.add_argument(
        "--stop-after",
        type=int_in("--stop-after", 0),
        default=0,
        help="stop at this step (the schedule still spans --steps); 0: --steps",
    )
    p.add_argument(
        "--time-limit",
        type=float_in("--time-limit", 0.0, 1e7),
        default=0.0,
        help="wall-clock seconds for the whole run, data stage included: no training step starts after them, "
        "and the last one is checkpointed and exported (the schedule still spans --steps); 0: no limit",
    )
    p.add_argument("--batch-seqs", type=int_in("--batch-seqs", 1), default=8)
    p.add_argument("--anchors", type=int_in("--anchors", 1), default=8, help="blocks per sequence per step")
    p.add_argument(
        "--reveal-prob",
        type=float_in("--reveal-prob", 0.0, 1.0),
        default=0.25,
        help="share of blocks with positions revealed",
    )
    p.add_argument("--lr", type=float_in("--lr", 0.0, 1.0, low_open=True), default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int_in("--warmup", 0), default=100, help="warm-up steps (at most --steps / 10)")
    p.add_argument(
        "--gamma",
        type=float_in("--gamma", 0.0, math.inf, low_open=True),
        default=2.0,
        help="decay length of the per-position loss weights (inf: equal weights)",
    )
    p.add_argument(
        "--teacher-top-k",
        type=int_in("--teacher-top-k", 0),
        default=32,
        help="store the target's K most likely next tokens and their log probabilities with the data (0: none)",
    )
    p.add_argument(
        "--soft-weight",
        type=float_in("--soft-weight", 0.0, 1.0),
        default=0.5,
        help="weight in [0, 1] of the cross-entropy with the target's stored distribution (the rest: its greedy token)",
    )
    p.add_argument("--log-every", type=int_in("--log-every", 1), default=10)
    p.add_argument(
        "--save-every", type=int_in("--save-every", 1), default=200, help="checkpoint (and validate) every N steps"
    )
    p.add_argument("--val-fraction", type=float, default=0.05, help="sequences held out for validation, in [0, 0.5)")
    p.add_argument("--val-batches", type=int_in("--val-batches", 1), default=4, help="fully masked validation batches")
    p.add_argument("--seed", type=int_in("--seed", 0, 2**32 - 1), default=0)
    return p


def parse_args(argv=None, p: argparse.ArgumentParser | None = None):
    p = p or build_parser()
    args = p.parse_args(argv)
    if not 0 <= args.val_fraction < 0.5:
        p.error(f"--val-fraction must be in [0, 0.5), got {args.val_fraction}")
    if args.num_text_sequences and not args.teacher_top_k:
        p.error("--num-text-sequences needs --teacher-top-k > 0 (its labels are the target's greedy tokens)")
    if args.num_self_prompts and not pathlib.Path(args.held_out_prompts).is_file():
        p.error(f"--held-out-prompts: no such file {args.held_out_prompts!r} (needed with --num-self-prompts)")
    if args.init_draft and args.init_from_target:
        p.error("--init-draft and --init-from-target both choose the starting parameters; give one")
    if args.init_draft and not pathlib.Path(args.init_draft).is_file():
        p.error(f"--init-draft: no such file {args.init_draft!r}")
    if args.max_new_tokens + 16 > args.max_len:
        p.error("--max-len must leave room for a prompt beside --max-new-tokens")
    return args


def main(argv=None) -> int:
    began = clock()
    parser = build_parser()
    args = parse_args(argv, parser)
    deadline = began + args.time_limit if args.time_limit else None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save step at INFO
    if args.print_prompts:
        for conv in build_prompts(args.print_prompts, seed=args.seed, split=args.split):
            print(json.dumps({"messages": conv}))
        return 0
    from models.draft_io import save_draft
    from models.registry import resolve_model
    from models.weights import load_weights

    try:
        gguf = GGUFFile(resolve_model(args.model))
        target_cfg = ModelConfig.from_gguf(gguf)
    except (ValueError, GGUFError) as e:
        parser.error(str(e))
    error = check_target_flags(args, target_cfg)
    if error:
        parser.error(error)
    cfg = DraftConfig.for_target(
        target_cfg,
        num_layers=args.num_layers,
        intermediate_size=args.intermediate_size,
        num_taps=args.num_taps,
        block_size=args.block_size,
        draft_vocab_size=args.draft_vocab_size,
    )
    start_layers = None
    if args.init_from_target:
        try:
            start_layers = parse_start_layers(args.init_from_target, cfg.num_layers, cfg.intermediate_size, target_cfg)
        except ValueError as e:
            parser.error(f"--init-from-target: {e}")
    start_params = start_vocab = start_meta = None
    if args.init_draft:
        from models.draft_io import load_draft

        try:
            init_cfg, start_params, start_meta, start_vocab = load_draft(args.init_draft)
        except ValueError as e:
            parser.error(f"--init-draft: {e}")
        if init_cfg != cfg:
            differ = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(init_cfg, f.name)]
            parser.error(
                f"--init-draft: {args.init_draft} is a different draft ({', '.join(differ)} differ from the flags')"
            )
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "draft_config.json"
    if saved.exists() and DraftConfig.from_json(saved.read_text()) != cfg:
        parser.error(f"{saved} holds a different draft configuration; use a new --out")
    saved.write_text(cfg.to_json())
    log.info("draft: %s, %.1fM trained parameters", cfg, cfg.num_params() / 1e6)
    t0 = time.time()
    shards = generate_data(args, cfg, out / "data")
    dataset = Dataset(shards, args.max_len, cfg.block_size)
    dataset.hold_out(args.val_fraction, args.seed)
    log.info("data: %d sequences, %d tokens (%.0f s)", dataset.num, dataset.num_tokens, time.time() - t0)
    try:
        check_soft_labels(args, dataset)  # before loading the target's weights
    except ValueError as e:
        parser.error(str(e))
    if args.init_draft:
        vocab = start_vocab  # the head it was trained with, not one chosen from this data
    else:
        vocab = dataset.vocab(cfg.draft_vocab_size, cfg.vocab_size) if cfg.draft_vocab_size else None
    weights = load_weights(gguf, target_cfg, "float32", progress=False)
    start = [weights.layers[i] for i in start_layers] if start_layers is not None else None
    params, trained = train(
        args,
        cfg,
        dataset,
        weights.embed,
        weights.lm_head,
        weights.final_norm,
        out,
        vocab,
        start,
        deadline,
        start_params,
    )
    if args.export and trained == 0:
        log.info("nothing to export: no training step was taken (%s not written)", args.export)
    elif args.export:
        meta = {
            "model": args.model,
            "command": " ".join(["python -m aither_jax.train_draft", *(argv or sys.argv[1:])]),
            "data_sequences": dataset.num,
            "data_tokens": dataset.num_tokens,
            "steps": trained,
            "schedule_steps": args.steps,
        }
        if start_meta is not None:
            meta["initialized_from"] = {
                "path": args.init_draft,
                **{k: start_meta[k] for k in ("command", "steps", "data_tokens") if k in start_meta},
            }
        save_draft(args.export, cfg, params, meta, vocab)
        log.info("exported %s (%.1f MB)", args.export, os.path.getsize(args.export) / 1e6)
    return 0


if __name__ == "__main__":
    sys.exit(main())
