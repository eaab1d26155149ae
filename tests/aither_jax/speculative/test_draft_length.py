"""The adaptive choice of drafts per step, on simulated machines whose best choice is known."""

import numpy as np
import pytest

from aither_jax.speculative.draft_length import DraftLength


def test_options_fill_verify_buckets():
    assert DraftLength(15).options == [0, 1, 3, 7, 15]
    assert DraftLength(8).options == [0, 1, 3, 7, 8]
    assert DraftLength(1).options == [0, 1]
    with pytest.raises(ValueError, match="max_drafts"):
        DraftLength(0)


def test_acceptance_counts_only_checked_positions():
    d = DraftLength(7, decay=1.0)
    d.observe_row(offered=5, accepted=2)  # drafts 1, 2 accepted, 3 rejected, 4 and 5 never checked
    d.observe_row(offered=3, accepted=3)
    np.testing.assert_array_equal(d.offered, [2, 2, 2, 0, 0, 0, 0])
    np.testing.assert_array_equal(d.accepted, [2, 2, 1, 0, 0, 0, 0])


MACHINES = {
    # A verify pass of k + 1 tokens costs 0.7 + 0.12 (k + 1) plain steps, a draft 0.25.
    "cpu": lambda k: 1.0 if k == 0 else 0.25 + 0.7 + 0.12 * (k + 1),
    # A verify pass costs a plain step whatever its length, a draft 0.3.
    "gpu": lambda k: 1.0 if k == 0 else 0.3 + 1.0,
}


def _expected(accept: float, k: int) -> float:
    return sum(accept**i for i in range(k + 1))


def _simulate(accept: float, seconds, steps: int = 400, rows: int = 1, seed: int = 0, spikes=()):
    """Runs the chooser against a machine where a step of k drafts takes seconds(k) and every
    draft is accepted with probability `accept`: (runs per option, tokens a second achieved,
    counted with the true expectation of each step). Steps listed in `spikes` are timed 100x
    slower (a compile), which the achieved rate does not count."""
    rng = np.random.default_rng(seed)
    d = DraftLength(15)
    runs: dict[int, int] = {}
    tokens = elapsed = 0.0
    for step in range(steps):
        k = d.choose(rows)
        runs[k] = runs.get(k, 0) + 1
        tokens, elapsed = tokens + _expected(accept, k), elapsed + seconds(k)
        d.observe_step(k, rows, seconds(k) * rng.uniform(0.95, 1.05) * (100 if step in spikes else 1))
        if k:
            accepted = 0
            while accepted < k and rng.random() < accept:
                accepted += 1
            d.observe_row(k, accepted)
    return runs, tokens / elapsed


def _best_rate(accept: float, seconds) -> tuple[int, float]:
    rates = {k: _expected(accept, k) / seconds(k) for k in (0, 1, 3, 7, 15)}
    best = max(rates, key=rates.get)
    return best, rates[best]


@pytest.mark.parametrize(
    ("accept", "machine"), [(0.25, "cpu"), (0.55, "cpu"), (0.8, "cpu"), (0.25, "gpu"), (0.8, "gpu")]
)
def test_throughput_comes_close_to_the_best_fixed_choice(accept, machine):
    """Over 400 steps, exploration and probes included, the tokens a second reach 90% of the
    best fixed option's (known from the true acceptance); the worst fixed option is far below
    that in every case but one, so choosing at random would fail."""
    seconds = MACHINES[machine]
    _, achieved = _simulate(accept, seconds)
    best, best_rate = _best_rate(accept, seconds)
    assert achieved >= 0.9 * best_rate, (achieved, best, best_rate)


@pytest.mark.parametrize(("accept", "machine", "best"), [(0.1, "cpu", 0), (0.8, "gpu", 15), (0.8, "cpu", 7)])
def test_a_clear_winner_runs_most(accept, machine, best):
    seconds = MACHINES[machine]
    assert _best_rate(accept, seconds)[0] == best
    runs, _ = _simulate(accept, seconds)
    assert max(runs, key=runs.get) == best, runs


@pytest.mark.parametrize(("accept", "machine"), [(0.1, "cpu"), (0.8, "gpu")])
def test_compiles_in_the_middle_do_not_rule_an_option_out(accept, machine):
    """A longer context reaches a new page bucket and the step that meets it compiles; here
    five steps spread over the run take 100x as long. The choice must recover from each."""
    seconds = MACHINES[machine]
    _, achieved = _simulate(accept, seconds, spikes=(40, 41, 90, 150, 260))
    assert achieved >= 0.9 * _best_rate(accept, seconds)[1]


def test_every_option_is_measured_again_while_one_wins():
    runs, _ = _simulate(0.25, lambda k: 1.0 if k == 0 else 3.0, steps=400)
    assert set(runs) == {0, 1, 3, 7, 15}
    assert all(runs[k] >= 5 for k in (1, 3, 7, 15))  # probed, not only tried once at the start


def test_probes_back_off_once_the_choice_is_clear():
    """Plain steps win clearly (drafts are rarely accepted and cost twice a step): over 1,000
    steps the other options, first tries and probes together, run at most 4% of the steps
    (a probe every 16 steps alone would be over 6%)."""
    runs, _ = _simulate(0.1, lambda k: 1.0 if k == 0 else 2.0, steps=1000)
    assert sum(n for k, n in runs.items() if k) <= 40, runs


def test_first_timing_of_an_option_is_not_trusted():
    """A compile makes the first step of an option slow; one slow sample must not rule it out."""
    d = DraftLength(3)
    first = {}
    while (k := d.choose(1)) not in first or any(d.rate(o, 1) is None for o in d.options):
        d.observe_step(k, 1, 50.0 if k == 3 and k not in first else 1.0)  # option 3 compiles
        first.setdefault(k, True)
    d.offered[:], d.accepted[:] = 100, 90  # drafts almost always accepted: 3 is best at equal cost
    assert d.choose(1) == 3
