"""The context pipeline: a prompt assembled from tagged sections with token budgets.

A prompt is a list of `Section`s (axioms, identity, rules, knowledge, memories, the
conversation, ...), each with a tag, content (text, rendered as one message of the section's
role, or a list of messages), an importance in [0, 1], a token budget (min and max), whether it
is stable (the same bytes from request to request) and how it is cut when it must be. A
`Context` renders them, in the order given, through the model's chat template to exact token
ids, and reports per section what it kept and cut.

Budgets. The rendered prompt stays within `context_budget` tokens. The prefill budget is the
new tokens one request may cost (the latency that matters). The leading run of stable
sections is the stable prefix, named by the SHA-256 of its token ids; once it has been seen
(or the caller says to pin it at once) its pages are pinned in the prefix cache. The part of
it the engine holds cached (whole pages; `cached_tokens`, asked at each assembly) costs no
prefill, so the budget it used flows to the downstream sections, most important first (the
cascade). Sections are cut least important first (later sections first among equals), down
to their minimum: `tail` keeps the start of a text, `head` keeps its end, `messages` drops
the oldest messages in steps of `step` messages (and the answers and tool results whose
question went), so the kept history changes only every `step` messages and stays
hash-identical (cache hits) in between, `drop` keeps all or nothing, and `never` is never cut
(over its max_tokens it is refused). The stable prefix is
pinned under the Context's `pin_owner`: the engine holds one pin per owner, on the latest
prefix computed.

Every section's token span rides along with the ids (`Prompt.sections`); the scheduler writes
each page's section tag and importance into its block record (the eviction advisor's input;
a page spanning two sections takes the least important, core/page_records.py).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import re
from collections.abc import Callable, Sequence

from aither_jax.context.prompt import ROLE_IMPORTANCE, PinOwner, Prompt, SectionSpan
from models.tokenizer import CHAT_ROLES, Tokenizer

TRUNCATIONS = ("tail", "head", "messages", "drop", "never")
MAX_SEEN = 4096  # stable prefixes a Context remembers having seen, least recently seen dropped
MAX_TAG_CHARS = 128  # a tag rides in every page's block record, and in its disk file's header


class ContextError(ValueError):
    """A section or budget that cannot be assembled; the message names the section."""


@dataclasses.dataclass(frozen=True)
class Section:
    """One tagged part of a prompt.

    Attributes:
        tag: what the section is ("identity", "knowledge", "conversation", ...); it becomes the
            source tag of the KV pages its tokens fill.
        content: text (one message of `role`), or a list of {"role", "content"} messages.
        importance: 0-1; less important sections are cut first.
        min_tokens / max_tokens: its budget (max None: as long as it is).
        stable: expected to repeat byte for byte across requests (the leading run of stable
            sections is the stable prefix, pinned once seen).
        truncate: "tail" (keep the start), "head" (keep the end), "messages" (drop the oldest
            messages in steps of `step`), "drop" (all or nothing), "never"; None (the default):
            "tail" for text, "messages" for a list of messages. A list is cut only by "messages",
            "drop" or "never".
        role: the role of text content.
        step: messages dropped at a time by "messages" truncation.
        source: the source tag its KV pages take, if not `tag` (a chat message's role).
    """

    tag: str
    content: str | Sequence[dict]
    importance: float = 0.5
    min_tokens: int = 0
    max_tokens: int | None = None
    stable: bool = False
    truncate: str | None = None
    role: str = "system"
    step: int = 4
    source: str | None = None

    def __post_init__(self):
        if not isinstance(self.tag, str) or not self.tag or len(self.tag) > MAX_TAG_CHARS:
            raise ContextError(
                f"a section's tag must be a non-empty string of at most {MAX_TAG_CHARS} characters, "
                f"got {self.tag[: MAX_TAG_CHARS + 3] if isinstance(self.tag, str) else self.tag!r}"
            )
        where = f"section {self.tag!r}"
        if not isinstance(self.stable, bool):
            raise ContextError(f"{where}: stable must be true or false, got {self.stable!r}")
        if self.truncate is None:
            object.__setattr__(self, "truncate", "tail" if isinstance(self.content, str) else "messages")
        if isinstance(self.importance, bool) or not isinstance(self.importance, int | float):
            raise ContextError(f"{where}: importance must be a number in [0, 1], got {self.importance!r}")
        if not 0 <= self.importance <= 1:
            raise ContextError(f"{where}: importance must be in [0, 1], got {self.importance!r}")
        for name in ("min_tokens", "max_tokens", "step"):
            value = getattr(self, name)
            if value is None and name == "max_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "step" else 0):
                raise ContextError(f"{where}: {name} must be an integer >= {int(name == 'step')}, got {value!r}")
        if self.max_tokens is not None and self.max_tokens < self.min_tokens:
            raise ContextError(f"{where}: max_tokens {self.max_tokens} is below min_tokens {self.min_tokens}")
        if self.truncate not in TRUNCATIONS:
            raise ContextError(f"{where}: truncate must be one of {', '.join(TRUNCATIONS)}, got {self.truncate!r}")
        if self.role not in CHAT_ROLES:
            raise ContextError(f"{where}: role must be one of {', '.join(CHAT_ROLES)}, got {self.role!r}")
        if isinstance(self.content, str):
            if self.truncate == "messages":
                raise ContextError(f"{where}: 'messages' truncation needs a list of messages")
        elif isinstance(self.content, Sequence) and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in CHAT_ROLES
            for m in self.content
        ):
            object.__setattr__(self, "content", tuple(dict(m) for m in self.content))
            if self.truncate in ("tail", "head"):
                raise ContextError(
                    f"{where}: a list of messages is cut by 'messages', 'drop' or 'never', not {self.truncate!r}"
                )
        else:
            raise ContextError(f"{where}: content must be text or a list of {{'role', 'content'}} messages")

    def messages(self) -> list[dict]:
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}] if self.content else []
        return list(self.content)


@dataclasses.dataclass(frozen=True)
class SectionReport:
    """What happened to one section."""

    tag: str
    importance: float
    stable: bool
    wanted: int  # tokens rendered in full (capped by max_tokens)
    budget: int  # tokens allotted
    kept: int  # tokens in the prompt
    start: int  # its span in the prompt's ids
    stop: int
    truncated: str | None  # how it was cut, None if whole


@dataclasses.dataclass(frozen=True)
class ContextReport:
    """Budgets and the cascade of one assembly."""

    sections: tuple[SectionReport, ...]
    context_budget: int
    prefill_budget: int | None
    num_tokens: int
    stable_tokens: int
    stable_hash: str | None
    stable_cached: bool  # part of the stable prefix is cached: it costs no prefill
    downstream_budget: int  # tokens the sections after the stable prefix could have
    downstream_budget_uncached: int  # what they could have had if it were not cached
    prefill_tokens: int  # tokens this prompt costs beyond the cached stable prefix
    stable_cached_tokens: int = 0  # the stable prefix's tokens cached (in whole pages)

    @property
    def cascade(self) -> int:
        """Budget the cached stable prefix freed for the downstream sections."""
        return self.downstream_budget - self.downstream_budget_uncached

    def __str__(self) -> str:
        head = (
            f"{self.num_tokens} tokens of {self.context_budget}"
            + (f", prefill budget {self.prefill_budget}" if self.prefill_budget is not None else "")
            + f"; stable prefix {self.stable_tokens} tokens"
            + (f" ({self.stable_hash[:12]}, {self.stable_cached_tokens} cached)" if self.stable_cached else "")
            + f"; downstream budget {self.downstream_budget} ({self.cascade:+d} from the cascade); "
            + f"prefill {self.prefill_tokens} tokens"
        )
        w = max(8, *(len(s.tag) for s in self.sections)) if self.sections else 8
        rows = [f"{'section':<{w}} {'imp':>5} {'wanted':>7} {'budget':>7} {'kept':>7}  span          cut"]
        for s in self.sections:
            span = f"[{s.start}, {s.stop})"
            stable = " stable" if s.stable else ""
            rows.append(
                f"{s.tag:<{w}} {s.importance:>5.2f} {s.wanted:>7} {s.budget:>7} {s.kept:>7}  {span:<13} "
                f"{s.truncated or '-'}{stable}"
            )
        return "\n".join([head, *rows])


class Context:
    """Assembles sections for one model (its tokenizer and chat template) within budgets, and
    remembers which stable prefixes it has seen and which one is pinned."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        context_budget: int,
        prefill_budget: int | None = None,
        cached_tokens: Callable[[list[int]], int] | None = None,
    ):
        """`cached_tokens(ids)`: how many leading tokens of `ids` the engine holds cached now
        (`Engine.cached_prefix_tokens`, under the requests' tenant); what the stable prefix gets
        as cached. Without it (a context with no engine) a stable prefix counts as cached in
        full once it is pinned (seen before, or `assemble(pinned=True)`)."""
        for name, value in (("context_budget", context_budget), ("prefill_budget", prefill_budget)):
            if value is None and name == "prefill_budget":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ContextError(f"{name} must be an integer >= 1, got {value!r}")
        self.tokenizer = tokenizer
        self.context_budget = context_budget
        self.prefill_budget = prefill_budget
        self.cached_tokens = cached_tokens
        self._placeholder: bool | None = None  # whether a lone empty system message beats the template's default
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        # The owner of this context's pin: the engine keeps one pin per owner, on the latest
        # stable prefix computed, taken once however many prompts ask (`Scheduler.pin`).
        self.pin_owner = PinOwner()

    # -- rendering ----------------------------------------------------------------------------

    def _ids(self, messages: list[dict], *, generation: bool) -> list[int]:
        if not messages:
            return []
        return self.tokenizer.encode_chat(messages, add_generation_prompt=generation)[0]

    def _render(self, parts: list[list[dict]]) -> tuple[list[int], list[int]]:
        """(ids with the generation prompt, the end of each part's span), checking that every
        part's tokens extend the ids before it (the template renders messages one by one)."""
        ends, done, flat = [], [], []
        for part in parts:
            flat = flat + part
            ids = self._ids(flat, generation=False)
            if ids[: len(done)] != done:
                raise ContextError("this chat template does not render messages one after another; sections need it")
            done = ids
            ends.append(len(ids))
        full = self._ids(flat, generation=True)
        if full[: len(done)] != done:
            raise ContextError("this chat template's generation prompt rewrites the conversation")
        return full, ends

    def _size(self, messages: list[dict], before: list[dict]) -> int:
        """Tokens `messages` add rendered after `before` (a template may write a message
        differently at the start of a conversation)."""
        _, ends = self._render([before, messages])
        return ends[1] - ends[0]

    # -- cutting ------------------------------------------------------------------------------

    def _cut(
        self, section: Section, budget: int, before: list[dict], size: int, lead: list[dict] = ()
    ) -> tuple[list[dict], str | None]:
        """The section's messages (`size` tokens in full) cut to at most `budget` tokens as
        rendered after `before`, and how it was cut. `lead`: messages a cut must start with
        where it does not start with a system message (`_lead`)."""
        messages = section.messages()
        if size <= budget or section.truncate == "never":  # never cut (the budgets' total is checked after)
            return messages, None

        def led(cut: list[dict]) -> list[dict]:
            return cut if not lead or (cut and cut[0]["role"] == "system") else [*lead, *cut]

        if section.truncate == "drop" or budget <= 0:
            return led([]), "dropped" + ("; an empty system message holds its place" if lead else "")
        if section.truncate == "messages":

            def start(steps: int) -> int:  # answers and tool results whose question is dropped go with it
                drop = min(len(messages), steps * section.step)
                if any(m["role"] == "user" for m in messages[:drop]):
                    while drop < len(messages) and messages[drop]["role"] in ("assistant", "tool"):
                        drop += 1
                return drop

            # The fewest whole steps of oldest messages to drop (binary search: fits is monotone).
            lo, hi = 1, -(-len(messages) // section.step)
            while lo < hi:
                mid = (lo + hi) // 2
                if self._size(led(messages[start(mid) :]), before) <= budget:
                    hi = mid
                else:
                    lo = mid + 1
            drop = start(lo)
            return led(messages[drop:]), f"dropped {drop} oldest messages"
        # Text: cut its content's tokens (as a message's content is encoded: control-token text
        # is plain characters), keeping the template's tokens around it. A character split by
        # the cut is left out, never written as U+FFFD.
        content = self.tokenizer.encode_text(section.content)
        split = "\ufffd" not in section.content
        keep = max(0, budget - (size - len(content)))
        while True:
            kept = content[:keep] if section.truncate == "tail" else content[len(content) - keep :]
            text = self.tokenizer.decode(kept, skip_special_tokens=False) if keep else ""
            if split:
                text = text.rstrip("\ufffd") if section.truncate == "tail" else text.lstrip("\ufffd")
            cut = led([{"role": section.role, "content": text}] if text else [])
            if not text:
                return cut, "dropped" + ("; an empty system message holds its place" if lead else "")
            if self._size(cut, before) <= budget:  # a decoded cut may re-encode longer
                return cut, f"kept {'first' if section.truncate == 'tail' else 'last'} {keep} of {len(content)} tokens"
            keep -= 1

    def _lead(self, first: Section) -> list[dict]:
        """What the first section's cut must start with: an empty system message where the
        section starts with one and the chat template writes a default system prompt of its
        own (a model's name, someone else's identity) before a conversation without one, and
        the empty message is shorter; else nothing."""
        messages = first.messages()
        if not messages or messages[0]["role"] != "system":
            return []
        if self._placeholder is None:
            user = [{"role": "user", "content": "x"}]
            with_empty = self._ids([{"role": "system", "content": ""}, *user], generation=False)
            self._placeholder = len(with_empty) < len(self._ids(user, generation=False))
        return [{"role": "system", "content": ""}] if self._placeholder else []

    # -- assembly -----------------------------------------------------------------------------

    def assemble(self, sections: Sequence[Section], *, pinned: bool = False) -> Prompt:
        """The prompt for `sections` within the budgets, with its report (`Prompt.report`).

        `pinned`: treat the stable prefix as pinned even the first time it is seen.

        Raises:
            ContextError: bad sections, duplicate tags, or budgets that cannot hold the sections
                that may not be cut (it names them).
        """
        sections = list(sections)
        if not sections:
            raise ContextError("a context needs at least one section")
        bad = next((i for i, s in enumerate(sections) if not isinstance(s, Section)), None)
        if bad is not None:
            raise ContextError(f"section {bad} must be a Section, got {type(sections[bad]).__name__}")
        tags = [s.tag for s in sections]
        if len(set(tags)) != len(tags):
            raise ContextError(f"section tags must be unique, got {tags}")
        num_stable = next((i for i, s in enumerate(sections) if not s.stable), len(sections))
        full, ends = self._render([s.messages() for s in sections])
        sizes = [b - a for a, b in zip([0, *ends[:-1]], ends, strict=True)]
        tail = len(full) - ends[-1]  # the generation prompt
        stable_tokens = ends[num_stable - 1] if num_stable else 0
        stable_hash = prefix_hash(full[:stable_tokens]) if stable_tokens else None
        pin = stable_hash is not None and (pinned or stable_hash in self._seen)
        if self.cached_tokens is None:
            credit = stable_tokens if pin else 0
        else:
            credit = min(self.cached_tokens(full[:stable_tokens]), stable_tokens) if stable_tokens else 0
        # What the sections after the stable prefix may take: the context left after it, and
        # the prefill budget, less what the stable prefix costs of it (its tokens not cached).
        room = self.context_budget - stable_tokens - tail

        def downstream_with(cached: int) -> int:
            if self.prefill_budget is None:
                return room
            return min(room, self.prefill_budget - (stable_tokens - cached) - tail)

        uncached, downstream = downstream_with(0), downstream_with(credit)
        if downstream < 0 <= room and stable_tokens and credit < stable_tokens:
            downstream = room  # a stable prefix over the prefill budget alone is paid (once, if it gets cached)
        if not credit:
            uncached = downstream
        if room < 0 or downstream < 0:
            raise ContextError(
                f"the stable prefix ({', '.join(tags[:num_stable])}) takes {stable_tokens} tokens: more than the "
                f"budget allows"
            )
        for i, (s, size) in enumerate(zip(sections, sizes, strict=True)):
            if (i < num_stable or s.truncate == "never") and s.max_tokens is not None and size > s.max_tokens:
                kind = "stable sections are" if i < num_stable else "a 'never' section is"
                raise ContextError(f"section {s.tag!r}: {kind} never cut; {size} tokens > max_tokens {s.max_tokens}")
        # A first section that may be cut keeps an empty system message in place of its own
        # where the template would write its default system prompt instead (`_lead`).
        lead = self._lead(sections[0]) if num_stable == 0 else []
        reserve = self._size(lead, []) if lead else 0
        budgets = self._allocate(sections[num_stable:], sizes[num_stable:], downstream, reserve)
        parts = [s.messages() for s in sections[:num_stable]]
        how: list[str | None] = [None] * num_stable
        for k, (s, b, size) in enumerate(zip(sections[num_stable:], budgets, sizes[num_stable:], strict=True)):
            before = [m for part in parts for m in part]
            if any(how):  # after a cut section it may render otherwise
                size = self._size(s.messages(), before)
            messages, cut = self._cut(s, b, before, size, lead if num_stable + k == 0 else [])
            parts.append(messages)
            how.append(cut)
        ids, ends = self._render(parts)
        starts = [0, *ends[:-1]]
        laid_out = zip(sections[num_stable:], budgets, starts[num_stable:], ends[num_stable:], strict=True)
        for s, b, start, stop in laid_out:
            if stop - start > b and s.truncate != "never":  # the template wrote a section longer than it measured
                raise ContextError(
                    f"section {s.tag!r}: the chat template writes it in {stop - start} tokens after the cuts before "
                    f"it, over its budget of {b}: give the sections before it room, or it a larger budget"
                )
        if ends[-1] - stable_tokens > downstream:  # a 'never' section written longer after the cuts before it
            raise ContextError(
                f"after the cuts the chat template writes the sections after the stable prefix in "
                f"{ends[-1] - stable_tokens} tokens, over the {downstream} the budgets leave (a template adds text of "
                "its own where a leading section was dropped): give the sections that may be cut room, or the "
                "context larger budgets"
            )
        if len(ids) > self.context_budget:
            raise ContextError(
                f"the assembled prompt is {len(ids)} tokens, over the context budget of {self.context_budget}: "
                "give the sections that may be cut smaller budgets, or the context a larger one"
            )
        wanted = [_wanted(s, size) for s, size in zip(sections, sizes, strict=True)]
        reports = tuple(
            SectionReport(s.tag, s.importance, s.stable, w, b, stop - start, start, stop, cut)
            for s, w, b, start, stop, cut in zip(
                sections, wanted, [*sizes[:num_stable], *budgets], starts, ends, how, strict=True
            )
        )
        report = ContextReport(
            reports, self.context_budget, self.prefill_budget, len(ids), stable_tokens, stable_hash, credit > 0,
            downstream, uncached, len(ids) - credit, credit,
        )  # fmt: skip
        spans = tuple(
            SectionSpan(s.source or s.tag, s.importance, r.start, r.stop)
            for s, r in zip(sections, reports, strict=True)
            if r.stop > r.start
        )
        if stable_hash is not None:
            self._seen[stable_hash] = None
            self._seen.move_to_end(stable_hash)
            while len(self._seen) > MAX_SEEN:
                self._seen.popitem(last=False)
        num_pinned = stable_tokens if pin else 0
        owner = self.pin_owner if pin else None
        return Prompt(ids, num_pinned, None, sections=spans, pin_owner=owner, report=report)

    def _allocate(self, sections: list[Section], sizes: list[int], budget: int, reserve: int = 0) -> list[int]:
        """Token budgets for the downstream sections within `budget`: each its full size (at most
        max_tokens), then cut least important first (later first among equals) down to its
        minimum (nothing for "drop", its full size for "never"; at least `reserve` for the
        first, the empty system message it keeps) until they fit."""
        want = [_wanted(s, size) for s, size in zip(sections, sizes, strict=True)]
        floor = [
            w if s.truncate == "never" else 0 if s.truncate == "drop" else min(w, s.min_tokens)
            for s, w in zip(sections, want, strict=True)
        ]
        if sections and reserve:
            floor[0] = max(floor[0], min(want[0], reserve))
        if sum(floor) > budget:
            fixed = [s.tag for s, f in zip(sections, floor, strict=True) if f]
            raise ContextError(
                f"budgets cannot fit the sections that may not be cut further ({', '.join(fixed)}): they need "
                f"{sum(floor)} tokens, {budget} are left after the stable prefix"
            )
        out = list(want)
        over = sum(out) - budget
        for i in sorted(range(len(sections)), key=lambda i: (sections[i].importance, -i)):
            if over <= 0:
                break
            if sections[i].truncate == "drop":  # all or nothing
                cut = out[i] - floor[i] if i == 0 and reserve else out[i]
            else:
                cut = min(over, out[i] - floor[i])
            out[i] -= cut
            over -= cut
        return out


def _wanted(section: Section, size: int) -> int:
    """A section's tokens in full, capped by its max_tokens."""
    return size if section.max_tokens is None else min(size, section.max_tokens)


def prefix_hash(ids: Sequence[int]) -> str:
    """SHA-256 of token ids (the stable prefix's name)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


SECTION_FIELDS = ("tag", "importance", "stable", "truncate", "min_tokens", "max_tokens", "step")
_AUTOMATIC = re.compile(r"message-\d+")  # the tags of untagged messages


def sections_from_messages(messages: Sequence[dict]) -> tuple[list[Section], bool]:
    """Sections from chat messages tagged one by one, as the server receives them: each message
    may carry "section" (a dict of `Section` fields but content and role) and "cache_control"
    (True: a breakpoint). Consecutive messages with one tag form one section (its fields from
    the first message that gives them); untagged messages form sections of their own. The
    sections up to the last breakpoint, inclusive, are stable. Returns (sections, whether a
    breakpoint was given: the stable prefix is then pinned at once).

    Raises:
        ContextError: an unknown section field, a tag used by two runs of messages, or a
            breakpoint inside a section rather than at its last message.
    """
    groups: list[tuple[str, dict, list[dict]]] = []
    last_break = -1
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
            raise ContextError(f"message {i} must be a {{'role', 'content'}} object with a role of {CHAT_ROLES}")
        if not isinstance(m.get("section") or {}, dict):
            raise ContextError(f"message {i}: section must be an object of section fields, got {m['section']!r}")
        spec = dict(m.get("section") or {})
        unknown = set(spec) - set(SECTION_FIELDS)
        if unknown:
            raise ContextError(f"message {i}: unknown section fields {sorted(unknown)}; allowed: {SECTION_FIELDS}")
        tag = spec.get("tag")
        if tag is not None and (not isinstance(tag, str) or not tag or _AUTOMATIC.fullmatch(tag)):
            raise ContextError(
                f"message {i}: a section's tag must be a non-empty string other than message-N (the name of an "
                f"untagged message), got {tag!r}"
            )
        if tag is None or not groups or groups[-1][0] != tag:
            groups.append((tag if tag is not None else f"message-{i}", spec, []))
        elif spec:
            groups[-1][1].update({k: v for k, v in spec.items() if k not in groups[-1][1]})
        groups[-1][2].append({"role": m["role"], "content": m["content"]})
        if m.get("cache_control"):
            last_break = len(groups) - 1
            if i + 1 < len(messages) and tag is not None and (messages[i + 1].get("section") or {}).get("tag") == tag:
                raise ContextError(f"section {tag!r}: cache_control must mark its last message")
    tags = [g[0] for g in groups]
    repeated = sorted({t for t in tags if tags.count(t) > 1})
    if repeated:
        raise ContextError(f"section {repeated[0]!r}: its messages must be consecutive")
    sections = []
    for k, (tag, spec, group) in enumerate(groups):
        fields = {f: spec[f] for f in SECTION_FIELDS[1:] if f in spec}
        if k <= last_break:
            fields["stable"] = True
        if len(group) == 1 and group[0]["content"]:  # an empty message is a turn too: kept as a list
            role = group[0]["role"]
            if "tag" not in spec:  # an untagged message: its pages are known by its role
                fields = {"importance": ROLE_IMPORTANCE[role], **fields, "source": role}
            sections.append(Section(tag, group[0]["content"], role=role, **fields))
        else:
            sections.append(Section(tag, group, **{"truncate": "messages", **fields}))
    return sections, last_break >= 0
