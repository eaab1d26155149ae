"""Draft training on a tiny synthetic task: the loss falls, a run resumes from its orbax
checkpoint with the same state, and the exported draft loads."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from aither_jax import chat_prompts as chat_prompts_module
from aither_jax.train_draft import (
    Dataset,
    build_prompts,
    keep_self_prompt,
    parse_args,
    position_weights,
    read_prompt_texts,
    self_prompts,
    train,
)
from models.draft import DraftConfig
from models.draft_io import load_draft, save_draft

V, D, TAPS = 64, 32, 2


def _config():
    return DraftConfig(
        vocab_size=V, hidden_size=D, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=48, target_layers=(0, 1), target_num_layers=2, block_size=6,
    )  # fmt: skip


def _shard(path, rng, num_seqs=24, length=48):
    """Sequences a small draft can learn quickly: two tokens alternating. The "hidden states"
    are a fixed code of each position's token, so the draft can also learn to continue pairs
    it never saw by reading them from the context."""
    code = np.random.default_rng(99).standard_normal((V, TAPS * D))
    toks, hidden = [], []
    for _ in range(num_seqs):
        a, b = rng.integers(V, size=2)
        toks.append(np.asarray([a, b] * (length // 2), np.int32))
        hidden.append(code[toks[-1]].astype(np.float16))
    np.savez(
        path,
        tokens=np.concatenate(toks),
        lengths=np.full(num_seqs, length, np.int32),
        prompt_lengths=np.full(num_seqs, 4, np.int32),
        hidden=np.concatenate(hidden),
    )
    return path


def _args(out, steps, **extra):
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
    lm_head = embed.T
    final_norm = jnp.ones(D)

    params = train(_args(tmp_path, 80, stop_after=40), cfg, data, embed, lm_head, final_norm, tmp_path)
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
    params = train(_args(tmp_path, 80), cfg, data, embed, lm_head, final_norm, tmp_path)
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
    params = train(_args(tmp_path, 30), cfg, data, embed, embed.T, jnp.ones(D), tmp_path, vocab)
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"]
    save_draft(tmp_path / "d.npz", cfg, params, vocab=vocab)
    _, _, _, vocab2 = load_draft(tmp_path / "d.npz")
    np.testing.assert_array_equal(vocab2, vocab)
    with pytest.raises(ValueError, match="sorted unique"):
        save_draft(tmp_path / "e.npz", cfg, params, vocab=vocab[::-1])


def test_position_weights_decay():
    w = position_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1.0 and np.all(np.diff(w) < 0)


def test_prompt_splits_are_disjoint():
    train_convs = build_prompts(50, seed=0)
    eval_convs = build_prompts(50, seed=0, split="eval")
    assert len(train_convs) == 50 and len(eval_convs) == 50
    assert not {c[0]["content"] for c in train_convs} & {c[0]["content"] for c in eval_convs}


def _eval_prompts():
    path = pathlib.Path(__file__).parents[2] / "scripts" / "data" / "chat_eval.jsonl"
    return [json.loads(line)["messages"][-1]["content"] for line in path.read_text().splitlines() if line.strip()]


def test_chat_prompts_stay_apart_from_the_evaluation_set():
    evals = _eval_prompts()
    assert len(evals) == 40
    chat_prompts_module.check_disjoint(evals)  # raises on a shared topic or request
    requests = chat_prompts_module.all_requests()
    assert len(set(requests)) == len(requests) >= 768
    convs = chat_prompts_module.chat_prompts(768, seed=0)
    assert convs == chat_prompts_module.chat_prompts(768, seed=0)  # reproducible
    assert len({c[0]["content"] for c in convs}) == 768
    assert not {c[0]["content"] for c in convs} & set(evals)


def test_chat_prompt_overlap_is_caught():
    topic = chat_prompts_module.topics()[5]
    with pytest.raises(ValueError, match="occurs in the evaluation prompt"):
        chat_prompts_module.check_disjoint([f"Tell me everything about {topic.upper()}, please."])
    request = chat_prompts_module.all_requests()[0]
    with pytest.raises(ValueError):
        chat_prompts_module.check_disjoint([request])
    with pytest.raises(ValueError, match="distinct chat requests"):
        chat_prompts_module.chat_prompts(len(chat_prompts_module.all_requests()) + 1, seed=0)
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
