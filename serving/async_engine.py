"""The engine loop: one thread owns the engine; asyncio handlers talk to it through queues.

HTTP handlers never touch the engine. They put commands (add, abort, pin, unpin) into an inbox; the
loop thread applies them between steps, runs steps while there is work, and after each step
posts every sequence's new tokens to the asyncio queue of its request. If a step raises, the
loop records the error, fails every open request and stops: `/health` then answers 503.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from aither_jax.compile.counter import CompileCounter
from aither_jax.core.engine import Engine
from aither_jax.core.sequence import Sequence
from aither_jax.device.sampling import SamplingParams
from serving.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, Metrics

log = logging.getLogger(__name__)
# aither:kv_disk_files_total's outcomes and the DiskCounters field each reads.
DISK_OUTCOMES = (
    ("torn", "num_torn"), ("skipped", "num_skipped"), ("corrupt", "num_corrupt"), ("missing", "num_missing"),
    ("failed_write", "num_failed"), ("stale_removed", "num_stale_removed"),
)  # fmt: skip

IDLE_WAIT_SECONDS = 0.05
T = TypeVar("T")


class QueueFullError(RuntimeError):
    """More requests are waiting than the server accepts."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped after an error."""


@dataclasses.dataclass
class Update:
    """New output of one sequence since the previous update."""

    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]]]
    finished: bool
    finish_reason: str | None
    seq: Sequence


class Reservation:
    """Places taken in the engine's capacity by one HTTP request; each of its sequences gives
    one back when it ends, and whatever was never used is given back when this is dropped
    (a response that never started)."""

    def __init__(self, engine: AsyncEngine, num: int):
        self.engine, self.left = engine, num

    def release(self, num: int) -> None:
        num = min(num, self.left)
        self.left -= num
        self.engine.num_open -= num

    def __del__(self) -> None:
        self.release(self.left)


@dataclasses.dataclass(eq=False)
class _Stream:
    seq: Sequence | None
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent: int = 0
    last_token_time: float = 0.0


class AsyncEngine:
    """Runs `engine` on a background thread and streams results to asyncio callers.

    Args:
        engine: the engine to own (nothing else may call it once started).
        metrics: the registry to update.
        max_waiting: requests accepted beyond the running batch; more are refused.
    """

    def __init__(self, engine: Engine, metrics: Metrics, *, max_waiting: int):
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[Sequence, _Stream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error: BaseException | None = None
        self._calls: set[asyncio.Future] = set()  # answers the loop owes to `unpin` callers
        self.num_open = 0  # requests accepted and not finished (event-loop thread only)
        self.num_prefilled_tokens = 0
        self._declare_metrics()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    # -- requests (called from the event loop) ------------------------------------------------

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        salt: bytes,
        reservation: Reservation,
        pin_tokens: int = 0,
        num_logprobs: int | None = None,
        sections: tuple = (),
        pin_key: bytes | None = None,
    ) -> AsyncIterator[Update]:
        """Yields the request's updates until it finishes; aborts it if the caller stops early.
        Gives back one place of `reservation` when it ends.

        Raises:
            EngineDeadError: the engine loop has stopped.
            ValueError: the engine rejected the request.
        """
        stream = _Stream(None, asyncio.get_running_loop(), asyncio.Queue())

        def add() -> None:
            try:
                seq = self.engine.add_request(
                    prompt_ids, params, salt=salt, pin_tokens=pin_tokens, num_logprobs=num_logprobs,
                    sections=sections, pin_key=pin_key,
                )  # fmt: skip
            except Exception as e:  # noqa: BLE001 - reported to the caller
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, e)
                return
            stream.seq = seq
            self._streams[seq] = stream

        finished = False
        try:
            self._inbox.put(add)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            reservation.release(1)
            if not finished:
                self._inbox.put(lambda: self._abort(stream))

    def reserve(self, num_requests: int) -> Reservation:
        """Takes places for `num_requests` sequences now, before any of them is queued, so a
        burst of requests cannot all pass the capacity check before the first one counts.

        Raises:
            QueueFullError: more would be open than max_num_seqs + max_waiting.
            EngineDeadError: the engine loop has stopped.
        """
        if not self.alive:
            raise EngineDeadError("the engine has stopped")
        if self.num_open + num_requests > self.engine.max_num_seqs + self.max_waiting:
            self.metrics.inc("aither:requests_rejected_total")
            raise QueueFullError(
                f"the server is at capacity ({self.engine.max_num_seqs} running, {self.max_waiting} waiting); "
                "retry later"
            )
        self.num_open += num_requests
        return Reservation(self, num_requests)

    async def pin(self, prompt_ids: list[int], salt: bytes) -> int:
        """Computes (if needed) and pins the full pages of `prompt_ids`; returns the pages pinned."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        reservation = self.reserve(1)
        updates = self.generate(prompt_ids, params, salt=salt, reservation=reservation, pin_tokens=len(prompt_ids))
        async for update in updates:
            if update.finished:
                return update.seq.num_pinned_pages or 0
        return 0

    async def unpin(self, prompt_ids: list[int], salt: bytes) -> int:
        """Drops one pin from each cached full page of `prompt_ids` under `salt` (what a request
        with these tokens and `pin_tokens=len(prompt_ids)` pinned); returns the pages unpinned.

        Raises:
            EngineDeadError: the engine loop has stopped.
            ValueError: prefix caching is off (nothing is ever pinned).
        """
        if not self.alive:
            raise EngineDeadError("the engine has stopped")
        if self.engine.scheduler.prefix_cache is None:
            raise ValueError("prefix caching is off on this server: nothing is pinned")
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._calls.add(done)

        def unpin() -> None:
            _answer(done, result=self.engine.unpin(prompt_ids, salt))

        self._inbox.put(unpin)
        try:
            return await done
        finally:
            self._calls.discard(done)

    def call(self, fn: Callable[[], T], timeout: float = 600.0) -> T:
        """Runs `fn` on the loop thread between steps and returns its result (or raises what it
        raised); for threads other than the event loop's (the balloon, serving/balloon.py).

        Raises:
            EngineDeadError: the engine loop has stopped, or stops before running `fn`.
            TimeoutError: `fn` did not finish within `timeout` seconds.
        """
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def command() -> None:
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    done.set_exception(e)

        if not self.alive:
            raise EngineDeadError("the engine has stopped")
        self._inbox.put(command)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return done.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                if not self.alive and done.cancel():  # stopped with the call still in the inbox
                    raise EngineDeadError("the engine has stopped") from None
                if time.monotonic() >= deadline and done.cancel():
                    raise TimeoutError(f"the engine loop did not run the call within {timeout} s") from None

    def _abort(self, stream: _Stream) -> None:
        if stream.seq is not None:
            self._streams.pop(stream.seq, None)
            self.engine.abort(stream.seq)
            self.metrics.inc("vllm:request_success_total", finished_reason="abort")

    # -- the loop (engine thread) -------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    # A row is prefill if it had more than one token to run or no output yet.
                    before = {s: (s.num_computed, s.prefilling or not s.output_ids) for s in self._streams}
                    self.engine.step()
                    self._publish(before)
        except BaseException as e:  # noqa: BLE001 - the loop must report any failure
            log.exception("engine loop failed")
            self.error = e
            for stream in list(self._streams.values()):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, EngineDeadError(f"engine failed: {e}"))
            self._streams.clear()
            for done in list(self._calls):  # commands still in the inbox never run now
                _answer(done, error=EngineDeadError(f"engine failed: {e}"))

    def _drain(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=IDLE_WAIT_SECONDS) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _publish(self, before: dict[Sequence, tuple[int, bool]]) -> None:
        now = time.monotonic()
        for seq, stream in list(self._streams.items()):
            computed, prefilling = before.get(seq, (seq.num_computed, False))
            if prefilling:
                self.num_prefilled_tokens += seq.num_computed - computed
            new = seq.output_ids[stream.sent :]
            if not new and not seq.finished:
                continue
            if new:
                if stream.sent == 0:
                    self.metrics.observe("vllm:time_to_first_token_seconds", now - seq.arrival_time)
                else:
                    gap = (now - stream.last_token_time) / len(new)
                    for _ in new:
                        self.metrics.observe("vllm:inter_token_latency_seconds", gap)
                stream.last_token_time = now
                self.metrics.inc("vllm:generation_tokens_total", len(new))
            update = Update(new, seq.logprobs[stream.sent : len(seq.output_ids)], seq.finished, seq.finish_reason, seq)
            stream.sent = len(seq.output_ids)
            if seq.finished:
                del self._streams[seq]
                self.metrics.observe("vllm:e2e_request_latency_seconds", now - seq.arrival_time)
                self.metrics.inc("vllm:request_success_total", finished_reason=seq.finish_reason)
                self.metrics.inc("vllm:prompt_tokens_total", len(seq.prompt_ids))
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, update)

    # -- metrics ------------------------------------------------------------------------------

    def _declare_metrics(self) -> None:
        m, sched, eng = self.metrics, self.engine.scheduler, self.engine
        cache = sched.prefix_cache
        read_gauges = (
            ("vllm:num_requests_running", "Requests in the running batch.", lambda: self.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be admitted.", lambda: self.num_waiting),
            (
                "vllm:kv_cache_usage_perc",
                "Fraction of KV pages in use (1 = full); idle prefix-cache pages count as free.",
                lambda: 1.0 - sched.num_free_pages / sched.num_usable_pages,
            ),
            ("aither:kv_pages_total", "KV pages in the pool.", lambda: sched.num_usable_pages),
            ("aither:kv_pages_free", "KV pages free or held only by the prefix cache.", lambda: sched.num_free_pages),
            ("aither:prefix_cache_pages", "Pages named in the prefix cache.", lambda: cache.num_cached if cache else 0),
            ("aither:pinned_pages", "Prefix-cache pages pinned.", lambda: cache.num_pinned if cache else 0),
            ("aither:pinned_pages_capacity", "Pin capacity in pages.", lambda: cache.max_pinned_pages if cache else 0),
        )
        read_counters = (
            ("vllm:prefix_cache_queries_total", "Prompt tokens looked up.", lambda: sched.num_prefix_queries),
            ("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", lambda: sched.num_prefix_hits),
            ("vllm:num_preemptions_total", "Sequences preempted to recompute.", lambda: sched.num_preemptions),
            (
                "aither:xla_compilations_total",
                "XLA compilations in this process (a load from the persistent compilation cache counts as one); "
                "process-wide: every served model reports the same value.",
                CompileCounter.count,
            ),
            (
                "aither:xla_compile_seconds_total",
                "Seconds spent in those compilations (process-wide).",
                CompileCounter.seconds,
            ),
            (
                "aither:xla_lowering_seconds_total",
                "Seconds spent lowering steps for XLA (with jaxlib >= 0.10.3, building the Pallas kernels too; "
                "process-wide).",
                CompileCounter.lowering_seconds,
            ),
            (
                "aither:prefill_tokens_total",
                "Tokens prefilled for requests: prompt tokens not found in the prefix cache, plus recomputes.",
                lambda: self.num_prefilled_tokens,
            ),
            ("aither:engine_steps_total", "Engine steps run.", lambda: self.engine.num_steps),
            (
                "aither:compiled_code_releases_total",
                "Times compiled steps were dropped because the process neared vm.max_map_count.",
                lambda: eng.code_budget.num_releases,
            ),
            (
                "aither:shared_prefix_attention_steps_total",
                "Decode calls that read their rows' common prefix pages once for the batch.",
                lambda: eng.runner.num_shared_prefix_steps,
            ),
            (
                "aither:sink_refills_total",
                "Requests admitted on cached pages whose unquantized sink tokens were recomputed (-s<n> formats).",
                lambda: eng.runner.num_sink_refills,
            ),
            (
                "vllm:spec_decode_num_drafts_total",
                "Speculative verify passes that carried drafts.",
                lambda: eng.spec_counters.num_drafts,
            ),
            (
                "vllm:spec_decode_num_draft_tokens_total",
                "Draft tokens proposed.",
                lambda: eng.spec_counters.num_draft_tokens,
            ),
            (
                "vllm:spec_decode_num_accepted_tokens_total",
                "Draft tokens accepted.",
                lambda: eng.spec_counters.num_accepted_tokens,
            ),
        )
        for name, help_text, read in read_gauges:
            m.gauge(name, help_text, read)
        for name, help_text, read in read_counters:
            m.counter(name, help_text, read)
        m.counter_series(
            "vllm:spec_decode_num_accepted_tokens_per_pos_total",
            "Draft tokens accepted, by position in the draft (0: the first).",
            lambda: [
                ({"position": str(i)}, float(n)) for i, n in enumerate(eng.spec_counters.accepted_per_pos.tolist())
            ],
        )
        if eng.tiers is not None:
            self._tier_metrics(eng.tiers)
        if eng.scheduler.policy.name == "advisor":
            self._advisor_metrics(eng.scheduler)
        m.counter("vllm:prompt_tokens_total", "Prompt tokens of finished requests.")
        m.counter("vllm:generation_tokens_total", "Generated tokens.")
        m.counter(
            "vllm:request_success_total", "Finished requests by finish reason.",
            labels=[{"finished_reason": r} for r in ("stop", "length", "abort")],
        )  # fmt: skip
        m.counter("aither:requests_rejected_total", "Requests refused because the queue was full.")
        m.counter(
            "aither:routed_requests_total",
            "Requests for model 'auto' routed to this model, by effort (1-5) and reason (scored, carried, follow-up, "
            "reasoning_effort).",
            labels=[],
        )
        m.histogram("vllm:time_to_first_token_seconds", "Time to the first token.", TTFT_BUCKETS)
        m.histogram("vllm:inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        m.histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", E2E_BUCKETS)

    def _tier_metrics(self, tiers) -> None:
        """Per-tier pages, hits and moves of the host and disk tiers (kv/tiers.py)."""
        m, c, cost = self.metrics, tiers.counters, tiers.cost
        disk = tiers.disk.counters if tiers.disk is not None else None
        m.gauge("aither:kv_host_pages", "KV pages held in the host tier.", lambda: tiers.num_host_pages)
        m.gauge("aither:kv_host_pages_capacity", "KV pages the host tier can hold.", lambda: tiers.host.capacity)
        m.gauge("aither:kv_disk_pages", "KV pages held in the disk tier.", lambda: tiers.num_disk_pages)
        m.counter_series(
            "aither:kv_tier_hits_total",
            "KV pages promoted to the device instead of recomputed, by the tier they came from.",
            lambda: [({"tier": "host"}, c.num_host_hits), ({"tier": "disk"}, c.num_disk_hits)],
        )
        m.counter_series(
            "aither:kv_tier_moved_pages_total",
            "KV pages moved between tiers, by direction.",
            lambda: [
                ({"direction": "device_to_host"}, c.num_demoted),
                ({"direction": "host_to_disk"}, c.num_spilled),
                ({"direction": "to_device"}, c.num_host_hits + c.num_disk_hits),
            ],
        )
        m.counter_series(
            "aither:kv_tier_moved_bytes_total",
            "KV bytes moved between the device and the tiers below it, by direction.",
            lambda: [
                ({"direction": "device_to_host"}, c.bytes_to_host),
                ({"direction": "to_device"}, c.bytes_to_device),
            ],
        )
        m.counter(
            "aither:kv_prefetched_pages_total",
            "KV pages promoted for requests still waiting for a slot (below the low watermark).",
            lambda: c.num_prefetched,
        )
        m.counter_series(
            "aither:kv_reload_decisions_total",
            "Requests with KV pages below the device, by the cost model's choice: reload them or recompute.",
            lambda: [({"choice": "reload"}, cost.num_reload), ({"choice": "recompute"}, cost.num_recompute)],
        )
        m.counter("aither:kv_promote_seconds_total", "Seconds spent promoting pages.", lambda: c.promote_seconds)
        m.counter(
            "aither:kv_disk_pages_dropped_total",
            "Disk pages dropped: evicted to stay within the size, or failing their checksum.",
            lambda: (disk.num_dropped + disk.num_corrupt) if disk else 0,
        )
        m.counter_series(
            "aither:kv_disk_files_total",
            "Disk tier files by what befell them: torn (writes cut off, cleared at start), skipped (unreadable or "
            "foreign at start), corrupt (failed their checksum), missing (removed by another process), "
            "failed_write (a full or failing disk), stale_removed (other configurations' files, removed for room).",
            lambda: [
                ({"outcome": outcome}, getattr(disk, counter) if disk else 0) for outcome, counter in DISK_OUTCOMES
            ],
        )

    def _advisor_metrics(self, scheduler) -> None:
        """The eviction advisor's candidates, protected pages, evictions by tag, ranking age, trust."""
        m, policy, cache = self.metrics, scheduler.policy, scheduler.prefix_cache
        m.gauge(
            "aither:kv_eviction_candidates", "Idle cached KV pages the advisor may evict.", lambda: cache.num_evictable
        )
        m.gauge(
            "aither:kv_protected_pages",
            "Cached KV pages the advisor protects (system, identity, axioms, importance 1.0).",
            lambda: sum(1 for b in cache.cached_blocks() if policy.protected(b)),
        )
        m.gauge(
            "aither:kv_advisor_ranking_age_seconds", "Age of the advisor's latest ranking.", lambda: policy.ranking_age
        )
        m.gauge(
            "aither:kv_advisor_trust",
            "Recent admissions' share that returned to a conversation: how far expected returns outrank idle time.",
            lambda: policy.trust,
        )
        m.counter_series(
            "aither:kv_evictions_total",
            "KV pages the advisor chose to evict or demote, by source tag.",
            lambda: [({"tag": tag}, n) for tag, n in sorted(policy.evicted_by_tag.items())],
        )
        m.counter(
            "aither:kv_advisor_ranking_seconds_total", "Seconds spent ranking pages.", lambda: policy.refresh_seconds
        )


def _answer(done: asyncio.Future, *, result=None, error: BaseException | None = None) -> None:
    """Resolves `done` from the engine thread, unless its caller has gone (cancelled)."""

    def resolve() -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    done.get_loop().call_soon_threadsafe(resolve)
