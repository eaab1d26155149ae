"""Draft training on a tiny synthetic task: the loss falls, a run resumes from its orbax
checkpoint with the same state, and the exported draft loads."""

import functools
import json
import pathlib
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import aither_jax as aj
from aither_jax.device.sampling import SamplingParams
from aither_jax.device.steps import top_log_probs
from aither_jax.speculative.train import prompts as train_prompts
from aither_jax.speculative.train.data import Dataset, generated_arrays, tap_arrays, teacher_labels, write_shard
from aither_jax.speculative.train.loss import loss_fn, position_weights
from aither_jax.speculative.train.prompts import (
    build_prompts,
    chat_prompts,
    chat_requests,
    chat_topics,
    check_disjoint,
    document_conversations,
    held_out,
    keep_self_prompt,
    read_prompt_texts,
    self_prompts,
)
from aither_jax.speculative.train.run import parse_args, parse_start_layers, train
from models.config import ModelConfig
from models.draft import DraftConfig, context_features, context_kv, copy_target_layers, init_params
from models.draft_io import load_draft, save_draft
from models.llama import queries_and_keys
from models.weights import LayerWeights

V, D, TAPS = 64, 32, 2
_TARGET = dict(
    arch="llama", num_layers=4, hidden_size=D, ffn_size=96, num_heads=4, num_kv_heads=2, head_dim=8,
    vocab_size=V, max_context=128,
)  # fmt: skip


def _config():
    return DraftConfig(
        vocab_size=V, hidden_size=D, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=48, target_layers=(0, 1), target_num_layers=2, block_size=6,
    )  # fmt: skip


def _shard(path, rng, num_seqs=24, length=48, top_k=0):
    """Sequences a small draft can learn quickly: two tokens alternating. The "hidden states"
    are a fixed code of each position's token, so the draft can also learn to continue pairs
    it never saw by reading them from the context. With `top_k`, soft labels as the data stage
    stores them: at position t the next token (t + 1) first, then t + 2 .. t + top_k mod V."""
    code = np.random.default_rng(99).standard_normal((V, TAPS * D))
    toks, hidden = [], []
    for _ in range(num_seqs):
        a, b = rng.integers(V, size=2)
        toks.append(np.asarray([a, b] * (length // 2), np.int32))
        hidden.append(code[toks[-1]].astype(np.float16))
    tokens = np.concatenate(toks)
    extra = {}
    if top_k:
        nxt = np.concatenate([np.roll(t, -1) for t in toks])
        ids = (nxt[:, None] + np.arange(top_k)) % V
        logp = np.log(np.linspace(2.0, 1.0, top_k) / (3 * top_k))
        extra = {"top_ids": ids.astype(np.int32), "top_log_probs": np.tile(logp, (len(tokens), 1)).astype(np.float16)}
    np.savez(
        path,
        tokens=tokens,
        lengths=np.full(num_seqs, length, np.int32),
        prompt_lengths=np.full(num_seqs, 4, np.int32),
        hidden=np.concatenate(hidden),
        **extra,
    )
    return path


def _args(out, steps, **extra):
    """Training arguments for the tiny task; hard labels only unless `soft_weight` is given."""
    extra = {"soft_weight": 0.0} | extra
    argv = ["--out", str(out), "--steps", str(steps), "--batch-seqs", "4", "--anchors", "4", "--lr", "3e-3"]
    argv += ["--log-every", "5", "--save-every", "20", "--warmup", "5"]
    for k, v in extra.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return parse_args(argv)


def test_tiny_run_learns_resumes_and_exports(tmp_path):
    rng = np.random.default_rng(0)
    cfg = _config()
    data = Dataset([_shard(tmp_path / "s0.npz", rng)], max_len=48, block_size=cfg.block_size)
    data.hold_out(0.2, seed=0)
    key = jax.random.PRNGKey(0)
    embed = jax.random.normal(key, (V, D)) * 0.5
    lm_head = embed
    final_norm = jnp.ones(D)

    params, step = train(_args(tmp_path, 80, stop_after=40), cfg, data, embed, lm_head, final_norm, tmp_path)
    assert step == 40
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log][-1] == 40
    first, last = log[0]["loss"], log[-1]["loss"]
    assert last < 0.7 * first, (first, last)
    val = [r for r in log if "val_tau" in r]  # at every checkpoint, on the held-out sequences
    assert [r["step"] for r in val] == [20, 40] and 1.0 <= val[-1]["val_tau"] <= cfg.block_size

    # The checkpoint at step 40 holds exactly the returned parameters.
    manager = ocp.CheckpointManager((tmp_path / "checkpoints").absolute())
    assert manager.latest_step() == 40
    restored = manager.restore(40, args=ocp.args.StandardRestore())
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # Resuming continues from step 40 (not from scratch) and keeps learning.
    params, step = train(_args(tmp_path, 80), cfg, data, embed, lm_head, final_norm, tmp_path)
    assert step == 80
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in log]
    assert steps == sorted(steps) and steps[-1] == 80 and steps.count(40) == 1
    assert log[-1]["loss"] < first * 0.5
    val = [r for r in log if "val_tau" in r]
    assert [r["step"] for r in val] == [20, 40, 60, 80]
    assert val[-1]["val_loss"] < 0.85 * val[0]["val_loss"]  # it continues pairs it never trained on

    save_draft(tmp_path / "d.npz", cfg, params)
    cfg2, params2, _, _ = load_draft(tmp_path / "d.npz")
    assert cfg2 == cfg and jax.tree.structure(params2) == jax.tree.structure(params)


def test_draft_vocabulary_subset_trains_and_round_trips(tmp_path):
    """A head over 16 of the 64 ids: labels outside it carry no loss and cannot be right."""
    import dataclasses

    rng = np.random.default_rng(1)
    cfg = dataclasses.replace(_config(), draft_vocab_size=16)
    data = Dataset([_shard(tmp_path / "s0.npz", rng)], max_len=48, block_size=cfg.block_size)
    vocab = data.vocab(16, V)
    assert vocab.shape == (16,) and np.all(np.diff(vocab) > 0)
    counts = np.bincount(data.tokens[data.tokens > 0], minlength=V)
    assert counts[vocab].sum() >= np.sort(counts)[::-1][:16].sum() * 0.9  # the frequent ids
    embed = jax.random.normal(jax.random.PRNGKey(0), (V, D)) * 0.5
    params, _ = train(_args(tmp_path, 30), cfg, data, embed, embed, jnp.ones(D), tmp_path, vocab)
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"]
    save_draft(tmp_path / "d.npz", cfg, params, vocab=vocab)
    _, _, _, vocab2 = load_draft(tmp_path / "d.npz")
    np.testing.assert_array_equal(vocab2, vocab)
    with pytest.raises(ValueError, match="sorted unique"):
        save_draft(tmp_path / "e.npz", cfg, params, vocab=vocab[::-1])


def test_a_deadline_ends_training_at_a_checkpointed_validated_step(tmp_path, monkeypatch):
    """The clock reads 0, 1, 2, ... (one tick per look): with the deadline at 7 the check before
    training and those after steps 1..6 pass, so step 7 is the last; it is validated and
    checkpointed although 7 is not a multiple of --save-every (20)."""
    import aither_jax.speculative.train.run as td

    ticks = iter(range(1000))
    monkeypatch.setattr(td, "clock", lambda: next(ticks))
    rng = np.random.default_rng(2)
    cfg = _config()
    data = Dataset([_shard(tmp_path / "s0.npz", rng)], max_len=48, block_size=cfg.block_size)
    data.hold_out(0.2, seed=0)
    embed = jax.random.normal(jax.random.PRNGKey(0), (V, D)) * 0.5
    params, step = train(_args(tmp_path, 80), cfg, data, embed, embed, jnp.ones(D), tmp_path, deadline=7)
    assert step == 7
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [5, 7] and "val_tau" in log[-1]
    manager = ocp.CheckpointManager((tmp_path / "checkpoints").absolute())
    assert manager.latest_step() == 7
    restored = manager.restore(7, args=ocp.args.StandardRestore())
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # A deadline already past when training would start: no step, the checkpoint as it was.
    params, step = train(_args(tmp_path, 80), cfg, data, embed, embed, jnp.ones(D), tmp_path, deadline=0)
    assert step == 7 and ocp.CheckpointManager((tmp_path / "checkpoints").absolute()).latest_step() == 7


def test_a_run_can_start_from_a_trained_drafts_parameters(tmp_path):
    """A run started from trained parameters begins where they left off: its first logged loss
    is that of the trained draft, far below a fresh start's; parameters of another shape are
    refused."""
    import dataclasses

    rng = np.random.default_rng(3)
    cfg = _config()
    data = Dataset([_shard(tmp_path / "s0.npz", rng)], max_len=48, block_size=cfg.block_size)
    embed = jax.random.normal(jax.random.PRNGKey(0), (V, D)) * 0.5
    trained, _ = train(_args(tmp_path / "a", 60), cfg, data, embed, embed, jnp.ones(D), tmp_path / "a")

    def first_loss(out):
        return json.loads((out / "train_log.jsonl").read_text().splitlines()[0])["loss"]

    train(_args(tmp_path / "b", 5), cfg, data, embed, embed, jnp.ones(D), tmp_path / "b", start_params=trained)
    train(_args(tmp_path / "c", 5), cfg, data, embed, embed, jnp.ones(D), tmp_path / "c")
    assert first_loss(tmp_path / "b") < 0.6 * first_loss(tmp_path / "c")
    wider = init_params(dataclasses.replace(cfg, intermediate_size=64), jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="do not fit"):
        train(_args(tmp_path / "d", 5), cfg, data, embed, embed, jnp.ones(D), tmp_path / "d", start_params=wider)


def test_position_weights_decay():
    w = position_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1.0 and np.all(np.diff(w) < 0)


def test_prompt_splits_are_disjoint(monkeypatch):
    # The standard library's docstrings read once for both splits.
    monkeypatch.setattr(train_prompts, "stdlib_docs", functools.cache(train_prompts.stdlib_docs))
    train_convs = build_prompts(50, seed=0)
    eval_convs = build_prompts(50, seed=0, split="eval")
    assert len(train_convs) == 50 and len(eval_convs) == 50
    assert not {c[0]["content"] for c in train_convs} & {c[0]["content"] for c in eval_convs}


def _eval_prompts():
    path = pathlib.Path(__file__).parents[4] / "scripts" / "data" / "chat_eval.jsonl"
    return [json.loads(line)["messages"][-1]["content"] for line in path.read_text().splitlines() if line.strip()]


def test_chat_prompts_stay_apart_from_the_evaluation_set():
    evals = _eval_prompts()
    assert len(evals) == 40
    check_disjoint(evals)  # raises on a shared topic or request
    requests = chat_requests()
    assert len(set(requests)) == len(requests) >= 768
    convs = chat_prompts(768, seed=0)
    assert convs == chat_prompts(768, seed=0)  # reproducible
    assert len({c[0]["content"] for c in convs}) == 768
    assert not {c[0]["content"] for c in convs} & set(evals)


def test_chat_prompt_overlap_is_caught():
    topic = chat_topics()[5]
    with pytest.raises(ValueError, match="occurs in the evaluation prompt"):
        check_disjoint([f"Tell me everything about {topic.upper()}, please."])
    request = chat_requests()[0]
    with pytest.raises(ValueError):
        check_disjoint([request])
    with pytest.raises(ValueError, match="distinct chat requests"):
        chat_prompts(len(chat_requests()) + 1, seed=0)
    with pytest.raises(SystemExit):
        parse_args(["--num-chat-prompts", "100000"])


def test_self_written_request_filter():
    evals = [frozenset(("what", "causes", "the", "seasons", "on", "earth"))]
    seen: set = set()
    assert keep_self_prompt("How do I bake sourdough bread at home?", seen, evals)
    assert not keep_self_prompt("What causes the seasons?", seen, evals)  # Jaccard 4/6 with an eval prompt
    assert not keep_self_prompt("So, what causes the seasons on Earth, really? Tell me.", seen, evals)  # contains it
    assert not keep_self_prompt("Hi there", seen, evals)  # too short
    assert not keep_self_prompt("Tell me a joke<|im_end|> please now", seen, evals)  # template markup
    assert not keep_self_prompt("word " * 81, seen, evals)  # too long
    seen.add(frozenset(("how", "do", "i", "bake", "sourdough", "bread", "at", "home")))
    assert not keep_self_prompt("How do I bake sourdough bread at home", seen, evals)  # a repeat
    with pytest.raises(SystemExit):
        parse_args(["--num-self-prompts", "-1"])
    with pytest.raises(SystemExit):
        parse_args(["--num-self-prompts", "8", "--held-out-prompts", "/nonexistent/evals.jsonl"])


def test_the_target_writes_its_own_requests(llm_f32):
    evals = _eval_prompts()
    convs = self_prompts(llm_f32, 6, seed=0, held_out_texts=evals, batch=8)
    assert len(convs) == 6 and all(len(c) == 1 and c[0]["role"] == "user" for c in convs)
    texts = [c[0]["content"] for c in convs]
    assert len(set(texts)) == 6
    assert not set(texts) & set(evals)
    for t in texts:
        assert t == t.strip() and len(t.split()) >= 4 and "<|" not in t
    # Requests read like requests: most end in a question mark or start with a request word.
    asks = sum(t.endswith("?") or t.split()[0].lower() in {"can", "write", "please", "i", "how", "what"} for t in texts)
    assert asks >= 3, texts
    assert self_prompts(llm_f32, 6, seed=0, held_out_texts=evals, batch=8) == convs  # reproducible
    assert self_prompts(llm_f32, 6, seed=1, held_out_texts=evals, batch=8) != convs


def test_prompt_files_are_read_in_both_forms(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a b"}\n\n{"messages": [{"role": "user", "content": "c d"}]}\n')
    assert read_prompt_texts(path) == ["a b", "c d"]


def test_held_out_sequences_never_reach_training_batches(tmp_path):
    data = Dataset([_shard(tmp_path / "s0.npz", np.random.default_rng(1))], max_len=48, block_size=6)
    data.hold_out(0.25, seed=3)
    assert len(data.val_rows) == 6 and not set(data.val_rows) & set(data.train_rows)
    held = {tuple(data.tokens[i, :2]) for i in data.val_rows}
    rng = np.random.default_rng(0)
    seen = {tuple(t[:2]) for _ in range(50) for t in data.batch(rng, 8, 2, 0.0)["tokens"]}
    assert not seen & held and seen  # (each sequence alternates its own two tokens)
    assert {tuple(t[:2]) for t in data.batch(rng, 8, 2, 0.0, val=True)["tokens"]} <= held
    with pytest.raises(ValueError, match="leaves none"):
        data.hold_out(1.0, seed=0)


def test_top_log_probs_match_a_full_sort():
    logits = np.random.default_rng(0).standard_normal((2, 5, 40)).astype(np.float32) * 3
    full = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    ids, logp = jax.device_get(top_log_probs(jnp.asarray(logits), 6))
    assert ids.dtype == np.int32 and ids.shape == (2, 5, 6)
    np.testing.assert_array_equal(ids, np.argsort(-logits, axis=-1)[..., :6])
    np.testing.assert_allclose(logp, np.take_along_axis(full, ids, axis=-1), rtol=1e-5, atol=1e-6)
    ids, logp = top_log_probs(jnp.asarray(logits), 100)  # more than the vocabulary: all of it
    assert ids.shape == (2, 5, 40)
    np.testing.assert_allclose(np.exp(logp).sum(axis=-1), 1.0, rtol=1e-5)


def test_soft_labels_come_from_the_position_before_each_label(tmp_path):
    data = Dataset([_shard(tmp_path / "s0.npz", np.random.default_rng(2), top_k=3)], max_len=48, block_size=6)
    assert data.top_ids.shape == (24, 48, 3)
    batch = data.batch(np.random.default_rng(0), 8, 4, 0.0)
    pos = batch["anchors"][..., None] + np.arange(1, 6)  # label positions 1..B-1 of each block
    labels = np.take_along_axis(batch["tokens"][:, None, :], pos, axis=2)
    assert batch["top_ids"].shape == (8, 4, 5, 3)
    np.testing.assert_array_equal(batch["top_ids"][..., 0], labels)  # the stored next token is the label
    assert batch["top_log_probs"].dtype == np.float32 and np.isfinite(batch["top_log_probs"]).all()
    # Shards without soft labels load as before; mixing the two leaves the dataset without any.
    mixed = Dataset(
        [tmp_path / "s0.npz", _shard(tmp_path / "s1.npz", np.random.default_rng(3))], max_len=48, block_size=6
    )
    assert mixed.top_ids is None and "top_ids" not in mixed.batch(np.random.default_rng(0), 2, 2, 0.0)


def test_text_labels_are_the_targets_greedy_tokens():
    """Two sequences of 3 and 4 tokens: every position but a sequence's first takes the target's
    top choice at the position before; the first keeps its own token."""
    arrays = {
        "tokens": np.asarray([10, 11, 12, 20, 21, 22, 23], np.int32),
        "lengths": np.asarray([3, 4], np.int32),
        "top_ids": np.asarray([[5, 1], [6, 1], [7, 1], [8, 1], [9, 1], [3, 1], [4, 1]], np.int32),
    }
    np.testing.assert_array_equal(teacher_labels(arrays), [10, 5, 6, 20, 8, 9, 3])
    assert arrays["tokens"][1] == 11  # the tokens themselves are left alone


def test_loss_reads_labels_past_the_anchor_and_the_anchor_from_the_tokens(tmp_path):
    """With text the target did not write, a block's labels (what the draft must propose) are
    the target's greedy tokens, while its first position holds the token as written."""
    cfg = _config()
    data = Dataset([_shard(tmp_path / "s0.npz", np.random.default_rng(6))], max_len=48, block_size=cfg.block_size)
    # One block per sequence, so that no block's anchor is a label position of another block.
    batch = {k: jnp.asarray(v) for k, v in data.batch(np.random.default_rng(1), 6, 1, 0.0).items()}
    np.testing.assert_array_equal(batch["labels"], batch["tokens"])  # generated data: the same
    embed = jax.random.normal(jax.random.PRNGKey(0), (V, D)) * 0.5
    params = init_params(cfg, jax.random.PRNGKey(1), final_norm=jnp.ones(D))
    kw = dict(cfg=cfg, embed=embed, lm_head=embed, weights=jnp.asarray(position_weights(6, 2.0)))
    n = jnp.arange(6)[:, None]
    base = loss_fn(params, batch, **kw)[0]

    def with_labels(pos):
        labels = batch["labels"].at[n, pos].set((batch["labels"][n, pos] + 1) % V)
        return loss_fn(params, batch | {"labels": labels}, **kw)[0]

    np.testing.assert_allclose(with_labels(batch["anchors"]), base, rtol=1e-6)  # anchors come from the tokens
    assert abs(float(with_labels(batch["anchors"] + 1)) - float(base)) > 1e-3  # the first proposal's label
    changed_tokens = batch | {"tokens": batch["tokens"].at[n, batch["anchors"] + 1].set(0)}
    # Past the anchor the tokens reach the loss only through the hidden states, which are unchanged.
    np.testing.assert_allclose(loss_fn(params, changed_tokens, **kw)[0], base, rtol=1e-6)


def test_document_conversations_come_from_training_modules_with_their_code():
    convs = document_conversations(40, seed=0, max_chars=600)
    assert len(convs) == 40 and convs == document_conversations(40, seed=0, max_chars=600)
    assert convs != document_conversations(40, seed=1, max_chars=600)
    for conv, answer in convs:
        assert [m["role"] for m in conv] == ["user"] and len(answer) <= 600
        assert "```python\n" in answer or len(answer) == 600
        question = conv[0]["content"]
        named = re.search(r"`([\w.]+)` module", question) or re.search(r"`([\w.]+)\.\w+`", question)
        assert named and not held_out(named.group(1)), question
    named = [c[0]["content"] for c, _ in convs]
    assert len(set(named)) > 30  # varied requests


def test_soft_loss_is_the_teacher_weighted_mix_of_hard_losses(tmp_path):
    """Cross-entropy is linear in the label distribution: with the teacher putting 0.56 / 0.24 /
    0.2 on ids c1 / c2 / c3 at every position, and c3 outside the draft's head (so the teacher
    renormalizes to 0.7 / 0.3), the soft loss equals 0.7 x the hard loss with every label c1
    plus 0.3 x the hard loss with every label c2."""
    cfg = _config()
    data = Dataset([_shard(tmp_path / "s0.npz", np.random.default_rng(4))], max_len=48, block_size=cfg.block_size)
    batch = {k: jnp.asarray(v) for k, v in data.batch(np.random.default_rng(1), 6, 1, 0.0).items()}
    c3 = int(np.setdiff1d(np.arange(V), np.asarray(batch["tokens"]))[0])  # an id no sequence uses
    c1, c2 = [c for c in (5, 9, 13) if c != c3][:2]
    vocab = jnp.asarray(np.setdiff1d(np.arange(V), [c3]))  # the head: every id but c3
    inverse = jnp.full(V, -1, jnp.int32).at[vocab].set(jnp.arange(V - 1, dtype=jnp.int32))
    shape = (6, 1, cfg.block_size - 1, 3)
    batch["top_ids"] = jnp.broadcast_to(jnp.asarray([c1, c2, c3], jnp.int32), shape)
    batch["top_log_probs"] = jnp.broadcast_to(jnp.log(jnp.asarray([0.56, 0.24, 0.2])), shape)
    embed = jax.random.normal(jax.random.PRNGKey(0), (V, D)) * 0.5
    params = init_params(cfg, jax.random.PRNGKey(1), final_norm=jnp.ones(D))
    kw = dict(cfg=cfg, embed=embed, lm_head=embed[vocab], weights=jnp.asarray(position_weights(6, 7.0)))

    def hard(label):  # every label position of each block (one anchor per sequence) set to `label`
        n = jnp.arange(6)[:, None]
        pos = batch["anchors"][:, 0, None] + jnp.arange(1, cfg.block_size)
        return loss_fn(params, batch | {"labels": batch["labels"].at[n, pos].set(label)}, inverse=inverse, **kw)[0]

    soft = loss_fn(params, batch, inverse=inverse, soft_weight=1.0, **kw)[0]
    np.testing.assert_allclose(soft, 0.7 * hard(c1) + 0.3 * hard(c2), rtol=1e-5)
    base = loss_fn(params, batch, inverse=inverse, **kw)[0]
    half = loss_fn(params, batch, inverse=inverse, soft_weight=0.5, **kw)[0]
    np.testing.assert_allclose(half, 0.5 * base + 0.5 * soft, rtol=1e-5)
    assert abs(float(soft) - float(base)) > 0.1  # the teacher really changes the loss


def test_soft_weight_trains_on_stored_soft_labels(tmp_path):
    rng = np.random.default_rng(5)
    cfg = _config()
    embed = jax.random.normal(jax.random.PRNGKey(0), (V, D)) * 0.5
    hard_only = Dataset([_shard(tmp_path / "h.npz", rng)], max_len=48, block_size=cfg.block_size)
    with pytest.raises(ValueError, match="--teacher-top-k"):  # the default weight needs soft labels
        train(parse_args(["--out", str(tmp_path)]), cfg, hard_only, embed, embed, jnp.ones(D), tmp_path)
    data = Dataset([_shard(tmp_path / "s0.npz", rng, top_k=4)], max_len=48, block_size=cfg.block_size)
    train(_args(tmp_path, 40, soft_weight=0.5), cfg, data, embed, embed, jnp.ones(D), tmp_path)
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < 0.8 * log[0]["loss"] and log[-1]["accuracy"] > log[0]["accuracy"]


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--soft-weight=1.5", "soft-weight"),
        ("--teacher-top-k=-1", "teacher-top-k"),
        ("--num-text-sequences=-1", "num-text-sequences"),
        ("--num-text-sequences=5 --teacher-top-k=0", "needs --teacher-top-k"),
    ],
)
def test_soft_label_flags_are_checked(tmp_path, flag, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--out", str(tmp_path), *flag.split()])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_one_pass_gives_logits_and_tapped_hidden_states(tiny_f32):
    """On the two-block stand-in of the target (its two blocks tapped)."""
    ids = tiny_f32.tokenizer.encode("Tap the hidden states and the logits in one pass. " * 3)
    logits, hidden = tiny_f32.engine.forward(ids, taps=(0, 1))
    np.testing.assert_array_equal(logits, tiny_f32.logits(ids))
    np.testing.assert_array_equal(hidden, tiny_f32.engine.hidden_states(ids, (0, 1)))
    assert hidden.shape == (len(ids), 2 * tiny_f32.config.hidden_size)
    assert tiny_f32.engine.forward(ids, taps=(1,), logits=False)[0] is None
    # top_k: the k best of the same logits, chosen on the device.
    (top_ids, top_logp), hidden_k = tiny_f32.engine.forward(ids, taps=(0, 1), top_k=5)
    np.testing.assert_array_equal(hidden_k, hidden)
    np.testing.assert_array_equal(top_ids, np.argsort(-logits, axis=-1, kind="stable")[:, :5])
    full = logits - np.log(np.exp(logits.astype(np.float64)).sum(axis=-1, keepdims=True))
    np.testing.assert_allclose(top_logp, np.take_along_axis(full, top_ids, axis=-1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="top_k"):
        tiny_f32.engine.forward(ids, top_k=-1)
    with pytest.raises(ValueError, match="nothing to return"):
        tiny_f32.engine.forward(ids, logits=False)
    with pytest.raises(ValueError, match="layer indices"):
        tiny_f32.engine.forward(ids, taps=(99,))


def test_generation_records_what_a_second_pass_computes(tiny_f32, tmp_path):
    """`generated_arrays` (hidden states and top-k kept by the generation's own calls) gives
    what `tap_arrays` (one more pass over each finished sequence) does: the same tokens, the
    hidden states within float16 rounding and the same top-k wherever training reads them.
    The prompts span one to three 64-token prefill chunks and run batched, on the two-block
    stand-in of the target (its two blocks tapped)."""
    llm = tiny_f32
    tok = llm.tokenizer
    texts = ["Hi", "Explain why the sky is blue, with an example about sunsets over the sea. " * 6, "A haiku."]
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    prompts = [tok.encode(c) for c in chats]
    assert max(map(len, prompts)) > 128
    params = SamplingParams(max_tokens=20, temperature=0.0)
    cfg = types.SimpleNamespace(target_layers=(0, 1))
    fused = generated_arrays(llm, cfg, prompts, params, 8, "answers")
    outs = llm.generate(prompts, params, use_tqdm=False)
    seqs = [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]
    second = tap_arrays(llm, cfg, seqs, [len(p) for p in prompts], 8, "hidden states")
    for key in ("tokens", "lengths", "prompt_lengths"):
        np.testing.assert_array_equal(fused[key], second[key])
    assert fused["hidden"].dtype == np.float16 and fused["top_log_probs"].dtype == np.float16
    ends = np.cumsum(fused["lengths"])
    for start, end, plen in zip(ends - fused["lengths"], ends, fused["prompt_lengths"], strict=True):
        # Every position but the last (sampled, never run) was run by the generation.
        h, h2 = (a["hidden"][start : end - 1].astype(np.float32) for a in (fused, second))
        np.testing.assert_allclose(h, h2, rtol=2e-3, atol=1e-3)
        assert not fused["hidden"][end - 1].any()
        # The top-k where a token was sampled: the prompt's last position and every answer position.
        answer = slice(start + plen - 1, end - 1)
        np.testing.assert_array_equal(fused["top_ids"][answer], second["top_ids"][answer])
        # At most one float16 step apart (the stand-in's near-uniform log probabilities lie
        # around -7.5, where a step is 0.004).
        np.testing.assert_array_max_ulp(fused["top_log_probs"][answer], second["top_log_probs"][answer], maxulp=1)
        assert np.isneginf(fused["top_log_probs"][start : start + plen - 1]).all()
    # Training never reads the rows that hold nothing.
    write_shard(tmp_path / "s.npz", fused)
    data = Dataset([tmp_path / "s.npz"], max_len=320, block_size=16)
    batch = data.batch(np.random.default_rng(0), 16, 8, 0.0)
    assert np.isfinite(batch["top_log_probs"]).all()
    assert llm.engine.recorder is None  # generated_arrays leaves the engine as it found it


def test_recording_survives_preemption_and_keeps_log_probabilities():
    """Four requests in a pool too small for them: some are preempted and run all their
    tokens again, and the kept states are still those of a second pass. A request that asks
    for log probabilities gets them beside its record. On the two-block stand-in of the target."""
    llm = aj.LLM(
        "smollm2-135m", dtype="float32", kv_cache_dtype="fp32", max_model_len=256, max_num_seqs=4,
        num_pages=20, max_prefill_chunk=64, progress=False, _num_layers=2,
    )  # fmt: skip
    tok = llm.tokenizer
    texts = ["Name a colour.", "Count to twenty.", "Describe a cat.", "What is rain?"]
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)) for t in texts
    ]
    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    cfg = types.SimpleNamespace(target_layers=(0, 1))
    fused = generated_arrays(llm, cfg, prompts, params, 4, "answers")
    assert llm.engine.scheduler.num_preemptions > 0
    seqs = np.split(fused["tokens"], np.cumsum(fused["lengths"])[:-1])
    second = tap_arrays(llm, cfg, [s.tolist() for s in seqs], [len(p) for p in prompts], 4, "hidden states")
    np.testing.assert_array_equal(fused["tokens"], second["tokens"])
    ends = np.cumsum(fused["lengths"])
    for start, end, plen in zip(ends - fused["lengths"], ends, fused["prompt_lengths"], strict=True):
        h, h2 = (a["hidden"][start : end - 1].astype(np.float32) for a in (fused, second))
        np.testing.assert_allclose(h, h2, rtol=2e-3, atol=1e-3)
        answer = slice(start + plen - 1, end - 1)
        np.testing.assert_array_equal(fused["top_ids"][answer], second["top_ids"][answer])
    # Log probabilities while recording: the sampled token's is the record's best.
    engine = llm.engine
    engine.record(cfg.target_layers, 3)
    try:
        seq = engine.add_request(prompts[0], SamplingParams(max_tokens=5, temperature=0.0), num_logprobs=2)
        while engine.has_unfinished():
            engine.step()
        _, ids, logp = engine.take_record(seq)
    finally:
        engine.record(None)
    plen = len(prompts[0])
    assert len(seq.logprobs) == len(seq.output_ids) == 5
    for j, (token_logp, alternatives) in enumerate(seq.logprobs):
        assert seq.output_ids[j] == ids[plen - 1 + j, 0] == alternatives[0][0]
        np.testing.assert_allclose(token_logp, logp[plen - 1 + j, 0], atol=1e-4)


def test_recording_refuses_what_it_cannot_record(llm_f32, monkeypatch):
    engine = llm_f32.engine
    with pytest.raises(RuntimeError, match="nothing is recorded"):
        engine.take_record(types.SimpleNamespace(seq_id=0, num_tokens=2))
    with pytest.raises(ValueError, match="layer indices"):
        engine.record((99,))
    with pytest.raises(ValueError, match="top_k"):
        engine.record((1,), top_k=-1)
    # A refused prompt leaves nothing queued or recorded behind it.
    cfg = types.SimpleNamespace(target_layers=(1,))
    with pytest.raises(ValueError, match="maximum context length"):
        generated_arrays(llm_f32, cfg, [[1, 2, 3], [1] * 700], SamplingParams(max_tokens=4), 2, "answers")
    assert not engine.has_unfinished() and engine.recorder is None
    monkeypatch.setattr(engine, "num_scheduler_steps", 2)
    with pytest.raises(ValueError, match="plain decoding"):
        engine.record((1,))
    monkeypatch.undo()
    monkeypatch.setattr(engine.scheduler, "prefix_cache", object())
    with pytest.raises(ValueError, match="enable_prefix_caching=False"):
        engine.record((1,))
    assert engine.recorder is None


def test_draft_layers_copied_from_the_target_start_as_its_blocks(llm_f32):
    """A draft started from target layers 28 and 29: its first layer's context keys and values,
    from the features of the deepest tap (layer 27's output), equal the target's own layer-28
    keys and values of the same tokens."""
    target = llm_f32.config
    cfg = DraftConfig.for_target(target, intermediate_size=target.ffn_size)
    layers = parse_start_layers("last", cfg.num_layers, target.ffn_size, target)
    assert layers == [28, 29] and cfg.target_layers[-1] == 27
    weights = llm_f32.engine.weights
    params = copy_target_layers(init_params(cfg, jax.random.PRNGKey(0)), cfg, [weights.layers[i] for i in layers])

    ids = llm_f32.tokenizer.encode("The draft starts from the target's own last blocks. " * 2)
    _, taps = llm_f32.engine.forward(ids, taps=cfg.target_layers, logits=False)
    feats = context_features(params, cfg, jnp.asarray(taps)[None])
    k, v = context_kv(params, cfg, feats, jnp.arange(len(ids), dtype=jnp.int32)[None])
    _, keys = queries_and_keys(weights, jnp.asarray(ids), cfg=target)
    np.testing.assert_allclose(np.asarray(k[0, 0]), np.asarray(keys[28]), rtol=1e-4, atol=1e-4)
    assert not np.allclose(np.asarray(k[1, 0]), np.asarray(keys[28]), atol=1e-2)  # layer 29's projection
    lw = weights.layers[28]
    values = (np.asarray(feats[0]) @ np.asarray(lw.wqkv[target.q_size + target.kv_size :]).T).reshape(v[0, 0].shape)
    np.testing.assert_allclose(np.asarray(v[0, 0]), values, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(params["layers"]["w_down"][1]), np.asarray(weights.layers[29].w_down).T)


def test_copying_target_layers_checks_shapes_and_flags():
    target = ModelConfig(**_TARGET)
    with pytest.raises(ValueError, match="--intermediate-size 96"):
        parse_start_layers("last", 2, 48, target)
    with pytest.raises(ValueError, match="3 layers given for a draft of 2"):
        parse_start_layers("0,1,2", 2, 96, target)
    with pytest.raises(ValueError, match=r"must be in \[0, 4\)"):
        parse_start_layers("3,4", 2, 96, target)
    with pytest.raises(ValueError, match="comma-separated"):
        parse_start_layers("first", 2, 96, target)
    assert parse_start_layers("0,3", 2, 96, target) == [0, 3]
    cfg = _config()  # intermediate 48: a target block with 96 does not fit
    block = LayerWeights(
        attn_norm=jnp.ones(D), wqkv=jnp.zeros((cfg.q_size + 2 * cfg.kv_size, D)), wo=jnp.zeros((D, cfg.q_size)),
        mlp_norm=jnp.ones(D), w_gate_up=jnp.zeros((2 * 96, D)), w_down=jnp.zeros((D, 96)),
    )  # fmt: skip
    with pytest.raises(ValueError, match="w_gate_up"):
        copy_target_layers(init_params(cfg, jax.random.PRNGKey(0)), cfg, [block])
    with pytest.raises(ValueError, match="2 target layers for 1 draft layers"):
        copy_target_layers(init_params(cfg, jax.random.PRNGKey(0)), cfg, [block, block])


def test_source_segments_are_those_of_the_ast_module():
    """`_source_segment` over lines split once per module gives `ast.get_source_segment`'s
    text: multi-byte characters before a column, CRLF and CR line ends, a form feed inside a
    line, one-line and nested definitions."""
    import ast

    from aither_jax.speculative.train.prompts import _LINE, _source_segment

    source = (
        'def café(x="ü"):\r\n    """Dœc."""\r\n    return x\r\n\x0c\n'
        "class K:\r    def m(self): return 'é' \x0c # tail\r\n\n"
        "if True:\n    def inner(a,\n              b): return a + b\n"
        "def one(): return 1"
    )
    tree = ast.parse(source)
    lines = _LINE.findall(source)
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Return))]
    assert len(nodes) >= 8
    for node in nodes:
        assert _source_segment(lines, node) == ast.get_source_segment(source, node), ast.dump(node)[:60]
