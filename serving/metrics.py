"""Prometheus metrics in the text exposition format, under vLLM's names plus our own.

Counters and histograms are updated by the engine loop; gauges are read from the engine when
`/metrics` is scraped. Every series carries the `model_name` label as vLLM's do, and every
counter's name ends in `_total`, as the Prometheus client vLLM uses writes them (a dashboard
built on vLLM queries `vllm:prefix_cache_hits_total`).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return "{" + body + "}"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _check_counter_name(name: str) -> None:
    if not name.endswith("_total"):
        raise ValueError(f"counter {name!r} must end in _total (Prometheus' name for a counter's series)")


def _number(x: float) -> str:
    return repr(float(x)) if not float(x).is_integer() else f"{float(x):.1f}"


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


class Metrics:
    """The registry: declared series, thread-safe updates, one `render()` for `/metrics`."""

    def __init__(self, model_name: str):
        self.labels = {"model_name": model_name}
        self._lock = threading.Lock()
        self._help: dict[str, tuple[str, str]] = {}  # name -> (type, help)
        self._counters: dict[tuple[str, tuple], float] = {}
        self._histograms: dict[str, Histogram] = {}
        self._gauges: dict[str, Callable[[], float]] = {}
        self._series: dict[str, Callable[[], list[tuple[dict[str, str], float]]]] = {}

    def counter_series(self, name: str, help_text: str, read: Callable[[], list[tuple[dict[str, str], float]]]) -> None:
        """Declares a counter with one series per label set, all read from their owner at once."""
        _check_counter_name(name)
        self._help[name] = ("counter", help_text)
        self._series[name] = read

    def gauge_series(self, name: str, help_text: str, read: Callable[[], list[tuple[dict[str, str], float]]]) -> None:
        """Declares a gauge with one series per label set, all read from their owner at once."""
        self._help[name] = ("gauge", help_text)
        self._series[name] = read

    def counter(
        self, name: str, help_text: str, read: Callable[[], float] | None = None, *, labels: list[dict] | None = None
    ) -> None:
        """Declares a counter, updated with `inc` or, with `read`, read from its owner. A
        counter with labels starts with the series of `labels` (label sets) at 0, and none
        without labels."""
        _check_counter_name(name)
        self._help[name] = ("counter", help_text)
        if read is not None:
            self._gauges[name] = read
            return
        for extra in [{}] if labels is None else labels:
            self._counters.setdefault((name, tuple(sorted(extra.items()))), 0.0)

    def histogram(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self._help[name] = ("histogram", help_text)
        self._histograms[name] = Histogram(buckets)

    def gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        self._help[name] = ("gauge", help_text)
        self._gauges[name] = read

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        if self._help.get(name, ("",))[0] != "counter" or name in self._gauges or name in self._series:
            raise KeyError(f"no counter named {name}")
        with self._lock:
            key = (name, tuple(sorted(labels.items())))
            self._counters[key] = self._counters.get(key, 0.0) + amount

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self._histograms[name].observe(value)

    def value(self, name: str, **labels: str) -> float:
        """A counter's or gauge's current value."""
        if name in self._gauges:
            return float(self._gauges[name]())
        return self._counters.get((name, tuple(sorted(labels.items()))), 0.0)

    def render(self) -> str:
        return render_metrics([self])

    def samples(self, name: str) -> list[str]:
        """The exposition lines of one declared series family (without HELP and TYPE)."""
        kind = self._help[name][0]
        lines = []
        with self._lock:
            if name in self._gauges:
                lines.append(f"{name}{_labels(self.labels)} {_number(self._gauges[name]())}")
            elif name in self._series:
                for extra, value in self._series[name]():
                    lines.append(f"{name}{_labels({**self.labels, **extra})} {_number(value)}")
            elif kind == "counter":
                for (cname, extra), value in sorted(self._counters.items()):
                    if cname == name:
                        lines.append(f"{name}{_labels({**self.labels, **dict(extra)})} {_number(value)}")
            else:
                h = self._histograms[name]
                running = 0
                for bound, count in zip((*h.buckets, float("inf")), h.counts, strict=True):
                    running += count
                    le = "+Inf" if bound == float("inf") else _number(bound)
                    lines.append(f"{name}_bucket{_labels({**self.labels, 'le': le})} {running}")
                lines.append(f"{name}_sum{_labels(self.labels)} {_number(h.sum)}")
                lines.append(f"{name}_count{_labels(self.labels)} {h.count}")
        return lines


def render_metrics(registries: list[Metrics]) -> str:
    """One exposition of several registries (one per served model, told apart by their
    `model_name` label): each family's HELP and TYPE once, then every registry's series."""
    lines = []
    families: dict[str, tuple[str, str]] = {}
    for m in registries:
        for name, meta in m._help.items():
            families.setdefault(name, meta)
    for name, (kind, help_text) in families.items():
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for m in registries:
            if name in m._help:
                lines.extend(m.samples(name))
    return "\n".join(lines) + "\n"
