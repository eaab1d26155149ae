"""Where a DFlash draft's guesses rank, and what other ways of drafting would commit.

The target decodes held-out chat prompts greedily (float32 weights and KV). Then, at every
answer position, the draft fills a fully masked block (one denoising step) over the target's
tapped hidden states of the text before it, exactly as in a speculative step, and the script
records where each of the target's next 15 tokens ranks among the draft's guesses for that
block position. From the ranks it reports top-k accuracy per block position and simulates
greedy speculative decoding along the target's own text:
- `chain`: the block as drafted (the engine's `{"method": "dflash", "prompt_lookup": false}`;
  its tau equals `eval acceptance`'s with fp32 KV);
- `chain+lookup`: rows with a prompt-lookup match take its drafts (the default config);
- `lookup`: prompt lookup alone;
- `tree N`: a verify pass over a tree of N drafted nodes, the N most probable prefixes under
  the draft's per-position distributions (a path's probability is the product of its
  positions'), as the engine's `{"method": "dflash", "tree": N}` drafts them (`--width`
  guesses per position, the engine's 8).
Nothing is timed. Writes JSON (`--out`).

    .venv/bin/python scripts/draft_ranks.py [--draft F.npz] [--prompts scripts/data/chat_eval.jsonl] \\
        [--max-prompts N] [--max-tokens 96] [--trees 4 16 64] [--width 8] [--out out/draft_ranks.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aither_jax.speculative.dflash import best_prefixes  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft", default=None, help="draft file (default: the one shipped for the model)")
    p.add_argument("--prompts", default=str(ROOT / "scripts" / "data" / "chat_eval.jsonl"))
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--trees", type=int, nargs="*", default=[4, 16, 64], help="tree sizes (drafted nodes) to simulate")
    p.add_argument(
        "--width", type=int, default=8, help="guesses per block position a tree may branch into (the engine's: 8)"
    )
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "out" / "draft_ranks.json")
    args = p.parse_args(argv)
    if args.max_tokens < 1 or (args.max_prompts is not None and args.max_prompts < 1):
        p.error("--max-tokens and --max-prompts must be at least 1")
    if any(n < 1 for n in args.trees):
        p.error("--trees sizes must be at least 1")
    if args.width < 1:
        p.error("--width must be at least 1")
    return args


# -- simulation (pure numpy; tests/test_draft_ranks.py) ------------------------------------


def accepted_chain(ranks: np.ndarray, limit: int) -> int:
    """Leading block positions whose token is the draft's first choice (rank 0), at most `limit`."""
    n = 0
    while n < min(limit, len(ranks)) and ranks[n] == 0:
        n += 1
    return n


def accepted_tree(ranks: np.ndarray, tree: set[tuple[int, ...]]) -> int:
    """Leading block positions whose rank path lies in the tree (ranks < 0: past the text)."""
    n = 0
    while n < len(ranks) and ranks[n] >= 0 and tuple(int(r) for r in ranks[: n + 1]) in tree:
        n += 1
    return n


def accepted_drafts(drafts: list[int], truth: np.ndarray) -> int:
    n = 0
    while n < min(len(drafts), len(truth)) and drafts[n] == truth[n]:
        n += 1
    return n


def walk(num_anchors: int, accept) -> list[int]:
    """Greedy speculative decoding along a text: from anchor 0, each verify pass commits
    accept(anchor) drafts plus the bonus token. Returns the tokens committed per pass."""
    taus, i = [], 0
    while i < num_anchors:
        n = accept(i)
        taus.append(n + 1)
        i += n + 1
    return taus


# -- the model part -----------------------------------------------------------------------


def draft_ranks(args) -> dict:
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from aither_jax.context.prompt import file_prompts, read_prompts
    from aither_jax.device.sampling import SamplingParams
    from aither_jax.llm import LLM
    from aither_jax.speculative.ngram import ngram_propose
    from aither_jax.speculative.train.data import tap_arrays
    from models.draft import MASK, block_forward, context_features, context_kv
    from models.draft_io import load_draft
    from models.llama import vocab_logits
    from models.registry import shipped_draft
    from pallas_kernels.draft_attention import draft_attention_dense

    path = args.draft or shipped_draft(args.model)
    if path is None:
        sys.exit(f"no draft ships for {args.model}; pass --draft")
    cfg, params, meta, vocab = load_draft(path)
    llm = LLM(args.model, dtype="float32", kv_cache_dtype="fp32", max_num_seqs=8, progress=False)
    cfg.check_target(llm.config)
    ids = [p.ids for p in file_prompts(llm.tokenizer, read_prompts(args.prompts)[: args.max_prompts])]
    outs = llm.generate(ids, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), use_tqdm=True)
    seqs = [list(p) + o.token_ids for p, o in zip(ids, outs, strict=True)]
    arrays = tap_arrays(llm, cfg, seqs, [len(p) for p in ids], 0, "hidden states")
    embed = jnp.asarray(llm.engine.weights.embed, jnp.float32)
    head = jnp.asarray(llm.engine.weights.lm_head, jnp.float32)
    inverse = np.arange(cfg.vocab_size)
    if vocab is not None:
        head = head[jnp.asarray(vocab)]
        inverse = np.full(cfg.vocab_size, -1, np.int64)
        inverse[vocab] = np.arange(len(vocab))
    b = cfg.block_size

    @jax.jit
    def block_logp(hidden, tokens, anchors):  # [1, L, taps*D], [L], [A] -> [A, B-1, Vd]
        feats = context_features(params, cfg, hidden)
        k_ctx, v_ctx = context_kv(params, cfg, feats, jnp.arange(tokens.shape[0])[None])
        a = anchors.shape[0]
        inputs = jnp.concatenate([tokens[anchors][:, None], jnp.full((a, b - 1), MASK, jnp.int32)], axis=1)
        rows = jnp.zeros(a, jnp.int32)

        def attend(i, q, k, v):
            return draft_attention_dense(q, k, v, k_ctx[i][rows], v_ctx[i][rows], anchors)

        h = block_forward(params, cfg, embed, inputs, anchors[:, None] + jnp.arange(b), attend)[:, 1:]
        return jax.nn.log_softmax(vocab_logits(h, head), axis=-1)

    starts = np.cumsum(arrays["lengths"]) - arrays["lengths"]
    per_seq = []
    for s in tqdm(range(len(seqs)), desc="draft blocks"):
        st, n, pl = int(starts[s]), int(arrays["lengths"][s]), int(arrays["prompt_lengths"][s])
        tokens = arrays["tokens"][st : st + n]
        pad = -n % 64 + b  # a few padded lengths compile once each
        toks = np.concatenate([tokens, np.zeros(pad, np.int32)])
        hidden = np.pad(arrays["hidden"][st : st + n].astype(np.float32), ((0, pad), (0, 0)))
        anchors = np.arange(pl - 1, n - 1)  # the prompt's last token onward
        logp = np.asarray(block_logp(jnp.asarray(hidden[None]), jnp.asarray(toks), jnp.asarray(anchors)))
        pos = anchors[:, None] + 1 + np.arange(b - 1)
        inside = pos < n
        label = inverse[toks[pos]]
        label_logp = np.take_along_axis(logp, np.maximum(label, 0)[..., None], -1)[..., 0]
        ranks = (logp > label_logp[..., None]).sum(-1)
        ranks = np.where(label >= 0, ranks, 1 << 30)  # outside the draft's head: never guessed
        ranks = np.where(inside, ranks, -1)
        top = -np.sort(-logp, axis=-1)[..., : args.width]
        per_seq.append((tokens, pl, ranks, top))
    return summarize(args, per_seq, ngram_propose, b)


def simulate_text(tokens, plen: int, ranks: np.ndarray, top: np.ndarray, trees, ngram_propose):
    """Tokens committed per verify pass by each way of drafting along one text, and how many
    chain+lookup passes took prompt lookup's drafts. Anchor i is the text's token plen - 1 + i."""
    k = ranks.shape[1]
    truth = [tokens[plen + i : plen + i + k] for i in range(len(ranks))]
    lookups = [ngram_propose(list(tokens[: plen + i]), k) for i in range(len(ranks))]
    hybrid = [
        accepted_drafts(d, t) if d else accepted_chain(r, k) for d, t, r in zip(lookups, truth, ranks, strict=True)
    ]
    taus = {
        "chain": walk(len(ranks), lambda i: accepted_chain(ranks[i], k)),
        "chain+lookup": walk(len(ranks), hybrid.__getitem__),
        "lookup": walk(len(ranks), lambda i: accepted_drafts(lookups[i], truth[i])),
    }
    for n in trees:
        taus[f"tree {n}"] = walk(len(ranks), lambda i, n=n: accepted_tree(ranks[i], set(best_prefixes(top[i], n))))
    visited = np.cumsum([0] + taus["chain+lookup"])[:-1]  # the anchors chain+lookup verified at
    return taus, sum(bool(lookups[i]) for i in visited)


def summarize(args, per_seq, ngram_propose, block: int) -> dict:
    k = block - 1
    all_ranks = np.concatenate([r for _, _, r, _ in per_seq])
    accuracy = {}
    for d in range(k):
        r = all_ranks[:, d]
        r = r[r >= 0]
        accuracy[str(d + 1)] = {str(t): float(np.mean(r < t)) for t in (1, 2, 4, 8, 16)}
    first = all_ranks[:, 0] == 0
    methods: dict[str, list[int]] = {}
    lookup_passes = 0
    for tokens, plen, ranks, top in per_seq:
        taus, used = simulate_text(tokens, plen, ranks, top, args.trees, ngram_propose)
        lookup_passes += used
        for m, t in taus.items():
            methods.setdefault(m, []).extend(t)
    return {
        "draft": str(args.draft or "shipped"),
        "prompts": args.prompts,
        "num_prompts": len(per_seq),
        "max_tokens": args.max_tokens,
        "num_anchors": int(len(all_ranks)),
        "topk_accuracy_by_position": accuracy,
        "second_given_first": float(np.mean(all_ranks[first, 1] == 0)) if first.any() else None,
        "tau": {m: float(np.mean(t)) for m, t in methods.items()},
        "verify_passes": {m: len(t) for m, t in methods.items()},
        "lookup_passes_in_chain+lookup": lookup_passes,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    report = draft_ranks(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for d in ("1", "2", "3", "4"):
        acc = report["topk_accuracy_by_position"][d]
        print(f"block position {d}: " + ", ".join(f"top-{t} {v:.3f}" for t, v in acc.items()))
    print("simulated tau: " + ", ".join(f"{m} {t:.3f}" for m, t in report["tau"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
