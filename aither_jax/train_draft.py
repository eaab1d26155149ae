"""Trains a DFlash draft for a target model: `python -m aither_jax.train_draft`.

Three resumable stages, each skipped when its output exists:

1. Prompts: chat requests built from the docstrings of Python's standard library, read with
   `ast` from the interpreter's own source files (no import, nothing downloaded); modules
   whose name hashes into the held-out tenth are never used (`--split eval` lists those).
   Then general chat requests (`aither_jax.chat_prompts`: explanations, how-tos, tips,
   stories, emails, small programs) from hand-written topic lists kept apart from
   `scripts/data/chat_eval.jsonl`. Then, with `--num-self-prompts`, requests the target writes
   itself: sampled from the chat template cut just after the user turn opens, so the
   instruction-tuned model plays the user (unlimited, varied, in its own chat distribution);
   near-copies of the evaluation prompts are dropped.
2. Data: the frozen target's own greedy continuations of those prompts, then, in one pass over
   prompt + continuation, the hidden states of the draft's tapped target layers and the
   target's `--teacher-top-k` most likely next tokens with their log probabilities, stored as
   .npz shards. With `--num-text-sequences`, also conversations whose answers are existing
   text (`document_conversations`: standard-library docstrings and source, no generation):
   the same one pass gives their hidden states, and the labels are the target's own greedy
   next token at every position (teacher-forced on the text), at ~5x the tokens per hour.
3. Training: random anchors in the continuations; the block is [anchor token, masks...]; the
   loss at every masked position mixes cross-entropy with the target's greedy token and with
   its stored distribution (`--soft-weight`), with weights decaying along the block; some
   blocks reveal a random subset of positions so multi-step denoising sees partly filled
   blocks. AdamW (optax) with warm-up and cosine decay; orbax checkpoints every
   `--save-every` steps and at the end; a run restarts from its latest checkpoint. With
   `--time-limit S` no training step starts more than S seconds after the run began (the data
   stage counts, and is never cut): the last step is validated, checkpointed and exported.

`--export F.npz` writes the shipped draft (float16 parameters + config) for `models/draft_io`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import pathlib
import re
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from aither_jax.chat_prompts import all_requests, chat_prompts
from aither_jax.cli_args import float_in, int_in
from models.config import ModelConfig
from models.draft import (
    MASK,
    DraftConfig,
    DraftParams,
    block_forward,
    context_features,
    context_kv,
    copy_target_layers,
    init_params,
)
from models.llama import vocab_logits
from pallas_kernels.draft_attention import draft_attention_dense

log = logging.getLogger("aither_jax.train_draft")

clock = time.monotonic  # what `--time-limit` is measured by

EVAL_PROMPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "data" / "chat_eval.jsonl"

TEMPLATES = (
    "Explain in simple terms what `{name}` in Python's `{module}` module does. Its documentation says:\n\n{doc}",
    "Summarize the following documentation in a few sentences:\n\n{doc}",
    "Write a short Python example that uses `{module}.{name}` and explain it step by step.",
    "What is `{name}` for, and when would I use it? Here is its documentation:\n\n{doc}",
    "Rewrite this technical text so that a beginner can follow it:\n\n{doc}",
    "List three key points a programmer should know about this:\n\n{doc}",
)


# -- stage 1: prompts -----------------------------------------------------------------------


def held_out(module: str) -> bool:
    """Whether a module belongs to the held-out tenth (never used for training)."""
    return hashlib.sha256(module.encode()).digest()[0] % 10 == 0


def stdlib_sources():
    """(module, source, parsed tree) of the standard library's own modules (no tests, IDLE,
    site-packages or demos), from the interpreter's source files, in a fixed order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(p in ("test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo") for p in rel.parts):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        yield module, source, tree


def public_definitions(tree: ast.AST) -> list[ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef) and not n.name.startswith("_")
    ]


def stdlib_docs() -> list[tuple[str, str, str]]:
    """(module, name, first paragraph) for documented modules, classes and functions of the
    standard library, read from source with `ast`, in a fixed order."""
    out = []
    for module, _, tree in stdlib_sources():
        nodes = [(module.rsplit(".", 1)[-1], tree)] + [(n.name, n) for n in public_definitions(tree)]
        for name, node in nodes:
            doc = ast.get_docstring(node)
            if not doc:
                continue
            para = doc.strip().split("\n\n")[0].strip()
            if 60 <= len(para) <= 700:
                out.append((module, name, para))
    return out


def build_prompts(num: int, *, seed: int, split: str = "train") -> list[list[dict]]:
    """`num` single-turn conversations from the standard library's docstrings (train split:
    modules outside the held-out tenth; eval split: only those)."""
    docs = [d for d in stdlib_docs() if held_out(d[0]) == (split == "eval")]
    if not docs:
        raise RuntimeError("no documented standard-library modules found")
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(docs), size=min(num, len(docs)), replace=False)
    convs = []
    for i in picks:
        module, name, doc = docs[i]
        template = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
        convs.append([{"role": "user", "content": template.format(module=module, name=name, doc=doc)}])
    return convs


DOC_TEMPLATES = (
    "What does `{name}` in Python's `{module}` module do? Show me its code.",
    "Explain `{module}.{name}` and how it is implemented.",
    "How does `{name}` from the `{module}` module work?",
    "Can you walk me through the source of `{module}.{name}`?",
)


@functools.lru_cache(maxsize=1)
def documented_definitions() -> tuple[tuple[str, str, str, str], ...]:
    """(module, name, docstring, source) of the public functions and classes with a docstring of
    60 characters or more in the standard library's training split, in a fixed order."""
    items = []
    for module, source, tree in stdlib_sources():
        if held_out(module):
            continue
        for node in public_definitions(tree):
            doc = ast.get_docstring(node)
            code = ast.get_source_segment(source, node)
            if doc and len(doc) >= 60 and code:
                items.append((module, node.name, doc.strip(), code))
    if not items:
        raise RuntimeError("no documented standard-library functions found")
    return tuple(items)


def document_conversations(num: int, *, seed: int, max_chars: int = 2400) -> list[tuple[list[dict], str]]:
    """`num` (conversation, answer) pairs whose answer is existing text: the full docstring of a
    public function or class of the standard library (training split), then its source in a
    Python code block, cut to `max_chars`. Read with `ast` from the interpreter's sources, in a
    fixed order, then sampled with `seed`."""
    items = documented_definitions()
    rng = np.random.default_rng([seed, 3])
    picks = rng.choice(len(items), size=min(num, len(items)), replace=False)
    out = []
    for i in picks:
        module, name, doc, code = items[i]
        question = DOC_TEMPLATES[int(rng.integers(len(DOC_TEMPLATES)))].format(module=module, name=name)
        answer = f"{doc}\n\n```python\n{code}\n```"[:max_chars]
        out.append(([{"role": "user", "content": question}], answer))
    return out


SELF_PROMPT_PLACEHOLDER = "\x00request\x00"


def _word_set(text: str) -> frozenset[str]:
    return frozenset(re.findall(r"[a-z0-9']+", text.lower()))


def keep_self_prompt(text: str, seen: set[frozenset[str]], held_out: list[frozenset[str]]) -> bool:
    """Whether a sampled request is usable: 4-80 words, no chat-template markup, not a repeat
    of one already kept (same word set), and not a near-copy of a held-out evaluation prompt
    (word-set Jaccard similarity 0.5 or more, or containing all of its words)."""
    words = _word_set(text)
    if not 4 <= len(text.split()) <= 80 or "<|" in text or words in seen:
        return False
    for h in held_out:
        if h <= words or len(words & h) >= 0.5 * len(words | h):
            return False
    return True


def self_prompts(llm, num: int, *, seed: int, held_out_texts: list[str], batch: int = 32) -> list[list[dict]]:
    """`num` single-turn requests written by the target itself, for training data.

    The chat template is rendered around a placeholder user message and cut where the message
    would start; sampling from there (temperature 1, top-p 0.95, one seed per request) makes
    the instruction-tuned target write a user's request, ended by its end-of-turn token.
    Requests cut off by the length limit, repeats and near-copies of `held_out_texts` are
    dropped (`keep_self_prompt`). Deterministic for a given seed and machine."""
    from aither_jax.sampling import SamplingParams

    rendered = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": SELF_PROMPT_PLACEHOLDER}], add_generation_prompt=False
    )
    if rendered.count(SELF_PROMPT_PLACEHOLDER) != 1:
        raise RuntimeError("the chat template does not render the user message verbatim; cannot sample requests")
    prefix = llm.tokenizer.encode(rendered[: rendered.index(SELF_PROMPT_PLACEHOLDER)])
    held_out = [_word_set(t) for t in held_out_texts]
    seen: set[frozenset[str]] = set()
    out: list[list[dict]] = []
    tried = 0
    with tqdm(total=num, desc="self-written prompts", leave=False) as bar:
        while len(out) < num:
            if tried >= 20 * num + 10 * batch:
                raise RuntimeError(
                    f"only {len(out)} usable requests from {tried} samples; the target rarely writes one"
                )
            params = [
                SamplingParams(max_tokens=96, temperature=1.0, top_p=0.95, seed=(seed * 1_000_003 + tried + i) % 2**32)
                for i in range(batch)
            ]
            tried += batch
            for o in llm.generate([prefix] * batch, params, use_tqdm=False):
                text = o.text.strip()
                if o.finish_reason == "stop" and keep_self_prompt(text, seen, held_out) and len(out) < num:
                    seen.add(_word_set(text))
                    out.append([{"role": "user", "content": text}])
                    bar.update(1)
    log.info("%d self-written requests kept of %d sampled", len(out), tried)
    return out


def read_prompt_texts(path: pathlib.Path) -> list[str]:
    """The last user message of each `{"messages": [...]}` or `{"prompt": ...}` JSON line."""
    texts = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            texts.append(row["prompt"] if "prompt" in row else row["messages"][-1]["content"])
    return texts


# -- stage 2: data --------------------------------------------------------------------------


DATA_PAGE_SIZE = 16  # tokens per KV page of the target that makes the data


def generate_data(args, cfg: DraftConfig, data_dir: pathlib.Path) -> list[pathlib.Path]:
    """Writes shards of (tokens, prompt lengths, tapped hidden states); returns their paths."""
    from aither_jax.llm import LLM
    from aither_jax.sampling import SamplingParams

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
        prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(c, add_generation_prompt=True)) for c in part]
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
            prompt = tok.encode(tok.apply_chat_template(conv, add_generation_prompt=True))
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


# -- stage 3: training ----------------------------------------------------------------------


def position_weights(block_size: int, gamma: float) -> np.ndarray:
    """Loss weight of block positions 1..B-1: exp(-(i-1)/gamma) (early positions gate the rest)."""
    return np.exp(-np.arange(block_size - 1) / gamma).astype(np.float32)


def loss_fn(params: DraftParams, batch, *, cfg: DraftConfig, embed, lm_head, weights, inverse=None, soft_weight=0.0):
    """Weighted cross-entropy at masked positions, plus metrics (accuracy, expected tau).

    `lm_head` [Vd, D] holds the draft's rows; `inverse` [V] maps a token id to its row (-1 when
    the draft cannot produce it: such labels count as wrong and carry no loss). With
    `soft_weight` w > 0 the per-position loss is (1 - w) x cross-entropy with the target's greedy
    token + w x cross-entropy with the target's own next-token distribution (its top-k, within
    the draft's head, renormalized; the batch's `top_ids` and `top_log_probs`)."""
    tokens, hidden, anchors, reveal = batch["tokens"], batch["hidden"], batch["anchors"], batch["reveal"]
    n, length = tokens.shape
    a, b = anchors.shape[1], cfg.block_size
    feats = context_features(params, cfg, hidden)
    k_ctx, v_ctx = context_kv(params, cfg, feats, jnp.broadcast_to(jnp.arange(length), (n, length)))
    pos = anchors[..., None] + jnp.arange(b)  # [N, A, B]
    labels = jnp.take_along_axis(batch["labels"][:, None, :], pos, axis=2)  # [N, A, B]
    # The anchor is the committed token as written; the rest are the target's greedy choices.
    labels = labels.at[..., 0].set(jnp.take_along_axis(tokens, anchors, axis=1))
    inputs = jnp.where(reveal, labels, MASK).reshape(n * a, b)
    seq_of_row = jnp.repeat(jnp.arange(n), a)
    ctx_lens = anchors.reshape(n * a)

    def attend(i, q, k, v):
        return draft_attention_dense(q, k, v, k_ctx[i][seq_of_row], v_ctx[i][seq_of_row], ctx_lens)

    h = block_forward(params, cfg, embed, inputs, pos.reshape(n * a, b), attend)[:, 1:]
    logits = vocab_logits(h, lm_head)  # [R, B-1, V]
    target = labels.reshape(n * a, b)[:, 1:]
    if inverse is not None:
        target = inverse[target]
    known = target >= 0
    target = jnp.maximum(target, 0)
    lse = jax.nn.logsumexp(logits, axis=-1)
    ce = lse - jnp.take_along_axis(logits, target[..., None], axis=-1)[..., 0]
    if soft_weight:
        ids = batch["top_ids"].reshape(n * a, b - 1, -1)
        if inverse is not None:
            ids = inverse[ids]
        usable = ids >= 0
        teacher = jax.nn.softmax(jnp.where(usable, batch["top_log_probs"].reshape(ids.shape), -1e30), axis=-1)
        student = jnp.take_along_axis(logits, jnp.maximum(ids, 0), axis=-1) - lse[..., None]
        soft = -(teacher * jnp.where(usable, student, 0.0)).sum(axis=-1)
        ce = (1.0 - soft_weight) * ce + soft_weight * jnp.where(usable.any(axis=-1), soft, ce)
    masked = ~reveal.reshape(n * a, b)[:, 1:]
    w = weights[None, :] * masked * known
    loss = (ce * w).sum() / jnp.maximum(w.sum(), 1e-6)
    correct = (jnp.argmax(logits, axis=-1) == target) & known
    full = masked.all(axis=1)  # blocks with every position masked: what greedy drafting sees
    tau = 1.0 + jnp.cumprod(correct, axis=1).sum(axis=1)
    metrics = {
        "loss": loss,
        "accuracy": (correct * masked).sum() / jnp.maximum(masked.sum(), 1),
        "tau": (tau * full).sum() / jnp.maximum(full.sum(), 1),
    }
    return loss, metrics


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
    with tqdm(total=args.steps, initial=start, desc="training draft", unit="step") as bar, log_path.open("a") as logf:
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
    manager.wait_until_finished()
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m aither_jax.train_draft", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default="runs/dflash-smollm2", help="run directory: data, checkpoints, log")
    p.add_argument("--export", help="write the trained draft here (.npz) for shipping")
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
        type=int_in("--num-chat-prompts", 0, len(all_requests())),
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
    args = parse_args(argv)
    deadline = began + args.time_limit if args.time_limit else None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save step at INFO
    if args.print_prompts:
        for conv in build_prompts(args.print_prompts, seed=args.seed, split=args.split):
            print(json.dumps({"messages": conv}))
        return 0
    from models.draft_io import save_draft
    from models.gguf_file import GGUFFile
    from models.registry import resolve_model
    from models.weights import load_weights

    gguf = GGUFFile(resolve_model(args.model))
    target_cfg = ModelConfig.from_gguf(gguf)
    error = check_target_flags(args, target_cfg)
    if error:
        sys.exit(error)
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
            sys.exit(f"--init-from-target: {e}")
    start_params = start_vocab = start_meta = None
    if args.init_draft:
        from models.draft_io import load_draft

        try:
            init_cfg, start_params, start_meta, start_vocab = load_draft(args.init_draft)
        except ValueError as e:
            sys.exit(f"--init-draft: {e}")
        if init_cfg != cfg:
            differ = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(init_cfg, f.name)]
            sys.exit(
                f"--init-draft: {args.init_draft} is a different draft ({', '.join(differ)} differ from the flags')"
            )
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "draft_config.json"
    if saved.exists() and DraftConfig.from_json(saved.read_text()) != cfg:
        sys.exit(f"{saved} holds a different draft configuration; use a new --out")
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
        sys.exit(str(e))
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
