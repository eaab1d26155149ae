"""Effort scoring on labeled prompts, and routing: explicit reasoning_effort, carry-forward
over three turns and its decay, follow-ups that refer back, conversations kept apart."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from aither_jax.fleet.effort import WEIGHTS, EffortScorer, score_effort
from aither_jax.fleet.router import Router

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE.parents[2] / "scripts"))
import fit_effort  # noqa: E402

# The scorer's cuts are fitted on the sets `effort_weights.json` names. Each blind set was
# written by someone who had seen neither the scorer nor any other set, and measured once on
# arrival, before it joined the fit (docs/benchmarks/log.jsonl, "Effort routing on blind sets").
SETS = fit_effort.PROMPT_SETS


@pytest.mark.parametrize("path", SETS, ids=lambda p: p.stem)
def test_effort_agrees_with_labels_on_nine_in_ten(path):
    prompts = json.loads(path.read_text(encoding="utf-8"))["prompts"]
    assert len(prompts) >= 60
    agree = sum((score_effort(p["text"]).level >= 3) == (p["effort"] >= 3) for p in prompts)
    assert agree / len(prompts) >= 0.9, f"{agree}/{len(prompts)}"


def test_the_shipped_cuts_are_the_fit_of_the_sets_they_name_and_each_set_left_out_still_agrees():
    shipped = json.loads(WEIGHTS.read_text(encoding="utf-8"))
    sets = fit_effort.load_sets()
    refit = fit_effort.fit_on(sets, shipped["fitted_on"])
    for k, cut in shipped["cuts"].items():
        assert refit["cuts"][k]["bias"] == pytest.approx(cut["bias"], abs=1e-4), k
        assert refit["cuts"][k]["weights"] == pytest.approx(cut["weights"], abs=1e-4), k
    # Fitted without it, each set is labeled prompts the scorer has never seen.
    left_out = fit_effort.left_out_agreement(sets, shipped["fitted_on"])
    assert min(left_out.values()) >= 0.9, left_out
    with pytest.raises(ValueError, match="other markers"):
        EffortScorer({**shipped, "features": shipped["features"][1:]})


def test_effort_levels_and_reasons():
    assert score_effort("hi!").level == 1
    assert score_effort("What is the capital of Peru?").level == 2
    hard = score_effort("Prove that there are infinitely many primes.")
    assert hard.level >= 4 and "proof" in hard.reasons
    long_easy = "Thanks so much for yesterday, " + "it really was a lovely evening and we enjoyed it. " * 12
    assert score_effort(long_easy).level <= 2


def turn(history: list[dict], text: str) -> list[dict]:
    return [*history, {"role": "assistant", "content": "..."}, {"role": "user", "content": text}]


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
RESEARCH = "Compare the causes of the 1929 crash and the 2008 crisis, and explain why the recoveries differed."


def test_explicit_reasoning_effort_wins_over_the_scorer():
    r = Router("small", "big")
    assert r.route([{"role": "user", "content": "hi"}], reasoning_effort="high").model == "big"
    proof = [{"role": "user", "content": "Prove that sqrt(2) is irrational."}]
    assert r.route(proof, reasoning_effort="low", conversation="x").model == "small"
    assert r.route(proof, conversation="y").model == "big"
    with pytest.raises(ValueError, match="reasoning_effort"):
        r.route(proof, reasoning_effort="extreme")


def test_a_heavy_turn_carries_for_three_turns_then_decays():
    r = Router("small", "big")
    conv = [SYSTEM, {"role": "user", "content": RESEARCH}]
    first = r.route(conv)
    assert (first.model, first.reason) == ("big", "scored")
    for text in ("How do I get tickets?", "ok", "cool thanks"):  # scored alone, each would be light
        conv = turn(conv, text)
        route = r.route(conv)
        assert (route.model, route.reason) == ("big", "carried"), text
    conv = turn(conv, "good night")
    assert r.route(conv).model == "small"  # the window has passed
    assert r.routed[("big", first.effort)] >= 1


def test_past_the_window_follow_ups_draw_on_a_decaying_effort_and_come_down():
    """A run of short follow-ups that refer back stays with the heavy turn only while the
    remembered effort, down a level per turn past the window, is heavy; thanks are no follow-up."""
    r = Router("small", "big", carry_turns=1)
    conv = [SYSTEM, {"role": "user", "content": "Prove that there are infinitely many primes."}]
    assert r.route(conv).effort == 5
    conv = turn(conv, "ok")
    assert r.route(conv).reason == "carried"
    routes = []
    for _ in range(5):
        conv = turn(conv, "and what about them?")
        routes.append(r.route(conv))
    assert [(x.reason, x.effort) for x in routes[:3]] == [("follow-up", 5), ("follow-up", 4), ("follow-up", 3)]
    assert [x.model for x in routes] == ["big", "big", "big", "small", "small"]
    r = Router("small", "big", carry_turns=0)
    conv = [SYSTEM, {"role": "user", "content": RESEARCH}]
    r.route(conv)
    assert r.route(turn(conv, "thanks, that helped")).model == "small"
    assert r.route(turn(conv, "ok and bye")).model == "small"


def test_a_turn_routed_without_remembering_counts_only_once_remembered():
    """The server routes before it validates a request and records the turn once it accepts
    it, so a refused request uses up no carry turn and is not counted."""
    r = Router("small", "big", carry_turns=1)
    conv = [SYSTEM, {"role": "user", "content": RESEARCH}]
    refused = r.route(conv, remember=False)
    assert refused.model == "big" and not r.routed
    assert r.route(turn(conv, "ok"), remember=False).reason == "scored"  # nothing was remembered
    r.remember(refused)
    assert r.routed == {("big", refused.effort): 1}
    follow = turn(conv, "ok")
    for _ in range(3):  # refused follow-ups leave the one carried turn in place
        assert r.route(follow, remember=False).reason == "carried"
    r.remember(r.route(follow, remember=False))
    assert r.route(turn(follow, "cool"), remember=False).model == "small"  # the window has passed
    assert sum(r.routed.values()) == 2


def test_a_short_follow_up_that_refers_back_is_routed_like_the_turn_before():
    r = Router("small", "big", carry_turns=0)
    conv = [SYSTEM, {"role": "user", "content": RESEARCH}]
    effort = r.route(conv).effort
    follow = r.route(turn(conv, "and what about them?"))
    assert (follow.model, follow.reason, follow.effort) == ("big", "follow-up", effort)
    assert r.route(turn(conv, "Good morning!")).model == "small"  # no reference back


def test_conversations_are_told_apart_by_their_history_or_their_key():
    r = Router("small", "big")
    research = [SYSTEM, {"role": "user", "content": RESEARCH}]
    r.route(research)
    other = [SYSTEM, {"role": "user", "content": "hello there"}]
    assert r.route(turn(other, "ok")).model == "small"  # another conversation: nothing carried
    assert r.route(turn(research, "ok")).model == "big"
    # Two conversations that open alike are told apart from where their histories part.
    greeting = [SYSTEM, {"role": "user", "content": "Hi"}]
    assert r.route(greeting).model == "small"
    heavy = turn(greeting, "Prove that there are infinitely many primes.")
    assert r.route(heavy).model == "big"
    assert r.route(greeting).model == "small"  # a first turn opening alike: a new conversation
    assert r.route(turn(greeting, "What's the weather like?")).model == "small"  # parted before the proof
    assert r.route(turn(heavy, "ok")).model == "big"  # the proof's own follow-up: carried
    # Histories alike leave the stronger: a light first turn does not undo a heavy one's carry.
    hello = [SYSTEM, {"role": "user", "content": "Hello!"}]
    assert r.route(hello, reasoning_effort="high").model == "big"
    assert r.route(hello).model == "small"
    assert r.route(turn(hello, "ok")).model == "big"
    # A named session carries whatever messages each turn sends.
    r.route([{"role": "user", "content": RESEARCH}], conversation="session-1", session=True)
    assert r.route([{"role": "user", "content": "ok"}], conversation="session-1", session=True).model == "big"
    assert r.route([{"role": "user", "content": "ok"}], conversation="session-2", session=True).model == "small"
    # A key that is no session (OpenAI's `user`: an end user): their new conversation starts afresh.
    proof = [{"role": "user", "content": "Prove that there are infinitely many primes."}]
    assert r.route(proof, conversation="alice").model == "big"
    assert r.route(turn(proof, "ok"), conversation="alice").model == "big"  # a follow-up: carried
    assert r.route([{"role": "user", "content": "What's the weather like?"}], conversation="alice").model == "small"
    assert r.route(turn(proof, "ok"), conversation="alice").model == "small"  # the new one replaced it


def test_a_tool_loops_turns_carry_the_request_that_started_it():
    """An agent's second request holds no new user message: [user, assistant (tool call), tool]."""
    r = Router("small", "big")
    ask = [{"role": "user", "content": "book it"}]
    assert r.route(ask, reasoning_effort="high").model == "big"
    loop = [*ask, {"role": "assistant", "content": ""}, {"role": "tool", "content": "booked: LH123"}]
    route = r.route(loop)
    assert (route.model, route.reason) == ("big", "carried")
    assert r.route([{"role": "user", "content": "ok"}]).model == "small"  # no history: a new conversation


def test_tool_results_open_a_carry_window_of_three_turns():
    r = Router("small", "big")
    conv = [SYSTEM, {"role": "user", "content": "find me a flight"}, {"role": "tool", "content": "results..."}]
    r.route(conv)
    models = []
    for _ in range(4):  # each later turn's history still holds the tool result: it opens no new window
        conv = turn(conv, "ok")
        models.append(r.route(conv).model)
    assert models == ["big", "big", "big", "small"]


def test_conversations_of_two_scopes_are_two_conversations():
    r = Router("small", "big")
    research = [SYSTEM, {"role": "user", "content": RESEARCH}]
    r.route(research, scope="tenant-a")
    assert r.route(turn(research, "ok"), scope="tenant-b").model == "small"
    assert r.route(turn(research, "ok"), scope="tenant-a").model == "big"
    r.route([{"role": "user", "content": RESEARCH}], conversation="s", session=True, scope="tenant-a")
    assert (
        r.route([{"role": "user", "content": "ok"}], conversation="s", session=True, scope="tenant-b").model == "small"
    )
    assert r.route([{"role": "user", "content": "ok"}], conversation="s", session=True, scope="tenant-a").model == "big"


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="threshold"):
        Router("a", "b", threshold=6)
    with pytest.raises(ValueError, match="carry_turns"):
        Router("a", "b", carry_turns=-1)
