"""Command line generation: `python -m aither_jax.generate --model smollm2-135m --prompt "..."`.

Exit codes: 0 success, 2 bad usage (flags, model name or file, prompt too long), 1 other errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time

from aither_jax.cli_args import (
    add_model_argument,
    add_residency_args,
    float_in,
    int_in,
    kv_spec,
    residency_kwargs,
    speculative_config,
)
from models.gguf_file import GGUFError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m aither_jax.generate", description="Generate text with a GGUF model.")
    add_model_argument(p)
    p.add_argument("--prompt", required=True, help="prompt text (the user message with --chat)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int_in("--max-tokens", 1), default=128)
    p.add_argument("--temperature", type=float_in("--temperature", 0.0, 100.0), default=0.0)
    p.add_argument("--top-p", type=float_in("--top-p", 0.0, 1.0, low_open=True), default=1.0)
    p.add_argument("--top-k", type=int_in("--top-k", -1), default=0, help="0 or -1 disables top-k")
    p.add_argument("--seed", type=int_in("--seed", 0, 2**32 - 1), default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="auto: bfloat16 on accelerators, float32 on CPU (bfloat16 is faster only on CPUs with bf16 instructions)",
    )
    p.add_argument("--max-model-len", type=int_in("--max-model-len", 2), default=None)
    p.add_argument(
        "--kv-cache-dtype",
        type=lambda text: text if text in ("auto", "turboquant") else kv_spec(text).name,
        default="auto",
        help="KV cache format: auto (the model's default), turboquant (its measured per-layer TurboQuant format), "
        "bf16, fp32, tq<bits>, tq-k<bits>v<bits>, "
        "with modifiers (docs/USAGE.md: KV cache formats)",
    )
    p.add_argument("--speculative", choices=("dflash", "ngram"), default=None, help="speculative decoding method")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="compute every token by fixed-shape programs, so greedy tokens do not depend on prompt chunking or "
        "speculation (slower)",
    )
    p.add_argument(
        "--speculative-config",
        type=speculative_config,
        default=None,
        help='JSON speculative settings, e.g. \'{"method": "dflash", "num_speculative_tokens": 7, "steps": 2}\'',
    )
    add_residency_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    return p


# SamplingParams names its fields; the CLI's messages name the flags that set them.
_SAMPLING_FIELD = re.compile(r"^(each )?(max_tokens|temperature|top_p|top_k|seed|stop)\b")


def _flag_message(message: str) -> str:
    """A SamplingParams error with its field name replaced by the flag's (top_k -> --top-k)."""
    return _SAMPLING_FIELD.sub(lambda m: (m[1] or "") + "--" + m[2].replace("_", "-"), message)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.system is not None and not args.chat:
        parser.error("--system needs --chat")
    if not args.prompt:
        parser.error("--prompt must not be empty")
    if args.speculative and args.speculative_config:
        parser.error("give --speculative or --speculative-config, not both")
    import aither_jax as aj  # heavy imports after argument checks, so --help and usage errors are fast
    from aither_jax.llm import resolve_dtype

    try:
        # SamplingParams holds the limits (stop strings, top-k range); checked before the model loads.
        params = aj.SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
        )
    except ValueError as e:
        parser.error(_flag_message(str(e)))
    args.dtype = resolve_dtype(args.dtype)
    try:
        llm = aj.LLM(
            args.model,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=1,
            progress=True,
            speculative=args.speculative_config or args.speculative,
            batch_invariant=args.batch_invariant,
            **residency_kwargs(args),
        )
    except (ValueError, GGUFError) as e:
        parser.error(str(e))
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]

    def run(p: aj.SamplingParams) -> aj.RequestOutput:
        if args.chat:
            return llm.chat([messages], p, use_tqdm=False)[0]
        return llm.generate([args.prompt], p, use_tqdm=False)[0]

    try:
        # A short untimed run compiles the prefill and decode steps, so the reported speed is
        # the steady state; compilation time is reported on its own.
        t0 = time.perf_counter()
        run(dataclasses.replace(params, max_tokens=min(2, params.max_tokens)))
        compile_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = run(params)
        elapsed = time.perf_counter() - t0
    except ValueError as e:
        parser.error(str(e))
    if args.json:
        result = {
            "model": args.model,
            "dtype": args.dtype,
            "kv_cache_dtype": llm.kv_spec.name,
            "text": out.text,
            "token_ids": out.token_ids,
            "finish_reason": out.finish_reason,
            "prompt_tokens": out.num_prompt_tokens,
            "completion_tokens": len(out.token_ids),
            "seconds": round(elapsed, 4),
            "warmup_seconds": round(compile_seconds, 4),
            "tokens_per_second": round(len(out.token_ids) / elapsed, 2),
        }
        if llm.engine.speculative is not None:
            result["speculative"] = {
                "method": llm.engine.speculative.method,
                "draft_tokens": out.num_draft_tokens,
                "accepted_tokens": out.num_accepted_tokens,
                "verify_passes_with_drafts": out.num_spec_steps,
            }
        print(json.dumps(result, ensure_ascii=False))
    else:
        print(out.text)
        print(
            f"[{len(out.token_ids)} tokens in {elapsed:.2f} s ({len(out.token_ids) / elapsed:.1f} tok/s, "
            f"after {compile_seconds:.1f} s of warm-up); finish: {out.finish_reason}]",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
