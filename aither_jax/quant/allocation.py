"""Per-layer bit allocation for TurboQuant KV formats (`python -m aither_jax.eval allocate`).

Layers differ a lot in how much their keys and values can be rounded: on SmolLM2 one layer's
4-bit keys cost more KL than twenty others together. This measures each layer side alone
(that side quantized at a probe width, everything else bf16) on one or more texts, then spends
a bytes-per-token budget greedily on the mean, and scores the resulting format on those texts
and on held-out ones.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from tqdm.auto import tqdm

from aither_jax.quant.scoring import FormatScorer
from models.kv_spec import parse_kv_spec
from pallas_kernels.turboquant import tq_vector_bytes

Key = tuple[str, int]  # ("k" or "v", layer)


def allocate_bits(
    sensitivity: dict[Key, float],
    probe_bits: dict[str, int],
    min_bits: dict[str, int],
    vector_bytes: dict[str, dict[int, int]],
    budget_bytes: int,
    heads: int,
) -> tuple[dict[Key, int], float, int]:
    """Greedy per-layer bits under a bytes-per-token budget.

    Model: a layer side's KL at b bits is its measured KL at the probe width times
    4^-(b - probe) (each bit quarters the codec's error), and contributions add across layers
    and sides (on SmolLM2, tq-k6v4's KL is the sum of its keys-only and values-only KL within
    2%). From `min_bits`, each next bit goes where it removes the most predicted KL per byte.

    Returns:
        bits per (side, layer), the predicted KL, the bytes per token used.
    """

    def kl(key: Key, b: int) -> float:
        return sensitivity[key] * 4.0 ** (probe_bits[key[0]] - b)

    def step_cost(key: Key, b: int) -> int:
        return (vector_bytes[key[0]][b + 1] - vector_bytes[key[0]][b]) * heads

    bits = {key: min_bits[key[0]] for key in sensitivity}
    used = sum(vector_bytes[side][b] for (side, _), b in bits.items()) * heads
    if used > budget_bytes:
        raise ValueError(f"the budget of {budget_bytes} B/token is below the minimum widths' {used} B/token")
    while True:
        options = [((kl(k, b) - kl(k, b + 1)) / step_cost(k, b), k) for k, b in bits.items() if b < 8]
        options = [(gain, k) for gain, k in options if used + step_cost(k, bits[k]) <= budget_bytes]
        if not options:
            break
        _, key = max(options)
        used += step_cost(key, bits[key])
        bits[key] += 1
    return bits, sum(kl(k, b) for k, b in bits.items()), used


def spec_name(bits: dict[Key, int], num_layers: int) -> str:
    """A format name for per-layer bits: the commonest widths as the base, the rest as overrides."""
    per_side = {side: [bits[(side, i)] for i in range(num_layers)] for side in ("k", "v")}
    base = {side: max(sorted(set(b)), key=b.count) for side, b in per_side.items()}
    name = f"tq-k{base['k']}v{base['v']}"
    for side in ("k", "v"):
        for width in sorted(set(per_side[side]) - {base[side]}):
            layers = ",".join(str(i) for i, b in enumerate(per_side[side]) if b == width)
            name += f"-{side}{width}@{layers}"
    return name


def probe_name(side: str, layer: int, bits: int, num_layers: int) -> str:
    """The format with only `side` of `layer` quantized (at `bits`), everything else bf16."""
    other = "v" if side == "k" else "k"
    name = f"tq{bits}-{other}bf16@" + ",".join(map(str, range(num_layers)))
    rest = ",".join(str(j) for j in range(num_layers) if j != layer)
    return name + (f"-{side}bf16@{rest}" if rest else "")


def run_allocate(args) -> dict:
    """Probes every layer side on each --text-file, allocates from the mean KL, and scores each
    plan on the fitted texts and on the --held-out-file texts.

    Returns {"texts", "held_out", "probes": [{side, layer, bits, kl_divergence (mean),
    kl_by_text}], "plans": [{format fields, target_compression, predicted_kl_divergence,
    kl_divergence / perplexity_change_pct / top1_agreement (means over the fitted texts),
    by_text: [the scorer's row per text, with held_out]}]}.
    """
    fitted = [FormatScorer(args.model, args.dtype, path, args.max_tokens, args.chunk) for path in args.text_file]
    cfg = fitted[0].llm.config
    n = cfg.num_layers
    probe = {"k": args.probe_key_bits, "v": args.probe_value_bits}
    vector_bytes = {side: {b: tq_vector_bytes(cfg.head_dim, b) for b in range(2, 9)} for side in "kv"}
    bf16_bytes = fitted[0].bf16_bytes
    floor = 2 * n * cfg.num_kv_heads * vector_bytes["k"][args.min_bits]
    for compression in args.compression:
        if bf16_bytes / compression < floor:
            raise ValueError(
                f"--compression {compression:g} needs at most {int(bf16_bytes / compression)} B/token, "
                f"below the {floor} B/token of --min-bits {args.min_bits} everywhere"
            )
    held_out = [FormatScorer(args.model, args.dtype, path, args.max_tokens, args.chunk) for path in args.held_out_file]
    # Probes and plans read keys through the transform, and keep the sinks, as the plan will run.
    suffix = ("-pc" if args.key_transform else "") + (f"-s{args.sink_tokens}" if args.sink_tokens else "")
    sensitivity, probes = {}, []
    setting = {
        "model": args.model,
        "dtype": fitted[0].dtype,
        "texts": [s.text_file for s in fitted],
        "max_tokens": args.max_tokens,
        "chunk": args.chunk,
    }
    done = _load_probes(args.probes_file, setting) if args.probes_file else {}
    for side, layer in tqdm([(s, i) for s in "kv" for i in range(n)], desc="per-layer sensitivity", unit="probe"):
        spec = parse_kv_spec(probe_name(side, layer, probe[side], n) + suffix)
        kls = done.get(spec.name)
        if kls is None:
            kls = [scorer.score(spec)["kl_divergence"] for scorer in fitted]
            # Each probe format compiles its own steps and is never run again: dropping them
            # keeps a 60-probe run from exhausting the process's memory maps.
            jax.clear_caches()
            if args.probes_file:
                _save_probe(args.probes_file, setting | {"kv_cache_dtype": spec.name, "kl_by_text": kls})
        sensitivity[(side, layer)] = float(np.mean(kls))
        probes.append(
            {"side": side, "layer": layer, "bits": probe[side], "kl_divergence": sensitivity[(side, layer)]}
            | {"kl_by_text": kls}
        )
    plans = []
    for compression in args.compression:
        budget = int(bf16_bytes / compression)
        bits, predicted, _ = allocate_bits(
            sensitivity, probe, {"k": args.min_bits, "v": args.min_bits}, vector_bytes, budget, cfg.num_kv_heads
        )
        spec = parse_kv_spec(spec_name(bits, n) + suffix)
        rows = [scorer.score(spec) | {"held_out": False} for scorer in fitted]
        rows += [scorer.score(spec) | {"held_out": True} for scorer in held_out]
        means = {key: float(np.mean([r[key] for r in rows[: len(fitted)]])) for key in _MEAN_FIELDS}
        fields = {key: rows[0][key] for key in ("model", "kv_cache_dtype", "bytes_per_token", "compression_vs_bf16")}
        plans.append(
            fields | means | {"target_compression": compression, "predicted_kl_divergence": predicted, "by_text": rows}
        )
    return {
        "texts": [s.text_file for s in fitted],
        "held_out": [s.text_file for s in held_out],
        "probes": probes,
        "plans": plans,
    }


_MEAN_FIELDS = ("kl_divergence", "perplexity_change_pct", "top1_agreement")


def _load_probes(path: str, setting: dict) -> dict[str, list[float]]:
    """Probe results an earlier run appended to `path` (JSON lines) under the same setting, by
    format name. A missing file is an empty record; a torn last line (a crash mid-write) is skipped."""
    if not os.path.exists(path):
        return {}
    found = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if all(row.get(key) == value for key, value in setting.items()):
                found[row["kv_cache_dtype"]] = row["kl_by_text"]
    return found


def _save_probe(path: str, row: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
