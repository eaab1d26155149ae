"""Answer-level fidelity of KV cache formats: do users get the same answers?

Perplexity and KL divergence average over every position of a text; a format can keep both
within a percent and still change what a chat model answers, because one flipped greedy token
early in an answer sends the rest elsewhere. This measures answers: greedy replies to chat
prompts (`fidelity_prompts.json`, written for this and kept out of every fitting) with each
format against the same model with an unquantized (float32) cache, float32 weights throughout:

- identical: replies whose first `max_tokens` tokens equal the unquantized cache's;
- mean common prefix: tokens the replies share before they part;
- factual: short questions with one unambiguous answer; a format breaks one when the
  unquantized cache's reply contains an accepted answer and the format's does not;
- the replies that differ, side by side.

    python -m aither_jax.eval fidelity --kv-cache-dtype auto tq8 bf16
"""

from __future__ import annotations

import dataclasses
import gc
import json
import pathlib

from tqdm.auto import tqdm

from models.kv_spec import parse_kv_spec

PROMPTS = pathlib.Path(__file__).resolve().parent / "fidelity_prompts.json"
REFERENCE = "fp32"


@dataclasses.dataclass
class FormatAnswers:
    kv_cache_dtype: str
    chat: list[list[int]]  # token ids of each chat reply
    chat_text: list[str]
    factual_text: list[str]


def load_prompts(path: str | pathlib.Path = PROMPTS) -> tuple[list[str], list[dict]]:
    """(chat prompts, factual items {"question", "answers"}). Raises ValueError for a file
    that is not such a set."""
    try:
        data = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON prompt set ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f'{path}: expected a JSON object with "chat" (and "factual"), got a {type(data).__name__}')
    chat, factual = data.get("chat"), data.get("factual", [])
    if not isinstance(chat, list) or not chat or not all(isinstance(p, str) and p for p in chat):
        raise ValueError(f'{path}: "chat" must be a non-empty list of strings')
    if not isinstance(factual, list):
        raise ValueError(f'{path}: "factual" must be a list of {{"question", "answers"}} items')
    for n, item in enumerate(factual):
        question, answers = (item.get("question"), item.get("answers")) if isinstance(item, dict) else (None, None)
        if not (
            isinstance(question, str)
            and question
            and isinstance(answers, list)
            and answers
            and all(isinstance(a, str) and a.strip() for a in answers)
        ):
            # A bare string of answers would be matched one character at a time.
            raise ValueError(
                f'{path}: "factual" item {n} needs a non-empty "question" and "answers", a non-empty list of '
                "non-empty strings"
            )
    return chat, factual


def answers(model: str, kv_cache_dtype: str, chat: list[str], factual: list[dict], *, max_tokens: int, batch: int):
    """Greedy replies of `model` (float32 weights) with one KV format."""
    import aither_jax as aj

    llm = aj.LLM(model, "float32", kv_cache_dtype=kv_cache_dtype, max_model_len=512, max_num_seqs=batch, progress=False)
    params = aj.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    conversations = [[{"role": "user", "content": p}] for p in chat]
    replies = llm.chat(conversations, params, use_tqdm=False)
    facts = llm.chat([[{"role": "user", "content": f["question"]}] for f in factual], params, use_tqdm=False)
    name = llm.kv_spec.name
    compression = parse_kv_spec("bf16").bytes_per_token(llm.config) / llm.kv_spec.bytes_per_token(llm.config)
    del llm
    gc.collect()
    out = FormatAnswers(name, [r.token_ids for r in replies], [r.text for r in replies], [r.text for r in facts])
    return out, compression


def knows(text: str, item: dict) -> bool:
    return any(a.lower() in text.lower() for a in item["answers"])


def compare(reference: FormatAnswers, other: FormatAnswers, chat: list[str], factual: list[dict]) -> dict:
    """The fidelity figures of `other` against `reference` (see the module docstring)."""
    same = [a == b for a, b in zip(reference.chat, other.chat, strict=True)]
    prefixes = [_common_prefix(a, b) for a, b in zip(reference.chat, other.chat, strict=True)]
    known = [knows(t, f) for t, f in zip(reference.factual_text, factual, strict=True)]
    kept = [knows(t, f) for t, f in zip(other.factual_text, factual, strict=True)]
    broken = [f["question"] for f, k, o in zip(factual, known, kept, strict=True) if k and not o]
    differ = [
        {"prompt": p, "reference": r, "format": o}
        for p, r, o, s in zip(chat, reference.chat_text, other.chat_text, same, strict=True)
        if not s
    ]
    return {
        "kv_cache_dtype": other.kv_cache_dtype,
        "identical": sum(same),
        "prompts": len(same),
        "identical_share": sum(same) / len(same),
        "mean_common_prefix": sum(prefixes) / len(prefixes),
        "factual_known_by_reference": sum(known),
        "factual_kept": sum(k and o for k, o in zip(known, kept, strict=True)),
        "factual_broken": broken,
        "differing": differ,
    }


def run_fidelity(
    model: str,
    formats: list[str],
    *,
    prompts: str | pathlib.Path = PROMPTS,
    max_tokens: int = 24,
    batch: int = 8,
    progress: bool = False,
) -> dict:
    """The unquantized cache's replies, then each format's figures against them; `progress`
    shows a bar over the formats (the reference first) on stderr."""
    chat, factual = load_prompts(prompts)
    with tqdm(total=len(formats) + 1, desc="answering", unit="format", disable=not progress) as bar:
        bar.set_postfix_str(REFERENCE)
        reference, _ = answers(model, REFERENCE, chat, factual, max_tokens=max_tokens, batch=batch)
        bar.update()
        rows = []
        for fmt in formats:
            bar.set_postfix_str(fmt if len(fmt) <= 24 else fmt[:21] + "...")
            got, compression = answers(model, fmt, chat, factual, max_tokens=max_tokens, batch=batch)
            rows.append(
                {"requested": fmt, "compression_vs_bf16": compression, **compare(reference, got, chat, factual)}
            )
            bar.update()
    return {
        "model": model,
        "max_tokens": max_tokens,
        "reference": REFERENCE,
        "prompts": str(prompts),
        "reference_factual": [
            {"question": f["question"], "reply": t, "known": knows(t, f)}
            for f, t in zip(factual, reference.factual_text, strict=True)
        ],
        "rows": rows,
    }


def table(report: dict) -> str:
    rows = report["rows"]
    w = max(16, *(len(r["kv_cache_dtype"]) for r in rows))
    known = rows[0]["factual_known_by_reference"] if rows else 0
    lines = [
        f"{report['model']}: greedy replies ({report['max_tokens']} tokens) against {report['reference']} KV; "
        f"factual questions the {report['reference']} cache answers: {known}",
        f"{'kv_cache_dtype':<{w}} {'vs bf16':>8} {'identical':>10} {'common prefix':>14} {'factual kept':>13}",
    ]
    for r in rows:
        lines.append(
            f"{r['kv_cache_dtype']:<{w}} {r['compression_vs_bf16']:>7.2f}x {r['identical']:>4}/{r['prompts']:<4} "
            f"{r['identical_share']:>5.0%}{r['mean_common_prefix']:>9.1f} tok {r['factual_kept']:>6}/{known}"
        )
    return "\n".join(lines)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
