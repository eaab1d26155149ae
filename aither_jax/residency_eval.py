"""Bounded residency's quality (`python -m aither_jax.eval residency`): a long real text
teacher-forced through the model with a full cache and with each resident bound and scorer.

- Divergence: at every `stride`-th position from the smallest bound on (before it every run
  equals the full cache), KL(full || bounded) of the next-token distributions and top-1
  agreement.
- Passkey retrieval: "The pass key is NNNNN." buried at depths 10 / 50 / 90% of a document
  built from the same text, then asked for; counted at the lengths where the full cache
  retrieves it at every depth.
Scorers are those of aither_jax/core/bounded.py; `window` is the sinks + sliding-window
baseline (StreamingLLM).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

DEPTHS = (0.1, 0.5, 0.9)
PASSKEY_QUESTION = "What is the pass key? Answer with the number only."


def default_text() -> tuple[str, str]:
    """(text, source): the Python language reference's topics, in order (pydoc_data)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)), "Python language reference (pydoc_data.topics)"


@dataclasses.dataclass
class ResidencySettings:
    model: str = "smollm2-135m"
    num_tokens: int = 4096
    fractions: tuple[float, ...] = (0.1, 0.25, 0.5)
    scorers: tuple[str, ...] = ("attention", "qk", "lru", "window")
    tau: int = 64
    stride: int = 4
    passkey_lengths: tuple[int, ...] = (2048, 4096)
    dtype: str = "auto"
    text: str | None = None
    source: str | None = None


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def bound_tokens(fraction: float, num_tokens: int, page_size: int = 16) -> int:
    return max(page_size, int(fraction * num_tokens) // page_size * page_size)


def passkey_prompt(tokenizer, filler: list[int], length: int, depth: float, key: int) -> list[int]:
    """A chat prompt of about `length` tokens: a document of `filler` tokens with the pass-key
    sentence at `depth`, then the question."""
    from aither_jax.context.prompt import chat_prompt

    needle = f" The pass key is {key}. Remember it: {key}. "
    frame = chat_prompt(tokenizer, [{"role": "user", "content": "\n\n" + PASSKEY_QUESTION}]).ids
    body = length - len(frame) - len(tokenizer.encode(needle))
    cut = int(depth * body)
    text = tokenizer.decode(filler[:cut]) + needle + tokenizer.decode(filler[cut:body])
    return chat_prompt(tokenizer, [{"role": "user", "content": text + "\n\n" + PASSKEY_QUESTION}]).ids


def _passkeys(llm, filler, lengths, rng_seed=0) -> dict[str, bool]:
    from aither_jax.device.sampling import SamplingParams

    rng = np.random.default_rng(rng_seed)
    out = {}
    params = SamplingParams(max_tokens=10, temperature=0.0)
    for length in lengths:
        for depth in DEPTHS:
            key = int(rng.integers(10000, 99999))
            ids = passkey_prompt(llm.tokenizer, filler, length, depth, key)
            text = llm.generate([ids], params, use_tqdm=False)[0].text
            out[f"{length}@{depth:.0%}"] = str(key) in text
    return out


def run(settings: ResidencySettings, progress=print) -> dict:
    """The report: the full cache's passkeys, then a row per (bound, scorer)."""
    import aither_jax as aj

    text, source = (settings.text, settings.source) if settings.text else default_text()
    common = dict(dtype=settings.dtype, max_num_seqs=1, progress=False)
    longest = max([settings.num_tokens, *settings.passkey_lengths]) + 64
    full = aj.LLM(settings.model, **common, max_model_len=longest)
    ids = full.tokenizer.encode(text)
    if len(ids) < settings.num_tokens:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than the {settings.num_tokens} asked for")
    ids = ids[: settings.num_tokens]
    page = full.engine.page_size

    def bounded(fraction: float, scorer: str):
        try:
            return aj.LLM(
                settings.model, **common, max_model_len=longest,
                max_resident_tokens=bound_tokens(fraction, settings.num_tokens, page), residency_scorer=scorer,
                residency_tau=settings.tau,
            )  # fmt: skip
        except ValueError as e:
            raise ValueError(f"resident share {fraction:g} of {settings.num_tokens} tokens: {e}") from None

    # The smallest and largest shares are built once first: one that cannot be served fails
    # now, not after the full cache's run.
    for fraction in {min(settings.fractions), max(settings.fractions)}:
        bounded(fraction, settings.scorers[0])
    first = bound_tokens(min(settings.fractions), settings.num_tokens, page)
    positions = np.arange(first, settings.num_tokens - 1, settings.stride)
    targets = np.asarray(ids)[positions + 1]
    start = time.perf_counter()
    ref = _log_softmax(full.engine.forward(ids, positions=positions)[0])
    full_seconds = time.perf_counter() - start
    ref_nll = float(-ref[np.arange(len(positions)), targets].mean())
    progress(f"full cache: {len(ids)} tokens in {full_seconds:.1f} s, NLL {ref_nll:.3f}")
    filler = ids
    full_keys = _passkeys(full, filler, settings.passkey_lengths)
    lengths = [n for n in settings.passkey_lengths if all(v for k, v in full_keys.items() if k.startswith(f"{n}@"))]
    progress(f"full cache passkeys: {full_keys} (lengths retrieved at every depth: {lengths})")
    del full
    rows = []
    for fraction in settings.fractions:
        bound = bound_tokens(fraction, settings.num_tokens, page)
        for scorer in settings.scorers:
            llm = bounded(fraction, scorer)
            start = time.perf_counter()
            got = _log_softmax(llm.engine.forward(ids, positions=positions)[0])
            seconds = time.perf_counter() - start
            held = positions >= bound  # positions whose context outgrew the bound
            kl = (np.exp(ref) * (ref - got)).sum(-1)
            keys = _passkeys(llm, filler, lengths) if lengths else {}
            row = {
                "residency": fraction,
                "max_resident_tokens": bound,
                "scorer": scorer,
                "kl": float(kl[held].mean()),
                "top1_agreement": float((ref.argmax(-1) == got.argmax(-1))[held].mean()),
                "nll": float(-got[np.arange(len(positions)), targets].mean()),
                "positions": int(held.sum()),
                "seconds": round(seconds, 2),
                "passkey": keys,
                "passkey_retrieved": sum(keys.values()),
                "passkey_asked": len(keys),
            }
            rows.append(row)
            progress(
                f"{fraction:>4.0%} {scorer:9s} KL {row['kl']:.4f} top-1 {row['top1_agreement']:.3f} "
                f"passkey {row['passkey_retrieved']}/{row['passkey_asked']} ({seconds:.1f} s)"
            )
            del llm
    return {
        "model": settings.model,
        "text": source,
        "num_tokens": settings.num_tokens,
        "stride": settings.stride,
        "tau": settings.tau,
        "full_nll": ref_nll,
        "full_seconds": round(full_seconds, 2),
        "full_passkey": full_keys,
        "passkey_lengths": lengths,
        "rows": rows,
    }


def table(report: dict) -> str:
    lines = [
        f"{report['model']}: {report['num_tokens']} tokens of {report['text']}; full-cache NLL "
        f"{report['full_nll']:.3f}; passkey lengths {report['passkey_lengths']}",
        f"{'residency':>9} {'tokens':>6} {'scorer':9s} {'KL':>8} {'top-1':>6} {'passkey':>7}",
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['residency']:>9.0%} {r['max_resident_tokens']:>6} {r['scorer']:9s} {r['kl']:>8.4f} "
            f"{r['top1_agreement']:>6.3f} {r['passkey_retrieved']:>3}/{r['passkey_asked']:<3}"
        )
    return "\n".join(lines)


def plot(report: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for scorer in dict.fromkeys(r["scorer"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["scorer"] == scorer]
        ax.plot([r["residency"] * 100 for r in rows], [r["kl"] for r in rows], marker="o", label=scorer)
    ax.set_yscale("log")
    ax.set_xlabel("resident share of the context (%)")
    ax.set_ylabel("KL(full cache || bounded), nats")
    ax.set_title(f"{report['model']}: {report['num_tokens']} tokens, bounded residency")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
