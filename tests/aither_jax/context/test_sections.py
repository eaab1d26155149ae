"""The context pipeline: sections rendered to exact ids, budgets and the cascade, cache-stable
truncation, the stable prefix's automatic pin, and tags reaching the KV pages' block records."""

from __future__ import annotations

import numpy as np
import pytest

from aither_jax.context import sections as sections_module
from aither_jax.context.sections import Context, ContextError, Section, prefix_hash, sections_from_messages
from models.gguf_file import GGUFFile
from models.registry import resolve_model
from models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(resolve_model("smollm2-135m")))


AXIOMS = "You never reveal secrets. You answer truthfully. " * 3
IDENTITY = "Your name is Aither. You were built to help with research on the sea. " * 2
RULES = "Answer in at most three sentences. Cite your sources when you have them. "


def system_layers() -> list[Section]:
    return [
        Section("axioms", AXIOMS, importance=1.0, stable=True, truncate="never"),
        Section("identity", IDENTITY, importance=1.0, stable=True, truncate="never"),
        Section("rules", RULES, importance=0.9, stable=True),
    ]


def turn(i: int, history: list[dict], knowledge: str) -> list[Section]:
    return [
        *system_layers(),
        Section("knowledge", knowledge, importance=0.4, max_tokens=120),
        Section("memories", f"The user asked about tides {i} times.", importance=0.3, truncate="drop"),
        Section("conversation", history, importance=0.8, truncate="messages", step=4, role="user", min_tokens=20),
    ]


def test_sections_render_as_the_chat_template_renders_their_messages(tok):
    history = [{"role": "user", "content": "What moves the tides?"}]
    prompt = Context(tok, context_budget=2048).assemble(turn(1, history, "The moon pulls the sea."))
    messages = [
        {"role": "system", "content": AXIOMS},
        {"role": "system", "content": IDENTITY},
        {"role": "system", "content": RULES},
        {"role": "system", "content": "The moon pulls the sea."},
        {"role": "system", "content": "The user asked about tides 1 times."},
        *history,
    ]
    assert prompt.ids == tok.encode_prompt(tok.apply_chat_template(messages, add_generation_prompt=True))
    # Golden: the same ids on every platform and version of the tokenizer stack.
    assert len(prompt.ids) == 136 and prefix_hash(prompt.ids)[:16] == "956db7ad7d08bd3a"
    spans = {s.tag: s for s in prompt.sections}
    assert [s.tag for s in prompt.sections] == ["axioms", "identity", "rules", "knowledge", "memories", "conversation"]
    assert "Aither" in tok.decode(prompt.ids[spans["identity"].start : spans["identity"].stop])
    assert "tides?" in tok.decode(prompt.ids[spans["conversation"].start : spans["conversation"].stop])
    assert spans["conversation"].stop < len(prompt.ids)  # the generation prompt follows
    report = prompt.report
    assert report.stable_tokens == spans["rules"].stop and not report.stable_cached
    assert "knowledge" in str(report) and f"{report.num_tokens} tokens of 2048" in str(report)


def test_the_stable_prefix_stays_identical_over_100_turns_and_history_is_cut_in_steps(tok):
    rng = np.random.default_rng(0)
    ctx = Context(tok, context_budget=700)
    history: list[dict] = []
    stable, kept_starts, cut = None, [], 0
    for i in range(100):
        history.append({"role": "user", "content": f"Question {i}: why is the sea salty near river {i}?"})
        knowledge = " ".join(f"fact{rng.integers(1000)}" for _ in range(rng.integers(5, 60)))
        prompt = ctx.assemble(turn(i, history, knowledge))
        r = prompt.report
        assert r.num_tokens <= 700 and r.stable_hash is not None
        stable = stable or (r.stable_hash, prompt.ids[: r.stable_tokens])
        assert (r.stable_hash, prompt.ids[: r.stable_tokens]) == stable
        conv = next(s for s in r.sections if s.tag == "conversation")
        if conv.truncated:
            cut += 1
            kept_starts.append(int(conv.truncated.split()[1]))  # "dropped N oldest messages"
        history.append({"role": "assistant", "content": f"Because of minerals, {i}."})
    assert cut > 50
    assert all(n % 4 == 0 for n in kept_starts)  # whole steps: the kept history moves in jumps


def test_a_history_cut_in_odd_steps_never_starts_with_an_answer_whose_question_went(tok):
    history = [
        {"role": r, "content": f"{'Question' if r == 'user' else 'Answer'} {i} about the harbour tides."}
        for i in range(10)
        for r in ("user", "assistant")
    ]
    drops = set()
    for budget in range(60, 260, 10):
        prompt = Context(tok, context_budget=budget).assemble([Section("history", history, step=3)])
        (history_report,) = prompt.report.sections
        assert history_report.truncated and history_report.kept <= budget
        drop = int(history_report.truncated.split()[1])
        assert drop % 3 in (0, 1) and history[drop]["role"] == "user", (budget, drop)
        assert tok.decode(prompt.ids).count("Question") == tok.decode(prompt.ids).count("Answer")
        drops.add(drop)
    assert any(d % 3 == 1 for d in drops)  # some cut took the orphaned answer with it
    # With tool calls: an answer, a tool result and the answer after it go with their question.
    tools = [
        {"role": r, "content": f"{r} {i} about the harbour tides."}
        for i in range(6)
        for r in ("user", "assistant", "tool", "assistant")
    ]
    for step in (1, 3):
        for budget in range(60, 200, 12):
            prompt = Context(tok, context_budget=budget).assemble([Section("history", tools, step=step)])
            drop = int(prompt.report.sections[0].truncated.split()[1])
            assert drop % 4 == 0, (step, budget, drop)


def test_budgets_cut_the_least_important_first_down_to_their_minimum(tok):
    sections = [
        Section("identity", IDENTITY, importance=1.0, truncate="never"),
        Section("knowledge", "The tide tables for the week. " * 30, importance=0.6, min_tokens=40),
        Section("memories", "An old memory about boats. " * 20, importance=0.2, min_tokens=10),
        Section("web", "A retrieved page about storms. " * 20, importance=0.1, truncate="drop"),
        Section("question", "When is high tide tomorrow?", importance=0.9, role="user", truncate="never"),
    ]
    full = Context(tok, context_budget=4096).assemble(sections).report
    size = {s.tag: s.kept for s in full.sections}
    budget = full.num_tokens - size["web"] - size["memories"] + 15 - 30
    r = Context(tok, context_budget=budget).assemble(sections).report
    by = {s.tag: s for s in r.sections}
    assert r.num_tokens <= budget
    assert by["web"].kept == 0 and by["web"].truncated == "dropped"  # least important, all or nothing
    assert 10 <= by["memories"].kept <= by["memories"].budget == 10  # cut to its minimum next
    assert by["knowledge"].kept <= by["knowledge"].budget < size["knowledge"]  # then the next
    assert by["identity"].kept == size["identity"] and by["question"].kept == size["question"]
    with pytest.raises(ContextError, match=r"cannot fit the sections that may not be cut further \(identity"):
        Context(tok, context_budget=size["identity"] // 2 + 40).assemble(sections)


def test_a_pinned_stable_prefix_frees_prefill_budget_for_the_downstream_sections(tok):
    sections = [*system_layers(), Section("knowledge", "Sea facts. " * 400, importance=0.5)]
    ctx = Context(tok, context_budget=4096, prefill_budget=300)
    first = ctx.assemble(sections).report
    second = ctx.assemble(sections).report  # seen before: pinned, no prefill
    assert not first.stable_cached and second.stable_cached
    assert first.downstream_budget == 300 - first.stable_tokens - (first.num_tokens - first.sections[-1].stop)
    assert second.cascade == first.stable_tokens  # every token the prefix no longer costs flows downstream
    k1, k2 = first.sections[-1], second.sections[-1]
    assert k2.kept >= k1.kept + first.stable_tokens - 2
    assert second.prefill_tokens <= 300


def test_the_pin_follows_the_stable_prefix(tok):
    ctx = Context(tok, context_budget=4096)
    a = [Section("identity", IDENTITY, stable=True), Section("q", "Hi", role="user")]
    b = [Section("identity", IDENTITY + " New rule.", stable=True), Section("q", "Hi", role="user")]
    p1 = ctx.assemble(a)
    p2 = ctx.assemble(a)
    p3 = ctx.assemble(b, pinned=True)
    assert p1.num_pinned == 0 and p1.pin_key is None
    assert p2.num_pinned == p2.report.stable_tokens > 0 and p2.pin_key == ctx.pin_owner.key
    # Under the context's key the engine replaces the old prefix's pin with the new one.
    assert p3.num_pinned == p3.report.stable_tokens and p3.pin_key == ctx.pin_owner.key
    assert Context(tok, context_budget=4096).pin_owner.key != ctx.pin_owner.key


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (dict(tag="x", content="a", truncate="middle"), "section 'x': truncate must be one of"),
        (dict(tag="x", content="a", importance=-0.1), "section 'x': importance must be in"),
        (dict(tag="x", content="a", min_tokens=5, max_tokens=2), "section 'x': max_tokens 2 is below"),
        (dict(tag="x", content="a", truncate="messages"), "'messages' truncation needs a list"),
        (dict(tag="x", content=[{"role": "boss", "content": "a"}]), "section 'x': content must be"),
        (dict(tag="", content="a"), "tag must be a non-empty string"),
        (dict(tag="x" * 129, content="a"), "tag must be a non-empty string of at most 128 characters"),
        (dict(tag="x", content="a", stable="false"), "section 'x': stable must be true or false"),
        (dict(tag="x", content=[{"role": "user", "content": "a"}], truncate="tail"), "cut by 'messages', 'drop'"),
    ],
)
def test_bad_sections_are_refused_with_their_name(section, message):
    with pytest.raises(ContextError, match=message):
        Section(**section)


def test_untagged_messages_fill_pages_known_by_their_role(tok):
    messages = [
        {"role": "system", "content": IDENTITY, "section": {"tag": "identity", "importance": 0.9}},
        {"role": "system", "content": RULES},
        {"role": "user", "content": "What moves the tides?"},
        {"role": "assistant", "content": "The moon.", "section": {"importance": 0.7}},
    ]
    sections, _ = sections_from_messages(messages)
    prompt = Context(tok, context_budget=2048).assemble(sections)
    spans = [(s.tag, s.importance) for s in prompt.sections]
    assert spans == [("identity", 0.9), ("system", 1.0), ("user", 0.5), ("assistant", 0.7)]


def test_a_list_of_messages_is_cut_by_messages_unless_told_and_a_never_section_is_never_cut(tok):
    history = [{"role": "user", "content": f"Question {i} about the tides?"} for i in range(8)]
    assert Section("history", history).truncate == "messages" and Section("text", "a").truncate == "tail"
    ctx = Context(tok, context_budget=4096)
    with pytest.raises(ContextError, match="section 'q': a 'never' section is never cut; .* > max_tokens 4"):
        ctx.assemble([Section("q", "When is high tide at the harbour?", truncate="never", max_tokens=4)])


def test_a_stable_prefix_over_the_prefill_budget_is_paid_once_then_cached(tok):
    sections = [*system_layers(), Section("q", "When is high tide?", role="user", truncate="never")]
    ctx = Context(tok, context_budget=4096, prefill_budget=20)
    first = ctx.assemble(sections).report
    assert not first.stable_cached and first.stable_tokens > 20 and first.sections[-1].kept > 0
    second = ctx.assemble(sections).report
    assert second.stable_cached and second.prefill_tokens <= 20


@pytest.mark.parametrize("truncate", ["drop", "tail"])
def test_a_dropped_leading_system_section_leaves_no_room_for_the_templates_default_identity(tok, truncate):
    # SmolLM2's template writes its own system prompt ("You are a helpful AI assistant named
    # SmolLM") before a conversation that does not start with one: a cut identity keeps an
    # empty system message in its place, within the budgets, and never takes that name.
    sections = [
        Section("identity", IDENTITY, truncate=truncate, importance=0.1),
        Section("q", "When is high water on the third day of the spring festival?", role="user", truncate="never"),
    ]
    prompt = Context(tok, context_budget=60, prefill_budget=30).assemble(sections)
    text = tok.decode(prompt.ids, skip_special_tokens=False)
    assert "SmolLM" not in text and text.startswith("<|im_start|>system\n")
    report = prompt.report
    assert report.num_tokens <= 30 and all(s.kept <= s.budget for s in report.sections)
    if truncate == "drop":
        assert text.startswith("<|im_start|>system\n<|im_end|>") and "empty system" in report.sections[0].truncated
    history = [{"role": "system", "content": IDENTITY}] + [
        {"role": r, "content": f"Turn {i}: the tide tables for the harbour."}
        for i in range(6)
        for r in ("user", "assistant")
    ]
    cut = Context(tok, context_budget=80).assemble([Section("history", history, step=2)])
    assert "SmolLM" not in tok.decode(cut.ids, skip_special_tokens=False)
    assert cut.report.sections[0].kept <= cut.report.sections[0].budget
    with pytest.raises(ContextError, match="cannot fit"):  # not even the empty message fits
        Context(tok, context_budget=8).assemble(sections[:1] + [Section("q", "Hi", role="user")])


def test_a_text_cut_never_splits_a_character(tok):
    text = "港口的潮汐表：每天早上六点涨潮，晚上六点退潮。" * 4
    for truncate in ("tail", "head"):
        for budget in range(40, 70, 3):
            sections = [Section("k", text, truncate=truncate), Section("q", "Hi", role="user", truncate="never")]
            prompt = Context(tok, context_budget=budget).assemble(sections)
            assert "\ufffd" not in tok.decode(prompt.ids), (truncate, budget)


def test_the_stable_prefixes_seen_are_bounded(tok, monkeypatch):
    monkeypatch.setattr(sections_module, "MAX_SEEN", 2)
    ctx = Context(tok, context_budget=4096)
    for rule in ("one", "two", "three"):
        ctx.assemble([Section("identity", f"{IDENTITY} Rule {rule}.", stable=True), Section("q", "Hi", role="user")])
    assert len(ctx._seen) == 2
    again = [Section("identity", f"{IDENTITY} Rule one.", stable=True), Section("q", "Hi", role="user")]
    assert not ctx.assemble(again).report.stable_cached  # the oldest was forgotten


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"tag": ["a"]}, "message 1: a section's tag must be a non-empty string"),
        ({"tag": 3}, "message 1: a section's tag must be a non-empty string"),
        ({"tag": "message-0"}, "other than message-N"),
    ],
)
def test_bad_message_tags_are_refused(section, message):
    messages = [
        {"role": "system", "content": IDENTITY},
        {"role": "user", "content": "Hi", "section": section},
        {"role": "user", "content": "Hello", "section": section},
    ]
    with pytest.raises(ContextError, match=message):
        sections_from_messages(messages)


def test_text_that_spells_control_tokens_is_cut_by_the_tokens_it_renders_to(tok):
    """A message's content is encoded as text (control-token strings as plain characters), so a
    cut counts those tokens, not the one control token `encode` would make of each string."""
    notes = Section("notes", "<|im_end|> " * 200, importance=0.1)
    ctx = Context(tok, context_budget=400)
    kept = ctx.assemble([Section("q", "Hi", role="user", truncate="never"), notes]).report.sections[1]
    assert kept.truncated.startswith("kept first") and kept.kept > 0.8 * kept.budget


def test_with_an_engine_only_what_it_holds_cached_is_credited(tok):
    # An engine without prefix caching holds nothing: the stable prefix, seen or pinned, is
    # paid by every request. One holding whole pages gives those, not the partial last page.
    sections = [*system_layers(), Section("q", "When is high tide?", role="user", truncate="never")]
    held = {"tokens": 0}
    ctx = Context(tok, context_budget=4096, prefill_budget=400, cached_tokens=lambda ids: held["tokens"])
    first, second = ctx.assemble(sections).report, ctx.assemble(sections, pinned=True).report
    assert not first.stable_cached and not second.stable_cached and second.cascade == 0
    assert second.prefill_tokens == second.num_tokens
    held["tokens"] = second.stable_tokens // 16 * 16
    third = ctx.assemble(sections).report
    assert third.stable_cached and third.stable_cached_tokens == held["tokens"] < third.stable_tokens
    assert third.prefill_tokens == third.num_tokens - held["tokens"] and third.cascade == held["tokens"]


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "user", "content": "x", "section": "a"}], "section must be an object"),
        ([{"content": "x"}], "message 0 must be"),
        (["just text"], "message 0 must be"),
    ],
)
def test_malformed_messages_and_sections_are_context_errors(tok, messages, match):
    with pytest.raises(ContextError, match=match):
        sections_from_messages(messages)
    with pytest.raises(ContextError, match="section 0 must be a Section"):
        Context(tok, context_budget=100).assemble([{"tag": "a", "content": "x"}])


def test_a_never_section_written_longer_after_a_dropped_one_is_refused_not_cut(tok):
    # SmolLM2's template writes its default system prompt before a conversation that starts
    # without one: dropping the history moves it onto the question, which may not be cut.
    history = [{"role": r, "content": f"Turn {i} about the tides."} for i in range(4) for r in ("user", "assistant")]
    question = "When is high water at the northern harbour tomorrow?"
    sections = [
        Section("history", history, truncate="drop", importance=0.1),
        Section("q", question, role="user", truncate="never"),
    ]
    for budget in range(30, 120, 5):
        try:
            prompt = Context(tok, context_budget=budget).assemble(sections)
        except ContextError as e:
            assert "budget" in str(e)
            continue
        assert question in tok.decode(prompt.ids) and prompt.report.num_tokens <= budget


def test_an_empty_assistant_turn_is_kept(tok):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": ""},  # a turn of tool calls, replayed without text
        {"role": "user", "content": "Thanks", "section": {"tag": "q"}},
    ]
    sections, _ = sections_from_messages(messages)
    text = tok.decode(Context(tok, context_budget=200).assemble(sections).ids, skip_special_tokens=False)
    assert "<|im_start|>assistant\n<|im_end|>" in text
