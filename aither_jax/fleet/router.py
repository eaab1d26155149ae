"""Routing by effort: which of the served models answers a request that names none of them.

An explicit OpenAI `reasoning_effort` wins (none/minimal 1, low 2, medium 3, high 5). Otherwise
the effort scorer (`effort.py`) reads the turn's last user message. Effort at or above
`threshold` goes to the heavy model (by default the one with more parameters), the rest to the
light one.

Follow-ups keep their intent. A conversation (a key the client gives: an `X-Session-Id`
header, or OpenAI's `user` field; else its history: each turn is remembered under the hash of
its messages and finds the turn before under the hash of what came before its last answer; a
first turn starts afresh, except in a session; within a `scope`, the server's tenant)
remembers a high-effort turn, or a turn with tool results, for its next `carry_turns` turns:
their effort is at least the remembered one. Past that window the remembered effort decays a
level per turn, and only a short follow-up that refers back ("How do I get tickets for it?",
"and that one?") still draws on it: it is routed like the turn before it, up to the decayed
effort, so a run of such follow-ups comes down to the light model within a few turns. A short
thanks or goodbye ("thanks, that helped") is not a follow-up. This is the bug it prevents: a
research question's short follow-up scored alone looks like chit-chat and went to a bare model.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import re
import threading
from collections.abc import Sequence

from aither_jax.fleet.effort import MAX_EFFORT, markers, score_effort

REASONING_EFFORT = {"none": 1, "minimal": 1, "low": 2, "medium": 3, "high": 5}
CARRY_TURNS = 3
SHORT_FOLLOW_UP_WORDS = 12
MAX_CONVERSATIONS = 4096  # remembered, least recently routed dropped
_REFERS_BACK = re.compile(
    r"\b(it|its|that|this|those|these|they|them|their|there|he|she|him|her|the same|the (first|second|last|other) "
    r"one|which one|and|also|what about|how about|then)\b",
    re.IGNORECASE,
)


@dataclasses.dataclass(frozen=True)
class Route:
    model: str
    effort: int
    reason: str  # "reasoning_effort", "scored", "carried" or "follow-up"
    detail: tuple[str, ...] = ()  # the scorer's reasons
    # What `Router.remember` records of the turn: where (its key; "": nowhere), from what (the
    # turn before's key), its own effort (scored or given), and whether it opens a carry window
    # (a heavy or tool turn).
    key: str = dataclasses.field(default="", repr=False, compare=False)
    own: int = dataclasses.field(default=0, repr=False, compare=False)
    opens_window: bool = dataclasses.field(default=False, repr=False, compare=False)
    lookup: str = dataclasses.field(default="", repr=False, compare=False)  # the turn before's key ("": none)
    by_history: bool = dataclasses.field(default=False, repr=False, compare=False)  # keyed by its messages


@dataclasses.dataclass
class _Memory:
    effort: int  # remembered effort of the last heavy or tool turn, decaying past the window
    turns_left: int  # turns still carrying it in full
    last: int  # the effort the previous turn was routed with


class Router:
    """Routes between a light and a heavy model by effort, remembering conversations.

    Args:
        light / heavy: model names (the same name twice serves everything with one model).
        threshold: effort at or above which a request goes to `heavy`.
        carry_turns: turns a heavy or tool turn's effort is carried forward in full.
    """

    def __init__(self, light: str, heavy: str, *, threshold: int = 3, carry_turns: int = CARRY_TURNS):
        if not 1 <= threshold <= MAX_EFFORT:
            raise ValueError(f"the routing threshold must be an effort from 1 to {MAX_EFFORT}, got {threshold!r}")
        if carry_turns < 0:
            raise ValueError(f"carry_turns must be >= 0, got {carry_turns!r}")
        self.light, self.heavy, self.threshold, self.carry_turns = light, heavy, threshold, carry_turns
        self._memory: collections.OrderedDict[str, _Memory] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.routed: collections.Counter[tuple[str, int]] = collections.Counter()  # (model, effort) -> requests

    def route(
        self,
        messages: Sequence[dict],
        *,
        reasoning_effort: str | None = None,
        conversation: str | None = None,
        session: bool = False,
        scope: str = "",
        remember: bool = True,
    ) -> Route:
        """The model for a chat turn (`messages`, OpenAI-style), and why. `conversation` names
        the conversation ("": remember nothing), within `scope` (a tenant: equal conversations
        of two scopes are two conversations); None: the conversation is its history, each turn
        found by the turn before it (`chain_key`). A first turn (no answer in its messages)
        starts the conversation afresh, unless `session`: the name is a session the client
        continues whatever messages it sends (a client that sends only its latest message).
        With `remember` False the turn is neither counted nor remembered until
        `remember(route)`: the server does that once it has accepted the request, so a refused
        one uses up no carry turn."""
        last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
        text = messages[last_user].get("content") if last_user >= 0 else ""
        text = text if isinstance(text, str) else ""
        answered = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if conversation is not None:
            key = lookup = conversation and f"{scope}\x00{conversation}"
        else:  # remembered under this turn's messages, read from the turn before: all before its answer
            key = f"{scope}\x00{chain_key(messages)}"
            lookup = f"{scope}\x00{chain_key(messages[: answered[-1]])}" if answered else ""
        if not session and not answered:  # a first turn: a new conversation, whatever another
            lookup = ""  # that opened alike (or another of the same user) remembers
        # Tool results answer this turn's request, after its user message; a later turn's
        # history still holds them, but they belong to the turn that opened the window.
        tool_turn = any(m.get("role") == "tool" for m in messages[last_user + 1 :])
        with self._lock:
            memory = self._memory.get(lookup) if lookup else None
            if reasoning_effort is not None:
                if reasoning_effort not in REASONING_EFFORT:
                    raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORT)}")
                own = effort = REASONING_EFFORT[reasoning_effort]
                reason, detail = "reasoning_effort", ()
            else:
                scored = score_effort(text)
                own = effort = scored.level
                reason, detail = "scored", scored.reasons
                if memory is not None and memory.turns_left > 0 and memory.effort > effort:
                    effort, reason = memory.effort, "carried"
                elif memory is not None and min(memory.last, memory.effort) > effort and _follows_up(text):
                    effort, reason = min(memory.last, memory.effort), "follow-up"  # the turn before, decayed
        model = self.heavy if effort >= self.threshold else self.light
        opens_window = own >= self.threshold or tool_turn
        chosen = Route(
            model, effort, reason, detail, key=key, lookup=lookup, own=own, opens_window=opens_window,
            by_history=conversation is None,
        )  # fmt: skip
        if remember:
            self.remember(chosen)
        return chosen

    def route_text(self, prompt: str, *, reasoning_effort: str | None = None, remember: bool = True) -> Route:
        """The model for a plain completion prompt (no conversation to remember)."""
        messages = [{"role": "user", "content": prompt}]
        return self.route(messages, reasoning_effort=reasoning_effort, conversation="", remember=remember)

    def remember(self, route: Route) -> None:
        """Counts a routed turn and updates its conversation's memory: a heavy or tool turn
        starts a new carry window; past the window the remembered effort decays."""
        with self._lock:
            self.routed[(route.model, route.effort)] += 1
            if route.key == "":
                return
            before = self._memory.get(route.lookup) if route.lookup else None
            held = self._memory.get(route.key)
            # Known by its history, a light first turn alike another conversation's heavy one
            # leaves that one its carry.
            if route.by_history and not route.lookup and not route.opens_window and held and held.turns_left > 0:
                return
            memory = dataclasses.replace(before) if before is not None else _Memory(0, 0, 0)
            self._update(memory, route)  # a copy: a retried turn finds the turn before as it was
            self._memory[route.key] = memory
            self._memory.move_to_end(route.key)
            while len(self._memory) > MAX_CONVERSATIONS:
                self._memory.popitem(last=False)

    def _update(self, memory: _Memory, route: Route) -> None:
        if route.opens_window:  # the window restarts; a stronger effort still carried is kept
            held = memory.effort if memory.turns_left > 0 else 0
            memory.effort, memory.turns_left = max(route.own, self.threshold, held), self.carry_turns
        elif memory.turns_left > 0:
            memory.turns_left -= 1
        else:  # past the window the remembered effort decays a level per turn
            memory.effort = max(0, memory.effort - 1)
        memory.last = route.effort


def chain_key(messages: Sequence[dict]) -> str:
    """SHA-256 of a conversation's messages (roles and contents): the next turn, which repeats
    them and adds the answer and its own message, finds this one by it."""
    history = [[m.get("role"), m.get("content")] for m in messages]
    return hashlib.sha256(json.dumps(history, ensure_ascii=False).encode()).hexdigest()


def _follows_up(text: str) -> bool:
    """A short message that refers back to what came before, and is not a thanks or goodbye
    (a greeting or acknowledgement that asks nothing: "thanks, that helped", "ok and bye")."""
    if len(text.split()) > SHORT_FOLLOW_UP_WORDS or not _REFERS_BACK.search(text):
        return False
    return "?" in text or not markers(text)["a greeting"]
