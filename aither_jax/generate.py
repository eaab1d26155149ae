"""Command line generation: `python -m aither_jax.generate --model smollm2-135m --prompt "..."`.

One prompt streams its text to stdout as it is decoded; several (`--prompt` repeated, or a
JSON-lines `--prompts` file) are decoded together, with a progress bar, and printed in order.

Exit codes: 0 success, 2 bad usage (flags, model name or file, prompt too long), 130
interrupted (Ctrl-C: the text streamed so far stays, and of several prompts those decoded
are printed or written), 1 other errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import secrets
import sys
import time

from aither_jax.cli_args import (
    HelpFormatter,
    add_json_argument,
    add_model_argument,
    add_residency_args,
    add_version_argument,
    float_in,
    input_file,
    int_in,
    kv_spec,
    residency_kwargs,
    speculative_config,
)
from aither_jax.cli_output import emit_json, run_command, run_info
from models.gguf_file import GGUFError

PROG = "python -m aither_jax.generate"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Generate text with a GGUF model.", formatter_class=HelpFormatter
    )
    add_version_argument(p)
    add_model_argument(p)
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument(
        "--prompt", action="append", help="prompt text (the user message with --chat); repeat for several"
    )
    given.add_argument(
        "--prompts",
        type=input_file("--prompts", utf8=True),
        metavar="FILE",
        help='JSON lines, each {"messages": [...]} (a conversation, through the chat template) or {"prompt": "..."}',
    )
    p.add_argument("--chat", action="store_true", help="wrap each --prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int_in("--max-tokens", 1), default=128)
    p.add_argument("--temperature", type=float_in("--temperature", 0.0, 100.0), default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float_in("--top-p", 0.0, 1.0, low_open=True), default=1.0)
    p.add_argument("--top-k", type=int_in("--top-k", -1), default=0, help="0 or -1 disables top-k")
    p.add_argument(
        "--seed",
        type=int_in("--seed", 0, 2**32 - 1),
        default=None,
        help="sampling seed: the same seed gives the same tokens (default: a random one, reported with --json)",
    )
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="auto: bfloat16 on accelerators, float32 on CPU (bfloat16 is faster only on CPUs with bf16 instructions)",
    )
    p.add_argument("--max-model-len", type=int_in("--max-model-len", 2), default=None)
    p.add_argument(
        "--batch-size", type=int_in("--batch-size", 1, 256), default=8, help="prompts decoded together (with several)"
    )
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
    add_json_argument(p, "an object per prompt: text, token ids, timings and the sampling settings")
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
    if args.prompts is not None and (args.chat or args.system is not None):
        parser.error("--chat and --system are for --prompt (a --prompts file says which lines are conversations)")
    if args.prompt is not None and not all(args.prompt):
        parser.error("--prompt must not be empty")
    if args.speculative and args.speculative_config:
        parser.error("give --speculative or --speculative-config, not both")
    import aither_jax as aj  # heavy imports after argument checks, so --help and usage errors are fast
    from aither_jax.context.prompt import chat_prompt, file_prompts, read_prompts, text_prompt
    from aither_jax.llm import resolve_dtype

    try:
        items = read_prompts(args.prompts) if args.prompts is not None else None
    except ValueError as e:
        parser.error(f"--prompts: {e}")
    seed = args.seed
    if seed is None and args.temperature > 0:
        seed = secrets.randbits(32)  # reported, so a run worth keeping can be repeated
    try:
        # SamplingParams holds the limits (stop strings, top-k range); checked before the model loads.
        params = aj.SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=seed,
            stop=args.stop,
        )
    except ValueError as e:
        parser.error(_flag_message(str(e)))
    args.dtype = resolve_dtype(args.dtype)
    num_prompts = len(items) if items is not None else len(args.prompt)
    try:
        llm = aj.LLM(
            args.model,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=min(num_prompts, args.batch_size),
            progress=True,
            speculative=args.speculative_config or args.speculative,
            batch_invariant=args.batch_invariant,
            **residency_kwargs(args),
        )
    except (ValueError, GGUFError) as e:
        parser.error(str(e))
    system = [{"role": "system", "content": args.system}] if args.system else []
    try:
        if items is not None:
            prompts = file_prompts(llm.tokenizer, items)
        elif args.chat:
            prompts = [chat_prompt(llm.tokenizer, [*system, {"role": "user", "content": p}]) for p in args.prompt]
        else:
            prompts = [text_prompt(llm.tokenizer, p) for p in args.prompt]
        for prompt in prompts:
            llm.engine.check_prompt(len(prompt.ids))
    except (ValueError, KeyError, TypeError) as e:
        parser.error(f"{'--prompts' if items is not None else '--prompt'}: {e}")
    # Each prompt its own seed: one seed for all would give equal prompts equal samples.
    per_prompt = [
        params if seed is None else dataclasses.replace(params, seed=(seed + i) % 2**32) for i in range(num_prompts)
    ]
    several = items is not None or num_prompts > 1  # a --prompts file: JSON lines however many
    outs, interrupted = [], False
    try:
        # A short untimed run compiles the prefill and decode steps, so the reported speed is
        # the steady state; compilation time is reported on its own.
        t0 = time.perf_counter()
        short = [dataclasses.replace(p, max_tokens=min(2, p.max_tokens)) for p in per_prompt[: args.batch_size]]
        llm.generate(prompts[: args.batch_size], short, use_tqdm=False)
        warmup_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        if not several:
            outs = [stream_one(llm, prompts[0], per_prompt[0], echo=args.json != "-")]
        else:
            for i in range(0, num_prompts, args.batch_size):
                outs += llm.generate(
                    prompts[i : i + args.batch_size], per_prompt[i : i + args.batch_size], use_tqdm=True
                )
    except ValueError as e:  # a request the engine refuses (its pages, a bound it cannot keep)
        parser.error(str(e))
    except KeyboardInterrupt:
        if not outs:
            raise
        interrupted = True  # the prompts decoded so far are reported, then the interruption goes on
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    if args.json:
        rows = [
            json_row(args, llm, out, p, tokens, elapsed, warmup_seconds)
            for out, p in zip(outs, per_prompt, strict=False)
        ]
        # Several prompts are always JSON lines, even when an interruption left one.
        emit_json(args.json, rows if several else rows[0], run_info(PROG, argv))
    if args.json != "-" and several:
        for i, out in enumerate(outs):
            print(f"--- {i} ({out.finish_reason}) ---\n{out.text}")
    print(
        f"[{len(outs)} of {num_prompts} prompts, {tokens} tokens in {elapsed:.2f} s ({tokens / elapsed:.1f} tok/s, "
        f"after {warmup_seconds:.1f} s of warm-up); finish: {', '.join(sorted({o.finish_reason for o in outs}))}]",
        file=sys.stderr,
    )
    if interrupted:
        raise KeyboardInterrupt
    return 0


def stream_one(llm, prompt, params, *, echo: bool):
    """Decodes one prompt; with `echo`, its text goes to stdout as it settles. Ctrl-C ends the
    line where decoding stopped before the interruption goes on."""
    stream = llm.stream(prompt, params)
    try:
        for piece in stream:
            if echo:
                print(piece, end="", flush=True)
    finally:
        if echo:
            print(flush=True)
    return stream.output


def json_row(args, llm, out, params, tokens: int, seconds: float, warmup_seconds: float) -> dict:
    """One prompt's object; `seconds` and `tokens_per_second` are the whole run's (with
    several prompts, every prompt's tokens over the time they were decoded together)."""
    row = {
        "model": args.model,
        "dtype": args.dtype,
        "kv_cache_dtype": llm.kv_spec.name,
        "prompt": out.prompt,
        "text": out.text,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": len(out.token_ids),
        "sampling": {
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "seed": params.seed,
            "stop": list(params.stop_strings),
        },  # fmt: skip
        "seconds": round(seconds, 4),
        "warmup_seconds": round(warmup_seconds, 4),
        "tokens_per_second": round(tokens / seconds, 2),
    }
    if llm.engine.speculative is not None:
        row["speculative"] = {
            "method": llm.engine.speculative.method,
            "draft_tokens": out.num_draft_tokens,
            "accepted_tokens": out.num_accepted_tokens,
            "verify_passes_with_drafts": out.num_spec_steps,
        }
    return row


if __name__ == "__main__":
    sys.exit(run_command(main))
