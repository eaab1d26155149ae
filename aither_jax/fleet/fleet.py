"""`Fleet`: several models resident in one process under one memory plan, routed by effort.

The server (`python -m aither_jax.serve --model A --model B`) and notebooks use the same
steps: load every model's weights, measure what each needs of the device (`model_needs`: the
weights' bytes, the exact bytes of a KV page and of the cache's fixed part from the cache's
shapes, the DFlash draft's weights and pools, a step's activation headroom), split the budget
(`planner.plan_memory`), build each engine with its planned pages, and route requests that
name no model (`router.Router`). Every engine keeps its own pools, scheduler and prefix cache,
so no page is ever shared across models, and both stay compiled: a route change costs no load
and no compile.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import jax

from aither_jax.fleet.balloon import Move, PoolState, next_move, pool_state, stamped
from aither_jax.fleet.planner import (
    ACTIVATION_WIDTHS,
    COMPILE_HEADROOM_BYTES,
    MemoryPlan,
    ModelNeeds,
    plan_memory,
    repage,
)
from aither_jax.fleet.router import Route, Router
from aither_jax.kv.tiers import DEFAULT_DISK_GIB, GIB
from aither_jax.llm import LLM, RequestOutput, StreamedOutput, as_prompt_list, is_conversation, resolve_dtype
from aither_jax.speculative.config import SpeculativeConfig
from models.kv_cache import init_cache
from models.kv_spec import parse_kv_spec
from models.kv_transform import load_key_transforms
from models.registry import MODELS, ModelHandle, load_model, resolve_kv_cache_dtype

BALLOON_GRID = 8  # by default a pool's balloon step is at most an eighth of its planned pool

log = logging.getLogger(__name__)
T = TypeVar("T")
# Calls a function where a model's engine is between steps: run(model, fn) -> fn().
Runner = Callable[[str, Callable[[], T]], T]


def _here(_model: str, fn: Callable[[], T]) -> T:
    return fn()


def tree_bytes(tree) -> int:
    """Bytes of the distinct arrays in a pytree (a tied embedding counts once)."""
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in _distinct_leaves(tree))


def tree_params(tree) -> int:
    """Elements of the distinct arrays in a pytree: a model's parameter count, whatever its dtype."""
    return sum(math.prod(leaf.shape) for leaf in _distinct_leaves(tree))


def _distinct_leaves(tree) -> list:
    return list({id(leaf): leaf for leaf in jax.tree.leaves(tree)}.values())


def device_budget(memory_budget_gib: float | None, gpu_memory_utilization: float | None) -> int:
    """The device bytes to plan: an explicit budget, or a fraction of the accelerator's memory
    less what is already in use. Raises ValueError when neither applies (CPU needs a budget),
    and for an explicit budget above what an accelerator that reports its memory has free."""
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    if memory_budget_gib is not None:
        if not memory_budget_gib > 0:
            raise ValueError(f"the memory budget must be positive GiB, got {memory_budget_gib!r}")
        budget = int(memory_budget_gib * GIB)
        free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        if stats.get("bytes_limit") and budget > free:
            raise ValueError(
                f"a memory budget of {memory_budget_gib:g} GiB is more than the {free / GIB:.2f} GiB free on "
                f"{device.device_kind}: give at most that"
            )
        return budget
    if gpu_memory_utilization is None or not stats.get("bytes_limit"):
        raise ValueError(
            f"several models need a memory budget: give memory_budget_gib (--memory-budget), or on an accelerator "
            f"gpu_memory_utilization (this is {jax.default_backend()})"
        )
    return int(gpu_memory_utilization * stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def model_needs(name: str, handle: ModelHandle, options: Mapping) -> ModelNeeds:
    """What `handle` served with LLM `options` needs of the device (see the module docstring)."""
    cfg = handle.config
    page_size = options.get("page_size", 16)
    max_num_seqs = options.get("max_num_seqs", 8)
    max_model_len = options.get("max_model_len") or cfg.max_context
    pages_per_seq = -(-max_model_len // page_size)
    kv = options.get("kv_cache_dtype", "auto")
    kv = resolve_kv_cache_dtype(kv, handle.name)
    spec = parse_kv_spec(kv)
    transform = None
    if spec.precondition:
        transform = load_key_transforms(
            handle.key_transform or handle.name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        )

    def cache_bytes(num_pages: int) -> int:
        make = functools.partial(
            init_cache, cfg, num_pages=num_pages, max_seqs=max_num_seqs, max_pages_per_seq=pages_per_seq,
            page_size=page_size, kv_cache_dtype=kv, key_transform=transform,
        )  # fmt: skip
        return tree_bytes(jax.eval_shape(make))  # shapes only: nothing is allocated

    page_bytes = cache_bytes(3) - cache_bytes(2)
    fixed = cache_bytes(2) - 2 * page_bytes
    act = 2 if handle.dtype == "bfloat16" else 4
    prefill_chunk = options.get("max_prefill_chunk", 256)
    tokens = options.get("max_num_batched_tokens") or max(prefill_chunk, max_num_seqs)
    widths = cfg.vocab_size * 4 + (ACTIVATION_WIDTHS * cfg.hidden_size + 3 * cfg.ffn_size) * act
    draft_weights, draft_page = _draft_needs(handle, options.get("speculative"), page_size)
    return ModelNeeds(
        name=name, weight_bytes=tree_bytes(handle.weights), page_bytes=page_bytes + draft_page,
        draft_page_bytes=draft_page, draft_weight_bytes=draft_weights, kv_fixed_bytes=fixed,
        activation_bytes=tokens * widths + COMPILE_HEADROOM_BYTES, min_pages=pages_per_seq + 1,
        max_pages=max_num_seqs * pages_per_seq + 1, num_pages=options.get("num_pages"),
        kv_share=options.get("kv_share", 1.0), host_bytes=int(options.get("kv_offloading_size", 0.0) * GIB),
    )  # fmt: skip


def _draft_needs(handle: ModelHandle, speculative, page_size: int) -> tuple[int, int]:
    """(the DFlash draft's weight bytes, its context pools' bytes per page); zeros without one."""
    from models.draft_io import load_draft

    spec = SpeculativeConfig.parse(speculative)
    path = None if spec is None or spec.method != "dflash" else (spec.model or handle.draft)
    if path is None or not os.path.isfile(path):
        return 0, 0  # no draft, or the engine reports the missing file
    cfg, params, _, vocab = load_draft(path)
    item = 2 if handle.dtype == "bfloat16" else 4
    head = 0 if vocab is None else len(vocab) * handle.config.hidden_size * item  # the restricted LM head
    weights = sum(math.prod(x.shape) for x in jax.tree.leaves(params)) * item + head
    return weights, 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * item


def _shared_tier_sizes(own: Mapping[str, Mapping], common: Mapping) -> dict[str, dict[str, float]]:
    """The host and disk tier sizes (GiB) of the models that have the tier but give no size of
    their own (`own`: each model's options; `common`: the fleet's): the fleet's size (the disk
    tier's default without one) split between them by `kv_share`."""
    sizes: dict[str, dict[str, float]] = {name: {} for name in own}
    for key, default in (("kv_offloading_size", None), ("kv_disk_size", DEFAULT_DISK_GIB)):
        total = common.get(key)
        total = default if total is None else total
        sharing = [
            name for name, o in own.items()
            if key not in o and (key != "kv_disk_size" or {**common, **o}.get("kv_cache_dir") is not None)
        ]  # fmt: skip
        weights = {name: {**common, **own[name]}.get("kv_share", 1.0) for name in sharing}
        if not sharing or not all(_positive(x) for x in (total, *weights.values())):
            continue  # nothing to share, or a size or share the engines and planner refuse by name
        for name in sharing:
            sizes[name][key] = total * weights[name] / sum(weights.values())
    return sizes


def _positive(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x > 0


class Fleet:
    """Models resident together under one memory plan, with effort routing between them.

    Args:
        models: model names (registered names or GGUF paths), or a dict from name to that
            model's own `LLM` keyword arguments (kv_cache_dtype, max_model_len, speculative,
            num_pages, ...; plus `kv_share`, its weight in sharing the KV memory).
        memory_budget_gib: device memory to plan (required on CPU).
        gpu_memory_utilization: on an accelerator, the fraction of its memory to plan instead.
        heavy: the model effortful requests go to (default: the one with the most
            parameters); the light one is the first other model.
        threshold: effort (1-5) from which a request goes to `heavy`.
        balloon: move idle KV pages between the pools as load shifts (balloon.py), checked
            before each batch; `moves` lists what moved.
        min_move_pages: the smallest move worth its recompiles, in the borrower's pages
            (default: the smallest floor, one sequence of full length).
        balloon_step: a pool's sizes are its plan plus or minus whole steps of this many of
            its pages (default: its floor, one sequence of full length, or an eighth of its
            planned pool if less), so the sizes the balloon visits, each with its own compiled
            steps, are few; 1 for any size.
        prepare_moves: before a move, compile both models' steps for their new pool sizes on
            several threads (`prepare`) rather than one shape at a time as steps first need them.
        **common: `LLM` keyword arguments for every model (a model's own win). The host
            and disk tier sizes (`kv_offloading_size`, `kv_disk_size`, default 4 GiB with a
            `kv_cache_dir`) are the fleet's: the models that give none of their own share
            them by `kv_share`, so the process holds what was asked.

    `fleet.plan` holds the zones (`fleet.plan.table()` prints them); `fleet.llms[name]` each
    model's `LLM`; `chat` and `generate` take `model="auto"` to route.
    """

    def __init__(
        self,
        models: Sequence[str] | Mapping[str, Mapping],
        *,
        memory_budget_gib: float | None = None,
        gpu_memory_utilization: float | None = None,
        heavy: str | None = None,
        threshold: int = 3,
        balloon: bool = False,
        min_move_pages: int | None = None,
        balloon_step: int | None = None,
        prepare_moves: bool = True,
        **common,
    ):
        if balloon_step is not None and (
            isinstance(balloon_step, bool) or not isinstance(balloon_step, int) or balloon_step < 1
        ):
            raise ValueError(f"balloon_step must be a whole number of pages >= 1, got {balloon_step!r}")
        options = (
            {m: {} for m in models} if not isinstance(models, Mapping) else {m: dict(o) for m, o in models.items()}
        )
        if not options:
            raise ValueError("a fleet needs at least one model")
        budget = device_budget(memory_budget_gib, gpu_memory_utilization)
        handles, needs = {}, []
        if "num_pages" in common:
            raise ValueError("num_pages is a model's own option: models={name: {'num_pages': ...}}")
        tier_sizes = _shared_tier_sizes(options, common)
        for name, own in options.items():
            options[name] = merged = {**common, **own, **tier_sizes[name]}
            dtype = resolve_dtype(merged.get("dtype", "auto"))
            handles[name] = load_model(
                name, dtype, progress=merged.get("progress", True), num_layers=merged.get("_num_layers")
            )
            needs.append(model_needs(name, handles[name], merged))
        self.plan: MemoryPlan = plan_memory(budget, needs)
        self.planned = dict(self.plan.num_pages)  # the balloon returns toward these
        self.needs = {n.name: n for n in needs}
        self.llms: dict[str, LLM] = {}
        for name, merged in options.items():
            merged.pop("kv_share", None)
            self.llms[name] = LLM(name, **{**merged, "num_pages": self.plan.num_pages[name]})
        # The balloon (balloon.py): each batch first lets the pools trade pages.
        self.min_move_pages = min_move_pages
        self.balloon_step = {
            n.name: balloon_step or max(min(n.min_pages, self.planned[n.name] // BALLOON_GRID), 1) for n in needs
        }
        self.prepare_moves = prepare_moves
        # Per model, the pool sizes its steps are compiled for: size -> how many step shapes
        # it had then (a size is ready while no new shape has been seen since).
        self._ready: dict[str, dict[int, int]] = {name: {} for name in self.llms}
        self._compile_s = 0.0  # `prepare`'s seconds since the last move
        # Per model, the pool size it is at and whether the shapes it had on arriving there
        # were compiled for it (an idle model is moved without compiling).
        self._arrived: dict[str, tuple[int, bool]] = {name: (self.plan.num_pages[name], True) for name in self.llms}
        if balloon:
            for name, llm in self.llms.items():
                if llm.engine.bounded is not None:
                    raise ValueError(
                        f"the balloon cannot resize {name}'s pool under bounded residency (max_resident_tokens)"
                    )
                llm.before_steps = self.rebalance
        self._handles = handles  # keeps the loaded weights shared with the engines
        if heavy is not None and heavy not in self.llms:
            raise ValueError(f"heavy model {heavy!r} is not one of {list(self.llms)}")
        params = {name: tree_params(handle.weights) for name, handle in handles.items()}
        by_size = heavy is None
        heavy = heavy or max(params, key=params.get)  # by parameters: per-model dtypes do not decide
        light = next((m for m in self.llms if m != heavy), heavy)
        self.router = Router(light, heavy, threshold=threshold)
        if by_size and (note := base_model_note(heavy, light)):
            log.warning(note)

    @property
    def models(self) -> list[str]:
        return list(self.llms)

    def allocated(self) -> dict[tuple[str, str], int]:
        """Bytes each zone actually holds now, measured from the engines' arrays, keyed like
        the plan's zones (owner, zone); activations are not arrays that persist."""
        out = {}
        for name, llm in self.llms.items():
            engine = llm.engine
            out[(name, "weights")] = tree_bytes(engine.weights)
            out[(name, "kv_pool")] = tree_bytes(engine.store.cache)
            drafter = engine.store.drafter
            if drafter is not None:
                out[(name, "draft_pool")] = tree_bytes(drafter.pools)
                head = 0 if drafter.vocab is None else tree_bytes(drafter.lm_head)
                out[(name, "draft_weights")] = tree_bytes(drafter.params) + head
        return out

    @property
    def moves(self) -> list[Move]:
        """The balloon's moves so far, as applied."""
        return self.plan.moves

    def pool_state(self, name: str) -> PoolState:
        """Model `name`'s KV pool as the balloon sees it (between its engine's steps)."""
        need = self.needs[name]
        return pool_state(
            self.llms[name].engine, name=name, planned_pages=self.planned[name], min_pages=need.min_pages,
            max_pages=need.max_pages, page_bytes=need.page_bytes, step=self.balloon_step[name],
        )  # fmt: skip

    def next_move(self, run: Runner | None = None) -> Move | None:
        """The balloon's next move if one is due (balloon.py), not yet applied. `run(model, fn)`
        calls `fn` where that model's engine is between steps (the server: on its loop
        thread); by default, here."""
        run = run or _here
        least = self.min_move_pages
        if least is None:  # by default, one sequence of full length of the smallest floor
            least = min(n.min_pages for n in self.needs.values())
        states = [run(name, functools.partial(self.pool_state, name)) for name in self.llms]
        return next_move(states, min_move_pages=least, unassigned=self.plan.unassigned_bytes)

    def targets(self, move: Move) -> dict[str, int]:
        """The pool sizes `move` leaves its two models with, from their sizes now."""
        lender, borrower = self.llms[move.lender].engine, self.llms[move.borrower].engine
        return {
            move.lender: lender.num_pages - move.lender_pages,
            move.borrower: borrower.num_pages + move.borrower_pages,
        }

    def ready(self, move: Move) -> bool:
        """Whether the steps are compiled for the sizes `move` leaves its models with, where
        it matters: nothing is left for `prepare` to do."""
        return not self._to_prepare(move)

    def _to_prepare(self, move: Move) -> dict[str, int]:
        """The models of `move` (name -> new pool size) whose steps `prepare` compiles: those
        with requests running or waiting (an idle one, usually the lender, compiles at its new
        size only if it runs there before the next move) and not yet compiled for that size
        (`_compiled_for`)."""
        return {
            name: size
            for name, size in self.targets(move).items()
            if self.llms[name].engine.has_unfinished() and not self._compiled_for(name, size)
        }

    def _compiled_for(self, name: str, size: int) -> bool:
        """Whether every step shape model `name` has run is compiled for a pool of `size`
        pages: it has run none, or it left that size (or `prepare` compiled for it) with no
        shape seen since."""
        shapes = len(self.llms[name].engine.step_shapes())
        return shapes == 0 or self._ready[name].get(size) == shapes

    def prepare(self, move: Move, *, workers: int | None = None) -> int:
        """Compiles the step shapes of the models of `move` that need it (`_to_prepare`) for
        the pool sizes the move leaves them with (`Engine.precompile_pool`), so that applying
        it compiles nothing for them. Safe on another thread while the engines step; returns
        the shapes compiled."""
        done = 0
        for name, size in self._to_prepare(move).items():
            engine = self.llms[name].engine
            shapes = engine.step_shapes()
            start = time.perf_counter()
            done += engine.precompile_pool(size, shapes, workers=workers)
            self._ready[name][size] = len(shapes)
            seconds = time.perf_counter() - start
            self._compile_s += seconds
            log.info("balloon: %s's %d step shapes compiled for %d pages in %.1f s", name, len(shapes), size, seconds)
        return done

    def apply(self, move: Move, run: Runner | None = None) -> Move:
        """Makes `move` and returns it as applied: the lender's pool shrinks first, then the
        borrower's grows by what the freed bytes hold; the plan's zones follow."""
        run = run or _here
        unassigned = self.plan.unassigned_bytes
        lender, borrower = self.llms[move.lender].engine, self.llms[move.borrower].engine
        lender_bytes, borrower_bytes = self.needs[move.lender].page_bytes, self.needs[move.borrower].page_bytes
        pairs = ((move.lender, lender), (move.borrower, borrower))
        for name, engine in pairs:
            # Leaving a size: every shape is compiled for it if those it arrived with were
            # (shapes first seen there compiled there).
            size, complete = self._arrived[name]
            if complete and size == engine.num_pages:
                self._ready[name][size] = len(engine.step_shapes())
        before = lender.num_pages
        given = before - run(move.lender, lambda: lender.resize_pool(before - move.lender_pages))  # less if in use
        gain = min((given * lender_bytes + unassigned) // borrower_bytes, move.borrower_pages)
        if gain:
            try:
                run(move.borrower, lambda: borrower.resize_pool(borrower.num_pages + gain))
            except Exception:  # the device refused the borrower's pools: the lender takes its pages back
                run(move.lender, lambda: lender.resize_pool(before))
                raise
        for name, engine in pairs:
            self._arrived[name] = (engine.num_pages, self._compiled_for(name, engine.num_pages))
        move = dataclasses.replace(stamped(move, given, gain, borrower_bytes), compile_s=self._compile_s)
        self._compile_s = 0.0
        repage(
            self.plan,
            list(self.needs.values()),
            {m: self.llms[m].engine.num_pages for m in (move.lender, move.borrower)},
        )
        self.plan.moves.append(move)
        log.info("balloon: %s", move)
        return move

    def rebalance(self, run: Runner | None = None) -> Move | None:
        """Makes the balloon's next move, if one is due, and returns it as applied; with
        `prepare_moves`, first compiles the steps for the new pool sizes (`prepare`)."""
        move = self.next_move(run)
        if move is None:
            return None
        if self.prepare_moves and not self.ready(move):
            self.prepare(move)
        return self.apply(move, run)

    def route(
        self, messages: Sequence[dict], *, reasoning_effort: str | None = None, conversation=None, session=False
    ) -> Route:
        """`Router.route`: the model for a chat turn, and why."""
        return self.router.route(
            messages, reasoning_effort=reasoning_effort, conversation=conversation, session=session
        )

    def chat(
        self,
        conversations: Sequence[Sequence[dict]],
        sampling_params=None,
        *,
        model: str = "auto",
        reasoning_effort: str | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """`LLM.chat` on the named model, or with `model="auto"` on the model each
        conversation routes to; each output's `model` says which served it."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        targets = [
            self._target(model, lambda c=c: self.route(c, reasoning_effort=reasoning_effort)) for c in conversations
        ]
        return self._fan_out(targets, conversations, sampling_params, use_tqdm, chat=True)

    def generate(
        self,
        prompts,
        sampling_params=None,
        *,
        model: str = "auto",
        reasoning_effort: str | None = None,
        use_tqdm: bool | None = None,
    ):
        """`LLM.generate` on the named model, or routed by each prompt's effort (or the
        `reasoning_effort` given)."""
        prompts = as_prompt_list(prompts)
        if model == "auto" and any(not isinstance(p, str) for p in prompts):
            raise ValueError(TOKENS_NOT_ROUTED)
        route = self.router.route_text
        targets = [self._target(model, lambda p=p: route(p, reasoning_effort=reasoning_effort)) for p in prompts]
        return self._fan_out(targets, prompts, sampling_params, use_tqdm, chat=False)

    def stream(
        self, prompt, sampling_params=None, *, model: str = "auto", reasoning_effort: str | None = None
    ) -> StreamedOutput:
        """`LLM.stream` on the named model or, with `model="auto"`, on the one a text prompt or
        a conversation routes to; the stream's `model` (and its output's) names it."""
        conversation = is_conversation(prompt)
        if model == "auto" and not conversation and not isinstance(prompt, str):
            raise ValueError(TOKENS_NOT_ROUTED)
        if conversation:
            name = self._target(model, lambda: self.route(prompt, reasoning_effort=reasoning_effort))
        else:
            name = self._target(model, lambda: self.router.route_text(prompt, reasoning_effort=reasoning_effort))
        stream = self.llms[name].stream(prompt, sampling_params)
        stream.model = name
        return stream

    def _target(self, model: str, route) -> str:
        if model == "auto":
            return route().model
        if model not in self.llms:
            raise ValueError(f"model {model!r} is not served here; models: {', '.join(self.llms)} or 'auto'")
        return model

    def _fan_out(self, targets, items, sampling_params, use_tqdm, *, chat: bool) -> list[RequestOutput]:
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(items)
        if len(params) != len(items):
            raise ValueError(f"{len(params)} sampling params for {len(items)} prompts")
        outputs: list[RequestOutput | None] = [None] * len(items)
        for name in dict.fromkeys(targets):
            idx = [i for i, t in enumerate(targets) if t == name]
            llm = self.llms[name]
            run = llm.chat if chat else llm.generate
            own = None if sampling_params is None else [params[i] for i in idx]
            results = run([items[i] for i in idx], own, use_tqdm=use_tqdm)
            for i, out in zip(idx, results, strict=True):
                out.model = name
                outputs[i] = out
        return outputs


TOKENS_NOT_ROUTED = (
    "model='auto' routes text prompts and conversations; token ids and assembled Prompts are one model's tokens: "
    "name the model"
)


def base_model_note(heavy: str, light: str) -> str | None:
    """A warning for routing that sends effortful requests to a registered base model while
    the other model is tuned for chat (the heavy model is chosen by parameters by default)."""
    entry, other = MODELS.get(heavy), MODELS.get(light)
    if entry is None or other is None or entry.chat_tuned or not other.chat_tuned:
        return None
    return (
        f"routing by effort sends demanding requests to {heavy}, the model with more parameters, which is a base "
        f"model not tuned for chat ({light} is); name the heavy model to choose otherwise (heavy=, --route-heavy)"
    )
