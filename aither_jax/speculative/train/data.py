"""Stage 2 of draft training: the target's own answers, with the hidden states of the draft's tapped
layers and the teacher's top-k kept by the generation itself, stored as .npz shards; and the
`Dataset` that samples training blocks from them."""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import sys

import numpy as np
from tqdm.auto import tqdm

from aither_jax.context.prompt import chat_prompt
from aither_jax.speculative.train.prompts import (
    build_prompts,
    chat_prompts,
    document_conversations,
    read_prompt_texts,
    self_prompts,
)
from models.draft import (
    DraftConfig,
)

log = logging.getLogger("aither_jax.train_draft")


# -- stage 2: data --------------------------------------------------------------------------


DATA_PAGE_SIZE = 16  # tokens per KV page of the target that makes the data


def generate_data(args, cfg: DraftConfig, data_dir: pathlib.Path) -> list[pathlib.Path]:
    """Writes shards of (tokens, prompt lengths, tapped hidden states); returns their paths."""
    from aither_jax.device.sampling import SamplingParams
    from aither_jax.llm import LLM

    data_dir.mkdir(parents=True, exist_ok=True)
    convs = build_prompts(args.num_prompts, seed=args.seed)
    convs += chat_prompts(args.num_chat_prompts, seed=args.seed) if args.num_chat_prompts else []
    llm = None

    def target():
        nonlocal llm
        if llm is None:
            # Pages for every sequence of a batch at full length: the library's default pool
            # (1 GiB) holds ~23k float32 tokens, and a request preempted for want of pages runs
            # all its tokens again (--gen-batch 256 at 640 tokens needs 164k, 7.5 GB).
            llm = LLM(
                args.model,
                dtype="float32",
                kv_cache_dtype="fp32",
                max_model_len=args.max_len,
                max_num_seqs=args.gen_batch,
                num_pages=args.gen_batch * -(-args.max_len // DATA_PAGE_SIZE) + 1,
                page_size=DATA_PAGE_SIZE,
                progress=False,
            )
            cfg.check_target(llm.config)
        return llm

    if args.num_self_prompts:
        saved = data_dir / "self_prompts.jsonl"  # sampled once; a resumed run reads them back
        if saved.exists():
            own = [[{"role": "user", "content": t}] for t in read_prompt_texts(saved)]
            if len(own) != args.num_self_prompts:
                sys.exit(
                    f"{saved} holds {len(own)} self-written requests, not {args.num_self_prompts}; use a new --out"
                )
        else:
            held_out = read_prompt_texts(pathlib.Path(args.held_out_prompts))
            own = self_prompts(
                target(), args.num_self_prompts, seed=args.seed, held_out_texts=held_out, batch=args.gen_batch
            )
            tmp = saved.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps({"messages": c}) + "\n" for c in own))
            os.replace(tmp, saved)
        convs += own
    shards: list[pathlib.Path] = []
    for s, path, part in missing_shards(data_dir, "shard", convs, args.shard_size, shards):
        llm = target()
        prompts = [chat_prompt(llm.tokenizer, c).ids for c in part]
        keep = [p[: args.max_len - args.max_new_tokens] for p in prompts]
        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0)
        arrays = generated_arrays(llm, cfg, keep, params, args.teacher_top_k, f"shard {s}: answers")
        write_shard(path, arrays)
    docs = document_conversations(args.num_text_sequences, seed=args.seed) if args.num_text_sequences else []
    for s, path, part in missing_shards(data_dir, "text", docs, args.shard_size, shards):
        llm = target()
        tok = llm.tokenizer
        seqs, plens = [], []
        for conv, answer in part:
            prompt = chat_prompt(tok, conv).ids
            seqs.append((prompt + tok.encode(answer))[: args.max_len])
            plens.append(len(prompt))
        arrays = tap_arrays(llm, cfg, seqs, plens, args.teacher_top_k, f"text shard {s}: hidden states")
        write_shard(path, arrays | {"labels": teacher_labels(arrays)})
    return shards


def missing_shards(data_dir: pathlib.Path, prefix: str, items: list, per_shard: int, shards: list[pathlib.Path]):
    """Appends the path of every shard of `items` to `shards`; yields (index, path, its items)
    for those not written yet (a resumed run skips the rest)."""
    for s in range(math.ceil(len(items) / per_shard)):
        path = data_dir / f"{prefix}{s:04d}.npz"
        shards.append(path)
        if not path.exists():
            yield s, path, items[s * per_shard : (s + 1) * per_shard]


def teacher_labels(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """Labels for text the target did not write: at every position of each sequence but its
    first, the target's greedy choice there (its most likely token at the position before,
    `top_ids[:, 0]`); a sequence's first position keeps its token."""
    tokens = arrays["tokens"]
    labels = np.concatenate([tokens[:1], arrays["top_ids"][:-1, 0]]).astype(tokens.dtype)
    starts = np.cumsum(arrays["lengths"]) - arrays["lengths"]
    labels[starts] = tokens[starts]
    return labels


def generated_arrays(llm, cfg: DraftConfig, prompts: list[list[int]], params, top_k: int, desc: str):
    """The target's answers to `prompts` and the shard arrays of prompt + answer, made by the
    generation itself (`Engine.record`): its calls keep the tapped hidden states of every
    position they run and the top-k at every position where they sample, so no second pass
    over the sequences is needed. A sequence's last token is sampled, never run: its row of
    hidden states is zeros and its top-k log probabilities -inf, as are the top-k rows of
    the prompt positions but the last (`Engine.take_record`). No training block reads them:
    blocks start at the prompt's last position and end inside the sequence, and the context
    is what lies before a block. The arrays are `tap_arrays`'s."""
    engine = llm.engine
    engine.record(cfg.target_layers, top_k)
    seqs = []
    try:
        for p in prompts:  # one at a time, so that a refused prompt leaves the others to abort
            seqs.append(engine.add_request(p, params))
        with tqdm(total=len(seqs), desc=desc, unit="seq", leave=False) as bar:
            while engine.has_unfinished():
                bar.update(len(engine.step()))
        records = [engine.take_record(seq) for seq in seqs]
    except BaseException:
        for seq in seqs:
            engine.abort(seq)
        raise
    finally:
        engine.record(None)
    return shard_arrays([s.prompt_ids + s.output_ids for s in seqs], [len(p) for p in prompts], records)


def tap_arrays(llm, cfg: DraftConfig, seqs: list[list[int]], prompt_lengths: list[int], top_k: int, desc: str):
    """One target pass over each sequence: the shard arrays (tokens, lengths, prompt lengths,
    tapped hidden states in float16 and, with `top_k`, the target's top-k next tokens and log
    probabilities at every position, most likely first)."""
    records = []
    for ids in tqdm(seqs, desc=desc, leave=False):
        top, h = llm.engine.forward(ids, taps=cfg.target_layers, logits=top_k > 0, top_k=top_k)
        records.append((h.astype(np.float16), *(top if top_k else (None, None))))
    return shard_arrays(seqs, prompt_lengths, records)


def shard_arrays(seqs: list[list[int]], prompt_lengths: list[int], records: list[tuple]) -> dict[str, np.ndarray]:
    """A shard's arrays from each sequence's tokens and its (hidden states [n, taps * D],
    top-k ids [n, k], log probabilities [n, k]) rows, the last two None without soft labels:
    hidden states and log probabilities stored in float16."""
    hidden, top_ids, top_logp = zip(*records, strict=True)
    arrays = {
        "tokens": np.concatenate([np.asarray(x, np.int32) for x in seqs]),
        "lengths": np.asarray([len(x) for x in seqs], np.int32),
        "prompt_lengths": np.asarray(prompt_lengths, np.int32),
        "hidden": np.concatenate(hidden).astype(np.float16, copy=False),
    }
    if top_ids[0] is not None:
        arrays |= {"top_ids": np.concatenate(top_ids), "top_log_probs": np.concatenate(top_logp).astype(np.float16)}
    return arrays


def write_shard(path: pathlib.Path, arrays: dict[str, np.ndarray]) -> None:
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)  # a crash never leaves a half-written shard
    log.info("wrote %s (%d sequences, %d tokens)", path, len(arrays["lengths"]), len(arrays["tokens"]))


class Dataset:
    """All shards in memory as padded [N, L] arrays; samples batches of blocks."""

    def __init__(self, shards: list[pathlib.Path], max_len: int, block_size: int):
        rows = []  # (shard arrays, start, end, prompt length) of usable sequences
        soft = ("top_ids", "top_log_probs")  # the target's top-k next tokens, when every shard has them
        with_soft = True
        for path in shards:
            with np.load(path) as z:  # each key access reads the array: read each once
                with_soft &= all(k in z.files for k in soft)
                keys = ("tokens", "labels", "lengths", "prompt_lengths", "hidden", *soft)
                arrays = {k: z[k] for k in keys if k in z.files}
            arrays.setdefault("labels", arrays["tokens"])  # generated text: the tokens are the target's own
            ends = np.cumsum(arrays["lengths"])
            for a, b, p in zip(ends - arrays["lengths"], ends, arrays["prompt_lengths"], strict=True):
                if b - a - p >= block_size and b - a <= max_len:
                    rows.append((arrays, int(a), int(b), int(p)))
        if not rows:
            raise RuntimeError("no sequence has a continuation as long as a block")
        self.num = len(rows)
        self.max_len = max_len
        self.lengths = np.asarray([b - a for _, a, b, _ in rows], np.int32)
        self.prompt_lengths = np.asarray([p for *_, p in rows], np.int32)

        def padded(key, dtype, fill=0):  # [N, max_len, ...] from every row's slice of its shard's array
            tails = {arrays[key].shape[1:] for arrays, *_ in rows}
            if len(tails) > 1:
                raise RuntimeError(f"the data shards hold {key} of different shapes: {sorted(tails)}")
            out = np.full((self.num, max_len, *tails.pop()), fill, dtype)
            for i, (arrays, a, b, _) in enumerate(rows):
                out[i, : b - a] = arrays[key][a:b]
            return out

        self.tokens = padded("tokens", np.int32)
        self.labels = padded("labels", np.int32)  # the target's greedy token at each position
        self.hidden = padded("hidden", np.float16)
        self.top_ids = padded("top_ids", np.int32) if with_soft else None
        self.top_log_probs = padded("top_log_probs", np.float16, -np.inf) if with_soft else None
        self.block_size = block_size
        self.num_tokens = int(self.lengths.sum())
        self.train_rows = np.arange(self.num)
        self.val_rows = np.zeros(0, np.int64)

    def hold_out(self, fraction: float, seed: int) -> None:
        """Sets aside `fraction` of the sequences (at least one when fraction > 0) for
        validation; training batches never draw them."""
        num_val = 0 if fraction <= 0 else max(1, round(self.num * fraction))
        if num_val >= self.num:
            raise ValueError(f"holding out {num_val} of {self.num} sequences leaves none to train on")
        order = np.random.default_rng([seed, 1]).permutation(self.num)
        self.val_rows, self.train_rows = np.sort(order[:num_val]), np.sort(order[num_val:])

    def vocab(self, size: int, vocab_size: int) -> np.ndarray:
        """`size` token ids for the draft's head: those of the training continuations by frequency, then
        the prompts', then the lowest unused ids; returned sorted."""
        r = self.train_rows  # held-out sequences do not choose the head
        rows = list(zip(self.labels[r], self.prompt_lengths[r], self.lengths[r], strict=True))
        answers = np.concatenate([t[p:n] for t, p, n in rows])
        prompts = np.concatenate([t[:p] for t, p, _ in rows])
        score = np.bincount(answers, minlength=vocab_size) * float(len(prompts) + 1)
        score += np.bincount(prompts, minlength=vocab_size)
        order = np.lexsort((np.arange(vocab_size), -score))  # most frequent first, then by id
        return np.sort(order[:size]).astype(np.int32)

    def batch(self, rng: np.random.Generator, num_seqs: int, num_anchors: int, reveal_prob: float, *, val=False):
        pool = self.val_rows if val else self.train_rows
        idx = pool[rng.integers(0, len(pool), num_seqs)]
        low = np.maximum(self.prompt_lengths[idx] - 1, 1)
        high = self.lengths[idx] - self.block_size  # the block must end inside the sequence
        anchors = low[:, None] + (rng.random((num_seqs, num_anchors)) * (high - low + 1)[:, None]).astype(np.int32)
        b = self.block_size
        partial = rng.random((num_seqs, num_anchors, 1)) < reveal_prob
        reveal = partial & (rng.random((num_seqs, num_anchors, b)) < rng.random((num_seqs, num_anchors, 1)))
        reveal[..., 0] = True  # the anchor token is always given
        out = {
            "tokens": self.tokens[idx],
            "labels": self.labels[idx],
            "hidden": self.hidden[idx].astype(np.float32),
            "anchors": anchors.astype(np.int32),
            "reveal": reveal,
        }
        if self.top_ids is not None:
            # The target's distribution of the token at block position i (1..B-1) comes from position i-1.
            pos = anchors[..., None] + np.arange(b - 1)  # [N, A, B-1]
            out["top_ids"] = self.top_ids[idx[:, None, None], pos]
            out["top_log_probs"] = self.top_log_probs[idx[:, None, None], pos].astype(np.float32)
        return out
