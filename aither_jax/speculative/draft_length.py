"""How many drafts a speculative step carries, chosen from measured acceptance and step times.

A step that carries k drafts per row commits E(k) = 1 + sum_{i<=k} a_1 ... a_i tokens a row on
average, where a_i is the chance that draft i is accepted once drafts 1 .. i-1 were, and costs
t(k) seconds: the draft's forward pass plus a verify pass over k + 1 tokens a row, or a plain
decode step for k = 0 (no draft). The best k maximizes E(k) / t(k). Both sides depend on the
machine: on a GPU a verify pass over 16 tokens costs about what one token costs, so long
blocks pay; on a few CPU cores it costs several plain steps, and a draft that is rarely
accepted loses to plain decoding.

`DraftLength` keeps decayed counts of drafts offered and accepted per block position, and the
median of the latest wall times of each option per batch size (bucketed). Options are 0 and the
drafts that fill a verify bucket (1, 3, 7, 15, ... up to the configured most). It tries every
option before trusting the estimates, then takes the best and, at most every `probe_every`
steps, times again a losing option that is due: each probe that leaves an option behind
doubles its wait (up to `max_probe_every` steps), so the probes cost little once the choice
is clear, and still follow a context that grows (attention cost) and a draft whose acceptance
changes with the text.

Which option runs changes only speed, not output: greedy verification commits the target's
own tokens, and sampled verification emits the token plain decoding with the same seed draws
(`speculative.verify`).
"""

from __future__ import annotations

import collections

import numpy as np

# Prior acceptance (pseudo-counts) for a position never measured yet: optimistic enough that
# long blocks get tried, weak enough that a few dozen observations override it.
PRIOR_ACCEPTED, PRIOR_OFFERED = 1.0, 2.0
# An option's step time is the median of its latest timings: a step that compiles a new shape
# (a longer context reaching a new page bucket) takes seconds instead of milliseconds, and a
# mean would carry that for many steps of an option that is then seldom chosen.
TIME_SAMPLES = 5


class DraftLength:
    """Chooses drafts per step (0 = a plain decode step) from what steps have measured."""

    def __init__(
        self,
        max_drafts: int,
        *,
        probe_every: int = 16,
        max_probe_every: int = 256,
        decay: float = 0.99,
        warm_samples: int = 1,
    ):
        if max_drafts < 1:
            raise ValueError(f"max_drafts must be >= 1, got {max_drafts}")
        options = {0, max_drafts}
        k = 1
        while k < max_drafts:
            options.add(k)
            k = 2 * k + 1
        self.options = sorted(options)
        self.probe_every = probe_every
        self.decay = decay
        self.warm_samples = warm_samples  # first timings of an option per batch size (compiles) are dropped
        self.offered = np.zeros(max_drafts)  # decayed count of drafts offered at each block position
        self.accepted = np.zeros(max_drafts)
        self._times: dict[tuple[int, int], collections.deque] = {}  # (option, rows) -> latest step times
        self._seen: dict[tuple[int, int], int] = {}
        self._last: dict[tuple[int, int], int] = {}  # step at which the option was last timed
        # Steps between probes of an option: doubles (up to max_probe_every) each time a probe
        # leaves it behind the best, back to probe_every once it is the best.
        self._interval: dict[tuple[int, int], int] = {}
        self.max_probe_every = max_probe_every
        self._last_probe = 0  # step of the latest probe: at most one every probe_every steps
        self.num_steps = 0
        self.chosen = dict.fromkeys(self.options, 0)  # timed steps that ran each option

    def acceptance(self) -> np.ndarray:
        """a_i for block positions 1 .. max_drafts (prior where nothing was measured)."""
        return (self.accepted + PRIOR_ACCEPTED) / (self.offered + PRIOR_OFFERED)

    def rates(self, rows: int) -> dict[int, float | None]:
        """Estimated tokens a second a row for each option at `rows` rows: E(k) over the median
        of its latest step times, None while it is not timed yet."""
        # E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k, for k = 0 .. max_drafts.
        expected = 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.acceptance()))])
        out = {}
        for k in self.options:
            times = self._times.get((k, rows))
            out[k] = float(expected[k] / np.median(times)) if times else None
        return out

    def rate(self, k: int, rows: int) -> float | None:
        return self.rates(rows)[k]

    def choose(self, rows: int) -> int:
        """Drafts per row for the next step of `rows` decoding rows (a bucketed count)."""
        self.num_steps += 1
        rates = self.rates(rows)
        untimed = [k for k, r in rates.items() if r is None]
        if untimed:
            return untimed[0]
        best = max(rates, key=rates.get)
        if self.num_steps - self._last_probe < self.probe_every:
            return best
        due = [k for k in self.options if k != best and self.num_steps - self._last[k, rows] >= self._interval[k, rows]]
        if not due:
            return best
        self._last_probe = self.num_steps
        return min(due, key=lambda k: self._last[k, rows])

    def observe_step(self, k: int, rows: int, seconds: float) -> None:
        """The wall time of one step of option k over `rows` rows."""
        self.chosen[k] += 1
        key = (k, rows)
        seen = self._seen.get(key, 0) + 1
        self._seen[key] = seen
        self._last[key] = self.num_steps
        if seen <= self.warm_samples:
            return
        self._times.setdefault(key, collections.deque(maxlen=TIME_SAMPLES)).append(seconds)
        # An option that is still behind the best after being timed again waits twice as long
        # for its next probe (up to max_probe_every steps); the best goes back to probe_every.
        rates = self.rates(rows)
        if None not in rates.values() and rates[k] < max(rates.values()):
            self._interval[key] = min(2 * self._interval.get(key, self.probe_every // 2), self.max_probe_every)
        else:
            self._interval[key] = self.probe_every

    def observe_row(self, offered: int, accepted: int) -> None:
        """One row of a verify pass: `offered` drafts, the first `accepted` of them kept."""
        reached = min(offered, accepted + 1)  # positions whose draft was checked
        # Only checked positions age: a position that short blocks never reach keeps what the
        # last long block measured there, instead of sliding back to the prior.
        self.offered[:reached] = self.offered[:reached] * self.decay + 1
        self.accepted[:reached] *= self.decay
        self.accepted[:accepted] += 1
