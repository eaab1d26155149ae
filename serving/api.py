"""The HTTP layer: OpenAI-compatible routes over the engine loop (FastAPI).

Routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (JSON or SSE), `/v1/unpin`
(ours: releases a `pin_prefix` pin), `/health`, `/metrics`, `/debug/memory` (the memory plan's
zones), `/debug/kv_graph` (the eviction advisor's graph). Several models may be served: a
request names one (`model`), or `auto` to be routed by effort (aither_jax/fleet/router.py),
or none for the server's default; the response's `model` names the model that served it. Everything a client sends is
validated here: bad parameters and prompts over the context limit get 400 with an OpenAI error
body, oversized bodies 413, a full queue 503 with Retry-After, a wrong or missing API key 401.
The tenant (API key and `X-Tenant-Id`) salts the prefix cache. A client that goes away aborts
its requests.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import contextlib
import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import uuid
import weakref
from collections.abc import AsyncIterator, Sequence

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aither_jax.context.prompt import Prompt, chat_prompt, text_prompt
from aither_jax.context.sections import Context, sections_from_messages
from aither_jax.core.output import TextStream
from aither_jax.device.sampling import SamplingParams
from aither_jax.fleet.planner import MemoryPlan
from aither_jax.fleet.router import Route, Router
from aither_jax.kv.prefix_cache import tenant_salt
from models.tokenizer import Tokenizer
from serving import protocol
from serving.async_engine import AsyncEngine, EngineDeadError, QueueFullError, Update
from serving.metrics import render_metrics

log = logging.getLogger(__name__)

MAX_REQUEST_ID_LEN = 128
MAX_TENANT_LEN = 128
RETRY_AFTER_SECONDS = 1
# Context pipelines kept per model (one per tenant and prompt_cache_key). Past it the tenant
# holding the most gives up its least recently used, so one tenant cycling keys cannot push
# out the others' (with one tenant: plain LRU).
MAX_CONTEXTS = 1024
DEFAULT_ANSWER_TOKENS = 256  # room a sectioned prompt leaves for the answer without max_tokens
DISCONNECT_POLL_SECONDS = 0.25


@dataclasses.dataclass
class ServerConfig:
    api_keys: tuple[str, ...] = ()  # none: no authentication
    max_body_bytes: int = 4 << 20
    secret: bytes = b""  # salts tenants' prefix-cache chains; random per process
    default_model: str | None = None  # a served model's name, "auto" (route), or None: the first

    def salt(self, tenant: str, key_index: int | None = None, model: str = "") -> bytes:
        """The prefix-cache root of a tenant on a model: the API key a request authenticated
        with (its index in `api_keys`; None without keys) and its `X-Tenant-Id` value (""
        when absent). Requests under different keys never share pages, whatever tenant header
        they send, and chains are named per model."""
        key = "" if key_index is None else hashlib.sha256(self.api_keys[key_index].encode()).hexdigest()
        return tenant_salt(self.secret, f"{model}\x00{key}\x00{tenant}")

    def root_salts(self, model: str = "") -> list[bytes]:
        """The salt of each key's requests without a tenant header (one salt without keys)."""
        keys = range(len(self.api_keys)) if self.api_keys else [None]
        return [self.salt("", i, model) for i in keys]


@dataclasses.dataclass(eq=False)
class ServedModel:
    """One model the server serves: its engine loop, tokenizer and context pipelines."""

    name: str
    engine: AsyncEngine
    tokenizer: Tokenizer
    max_model_len: int
    # What a request that leaves temperature, top_p or top_k unset gets (the model's card; {}:
    # the API's own defaults, temperature 1, top_p 1, top_k off).
    sampling: dict = dataclasses.field(default_factory=dict)
    # Context pipelines by (tenant salt, prompt_cache_key): each remembers its stable prefixes.
    contexts: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)

    @property
    def speculative(self) -> bool:
        return self.engine.engine.speculative is not None


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}


def _error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(protocol.error_body(message, status, param), status_code=status, headers=headers)


class BodyLimit:
    """ASGI middleware: 413 for bodies over `limit` bytes, declared or sent in chunks. The body
    is read (at most `limit` bytes of it) before the app runs, then replayed to it."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = _error(413, f"the request body exceeds {self.limit} bytes")
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await too_big(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await too_big(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class RequestGate:
    """ASGI middleware: checks the API key (every route but /health; any of `api_keys`, whose
    index goes into the request's state as `api_key_index`) and the request id, and echoes the
    id in `X-Request-Id` (generated when the client sent none)."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]):
        self.app, self.api_keys = app, tuple(k.encode() for k in api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        rid = headers.get("x-request-id")
        if rid is not None and (not 0 < len(rid) <= MAX_REQUEST_ID_LEN or not (rid.isascii() and rid.isprintable())):
            message = f"X-Request-Id must be 1 to {MAX_REQUEST_ID_LEN} printable ASCII characters"
            return await _error(400, message)(scope, receive, send)
        rid = rid or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        if self.api_keys and scope["path"] != "/health":
            scheme, _, token = headers.get("authorization", "").partition(" ")
            # Every key is compared (in constant time), so timing tells nothing about which matched.
            matches = [hmac.compare_digest(token.encode(), key) for key in self.api_keys]
            if scheme.lower() != "bearer" or not any(matches):
                response = _error(401, "invalid or missing API key (Authorization: Bearer <key>)")
                response.headers["X-Request-Id"] = rid
                return await response(scope, receive, send)
            scope["state"]["api_key_index"] = matches.index(True)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode("latin-1"))]
            await send(message)

        await self.app(scope, receive, send_with_id)


class SSEResponse(StreamingResponse):
    """A streaming response that stops (and so aborts its requests) as soon as the client
    disconnects, even while nothing is being sent: requests still waiting for a slot produce
    no chunks, so a failed send alone would not notice."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def stream() -> None:
                with contextlib.suppress(OSError):
                    await self.stream_response(send)
                group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()


class TokenOffsets:
    """Where each generated token's text starts and ends in the completion's text, in
    characters: the tokens' UTF-8 bytes decoded one after another, so a character that takes
    several tokens starts where its first token does and ends with its last. Special tokens,
    which the text leaves out, take no characters."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def add(self, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        spans = []
        for t in token_ids:
            start = self.chars
            if t not in self.tokenizer.special_ids:
                self.chars += len(self._decoder.decode(self.tokenizer.token_bytes(t)))
            spans.append((start, self.chars))
        return spans


class LogprobStream:
    """Holds a streamed choice's token logprobs until the text they make is sent, so each
    chunk's logprobs are those of the tokens of its text (text that could still become a stop
    string is held back, `TextStream`); what is left goes with the last chunk."""

    def __init__(self, tokenizer: Tokenizer):
        self.offsets = TokenOffsets(tokenizer)
        # (token, start, end, logprob) of each token not sent yet
        self._pending: collections.deque[tuple[int, int, int, object]] = collections.deque()

    def add(self, token_ids: Sequence[int], logprobs: Sequence) -> None:
        for t, (start, end), lp in zip(token_ids, self.offsets.add(token_ids), logprobs, strict=True):
            self._pending.append((t, start, end, lp))

    def take(self, sent_chars: int | None) -> tuple[list[int], list, list[int]]:
        """(tokens, logprobs, text offsets) of the held tokens whose text ends within the first
        `sent_chars` characters sent (None: all of them)."""
        tokens, logprobs, starts = [], [], []
        while self._pending and (sent_chars is None or self._pending[0][2] <= sent_chars):
            t, start, _, lp = self._pending.popleft()
            tokens.append(t)
            logprobs.append(lp)
            starts.append(start)
        return tokens, logprobs, starts


@dataclasses.dataclass
class _Job:
    """One choice of a request: a prompt sampled once."""

    index: int
    prompt: Prompt
    params: SamplingParams
    takes_pin: bool  # only the first choice of a prompt pins (and unpins) what the prompt names

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.ids


def build_app(
    models: Sequence[ServedModel],
    config: ServerConfig,
    *,
    router: Router | None = None,
    plan: MemoryPlan | None = None,
) -> FastAPI:
    """The FastAPI application serving `models` (the first is the default), routing requests
    for `auto` with `router` and showing `plan` at /debug/memory."""
    if not models:
        raise ValueError("build_app needs at least one model")
    by_name = {m.name: m for m in models}
    if len(by_name) != len(models):
        raise ValueError("served model names must differ")
    if config.default_model not in (None, "auto", *by_name):
        raise ValueError(f"the default model {config.default_model!r} is not served")
    if config.default_model == "auto" and router is None:
        raise ValueError("the default model 'auto' needs a router")
    app = FastAPI(title="aither-jax", version="0.1.0")
    app.state.draining = False
    # The last added is the outermost: the gate (auth, request id) sees every response, 413s included.
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(RequestGate, api_keys=config.api_keys)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return _error(400, message, param)

    @app.exception_handler(HTTPError)
    async def http_error(request: Request, exc: HTTPError):
        return _error(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def framework_error(request: Request, exc: StarletteHTTPException):
        # Unknown routes, wrong methods, bodies the framework cannot parse: same error shape.
        return _error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def health():
        """200 while every model's engine runs; 503 naming the stopped ones (the others keep
        serving)."""
        status = {m.name: "alive" if m.engine.alive else f"stopped: {m.engine.error!r}" for m in models}
        code = 200 if all(m.engine.alive for m in models) else 503
        return JSONResponse({"models": status}, status_code=code)

    @app.get("/metrics")
    async def prometheus():
        text = render_metrics([m.engine.metrics for m in models])
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/debug/memory")
    async def memory():
        """The memory plan: each model's zones (weights, KV pool, draft, activations, host tier)."""
        if plan is None:
            return _error(404, "no memory plan: start the server with --memory-budget or several --model")
        return plan.to_json()

    @app.get("/debug/kv_graph")
    async def kv_graph(model: str | None = None):
        """The eviction advisor's block graph: nodes (what each page is, where it is) and edges
        by type."""
        served = _named(model)
        cache = served.engine.engine.scheduler.prefix_cache
        graph = served.engine.engine.scheduler.policy.graph
        if graph is None:
            return _error(
                404, "the eviction advisor is off: this server runs --eviction-policy lru or no prefix caching"
            )
        return graph.to_json(cache.describe)

    def _card(m: ServedModel) -> dict:
        card = {"id": m.name, "object": "model", "created": 0, "owned_by": "aither-jax"}
        return card | {"max_model_len": m.max_model_len}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_card(m) for m in models]}

    @app.get("/v1/models/{name:path}")
    async def retrieve_model(name: str):
        return _card(_named(name))

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, request: Request):
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]

        def route() -> Route:  # the prompt that needs the most effort picks the model for all
            if not all(isinstance(p, str) for p in prompts):
                message = "model 'auto' routes text prompts; token ids are one model's tokens: name the model"
                raise HTTPError(400, message, "model")
            routes = [router.route_text(p, reasoning_effort=body.reasoning_effort, remember=False) for p in prompts]
            return max(routes, key=lambda r: r.effort)

        served, routed = _pick(body.model, route)
        assembled = [text_prompt(served.tokenizer, p, pin=body.pin_prefix) for p in prompts]
        jobs = _jobs(served, assembled, body, body.max_tokens)
        return await _serve(served, request, body, jobs, "text_completion", body.logprobs, chat=False, routed=routed)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: protocol.ChatCompletionRequest, request: Request):
        # An X-Session-Id continues across turns whatever they carry; `user` names an end user,
        # whose new conversation (a first turn) starts afresh.
        session = request.headers.get("x-session-id")
        conversation = session if session is not None else body.user
        messages = body.conversation()
        route = lambda: router.route(  # noqa: E731
            messages, reasoning_effort=body.reasoning_effort, conversation=conversation,
            session=session is not None, scope=_scope(request), remember=False,
        )  # fmt: skip
        served, routed = _pick(body.model, route)
        max_tokens = body.max_completion_tokens or body.max_tokens
        try:
            if body.sectioned:
                prompt = _context_prompt(served, body, _salt(request, served), max_tokens)
            else:
                prompt = chat_prompt(served.tokenizer, messages, pin_system=body.pin_prefix)
        except ValueError as e:
            raise HTTPError(400, str(e), "messages") from None
        top = (body.top_logprobs or 0) if body.logprobs else None
        jobs = _jobs(served, [prompt], body, max_tokens)
        return await _serve(served, request, body, jobs, "chat.completion", top, chat=True, routed=routed)

    @app.post("/v1/unpin")
    async def unpin(body: protocol.UnpinRequest, request: Request):
        """Drops the pin a `pin_prefix` request with the same prompt or messages (and tenant)
        took; pages pinned twice need two calls. Answers with the pages unpinned."""
        served = _named(body.model)
        if body.messages is not None:
            try:
                messages = protocol.template_messages(body.messages)
                pinned = chat_prompt(served.tokenizer, messages, pin_system=True)
            except ValueError as e:
                raise HTTPError(400, str(e), "messages") from None
        else:
            pinned = text_prompt(served.tokenizer, body.prompt, pin=True)
        try:
            pages = await served.engine.unpin(pinned.pinned_ids, _salt(request, served))
        except (EngineDeadError, ValueError) as e:
            raise _as_http(e) from None
        return {"object": "unpin", "pages": pages}

    def _named(name: str | None, *, routed: bool = False) -> ServedModel:
        """The model a request names (None: the server's default model); 404 for any other
        name, whose message offers `auto` where the route takes it (`routed`)."""
        if name is None and config.default_model == "auto":
            raise HTTPError(400, "name the model: this server's default model is `auto` (routed by effort)", "model")
        name = name if name is not None else config.default_model or models[0].name
        if name not in by_name:
            served = ", ".join(f"`{m}`" for m in by_name)
            more = " or `auto`" if router is not None and routed else ""
            raise HTTPError(404, f"The model `{name}` does not exist; this server serves {served}{more}.", "model")
        return by_name[name]

    def _pick(name: str | None, route) -> tuple[ServedModel, Route | None]:
        """The model that serves a request: the one it names, the routed one for `auto`,
        else the server's default; and the route when the router chose (`_serve` records it
        once the engine has admitted the request)."""
        name = config.default_model if name is None else name
        if name == "auto" and router is not None:
            chosen = route()
            served = by_name[chosen.model]
            if not served.engine.alive:  # the other model still answers
                served = next((m for m in models if m.engine.alive), served)
            return served, chosen
        if name == "auto" and len(models) == 1:
            return models[0], None
        return _named(name, routed=True), None

    def _jobs(served: ServedModel, prompts: list[Prompt], body, max_tokens: int | None) -> list[_Job]:
        """`body.n` choices of each prompt; only the first choice of a prompt takes its pin."""
        if len(prompts) * body.n > protocol.MAX_CHOICES:
            raise HTTPError(400, f"prompts x n must be at most {protocol.MAX_CHOICES}", "n")
        tokenizer, defaults = served.tokenizer, served.sampling
        jobs = []
        for i, prompt in enumerate(prompts):
            prompt_ids = prompt.ids
            if not prompt_ids:
                raise HTTPError(400, "the prompt is empty", "prompt")
            if max(prompt_ids) >= tokenizer.vocab_size:
                raise HTTPError(
                    400, f"prompt token ids must be below the vocabulary size {tokenizer.vocab_size}", "prompt"
                )
            remaining = served.max_model_len - len(prompt_ids)
            try:
                served.engine.engine.check_prompt(len(prompt_ids), max_tokens)
            except ValueError as e:  # past the context length (of the model named, or routed to)
                message = f"{e} (model `{served.name}`)" if len(models) > 1 else str(e)
                raise HTTPError(400, message, "messages" if hasattr(body, "messages") else "prompt") from None
            try:
                for j in range(body.n):
                    seed = None if body.seed is None else (body.seed + j) % 2**32
                    params = SamplingParams(
                        max_tokens=remaining if max_tokens is None else max_tokens,
                        temperature=float(_given(body.temperature, defaults, "temperature", 1.0)),
                        top_p=float(_given(body.top_p, defaults, "top_p", 1.0)),
                        top_k=int(_given(body.top_k, defaults, "top_k", 0)),
                        seed=seed,
                        stop=body.stop,
                        stop_token_ids=body.stop_token_ids,
                        ignore_eos=body.ignore_eos,
                    )
                    params.validate(tokenizer.vocab_size)
                    jobs.append(_Job(i * body.n + j, prompt, params, takes_pin=j == 0))
            except ValueError as e:
                raise HTTPError(400, str(e)) from None
        return jobs

    def _context_prompt(
        served: ServedModel, body: protocol.ChatCompletionRequest, salt: bytes, max_tokens: int | None
    ) -> Prompt:
        """A sectioned chat request through the context pipeline (ContextError is a ValueError)."""
        options = body.context or protocol.ContextOptions()
        messages = [
            m.model_dump(include={"section"}) | {"cache_control": m.breakpoint}
            | protocol.template_messages([m])[0]
            for m in body.messages
        ]  # fmt: skip
        sections, breakpoint = sections_from_messages(messages)
        if options.budget is not None and options.budget > served.max_model_len:
            raise HTTPError(
                400, f"context.budget {options.budget} exceeds the model's context length {served.max_model_len}",
                "context.budget",
            )  # fmt: skip
        budget = options.budget or max(1, served.max_model_len - (max_tokens or DEFAULT_ANSWER_TOKENS))
        key = (salt, body.prompt_cache_key or "")
        contexts = served.contexts
        ctx = contexts.get(key)
        if ctx is None:
            engine = served.engine.engine
            ctx = Context(
                served.tokenizer, context_budget=budget, prefill_budget=options.prefill_budget,
                cached_tokens=functools.partial(engine.cached_prefix_tokens, salt=salt),
            )  # fmt: skip
            # Its pin goes once the context is dropped and its last request is done with it.
            weakref.finalize(ctx.pin_owner, served.engine.engine.release_pin, ctx.pin_owner.key)
            contexts[key] = ctx
        else:  # the stable prefixes seen still count under this request's budgets
            ctx.context_budget, ctx.prefill_budget = budget, options.prefill_budget
        contexts.move_to_end(key)
        if len(contexts) > MAX_CONTEXTS:
            _drop_context(contexts)
        prompt = ctx.assemble(sections, pinned=breakpoint)
        return prompt if options.report else dataclasses.replace(prompt, report=None)

    def _salt(request: Request, served: ServedModel | None) -> bytes:
        """The request's tenant root on `served` (None: the router's, which names no model)."""
        model = "auto" if served is None else served.name
        return config.salt(_tenant(request), request.scope["state"].get("api_key_index"), model)

    def _scope(request: Request) -> str:
        """The router's conversation scope: a tenant's conversations are its own."""
        return _salt(request, None).hex()

    def _tenant(request: Request) -> str:
        tenant = request.headers.get("x-tenant-id", "")
        if len(tenant) > MAX_TENANT_LEN or not tenant.isprintable():
            raise HTTPError(400, f"X-Tenant-Id must be at most {MAX_TENANT_LEN} printable characters")
        return tenant

    async def _serve(
        served: ServedModel, request: Request, body, jobs: list[_Job], kind: str, num_logprobs, *, chat,
        routed: Route | None = None,
    ):  # fmt: skip
        if app.state.draining:
            raise HTTPError(503, "the server is shutting down", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        salt = _salt(request, served)
        try:
            reservation = served.engine.reserve(len(jobs))
        except (QueueFullError, EngineDeadError) as e:
            raise _as_http(e) from None
        prefix = "chatcmpl-" if chat else "cmpl-"
        rid = prefix + request.scope["state"]["request_id"]
        updates = _merge(served.engine, jobs, salt, num_logprobs, reservation)
        if routed is not None:

            def accepted() -> None:  # the engine took the request: the turn counts, its conversation remembers it
                router.remember(routed)
                served.engine.metrics.inc(
                    "aither:routed_requests_total", effort=str(routed.effort), reason=routed.reason
                )

            updates = _on_first(updates, accepted)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunk_kind = kind + (".chunk" if chat else "")
            stream = _sse(served, rid, chunk_kind, jobs, updates, body, num_logprobs, chat, include_usage)
            return SSEResponse(stream, media_type="text/event-stream")
        return await _complete(served, request, rid, kind, jobs, updates, body, num_logprobs, chat)

    async def _complete(served, request, rid, kind, jobs, updates, body, num_logprobs, chat):
        tokenizer = served.tokenizer
        results: dict[int, list[Update]] = {job.index: [] for job in jobs}

        async def collect() -> None:
            async with contextlib.aclosing(updates) as it:
                async for index, update in it:
                    results[index].append(update)

        # Whichever ends first: the results, or the client going away (which aborts them).
        collector = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not collector.done():
                collector.cancel()
            await asyncio.gather(collector, watcher, return_exceptions=True)
        if collector.cancelled():
            return Response(status_code=499)
        error = collector.exception()
        if error is not None:
            raise _as_http(error)
        choices, completion_tokens, cached = [], 0, 0
        for job in jobs:
            ups = results[job.index]
            seq = ups[-1].seq
            token_ids = [t for u in ups for t in u.token_ids]
            logprobs = [lp for u in ups for lp in u.logprobs]
            completion_tokens += len(token_ids)
            cached += seq.num_cached_prompt if job.index % body.n == 0 else 0
            choice = {"index": job.index, "finish_reason": ups[-1].finish_reason}
            lp = None
            if num_logprobs is not None:
                offsets = [start for start, _ in TokenOffsets(tokenizer).add(token_ids)]
                lp = _logprobs(tokenizer, token_ids, logprobs, chat, offsets)
            if chat:
                choice |= {"message": {"role": "assistant", "content": seq.text}, "logprobs": lp}
            else:
                choice |= {"text": seq.text, "logprobs": lp}
            choices.append(choice)
        prompt_tokens = sum(len(j.prompt_ids) for j in jobs if j.index % body.n == 0)
        seqs = [results[j.index][-1].seq for j in jobs] if served.speculative else None
        block = protocol.usage(prompt_tokens, completion_tokens, cached, seqs, jobs[0].prompt.report)
        return protocol.envelope(rid, kind, served.name, choices, block)

    async def _sse(served, rid, kind, jobs, updates, body, num_logprobs, chat, include_usage) -> AsyncIterator[str]:
        tokenizer, name = served.tokenizer, served.name
        texts = {j.index: TextStream(tokenizer, j.params.stop_strings) for j in jobs}
        held = {j.index: LogprobStream(tokenizer) for j in jobs} if num_logprobs is not None else None
        tokens: dict[int, list[int]] = {j.index: [] for j in jobs}
        cached = 0
        seqs = []
        if chat:
            for job in jobs:
                first = {"index": job.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                yield _event(protocol.envelope(rid, kind, name, [first | {"finish_reason": None}]))
        try:
            async with contextlib.aclosing(updates) as it:
                async for index, update in it:
                    tokens[index].extend(update.token_ids)
                    text = texts[index]
                    delta = text.finish(update.seq.text) if update.finished else text.delta(tokens[index])
                    lp = None
                    if held is not None:
                        held[index].add(update.token_ids, update.logprobs)
                        ids, logprobs, starts = held[index].take(None if update.finished else len(text.sent))
                        lp = _logprobs(tokenizer, ids, logprobs, chat, starts) if ids else None
                    if not delta and not update.finished and lp is None:
                        continue
                    choice = {"index": index, "finish_reason": update.finish_reason if update.finished else None}
                    if chat:
                        choice |= {"delta": {"content": delta} if delta else {}, "logprobs": lp}
                    else:
                        choice |= {"text": delta, "logprobs": lp}
                    if update.finished and index % body.n == 0:
                        cached += update.seq.num_cached_prompt
                    if update.finished:
                        seqs.append(update.seq)
                    yield _event(protocol.envelope(rid, kind, name, [choice]))
        except (ValueError, EngineDeadError, QueueFullError) as e:
            error = _as_http(e)
            log.warning("stream %s ended with an error event (%d): %s", rid, error.status, error.message)
            yield _event(protocol.error_body(error.message, error.status))
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            prompt_tokens = sum(len(j.prompt_ids) for j in jobs if j.index % body.n == 0)
            completion_tokens = sum(len(t) for t in tokens.values())
            spec = seqs if served.speculative else None
            block = protocol.usage(prompt_tokens, completion_tokens, cached, spec, jobs[0].prompt.report)
            yield _event(protocol.envelope(rid, kind, name, [], block))
        yield "data: [DONE]\n\n"

    return app


# The fields of every request body: a model-level check's message that starts with one names it.
_FIELDS = frozenset(
    name
    for body in (protocol.ChatCompletionRequest, protocol.CompletionRequest, protocol.Message, protocol.UnpinRequest)
    for name in body.model_fields
)


def validation_message(errors: Sequence[dict]) -> tuple[str, str | None]:
    """(message, param) of a body that failed validation: the parameter's path without
    pydantic's names for the members of a union (`temperature.int`), each member's complaint
    once, and plain words for a body that is not JSON or not an object."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        at = f" at character {loc[0]}" if loc and isinstance(loc[0], int) else ""
        return f"the request body is not valid JSON{at}{': ' + reason if reason else ''}", None
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return "the request body must be a JSON object (Content-Type: application/json)", None
    path = _param_path(loc)
    complaints = []
    for e in errors:
        if _param_path([p for p in e.get("loc", ()) if p != "body"]) == path:
            msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
            if msg not in complaints:
                complaints.append(msg)
    param = ".".join(str(p) for p in path) or None
    text = "; ".join(complaints)
    if param is None:  # a check over several fields: its message names the parameter first
        word = text.split(" ", 1)[0].rstrip(":,")
        param = word if word.split(".")[0] in _FIELDS else None
        return text, param
    return f"{param}: {text}", param


def _param_path(loc: Sequence) -> list:
    """A validation error's location as the client wrote it: field names and list indices,
    up to the first of pydantic's names for a union member or a validator (`int`,
    `constrained-str`, `list[...]`, `function-after[...]`)."""
    out = []
    for part in loc:
        if isinstance(part, int) or (isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS):
            out.append(part)
        else:
            break
    return out


_TYPE_TAGS = frozenset({"int", "float", "str", "bool", "dict", "list", "none", "bytes", "tuple", "set"})


def _given(value, defaults: dict, name: str, api_default):
    """A sampling field as the request gave it, else the model's recommended value, else the
    API's default."""
    return value if value is not None else defaults.get(name, api_default)


def _drop_context(contexts: collections.OrderedDict) -> None:
    """Drops the least recently used context of the tenant holding the most (`contexts` is
    keyed by (tenant salt, prompt_cache_key), least recently used first)."""
    held = collections.Counter(salt for salt, _ in contexts)
    most = max(held.values())
    key = next(k for k in contexts if held[k[0]] == most)
    del contexts[key]


def _as_http(error: BaseException) -> HTTPError:
    """The HTTP error for a failure of the engine side of a request."""
    if isinstance(error, QueueFullError):
        return HTTPError(503, str(error), headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(error, EngineDeadError):
        return HTTPError(503, str(error))
    if isinstance(error, ValueError):
        return HTTPError(400, str(error))
    return HTTPError(500, f"internal error: {type(error).__name__}")


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)


async def _on_first(updates: AsyncIterator, accepted) -> AsyncIterator:
    """`updates` as they come, calling `accepted()` before the first (an update comes only once
    the engine has admitted its request; a refusal raises first)."""
    first = True
    async with contextlib.aclosing(updates) as it:
        async for item in it:
            if first:
                accepted()
                first = False
            yield item


async def _merge(engine: AsyncEngine, jobs: list[_Job], salt: bytes, num_logprobs: int | None, reservation):
    """Runs every job and yields (choice index, update) as they come; closing it aborts all."""
    out: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(job: _Job) -> None:
        try:
            gen = engine.generate(
                job.prompt_ids,
                job.params,
                salt=salt,
                reservation=reservation,
                pin_tokens=job.prompt.num_pinned if job.takes_pin else 0,
                num_logprobs=num_logprobs,
                sections=job.prompt.sections,
                pin_key=job.prompt.pin_key if job.takes_pin else None,
            )
            async with contextlib.aclosing(gen) as it:
                async for update in it:
                    await out.put((job.index, update))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await out.put(e)
        await out.put(done)

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    try:
        remaining = len(tasks)
        while remaining:
            item = await out.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list, chat: bool, offsets: list[int]) -> dict:
    """The logprobs object of some generated tokens: chat's `content` (each token's text and
    its UTF-8 `bytes`, raw, so a character split over tokens can be put back together), or
    the Completions API's lists, with each token's `text_offset` in the choice's text."""

    def text(t: int) -> str:
        return tokenizer.decode([t], skip_special_tokens=False)

    if chat:
        content = []
        for t, (lp, top) in zip(token_ids, logprobs, strict=True):
            alts = [{"token": text(a), "logprob": v, "bytes": list(tokenizer.token_bytes(a))} for a, v in top]
            token = {"token": text(t), "logprob": lp, "bytes": list(tokenizer.token_bytes(t)), "top_logprobs": alts}
            content.append(token)
        return {"content": content}
    return {
        "tokens": [text(t) for t in token_ids],
        "token_logprobs": [lp for lp, _ in logprobs],
        "top_logprobs": [{text(a): v for a, v in top} for _, top in logprobs],
        "text_offset": list(offsets),
    }
