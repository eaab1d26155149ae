"""Prefill and decode throughput of aither-jax against HF transformers on the same weights.

What it measures, per batch size B (default 1 and 8), for SmolLM2-135M by default:

* prefill tok/s = B * prompt_len / t1, where t1 is the wall time of generating one token for B
  prompts of `--prompt-len` random token ids (greedy, end-of-sequence ignored): one prefill
  pass plus sampling the first token.
* decode tok/s = B * decode_tokens / (t2 - t1), where t2 is the wall time of generating
  `--decode-tokens` + 1 tokens for the same prompts: the prefill plus `decode_tokens` steps.

t1 and t2 are each the median over `--repeats` timed runs, after one untimed warm-up run of the
same call, so compilation (XLA for ours; torch.compile with `--hf-compile`) is excluded.

Ours is `aither_jax.LLM(...).generate(prompt_token_ids, SamplingParams(...))`, the public API,
end to end (host scheduling, paged KV cache, token transfer each step). The peer is HF
`model.generate(input_ids, do_sample=False)` with end-of-sequence disabled, on the same GGUF
dequantized to dense weights of the same dtype (`GgufConfig(dequantize=True)`). With
`--random-weights` no GGUF is needed: one set of random weights (normal * 0.02, norms 1) of the
model's shapes is built in numpy and loaded into both, so the greedy-token check still compares
like with like. Ours runs first and HF second, in the same process, so neither competes with
the other's threads.

Before the timings, the greedy tokens of both at batch 1 are compared over the first 16 new
tokens (a text prompt and the batch-1 benchmark prompt); a mismatch is warned about and
recorded as `tokens_match: false` (expected to match in float32; bfloat16 rounding may differ).

Writes a JSON report (`--out`), prints a table, records one result per batch size (unless
`--no-record`; scripts/bench_record.py: docs/benchmarks/log.jsonl and the decode table of
docs/BENCHMARKS.md) and, when matplotlib is importable, draws `out/bench_decode.png` next to
the JSON.

    python scripts/bench_decode.py                       # defaults: batch 1 and 8, prompt 128, 64 new
    python scripts/bench_decode.py --random-weights      # no GGUF needed (e.g. on a GPU machine)
    python scripts/bench_decode.py --hf-compile          # HF with a static cache and torch.compile
    python scripts/bench_decode.py --no-hf --kv-cache-dtype auto   # ours alone, in the model's TurboQuant format
    python scripts/bench_decode.py --no-hf --prefix-caching advisor  # ours as served (the advisor's attention mass)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # `python scripts/bench_decode.py` without installing the package

# JAX and torch share one GPU here: let JAX allocate as it goes instead of taking 75% up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _stub_gguf_if_missing() -> bool:
    """Lets the project import without the `gguf` package (only reading a GGUF needs it).

    `models.gguf_file` imports `gguf` at module level and everything imports it; a GPU machine
    may lack the package, and `--random-weights` never reads a GGUF. The stub knows the type
    names and fails loudly if anything tries to dequantize. Returns True when it stubbed.
    """
    try:
        import gguf  # noqa: F401

        return False
    except ImportError:
        pass
    import enum
    import types

    def dequantize(*args: Any, **kwargs: Any) -> Any:
        raise ImportError("reading GGUF tensors needs the gguf package: pip install gguf")

    ggml_types = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q8_1": 9}
    ggml_types |= {"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "Q8_K": 15, "BF16": 30}
    package, constants, quants = (types.ModuleType(n) for n in ("gguf", "gguf.constants", "gguf.quants"))
    package.__path__ = []
    constants.GGMLQuantizationType = enum.IntEnum("GGMLQuantizationType", ggml_types)
    constants.GGML_QUANT_SIZES = {}
    quants.dequantize = dequantize
    package.constants, package.quants = constants, quants
    sys.modules.update({"gguf": package, "gguf.constants": constants, "gguf.quants": quants})
    return True


GGUF_STUBBED = _stub_gguf_if_missing()

import bench_record  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from aither_jax.compile.counter import CompileCounter  # noqa: E402
from aither_jax.core.engine import Engine  # noqa: E402
from aither_jax.device.sampling import SamplingParams  # noqa: E402
from aither_jax.llm import LLM, default_num_pages, resolve_dtype, resolve_kv_cache_dtype  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.gguf_file import GGUFFile  # noqa: E402
from models.kv_spec import parse_kv_spec  # noqa: E402
from models.registry import DEFAULT_MODEL, MODELS, ModelHandle, resolve_model  # noqa: E402
from models.weights import DTYPES, LayerWeights, ModelWeights  # noqa: E402

CHECK_TOKENS = 16  # greedy tokens compared between ours and HF at batch 1
CHECK_TEXT = "The three primary colors are red, yellow and blue. Mixing red and blue gives"
FIRST_REGULAR_TOKEN = 17  # prompts avoid ids 0..16 (special tokens in SmolLM2)
PROMPT_SEED = 1234
WEIGHTS_SEED = 0

# SmolLM2-135M's shapes, for --random-weights when its GGUF is not installed.
SMOLLM2_135M = ModelConfig(
    arch="llama",
    num_layers=30,
    hidden_size=576,
    ffn_size=1536,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    vocab_size=49152,
    max_context=8192,
    rms_norm_eps=1e-5,
    rope_base=100000.0,
    tie_embeddings=True,
    name="SmolLM2-135M (random weights)",
)


# -- arguments ----------------------------------------------------------------------------------


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or any(b < 1 for b in sizes):
        raise argparse.ArgumentTypeError(f"--batch-sizes must be positive integers, got {text!r}")
    return sorted(set(sizes))


def _positive(name: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Prefill/decode tokens/s of aither-jax vs HF transformers on the same weights.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"registered name ({', '.join(MODELS)}) or a .gguf path")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: float32 on CPU, bfloat16 on GPU/TPU")
    p.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 8], help="comma-separated, e.g. 1,8")
    p.add_argument("--prompt-len", type=_positive("--prompt-len"), default=128)
    p.add_argument("--decode-tokens", type=_positive("--decode-tokens"), default=64)
    p.add_argument("--repeats", type=_positive("--repeats"), default=3, help="timed runs per call; median reported")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    p.add_argument(
        "--max-model-len",
        type=_positive("--max-model-len"),
        default=None,
        help="ours' longest sequence (default: just the prompt and the new tokens); a server's "
        "larger value lets decode steps read more pages than the context needs (page buckets)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        help="ours' KV cache format: default fp32 with float32 weights and bf16 otherwise (HF's cache is "
        "unquantized too); 'auto' for the model's TurboQuant default, or any format such as tq-k6v4",
    )
    p.add_argument(
        "--hf-compile",
        action="store_true",
        help='HF with cache_implementation="static" and torch.compile(forward, mode="reduce-overhead")',
    )
    p.add_argument(
        "--random-weights", action="store_true", help="random weights of the model's shapes for both (no GGUF needed)"
    )
    p.add_argument(
        "--num-scheduler-steps",
        type=_positive("--num-scheduler-steps"),
        default=1,
        help="ours' decode steps per device call (LLM(num_scheduler_steps=...)): 1 syncs with the host after "
        "every token",
    )
    p.add_argument(
        "--prefix-caching",
        choices=("off", "lru", "advisor"),
        default="off",
        help="ours with prefix caching and this eviction policy (the advisor's steps also return attention mass "
        "per page); the timed calls then reuse the prompt's cached pages, prefill and full alike",
    )
    p.add_argument("--out", default="out/bench_decode.json", help="JSON report path")
    p.add_argument("--no-record", action="store_true", help="do not record the results (scripts/bench_record.py)")
    return p.parse_args(argv)


# -- environment --------------------------------------------------------------------------------


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def versions() -> dict[str, str | None]:
    import jaxlib

    out: dict[str, str | None] = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", None),
        "torch": None,
        "transformers": None,
    }
    for name in ("torch", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            pass
    return out


# -- weights ------------------------------------------------------------------------------------


def random_hf_state(cfg: ModelConfig, seed: int = WEIGHTS_SEED) -> dict[str, np.ndarray]:
    """Random float32 weights in HF llama layout ([out, in] matrices): normal * 0.02, norm scales 1."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)

    d, f = cfg.hidden_size, cfg.ffn_size
    state = {"model.embed_tokens.weight": normal(cfg.vocab_size, d), "model.norm.weight": np.ones(d, np.float32)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = np.ones(d, np.float32)
        state[p + "post_attention_layernorm.weight"] = np.ones(d, np.float32)
        state[p + "self_attn.q_proj.weight"] = normal(cfg.q_size, d)
        state[p + "self_attn.k_proj.weight"] = normal(cfg.kv_size, d)
        state[p + "self_attn.v_proj.weight"] = normal(cfg.kv_size, d)
        state[p + "self_attn.o_proj.weight"] = normal(d, cfg.q_size)
        state[p + "mlp.gate_proj.weight"] = normal(f, d)
        state[p + "mlp.up_proj.weight"] = normal(f, d)
        state[p + "mlp.down_proj.weight"] = normal(d, f)
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = normal(cfg.vocab_size, d)
    return state


def ours_weights_from_hf_state(state: dict[str, np.ndarray], cfg: ModelConfig, dtype: str) -> ModelWeights:
    """The same weights in our layout: [out, in] as HF has them, fused QKV and gate/up, one pytree per layer.

    HF's Q/K rows are already in rotate-half order (what `load_weights` restores from GGUF).
    """
    jdtype = DTYPES[dtype]

    def fused(p: str, names: Sequence[str]) -> np.ndarray:
        return np.concatenate([state[p + n] for n in names])

    qkv = [f"self_attn.{n}_proj.weight" for n in "qkv"]
    gate_up = ["mlp.gate_proj.weight", "mlp.up_proj.weight"]

    def layer(p: str) -> LayerWeights:
        return LayerWeights(
            attn_norm=jnp.asarray(state[p + "input_layernorm.weight"], jnp.float32),
            wqkv=jnp.asarray(fused(p, qkv), jdtype),
            wo=jnp.asarray(state[p + "self_attn.o_proj.weight"], jdtype),
            mlp_norm=jnp.asarray(state[p + "post_attention_layernorm.weight"], jnp.float32),
            w_gate_up=jnp.asarray(fused(p, gate_up), jdtype),
            w_down=jnp.asarray(state[p + "mlp.down_proj.weight"], jdtype),
        )

    layers = tuple(layer(f"model.layers.{i}.") for i in range(cfg.num_layers))
    embed = jnp.asarray(state["model.embed_tokens.weight"], dtype=jdtype)
    return ModelWeights(
        embed=embed,
        layers=layers,
        final_norm=jnp.asarray(state["model.norm.weight"], dtype=jnp.float32),
        lm_head=embed if cfg.tie_embeddings else jnp.asarray(state["lm_head.weight"], dtype=jdtype),
    )


class _StubTokenizer:
    """What the engine asks of a tokenizer when prompts are token ids and EOS is ignored."""

    stop_token_ids: tuple[int, ...] = ()
    eos_token_id = None
    bos_token_id = None

    def decode(self, ids: Sequence[int]) -> str:
        return ""

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError("random-weight runs take token ids only")


def unquantized_kv(dtype: str) -> str:
    """Ours' default KV format: unquantized in the weights' dtype, as HF's cache is."""
    return "fp32" if dtype == "float32" else "bf16"


def random_weights_llm(
    cfg: ModelConfig,
    state: dict[str, np.ndarray],
    dtype: str,
    kv_cache_dtype: str,
    *,
    max_model_len: int,
    max_num_seqs: int,
    num_scheduler_steps: int,
    **engine_options,
) -> LLM:
    """An `LLM` over random weights: `LLM.__init__` minus the GGUF (same engine, same generate path)."""
    llm = LLM.__new__(LLM)
    t0 = time.perf_counter()
    weights = ours_weights_from_hf_state(state, cfg, dtype)
    jax.block_until_ready(weights)
    llm.model = ModelHandle(cfg.name, cfg, weights, _StubTokenizer(), dtype, load_seconds=time.perf_counter() - t0)
    llm.model_path, llm.model_name, llm.dtype = None, cfg.name, dtype
    llm.config, llm.tokenizer, llm.progress = cfg, llm.model.tokenizer, False
    llm.load_seconds = llm.model.load_seconds
    page_size = 16
    num_pages = default_num_pages(
        parse_kv_spec(kv_cache_dtype), cfg, max_num_seqs=max_num_seqs, max_model_len=max_model_len, page_size=page_size
    )
    llm.engine = Engine(
        llm.model,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        num_pages=num_pages,
        page_size=page_size,
        kv_cache_dtype=kv_cache_dtype,
        num_scheduler_steps=num_scheduler_steps,
        **engine_options,
    )
    return llm


def model_config_for(model: str) -> ModelConfig:
    """The model's shapes: from its GGUF header when readable, else SmolLM2-135M's for the default name."""
    try:
        if GGUF_STUBBED:
            raise ValueError("the gguf package is not installed")
        cfg = ModelConfig.from_gguf(GGUFFile(resolve_model(model)))
        return dataclasses.replace(cfg, name=f"{cfg.name} (random weights)")
    except ValueError:
        if model == "smollm2-135m":
            return SMOLLM2_135M
        raise


# -- timing -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Timing:
    """Wall times of the prefill-only call (1 new token) and the full call (decode_tokens + 1 new)."""

    prefill_s: list[float] = dataclasses.field(default_factory=list)
    total_s: list[float] = dataclasses.field(default_factory=list)
    compiles: int | None = None  # XLA compilations during the timed calls (ours only; should be 0)

    def summary(self, batch: int, prompt_len: int, decode_tokens: int) -> dict[str, Any]:
        prefill = statistics.median(self.prefill_s)
        total = statistics.median(self.total_s)
        decode = total - prefill
        return {
            "prefill_tok_s": batch * prompt_len / prefill,
            "decode_tok_s": batch * decode_tokens / decode if decode > 0 else None,
            "prefill_s_median": prefill,
            "total_s_median": total,
            "decode_s_median": decode,
            "prefill_s": self.prefill_s,
            "total_s": self.total_s,
            "compiles_during_timing": self.compiles,
        }


def measure(
    run: Callable[[np.ndarray, int], list[list[int]]],
    prompts: np.ndarray,
    batch_sizes: Sequence[int],
    decode_tokens: int,
    repeats: int,
    label: str,
    compile_count: Callable[[], int] | None = None,
) -> dict[int, Timing]:
    """Warm-up then `repeats` timed (prefill, full) pairs per batch size; checks exact token counts.

    With `compile_count`, counts the compilations that happen during the timed calls.
    """
    timings = {b: Timing(compiles=None if compile_count is None else 0) for b in batch_sizes}
    calls = len(batch_sizes) * 2 * (1 + repeats)
    with tqdm(total=calls, desc=f"timing {label}", unit="call", delay=2.0) as bar:
        for b in batch_sizes:
            batch = prompts[:b]
            for i in range(1 + repeats):  # i == 0: untimed warm-up
                for n, times in ((1, timings[b].prefill_s), (decode_tokens + 1, timings[b].total_s)):
                    compiles = compile_count() if compile_count else 0
                    t0 = time.perf_counter()
                    out = run(batch, n)
                    elapsed = time.perf_counter() - t0
                    if i and compile_count:
                        timings[b].compiles += compile_count() - compiles
                    if len(out) != b or any(len(o) != n for o in out):
                        raise RuntimeError(f"{label}: expected {b} x {n} new tokens, got {[len(o) for o in out]}")
                    if i:
                        times.append(elapsed)
                    bar.set_postfix(batch=b, new_tokens=n, refresh=False)
                    bar.update(1)
    return timings


def ours_runner(llm: LLM) -> Callable[[np.ndarray, int], list[list[int]]]:
    def run(prompts: np.ndarray, new_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        return [o.token_ids for o in llm.generate([p.tolist() for p in prompts], params, use_tqdm=False)]

    return run


def hf_runner(model: Any, device: Any) -> Callable[[np.ndarray, int], list[list[int]]]:
    import torch

    def run(prompts: np.ndarray, new_tokens: int) -> list[list[int]]:
        ids = torch.as_tensor(prompts, dtype=torch.long, device=device)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
            )
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out[:, ids.shape[1] :].tolist()

    return run


# -- HF -----------------------------------------------------------------------------------------


def load_hf(
    args: argparse.Namespace, cfg: ModelConfig, state: dict[str, np.ndarray] | None
) -> tuple[Any, Any, dict[str, Any]]:
    """The HF peer on the same weights and dtype, end-of-sequence disabled; returns (model, device, info)."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    t0 = time.perf_counter()
    if state is not None:
        hf_cfg = transformers.LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.ffn_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_context,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_base,
            tie_word_embeddings=cfg.tie_embeddings,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
        )
        model = transformers.LlamaForCausalLM(hf_cfg)
        missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise RuntimeError(f"random weights do not fit HF llama: missing {missing}, unexpected {unexpected}")
        if cfg.tie_embeddings:
            model.tie_weights()
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        model = model.to(device=device, dtype=tdtype)
        source = "random (shared with ours)"
    else:
        path = resolve_model(args.model)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path),
            gguf_file=os.path.basename(path),
            quantization_config=transformers.GgufConfig(dequantize=True),
            dtype=tdtype,
        ).to(device)
        source = f"GGUF dequantized ({os.path.basename(path)})"
    model.eval()
    gen = model.generation_config
    gen.eos_token_id = None  # generate exactly max_new_tokens, like ignore_eos=True
    gen.pad_token_id = gen.pad_token_id if gen.pad_token_id is not None else 0
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"cpu ({torch.get_num_threads()} threads)"
    info: dict[str, Any] = {
        "weights": source,
        "device": device_name,
        "dtype": str(next(model.parameters()).dtype),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "compile": None,
    }
    if args.hf_compile:
        mode = "reduce-overhead" if device.type == "cuda" else "default"  # CUDA graphs need a GPU
        gen.cache_implementation = "static"
        gen.disable_compile = True  # no second, automatic compile of the decode step inside generate
        compiled = torch.compile(model.forward, mode=mode)

        def forward(*a, **kw):
            # CUDA graphs replay into the same output buffers: each call starts a new step, or
            # the static cache's in-place update reads a buffer the last replay overwrote.
            if device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            return compiled(*a, **kw)

        model.forward = forward
        info["compile"] = {"cache_implementation": "static", "torch_compile_mode": mode, "target": "model.forward"}
    info["load_s"] = time.perf_counter() - t0
    return model, device, info


# -- report -------------------------------------------------------------------------------------


def _fmt(x: float | None, digits: int | None = None) -> str:
    """Thousands separators; tok/s get one decimal below 100 (digits=None), ratios fixed digits."""
    if x is None:
        return "–"
    if digits is None:
        digits = 1 if abs(x) < 100 else 0
    return f"{x:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def print_table(report: dict[str, Any]) -> None:
    p = report["parameters"]
    print(
        f"\n{report['model']} | {p['dtype']}, KV {p['kv_cache_dtype']} | {report['device']['summary']} | "
        f"prompt {p['prompt_len']}, "
        f"{p['decode_tokens']} new tokens, median of {p['repeats']}"
    )
    head = (
        f"{'batch':>5} | {'ours prefill':>12} | {'HF prefill':>12} | {'ratio':>6} "
        f"| {'ours decode':>12} | {'HF decode':>12} | {'ratio':>6}"
    )
    print(head + "   (tok/s)")
    print("-" * len(head))
    for r in report["results"]:
        ours, hf = r["ours"], r["hf"] or {}
        print(
            f"{r['batch']:>5} | {_fmt(ours['prefill_tok_s']):>12} | {_fmt(hf.get('prefill_tok_s')):>12} "
            f"| {_fmt(r['ratio']['prefill'], 2):>6} | {_fmt(ours['decode_tok_s']):>12} "
            f"| {_fmt(hf.get('decode_tok_s')):>12} | {_fmt(r['ratio']['decode'], 2):>6}"
        )
    match = report["tokens_match"]
    print(f"greedy tokens match HF (batch 1, first {CHECK_TOKENS}): {'n/a' if match is None else match}")


def record(report: dict[str, Any]) -> None:
    """Records one result per batch size (bench_record), keyed on the model, dtypes, batch,
    tokens, ours' settings and the HF peer's mode (None: ours alone)."""
    p = report["parameters"]
    peer = ("torch.compile" if p["hf_compile"] else "eager") if p["hf"] else None
    versions = {k: v for k, v in report["versions"].items() if v}
    run = {"device": report["device"]["summary"], "date": report["date"], "versions": versions}
    run |= {"command": report["command"], "commit": report.get("commit")}
    kept = ("parameters", "tokens_match", "ours_compilations", "ours_compile_seconds")
    entries = []
    for r in report["results"]:
        ours, hf = r["ours"], r["hf"] or {}
        config = {
            "model": report["model"],
            "weights": p["dtype"],
            "KV": p["kv_cache_dtype"],
            "batch": r["batch"],
            "tokens": f"{p['prompt_len']}+{p['decode_tokens']}",
            "max model len": p["max_model_len"],
            "steps per call": p["num_scheduler_steps"],
            "HF": peer,
        }
        if p.get("prefix_caching", "off") != "off":  # cached prompts: prefill figures are not comparable
            config["prefix caching"] = p["prefix_caching"]
        figures = {
            "ours prefill tok/s": bench_record.rounded(ours["prefill_tok_s"]),
            "HF prefill tok/s": bench_record.rounded(hf.get("prefill_tok_s")),
            "ours decode tok/s": bench_record.rounded(ours["decode_tok_s"]),
            "HF decode tok/s": bench_record.rounded(hf.get("decode_tok_s")),
            "decode vs HF (x)": bench_record.rounded(r["ratio"]["decode"], 2),
        }
        details = r | {k: report[k] for k in kept}
        entries.append(bench_record.result("decode", config, figures, details=details, **run))
    bench_record.record(entries)


def plot(report: dict[str, Any], path: Path) -> None:
    """Decode tok/s per batch size, ours vs HF, as grouped bars; skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return
    results = report["results"]
    x = np.arange(len(results))
    ours = [r["ours"]["decode_tok_s"] or 0.0 for r in results]
    hf = [(r["hf"] or {}).get("decode_tok_s") or 0.0 for r in results]
    has_hf = any(r["hf"] for r in results)
    width = 0.38 if has_hf else 0.6
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = [ax.bar(x - (width / 2 if has_hf else 0), ours, width, label="aither-jax")]
    if has_hf:
        bars.append(ax.bar(x + width / 2, hf, width, label="HF transformers"))
    for b in bars:
        ax.bar_label(b, labels=[_fmt(float(v)) for v in b.datavalues], fontsize=8)
    ax.set_xticks(x, [str(r["batch"]) for r in results])
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    p = report["parameters"]
    ax.set_title(f"{report['model']}, {p['dtype']}, {report['device']['summary']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if GGUF_STUBBED and not args.random_weights:
        sys.exit("loading the GGUF needs the gguf package (pip install gguf); or run with --random-weights")
    if args.dtype is None:
        args.dtype = resolve_dtype("auto")
    unquantized = unquantized_kv(args.dtype)
    args.kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype or unquantized, args.model)
    try:
        parse_kv_spec(args.kv_cache_dtype)
    except ValueError as e:
        sys.exit(f"--kv-cache-dtype: {e}")
    max_b = max(args.batch_sizes)
    needed = args.prompt_len + args.decode_tokens + CHECK_TOKENS
    if args.max_model_len is not None and args.max_model_len < needed:
        sys.exit(f"--max-model-len must be at least prompt + decode + {CHECK_TOKENS} check tokens = {needed}")
    max_model_len = args.max_model_len or needed
    dev = jax.devices()[0]
    cpu = cpu_model()
    device_summary = bench_record.device_name()
    print(f"jax {jax.__version__} on {dev.platform} ({dev.device_kind}); {args.model}, {args.dtype}", flush=True)

    # Ours first (HF is not even imported yet, so its threads do not compete).
    state = None
    caching = {"enable_prefix_caching": True, "eviction_policy": args.prefix_caching}
    caching = {} if args.prefix_caching == "off" else caching
    if args.random_weights:
        cfg = model_config_for(args.model)
        state = random_hf_state(cfg)
        llm = random_weights_llm(
            cfg, state, args.dtype, args.kv_cache_dtype, max_model_len=max_model_len, max_num_seqs=max_b,
            num_scheduler_steps=args.num_scheduler_steps, **caching,
        )  # fmt: skip
    else:
        llm = LLM(
            args.model,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_b,
            num_scheduler_steps=args.num_scheduler_steps,
            progress=False,
            **caching,
        )
        cfg = llm.config
    print(f"ours: loaded in {llm.load_seconds:.1f}s ({cfg.name})", flush=True)

    rng = np.random.default_rng(PROMPT_SEED)
    prompts = rng.integers(FIRST_REGULAR_TOKEN, cfg.vocab_size, size=(max_b, args.prompt_len), dtype=np.int64)
    check_prompts: dict[str, np.ndarray] = {"benchmark prompt": prompts[:1]}
    if not args.random_weights:
        text_ids = llm.tokenizer.encode(CHECK_TEXT)[: max_model_len - CHECK_TOKENS]
        check_prompts = {"text prompt": np.asarray([text_ids]), **check_prompts}

    run_ours = ours_runner(llm)
    compiled_before = CompileCounter.count(), CompileCounter.seconds(), CompileCounter.lowering_seconds()
    ours_check = {name: run_ours(p, CHECK_TOKENS)[0] for name, p in check_prompts.items()}
    ours_t = measure(
        run_ours, prompts, args.batch_sizes, args.decode_tokens, args.repeats, "aither-jax", CompileCounter.count
    )
    # Everything ours compiled (or loaded from the persistent cache), untimed warm-ups included.
    ours_compilations = CompileCounter.count() - compiled_before[0]
    ours_compile_s = CompileCounter.seconds() - compiled_before[1]
    ours_lowering_s = CompileCounter.lowering_seconds() - compiled_before[2]
    print(
        f"ours: {ours_compilations} compilations taking {ours_compile_s:.1f} s, lowering {ours_lowering_s:.1f} s",
        flush=True,
    )
    for b, t in ours_t.items():  # printed now: a failing peer must not take these with it
        ours_row = t.summary(b, args.prompt_len, args.decode_tokens)
        print(f"ours, batch {b}: decode {ours_row['decode_tok_s'] or 0:.1f} tok/s", flush=True)
    ours_compiles = sum(t.compiles or 0 for t in ours_t.values())
    if ours_compiles:
        warnings.warn(f"{ours_compiles} XLA compilation(s) during timed calls: timings include them", stacklevel=1)
    del llm, run_ours
    gc.collect()

    hf_t: dict[int, Timing] = {}
    hf_info: dict[str, Any] | None = None
    tokens_match: bool | None = None
    check: dict[str, Any] = {}
    if not args.no_hf:
        model, device, hf_info = load_hf(args, cfg, state)
        print(f"HF: loaded in {hf_info['load_s']:.1f}s on {hf_info['device']} ({hf_info['weights']})", flush=True)
        run_hf = hf_runner(model, device)
        tokens_match = True
        for name, p in check_prompts.items():
            theirs = run_hf(p, CHECK_TOKENS)[0]
            same = theirs == ours_check[name]
            first_diff = next(
                (i for i, (a, b) in enumerate(zip(ours_check[name], theirs, strict=True)) if a != b), None
            )
            check[name] = {"prompt_len": int(p.shape[1]), "ours": ours_check[name], "hf": theirs, "match": same}
            check[name]["first_mismatch"] = first_diff
            tokens_match &= same
        if not tokens_match:
            why = "" if args.dtype == "float32" else " (bfloat16 rounding can flip near-ties)"
            if args.kv_cache_dtype != unquantized:
                why = f" (ours keeps {args.kv_cache_dtype} KV, HF an unquantized cache)"
            where = {n: c["first_mismatch"] for n, c in check.items() if not c["match"]}
            warnings.warn(f"greedy tokens differ between ours and HF{why}; first mismatch at: {where}", stacklevel=1)
        hf_t = measure(run_hf, prompts, args.batch_sizes, args.decode_tokens, args.repeats, "HF")
        del model, run_hf
        gc.collect()
    else:
        check = {name: {"ours": toks} for name, toks in ours_check.items()}

    results = []
    for b in args.batch_sizes:
        ours = ours_t[b].summary(b, args.prompt_len, args.decode_tokens)
        hf = hf_t[b].summary(b, args.prompt_len, args.decode_tokens) if b in hf_t else None
        ratio = {k: _ratio(ours[f"{k}_tok_s"], hf and hf[f"{k}_tok_s"]) for k in ("prefill", "decode")}
        results.append({"batch": b, "ours": ours, "hf": hf, "ratio": ratio})

    torch_device = None if hf_info is None else hf_info["device"]
    report: dict[str, Any] = {
        "benchmark": "scripts/bench_decode.py",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", *sys.argv]) if argv is None else shlex.join(["bench_decode.py", *argv]),
        "executable": sys.executable,
        "commit": bench_record.git_commit(),
        "model": args.model + (" (random weights)" if args.random_weights else ""),
        "model_config": dataclasses.asdict(cfg),
        "device": {
            "summary": device_summary,
            "jax_platform": dev.platform,
            "jax_device_kind": dev.device_kind,
            "jax_device_count": jax.device_count(),
            "cpu": cpu,
            "cpu_count": os.cpu_count(),
            "torch_device": torch_device,
        },
        "versions": versions(),
        "parameters": {
            "dtype": args.dtype,
            "kv_cache_dtype": args.kv_cache_dtype,
            "batch_sizes": args.batch_sizes,
            "prompt_len": args.prompt_len,
            "decode_tokens": args.decode_tokens,
            "repeats": args.repeats,
            "hf": not args.no_hf,
            "hf_compile": args.hf_compile,
            "random_weights": args.random_weights,
            "max_model_len": max_model_len,
            "max_num_seqs": max_b,
            "num_scheduler_steps": args.num_scheduler_steps,
            "prefix_caching": args.prefix_caching,
            "prompt_seed": PROMPT_SEED,
            "weights_seed": WEIGHTS_SEED if args.random_weights else None,
        },
        "hf": hf_info,
        "ours_compiles_during_timing": ours_compiles,
        "ours_compilations": ours_compilations,
        "ours_compile_seconds": ours_compile_s,
        "ours_lowering_seconds": ours_lowering_s,
        "tokens_match": tokens_match,
        "tokens_check": check,
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"wrote {out}")
    plot(report, out.with_suffix(".png"))
    if not args.no_record:
        record(report)
    return report


if __name__ == "__main__":
    main()
