"""What the speculative engine tests share: prompts, settings, the chain-of-drafts config, the
two-block stand-in target with a draft made for it, and drafts steered to a known answer."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax

import aither_jax as aj
from aither_jax.core import speculate
from models.draft import DraftConfig, init_params
from models.draft_io import save_draft
from models.registry import load_model

PROMPTS = [
    "Write a haiku about the sea.",
    "What is the difference between a list and a tuple in Python?",
    "Give me three tips for a job interview.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Count from 1 to 15, separated by commas.",
    "Explain photosynthesis to a ten-year-old.",
    "Write a Python function that reverses a string.",
    "What are the planets of the solar system?",
]
GREEDY = aj.SamplingParams(max_tokens=40, temperature=0.0)
COMMON = dict(dtype="float32", max_model_len=512, progress=False)
MAX_GAP = 0.5  # nats between the target's best token and a speculative token (TurboQuant caches)
CHAIN = {"method": "dflash", "tree": 0}  # a chain of 15 drafts on every backend (CPU's default is a tree)

# The engine tests' target: two blocks of the default model's width with random weights, its
# vocabulary and tokenizer (models.registry.load_model); it compiles in a fraction of the time.
# What they check (speculative output = plain output, caches after rollback, compiled shapes)
# does not depend on the model being any good.
STAND_IN = dict(COMMON, _num_layers=2)
# The stand-in's TurboQuant format: what the default model's measured one ("turboquant") has,
# per-layer widths, the fitted key transform (-pc, `stand_in_key_transform`) and sink tokens.
STAND_IN_TQ = "tq-k6v5-k5@0-v4@1-pc-s2"


def stand_in_llm(kv: str, max_num_seqs: int, speculative=None, *, draft: str | None = None, **options) -> aj.LLM:
    """An `LLM` on the stand-in target: KV format `kv` ("turboquant": STAND_IN_TQ), and a
    speculative config (a method name or a dict) whose dflash drafts come from `draft`."""
    if isinstance(speculative, str):
        speculative = {"method": speculative}
    if speculative is not None and speculative["method"] == "dflash":
        speculative = speculative | {"model": draft}
    return aj.LLM(
        "smollm2-135m", kv_cache_dtype=STAND_IN_TQ if kv == "turboquant" else kv, max_num_seqs=max_num_seqs,
        speculative=speculative, **{**STAND_IN, **options},
    )  # fmt: skip


def write_stand_in_draft(path) -> str:
    """A DFlash draft (random weights, one layer, block of 16) for the stand-in target: it runs
    every drafting path; `steer_drafts` then decides which of its drafts are right."""
    target = load_model("smollm2-135m", "float32", num_layers=STAND_IN["_num_layers"]).config
    cfg = DraftConfig.for_target(target, num_layers=1, intermediate_size=256, num_taps=2)
    save_draft(path, cfg, init_params(cfg, jax.random.PRNGKey(0)))
    return str(path)


def every_third_wrong(position: int) -> bool:
    return position % 3 == 2


def steer_drafts(
    engine, answers: Mapping[tuple[int, ...], list[int]], monkeypatch, wrong: Callable[[int], bool] = every_third_wrong
) -> None:
    """Lets the speculator draft as it does (the draft model runs, its context is written;
    prompt lookup alone, which finds nothing in the stand-in's text, proposes placeholders
    through `monkeypatch`), then sets each draft token to what the answer to its prompt
    (`answers[prompt ids]`: the output plain decoding gives) has at that position, except at
    output positions where `wrong` says so: there, and past the known answer, a token that is
    not the answer's. In a tree, the right tokens lie along one path that takes each node's
    second child where it has one, so accepted paths leave the draft's first choices; every
    other node is wrong. A row's drafts are then right up to a known point: verification must
    accept exactly those and nothing after."""
    if engine.speculator.drafter is None:
        monkeypatch.setattr(speculate, "ngram_propose", lambda tokens, k, **_: [0] * k)
    propose, vocab = engine.speculator.propose, engine.cfg.vocab_size

    def steered(rows):
        drafts, parents = propose(rows)
        out = []
        for i, ((seq, _), d) in enumerate(zip(rows, drafts, strict=True)):
            done = len(seq.output_ids)
            want = list(answers.get(tuple(seq.prompt_ids), []))[done:]
            chain = list(range(len(d))) if parents is None else parents[i]
            out.append(_steer(d, chain, want, done, wrong, vocab))
        return out, parents

    engine.speculator.propose = steered


def _steer(drafts, parents, want, done, wrong, vocab) -> list[int]:
    """`drafts` (node i + 1 of a tree whose node parents[i] is its parent, 0 the root) set
    right along the steered path (`steer_drafts`), `want` being the answer from the root on."""
    children: dict[int, list[int]] = {}
    depth = [0] * (len(drafts) + 1)
    for node, parent in enumerate(parents, start=1):  # a parent comes before its children
        children.setdefault(parent, []).append(node)
        depth[node] = depth[parent] + 1
    right, node = set(), 0
    while children.get(node) and depth[node] < len(want) and not wrong(done + depth[node]):
        kids = children[node]
        node = kids[1] if len(kids) > 1 else kids[0]
        right.add(node)
    out = []
    for node, token in enumerate(drafts, start=1):
        truth = want[depth[node] - 1] if depth[node] <= len(want) else None
        if node in right:
            out.append(int(truth))
        elif truth is not None and int(token) == truth:
            out.append((int(truth) + 1) % vocab)
        else:
            out.append(int(token))
    return out
