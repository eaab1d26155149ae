"""The OpenAI-compatible server: `python -m aither_jax.serve --model smollm2-135m`.

Loads the model, starts the engine loop and serves HTTP with uvicorn. SIGTERM (or Ctrl-C)
stops admitting requests (503), lets running streams finish within `--drain-timeout` seconds
and exits 0. Exit codes: 0 clean shutdown, 2 bad flags, 1 other errors.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import pathlib
import signal
import sys
import time

import uvicorn

from aither_jax.cli_args import (
    HelpFormatter,
    add_residency_args,
    add_version_argument,
    float_in,
    int_in,
    kv_spec,
    nonempty_path,
    residency_kwargs,
    speculative_config,
)
from models.registry import DEFAULT_MODEL, MODELS

log = logging.getLogger("aither_jax.serve")


class _ModelsAction(argparse.Action):
    """`--model`, repeatable: the first use replaces the default, later ones add models."""

    def __call__(self, parser, namespace, value, option_string=None):
        given = getattr(namespace, "_models_given", False)
        models = list(getattr(namespace, self.dest)) if given else []
        namespace._models_given = True
        setattr(namespace, self.dest, [*models, value])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m aither_jax.serve",
        description="Serve a GGUF model over an OpenAI-compatible HTTP API.",
        formatter_class=HelpFormatter,
    )
    add_version_argument(p)
    p.add_argument(
        "--model",
        action=_ModelsAction,
        default=[DEFAULT_MODEL],
        help=f"registered name ({', '.join(sorted(MODELS))}) or a .gguf path (default {DEFAULT_MODEL}); give it twice "
        "to serve two models from one process and one device (the first is the default; see --memory-budget)",
    )
    p.add_argument(
        "--model-options",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help='one model\'s own settings over the shared flags, e.g. \'gemma3-270m={"kv_cache_dtype": "bf16"}\' '
        f"(keys: {', '.join(sorted(MODEL_OPTIONS))})",
    )
    p.add_argument(
        "--memory-budget",
        type=float_in("--memory-budget", 0.0, 1 << 20, low_open=True),
        default=None,
        metavar="GIB",
        help="device memory to plan for every model's weights, KV pool, draft and headroom (required for several "
        "models on CPU; on an accelerator --gpu-memory-utilization may give it instead)",
    )
    p.add_argument(
        "--default-model",
        default=None,
        help="the model for requests that name none: a served model, or 'auto' to route them by effort "
        "(default: the first --model)",
    )
    p.add_argument(
        "--route-heavy",
        default=None,
        metavar="NAME",
        help="with several models, the one requests of high effort go to (default: the one with most parameters)",
    )
    p.add_argument(
        "--route-threshold",
        type=int_in("--route-threshold", 1, 5),
        default=3,
        help="effort (1-5) from which model 'auto' routes to the heavy model (default 3)",
    )
    p.add_argument(
        "--kv-balloon",
        action="store_true",
        help="with several models, move idle KV pages between their pools as load shifts (a model whose requests "
        "wait for pages borrows another's idle ones, which go back once it is idle; each move recompiles both "
        "models' steps for their new pool sizes); moves at /debug/memory",
    )
    p.add_argument(
        "--kv-balloon-step",
        type=int_in("--kv-balloon-step", 1),
        default=None,
        metavar="PAGES",
        help="with --kv-balloon, each pool's sizes are its plan plus or minus whole steps of this many of its pages, "
        "so the sizes (each with its own compiled steps) are few (default: one full-length sequence, or an eighth "
        "of its planned pool if less; 1 allows any size)",
    )
    p.add_argument(
        "--kv-balloon-min-move",
        type=int_in("--kv-balloon-min-move", 1),
        default=None,
        metavar="PAGES",
        help="with --kv-balloon, the smallest move worth its recompiles, in the borrower's pages (default: the "
        "smallest model's floor, one full-length sequence)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int_in("--port", 0, 65535), default=8000, help="0 picks a free port")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: --model; one model)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    p.add_argument("--max-model-len", type=int_in("--max-model-len", 2), default=None)
    p.add_argument("--max-num-seqs", type=int_in("--max-num-seqs", 1, 1024), default=16)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int_in("--max-num-batched-tokens", 1),
        default=None,
        help="tokens per engine step (decode rows plus prefill chunks); "
        "default max(--max-prefill-chunk, --max-num-seqs)",
    )
    p.add_argument("--max-prefill-chunk", type=int_in("--max-prefill-chunk", 1), default=256)
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse cached KV pages of earlier prompts (default: on)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's greedy tokens do not depend on what shares its batch, how its prompt was chunked or "
        "speculation, with every KV format (slower; docs/BENCHMARKS.md, 'Batch invariance')",
    )
    p.add_argument(
        "--shared-prefix-attention",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode steps whose rows share 512+ cached prefix tokens read them once for the batch (default: on)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        type=lambda text: text if text in ("auto", "turboquant") else kv_spec(text).name,
        default="auto",
        help="KV cache format: auto (the model's default: the most compact format that keeps its answers, bf16 for "
        "SmolLM2-135M, tq-k8v6 for Gemma-3-270M), turboquant (the model's measured per-layer TurboQuant format, "
        "~3x fewer bytes), bf16, fp32, tq<bits>, tq-k<bits>v<bits> ...",
    )
    budget = p.add_mutually_exclusive_group()
    budget.add_argument(
        "--gpu-memory-utilization",
        type=float_in("--gpu-memory-utilization", 0.0, 1.0, low_open=True),
        default=None,
        help="fraction of accelerator memory for weights and KV pages (accelerators only)",
    )
    budget.add_argument("--num-pages", type=int_in("--num-pages", 2), default=None, help="KV pages in the pool")
    p.add_argument(
        "--max-queue",
        type=int_in("--max-queue", 0),
        default=None,
        help="waiting requests accepted beyond the running batch before 503s (default 4 x max-num-seqs)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health; give it several times for several "
        "keys, each its own tenant of the prefix cache (default: $AITHER_API_KEY, keys separated by commas)",
    )
    p.add_argument("--chat-template", default=None, help="jinja2 chat template: a file path or the template itself")
    p.add_argument(
        "--pin-prompt-file",
        type=pathlib.Path,
        default=None,
        help="text file whose tokens are prefilled at start-up and pinned in the prefix cache, for requests without "
        "X-Tenant-Id (under each API key)",
    )
    p.add_argument(
        "--kv-offloading-size",
        type=float_in("--kv-offloading-size", 0.0, 1 << 20),
        default=0.0,
        metavar="GIB",
        help="host memory (GiB) for KV pages evicted from the device pool; a later prompt that starts with them "
        "gets them back instead of recomputing them (default 0: dropped); several models share it",
    )
    p.add_argument(
        "--kv-cache-dir",
        type=nonempty_path("--kv-cache-dir"),
        default=None,
        metavar="DIR",
        help="disk tier: pages leaving host memory are written here (checksummed, atomically) and found again "
        "after a restart; the tenant secret is kept here too, so tenants stay isolated across restarts",
    )
    p.add_argument(
        "--kv-disk-size",
        type=float_in("--kv-disk-size", 0.0, 1 << 30, low_open=True),
        default=None,
        metavar="GIB",
        help="GiB the disk tier may hold (default 4; needs --kv-cache-dir); several models share it, and pages of "
        "configurations no running server has open count against it and go first",
    )
    p.add_argument(
        "--kv-high-watermark",
        type=float_in("--kv-high-watermark", 0.0, 1.0, low_open=True),
        default=0.8,
        help="with the tiers, idle cached pages beyond this share of the device pool are demoted between steps, "
        "ahead of need (default 0.8)",
    )
    p.add_argument(
        "--kv-low-watermark",
        type=float_in("--kv-low-watermark", 0.0, 1.0),
        default=None,
        help="with the tiers, while less than this share of the device pool is in use, the pages of requests "
        "waiting for a slot are promoted from host or disk ahead of their admission (default 0.5, or the high "
        "watermark if lower; 0: off)",
    )
    p.add_argument("--max-pinned-fraction", type=float_in("--max-pinned-fraction", 0.0, 1.0), default=0.5)
    p.add_argument(
        "--eviction-policy",
        choices=("advisor", "lru"),
        default=None,
        help="which idle cached KV pages leave the device first: the graph eviction advisor (the default with "
        "prefix caching: system and protected pages stay; the conversation due back latest goes first), or least "
        "recently used",
    )
    add_residency_args(p)
    p.add_argument(
        "--max-protected-fraction",
        type=float_in("--max-protected-fraction", 0.0, 1.0),
        default=None,
        help="with the advisor, most of the page pool that idle protected pages may hold (default 0.25, lowered "
        "with a warning where the pool must keep room for one request at full length, or at its resident bound, "
        "beside the pinned and protected pages; a share given that leaves none is refused)",
    )
    p.add_argument(
        "--advisor-weights",
        default=None,
        metavar="JSON",
        help="the advisor's score weights that differ from the defaults, e.g. '{\"age\": 1.0}' (fields: age, "
        "degree, edge_weight, importance, hits, attention, reuse)",
    )
    p.add_argument("--max-body-bytes", type=int_in("--max-body-bytes", 1024), default=4 << 20)
    p.add_argument("--drain-timeout", type=float_in("--drain-timeout", 0.0, 3600.0), default=30.0)
    p.add_argument(
        "--speculative-config",
        type=speculative_config,
        default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "dflash"}\' (the draft shipped for the model), '
        '\'{"method": "dflash", "num_speculative_tokens": 7, "steps": 2, "model": "draft.npz"}\' or '
        '\'{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4}\'',
    )
    p.add_argument(
        "--num-scheduler-steps",
        type=int_in("--num-scheduler-steps", 1, 64),
        default=1,
        help="decode steps per device call while nothing else waits (tokens then stream in bursts of this many); "
        "not with --speculative-config",
    )
    p.add_argument("--warmup", action="store_true", help="compile every decode shape before serving")
    p.add_argument(
        "--compile-first-requests",
        action="store_true",
        help="before serving, compile (or load from the persistent cache) the step shapes of a first chat request "
        "of up to 64 prompt tokens and of its follow-up, greedy and sampled, so the first requests answer promptly",
    )
    p.add_argument(
        "--compile-shapes",
        type=pathlib.Path,
        default=None,
        metavar="FILE",
        help="step-shapes file (JSON): its shapes are compiled on several threads before serving when it exists, "
        "and every new shape the server runs is added to it (aither_jax/compile/shape_file.py)",
    )
    p.add_argument(
        "--generation-config",
        choices=("auto", "none"),
        default="auto",
        help="sampling for requests that leave temperature, top_p or top_k unset: auto (the model's recommended "
        "sampling from its card, as vLLM applies a model's generation config) or none (the API's defaults: "
        "temperature 1, top_p 1, top_k off)",
    )
    p.add_argument("--seed", type=int_in("--seed", 0, 2**32 - 1), default=0, help="seeds requests that bring none")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return p


def _chat_template(value: str) -> str:
    path = pathlib.Path(value)
    with contextlib.suppress(OSError):
        if len(value) < 4096 and path.is_file():
            return path.read_text(encoding="utf-8")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if len(set(args.model)) != len(args.model):
        parser.error(f"--model: each model once, got {args.model}")
    if args.compile_shapes is not None and len(args.model) > 1:
        parser.error("--compile-shapes records one model's shapes: serve one --model with it")
    if args.api_key is None and os.environ.get("AITHER_API_KEY") is not None:
        args.api_key = os.environ["AITHER_API_KEY"].split(",")
    if args.api_key is not None and not all(k.strip() for k in args.api_key):
        parser.error("--api-key must not be empty")
    if args.api_key is not None and any(k != k.strip() or not k.isprintable() for k in args.api_key):
        parser.error("--api-key: a key must be printable and have no surrounding spaces")
    if args.pin_prompt_file is not None and not args.pin_prompt_file.is_file():
        parser.error(f"--pin-prompt-file: no such file: {args.pin_prompt_file}")
    if args.kv_disk_size is not None and args.kv_cache_dir is None:
        parser.error("--kv-disk-size needs --kv-cache-dir")
    if (args.kv_offloading_size or args.kv_cache_dir) and args.enable_prefix_caching is False:
        parser.error("--kv-offloading-size and --kv-cache-dir need prefix caching (drop --no-enable-prefix-caching)")
    if args.kv_cache_dir is not None:
        try:
            args.kv_cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            parser.error(f"--kv-cache-dir: {args.kv_cache_dir} cannot be created: {e.strerror}")
        if not os.access(args.kv_cache_dir, os.W_OK | os.X_OK):
            parser.error(f"--kv-cache-dir: {args.kv_cache_dir} is not writable")
    if args.compile_shapes is not None and not args.compile_shapes.absolute().parent.is_dir():
        parser.error(f"--compile-shapes: no such directory: {args.compile_shapes.absolute().parent}")
    if args.compile_shapes is not None and args.compile_shapes.is_dir():
        parser.error(f"--compile-shapes: {args.compile_shapes} is a directory, not a file")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        server = build_server(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # uvicorn re-raises the signal that stopped it once it has shut down; with a handler of
    # our own installed first, that re-raise is a no-op and the drained server exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    return 0


# What `--model-options` may set for one model: LLM keyword arguments, and the served name.
MODEL_OPTIONS = {
    "kv_cache_dtype": str,
    "chat_template": str,
    "speculative_config": (str, dict),
    "num_pages": int,
    "max_model_len": int,
    "max_num_seqs": int,
    "kv_share": (int, float),
    "kv_offloading_size": (int, float),
    "kv_disk_size": (int, float),
    "served_model_name": str,
}


def model_options(args: argparse.Namespace) -> dict[str, dict]:
    """Each served model's own options from `--model-options NAME=JSON`. Raises ValueError
    for a malformed value, an unknown key or a model not served."""
    import json

    from aither_jax.speculative.config import SpeculativeConfig
    from models.kv_spec import parse_kv_spec

    names = args.model
    out: dict[str, dict] = {name: {} for name in names}
    for item in args.model_options:
        name, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--model-options takes NAME=JSON, got {item!r}")
        if name not in out:
            raise ValueError(f"--model-options: {name!r} is not a served --model ({', '.join(names)})")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--model-options {name}: not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"--model-options {name}: expected a JSON object")
        for key, v in value.items():
            kind = MODEL_OPTIONS.get(key)
            if kind is None:
                raise ValueError(
                    f"--model-options {name}: unknown key {key!r} (keys: {', '.join(sorted(MODEL_OPTIONS))})"
                )
            if not isinstance(v, kind) or isinstance(v, bool):
                raise ValueError(f"--model-options {name}: {key} has the wrong type ({type(v).__name__})")
        try:
            if value.get("kv_cache_dtype") not in (None, "auto", "turboquant"):
                parse_kv_spec(value["kv_cache_dtype"])
            if "speculative_config" in value:
                value["speculative_config"] = SpeculativeConfig.parse(value["speculative_config"])
        except (ValueError, TypeError) as e:
            raise ValueError(f"--model-options {name}: {e}") from None
        out[name].update(value)
    return out


def build_server(args: argparse.Namespace):
    """The uvicorn server for parsed flags. Raises ValueError for flags the models reject."""
    import secrets

    from aither_jax.context.prompt import text_prompt
    from aither_jax.kv.disk import tenant_secret
    from serving.api import ServedModel, ServerConfig, build_app
    from serving.async_engine import AsyncEngine
    from serving.metrics import Metrics

    names = args.model
    own = model_options(args)
    if args.served_model_name is not None and len(names) > 1:
        raise ValueError(
            "--served-model-name names the one model served; with several, give each its own with "
            '--model-options NAME=\'{"served_model_name": "ID"}\''
        )
    served_names = [own[n].get("served_model_name") or args.served_model_name or n for n in names]
    if len(set(served_names)) != len(served_names):
        raise ValueError(f"served model names must differ: {served_names}")
    for name, served in zip(names, served_names, strict=True):
        if served == "auto":
            raise ValueError(f"{name}: 'auto' is routing by effort, not a served model name")
        if served != name and served in names:
            raise ValueError(f"{name}'s served name {served!r} is another --model: give it a name of its own")

    def model_named(flag: str, value: str) -> int:
        """--default-model and --route-heavy name a model by the id clients use or by its --model."""
        for i, (name, served) in enumerate(zip(names, served_names, strict=True)):
            if value in (name, served):
                return i
        raise ValueError(f"{flag} {value!r} is not a served model ({', '.join(served_names)})")

    if args.default_model == "auto" and len(names) == 1:
        raise ValueError("--default-model auto routes between several models: give --model twice")
    if args.default_model not in (None, "auto"):
        args.default_model = served_names[model_named("--default-model", args.default_model)]
    if args.route_heavy is not None:
        args.route_heavy = names[model_named("--route-heavy", args.route_heavy)]
    if args.kv_balloon and len(names) == 1:
        raise ValueError("--kv-balloon moves KV pages between models: give --model twice")
    for flag in ("kv_balloon_step", "kv_balloon_min_move"):
        if getattr(args, flag) is not None and not args.kv_balloon:
            raise ValueError(f"--{flag.replace('_', '-')} sets the balloon's moves: it needs --kv-balloon")
    fleet, llms, plan, router = _load(args, own)
    if args.compile_shapes is not None:
        _use_shape_file(next(iter(llms.values())), args)
    for llm in llms.values():
        policy = llm.engine.scheduler.policy
        if policy.protects:
            log.info(
                "%s: the eviction advisor keeps up to %d idle pages of system and protected sections cached",
                llm.model_name, policy.max_protected_pages,
            )  # fmt: skip
        if args.compile_first_requests:
            start = time.perf_counter()
            n = llm.engine.precompile(llm.engine.compiler.first_request_shapes(), progress=True)
            log.info(
                "%s: compiled the %d step shapes of a first request and its follow-up in %.1f s",
                llm.model_name, n, time.perf_counter() - start,
            )  # fmt: skip
        if args.warmup:
            llm.warmup()
    max_queue = 4 * args.max_num_seqs if args.max_queue is None else args.max_queue
    keys = tuple(dict.fromkeys(args.api_key or ()))
    # Tenants' chain names must stay the same across restarts for the disk tier to serve them.
    secret = tenant_secret(args.kv_cache_dir) if args.kv_cache_dir else secrets.token_bytes(32)
    default = args.default_model
    config = ServerConfig(keys, args.max_body_bytes, secret, default_model=default)
    served = []
    for name, llm in zip(served_names, llms.values(), strict=True):
        metrics = Metrics(name)
        if plan is not None:
            _zone_metrics(metrics, plan, llm.model_name)
        engine = AsyncEngine(llm.engine, metrics, max_waiting=max_queue)
        sampling = llm.sampling_defaults if args.generation_config == "auto" else {}
        served.append(ServedModel(name, engine, llm.tokenizer, llm.engine.max_model_len, sampling=sampling))
    if router is not None:  # the router speaks of models by their served names
        router.light, router.heavy = (served_names[names.index(m)] for m in (router.light, router.heavy))
    app = build_app(served, config, router=router, plan=plan)
    balloon = None
    if args.kv_balloon:
        from serving.balloon import BalloonLoop

        balloon = BalloonLoop(fleet, {n: m.engine for n, m in zip(names, served, strict=True)})
    pin_text = args.pin_prompt_file.read_text(encoding="utf-8") if args.pin_prompt_file else None

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        for m in served:
            m.engine.start()
        if pin_text:
            # Pinned for requests without a tenant header, under every key, on every model.
            for m in served:
                ids = text_prompt(m.tokenizer, pin_text, pin=True).pinned_ids
                for salt in config.root_salts(m.name):
                    pinned = await m.engine.pin(ids, salt)
                    log.info("%s: pinned %d pages (%d tokens) of %s", m.name, pinned, len(ids), args.pin_prompt_file)
        if balloon is not None:
            balloon.start()
        yield
        if balloon is not None:
            balloon.stop()
        for m in served:
            m.engine.stop()
            tiers = m.engine.engine.tiers
            if tiers is not None and tiers.disk is not None:
                log.info("%s: wrote %d cached KV pages to %s", m.name, m.engine.engine.persist(), tiers.disk.root)

    app.router.lifespan_context = lifespan
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.drain_timeout,
        timeout_keep_alive=30,  # clients reuse idle connections; 5 s raced with their next request
        access_log=False,
    )
    return DrainingServer(uv_config, app)


def _load(args: argparse.Namespace, own: dict[str, dict]):
    """(the fleet or None, {model: LLM}, the memory plan or None, the router or None). One
    model without a budget is sized as before (--num-pages, --gpu-memory-utilization, or the default); a
    budget, or several models, go through the planner (aither_jax/fleet)."""
    from aither_jax.fleet.fleet import Fleet
    from aither_jax.llm import LLM, resolve_dtype
    from models.gguf_file import GGUFError
    from models.tokenizer import ChatTemplateError

    names = args.model
    several = len(names) > 1
    common = dict(
        dtype=resolve_dtype(args.dtype),
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_prefill_chunk=_power_of_two(args.max_prefill_chunk, "--max-prefill-chunk"),
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        max_pinned_fraction=args.max_pinned_fraction,
        eviction_policy=args.eviction_policy,
        max_protected_fraction=args.max_protected_fraction,
        advisor_weights=args.advisor_weights,
        seed=args.seed,
        speculative=args.speculative_config,
        shared_prefix_attention=args.shared_prefix_attention,
        batch_invariant=args.batch_invariant,
        num_scheduler_steps=args.num_scheduler_steps,
        kv_offloading_size=args.kv_offloading_size,
        kv_disk_size=args.kv_disk_size,
        kv_high_watermark=args.kv_high_watermark,
        kv_low_watermark=args.kv_low_watermark,
        **residency_kwargs(args),
        progress=True,
    )
    per_model = {}
    for name in names:
        opts = dict(own[name])
        opts.pop("served_model_name", None)
        if "chat_template" in opts:
            opts["chat_template"] = _chat_template(opts["chat_template"])
        elif args.chat_template is not None:
            opts["chat_template"] = _chat_template(args.chat_template)
        if "speculative_config" in opts:
            opts["speculative"] = opts.pop("speculative_config")
        if args.kv_cache_dir is not None:  # several models: a directory each (their pages never mix)
            opts["kv_cache_dir"] = args.kv_cache_dir / _safe_name(name) if several else args.kv_cache_dir
        per_model[name] = opts
    if several and args.num_pages is not None:
        raise ValueError(
            "--num-pages sizes one model's pool: with several models, give each its own with "
            "--model-options NAME='{\"num_pages\": N}' (or let --memory-budget share the memory)"
        )
    fleet = plan = router = None
    try:
        if not several and args.memory_budget is None:
            name = names[0]
            pages = per_model[name].pop("num_pages", args.num_pages)
            if args.gpu_memory_utilization is not None and pages is None:
                pages = _pages_for_memory(args, name, {**common, **per_model[name]})
            llms = {name: LLM(name, **{**common, **per_model[name], "num_pages": pages})}
        else:
            if not several and args.num_pages is not None:
                per_model[names[0]].setdefault("num_pages", args.num_pages)
            fleet = Fleet(
                per_model, memory_budget_gib=args.memory_budget, gpu_memory_utilization=args.gpu_memory_utilization,
                heavy=args.route_heavy, threshold=args.route_threshold, balloon=args.kv_balloon,
                balloon_step=args.kv_balloon_step, min_move_pages=args.kv_balloon_min_move, **common,
            )  # fmt: skip
            llms, plan = fleet.llms, fleet.plan
            router = fleet.router if several else None
            log.info("memory plan:\n%s", plan.table())
    except (GGUFError, ChatTemplateError) as e:
        raise ValueError(str(e)) from None
    return fleet, llms, plan, router


def _safe_name(name: str) -> str:
    import hashlib

    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in os.path.basename(name))[:64]
    return f"{stem}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def _zone_metrics(metrics, plan, model: str) -> None:
    metrics.gauge_series(
        "aither:memory_zone_bytes",
        "Bytes the memory plan gives each of this model's zones (weights, kv_pool, draft_weights, draft_pool, "
        "activations on the device; host_tier in host memory).",
        lambda: [({"zone": z.name}, float(z.bytes)) for z in plan.zones if z.owner == model],
    )


def _use_shape_file(llm, args: argparse.Namespace) -> None:
    """`--compile-shapes FILE`: compiles the file's step shapes now (when it exists) and adds
    each new shape the engine runs to it. Raises ValueError for a file that is not a
    step-shapes file or holds a malformed record."""

    from aither_jax.compile import shape_file

    path = args.compile_shapes
    shapes: list[dict] = []
    if path.exists():
        shapes = shape_file.load(path)
        start = time.perf_counter()
        try:
            n = llm.engine.precompile(shapes, progress=True)
        except ValueError:
            raise  # a malformed record: the file is not what it claims to be
        except Exception:  # noqa: BLE001 - a compiler failure must not keep the server down
            log.exception("compiling the step shapes of %s failed; they compile on first use", path)
        else:
            log.info(
                "compiled %d of the %d step shapes of %s in %.1f s", n, len(shapes), path, time.perf_counter() - start
            )
    settings = {
        "model": args.model[0],
        "kv_cache_dtype": args.kv_cache_dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": llm.engine.max_model_len,
    }

    def record(shape: dict) -> None:  # on the engine thread, once per new shape (which then compiles)
        shapes.append(shape)
        try:
            shape_file.save(path, shapes, recorded_with=settings)
        except OSError as e:
            log.warning("could not update %s: %s", path, e)

    llm.engine.on_new_shape = record


def _power_of_two(value: int, flag: str) -> int:
    if value & (value - 1):
        raise ValueError(f"{flag} must be a power of two, got {value}")
    return value


def _pages_for_memory(args: argparse.Namespace, model: str, options: dict) -> int:
    import jax

    from aither_jax.llm import resolve_dtype
    from models.config import ModelConfig
    from models.gguf_file import GGUFFile
    from models.kv_spec import parse_kv_spec
    from models.registry import resolve_kv_cache_dtype, resolve_model

    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        raise ValueError(
            f"--gpu-memory-utilization needs an accelerator with memory statistics "
            f"(this is {jax.default_backend()}); pass --num-pages instead"
        )
    cfg = ModelConfig.from_gguf(GGUFFile(resolve_model(model)))
    kv_cache_dtype = options.get("kv_cache_dtype", "auto")
    kv = resolve_kv_cache_dtype(kv_cache_dtype, model)
    gguf = GGUFFile(resolve_model(model))
    num_params = sum(t.num_elements for t in gguf.tensors.values())
    weight_bytes = num_params * (4 if resolve_dtype(args.dtype) == "float32" else 2)
    free = args.gpu_memory_utilization * limit - stats.get("bytes_in_use", 0) - weight_bytes
    page_bytes = parse_kv_spec(kv).bytes_per_token(cfg) * 16
    if free < 2 * page_bytes:
        raise ValueError(f"--gpu-memory-utilization {args.gpu_memory_utilization} leaves no room for KV pages")
    return int(free // page_bytes)


class DrainingServer(uvicorn.Server):
    """Refuses new requests (503) from the moment a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, app):
        super().__init__(config)
        self.app = app

    def handle_exit(self, sig, frame) -> None:
        self.app.state.draining = True
        super().handle_exit(sig, frame)


if __name__ == "__main__":
    sys.exit(main())
