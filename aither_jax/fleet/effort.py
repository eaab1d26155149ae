"""A transparent effort scorer: how much reasoning a request needs, 1 (chit-chat) to 5 (proofs,
system design), from markers anyone can read and argue with.

The level starts at 1 and adds points for what the last user message asks for: mathematics
(expressions with numbers, quantitative words, proofs), code (snippets, languages, debugging),
multi-step work (explanations of why or how, comparisons and trade-offs, plans, design,
analysis, logic puzzles), several parts or constraints, and length. A plain factual question
is 2. Light tasks (translating, summarizing or rewording given text, greetings and thanks,
definitions) stay at 2 at most unless they also carry mathematics or code; a light
instruction over a long pasted text stays at 2 whatever the text holds, unless it is code.
Each point comes with its reason, so a route can be explained. The labeled prompts in
`effort_prompts.json` (and the sets in tests/aither_jax/fleet) measure it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

MAX_EFFORT = 5
HEAD_WORDS = 15  # a message's instruction, before the text it is about
LONG_WORDS = 40  # a request this long describes a situation that takes thought (light tasks aside)


@dataclasses.dataclass(frozen=True)
class Effort:
    level: int  # 1-5
    reasons: tuple[str, ...] = ()


def _rx(*patterns: str) -> re.Pattern:
    return re.compile("|".join(patterns), re.IGNORECASE)


_EXPRESSION = _rx(
    r"\d\s*[-+*/^×÷=<>]\s*\(?\s*[\d.a-z]",
    r"[=<>]\s*-?\d",
    r"\d\s*\(",
    r"\b[a-z]\s*\^\s*\d",
    r"\d+\s*%",
    r"\$\s*\d",
    r"\d+[.,]\d+",
    r"\d+:\d\d",
    r"\d+\s*(mph|km/?h|m/s|miles?|km|meters?|cm|mm|kg|g|mg|ml|liters?|lbs?|pounds|degrees|ft|feet|inch(es)?|hours?|"
    r"minutes?|days|years|"
    r"dollars|euros|percent)\b",
    r"\bfrom\s+[$€£]?\d[\d,.]*\s*%?\s+to\s+[$€£]?\d",  # a change between two amounts
    r"\b[a-z]\s*\(\s*[a-z]\s*[-+*/]\s*[a-z]\s*\)",  # f(x+y)
    r"[→ℝℕℤℚ∀∃∑∫√≤≥≠∞]",
    r"\b(two|three|four|five|six|seven|eight|nine|ten|twelve|fifteen|twenty|thirty|forty|fifty|sixty|seventy|eighty|"
    r"ninety|hundred|thousand)\s+(grams?|kilo\w*|miles?|meters?|hours?|minutes?|seconds?|liters?|dollars|percent)\b",
)
_MATH = _rx(
    r"\b(solve|equations?|calculat\w*|comput\w*|integral|derivative|integrate|differentiate|probabilit\w*|"
    r"percent\w*|interest|average|the mean|mean of|median|variance|expected value|how many|how much|how long|"
    r"ratio|fraction|factor\w*|prime|sum of|product of|divisible|remainder|modulo|matrix|vector|"
    r"geometry|triangle|circle|area|volume|speed|rate|loan|mortgage|compound|odds|chances?|dice|die|coins?|"
    r"in a row|expected number|how far|how fast|how high|infinitely many|per (hour|second|day|week|month|year)|"
    r"what time|mass of|moles?|molar|ecuaci\w*|calcul\w*|combien|wie viele)\b"
)
_PROOF = _rx(
    r"\b(prove|proof|show (that|there)|demonstrate that|derive|derivation|theorem|lemma|induction|irrational|"
    r"bijection|find all functions)\b",
    r"\b(demuestr|démontr|beweis)\w*",
)
_CODE = _rx(
    r"```",
    r"\bdef |\bclass |\breturn\b|;\s*$|[{}]|=>|\bfor\s*\(|\bwhile\s*\(|\bselect\b.*\bfrom\b",
    r"\bc\+\+|\bc#|std::|->",
    r"\b(shard\w*|replicat\w*|database|postgres\w*|mysql|db|schema|latency|throughput|scal(e|ing|able)|"
    r"concurren\w*|thread-?safe|lock-?free|atomics?|memory order\w*|cache invalidation|microservices?|kubernetes)\b",
    r"\b(python|javascript|typescript|java|rust|golang|go code|kotlin|swift|ruby|php|sql|bash|"
    r"shell script|regex|regular expression|function|method|algorithm|api|endpoint|recursion|recursive|"
    r"compile[sd]?|compiler|stack trace|traceback|exception|segfault|null pointer|bug|debug\w*|refactor\w*|"
    r"unit tests?|big-?o|complexity|data structure|linked list|hash ?map|binary search|query|script|"
    r"excel|spreadsheet|formula|vlookup|pandas|numpy|dataframe|df|groupby|react|django|flask|"
    r"crash\w*|npm|pip install|docker\w*|localhost|yaml|html|css|firmware|arduino|uart|gpio|interrupts?|"
    r"(type|value|key|index|attribute|name|syntax|reference|runtime|import|module)error)\b",
    r"`[^`\n]{3,}`",  # inline code or a quoted error
    r"\b\w+_\w+\(",  # a call of a snake_case function
)
_WHY_HOW = _rx(
    r"\b(why|how (does|did|would|could|is|are)|how (do|can) (?!i\b|you\b|we\b)|explain|what causes|"
    r"what happens|what'?s going on|what is going on|what (actually )?caused|keeps? \w+ing|troubleshoot\w*|"
    r"diagnos\w*|valid argument|argument valid|fallacy|justify|show your work|por qué|pourquoi|warum|wieso|"
    r"comment fonctionne|cómo funciona)\b",
    r"¿por qué",
)
_COMPARE = _rx(
    r"\b(compare|comparison|versus|vs\.?|pros and cons|for and against|trade-?offs?|better|smarter|wiser|"
    r"diff(erence)? between|which (is|should)|each side|both sides|diferencias?|différences?|differenza|verschil|"
    r"unterschied|vale (mais )?a pena|"
    r"vale la pena|conviene|lohnt (es )?sich)\b"
)
_PUZZLE = _rx(
    r"\b(puzzle|brain ?teaser|logic (problem|question)|knights?|knaves?|liars?|truth-?tellers?|"
    r"always (lie|lies|tells? the truth)|each \w+ (a )?different|monty hall|paradox)\b"
)
_PLAN = _rx(
    r"\b(plan|schedule|itinerary|roadmap|strategy|design|architect\w*|outline|budget|steps? to|step[- ]by[- ]step|"
    r"optimi[sz]\w*|analy[sz]\w*|evaluate|assess|estimate|forecast|prioriti[sz]e|weighing|factors|considerations|"
    r"routine|structured|debate|strongest arguments?|case (for|against))\b"
)
_LIGHT = _rx(
    r"\b(translate|translation|tradu\w*|summari[sz]e|summary|tl;?dr|rephrase|reword|paraphrase|proofread|"
    r"shorten|make (this|it) (shorter|friendlier|clearer|more \w+)|fix (the )?(grammar|typos|spelling)|"
    r"tidy( up)?|clean up|into (clean )?bullet points|shortcut|"
    r"define|definition|meaning of|what does .{1,30} (mean|stand for)|synonyms?|antonyms?|spell|how do (you|i) say|"
    r"file extension|in plain (words|english))\b",
    r"^\W*what(?:'s| is| are) (a|an|the)\b(?! diff)",  # a definition; "what are the trade-offs" later on is not
    # the bare difference between two words ("affect and effect?"): a usage question
    r"diff[ée]ren\w* (between|entre|tra|zwischen) \W*[\w-]+\W* (and|et|e|y|und) \W*[\w-]+\W*\s*\??\s*$",
)
# "how many tablespoons is 50 grams": a conversion, light whatever its numbers.
_CONVERSION = _rx(
    r"\bhow many (tablespoons|teaspoons|cups|ounces|oz|grams|pounds|lbs|miles|km|kilometers|feet|inches|meters|"
    r"liters|gallons|calories|minutes|hours|days|weeks)\b (is|are|in)\b"
)
_SOCIAL = _rx(
    r"^\W*(hi|hello|hey|yo|hola|bonjour|good (morning|afternoon|evening|night)|thanks?|thank you|thx|"
    r"ok(ay)?|cool|great|nice|bye|goodbye|see you|lol|haha|how are you)\b"
)
_WRITING = _rx(
    r"\b(write|compose|draft|create)\b.{0,40}\b(story|mystery|poem|haikus?|essay|song|letter|speech|limerick|sonnet|"
    r"script|paragraphs?)"
)
_CONSTRAINTS = _rx(
    r"\b(each|where|must|without|exactly|at least|at most|in (first|second|third) person|twist|rhymes?|pun|"
    r"last line|begins? with|acrostic|words? long|\d+ words|structure|chapters?|from the (point of view|perspective))\b"
)
_QUESTION = _rx(r"\?\s*$", r"^\s*(what|who|where|when|which|is|are|does|do|can|could|should|name|list|give)\b")


def score_effort(text: str) -> Effort:
    """The effort a message needs (see the module docstring)."""
    words = len(text.split())
    points, reasons = 0, []

    def add(n: int, why: str) -> None:
        nonlocal points
        points += n
        reasons.append(why)

    quantity_words = len(_MATH.findall(text))
    math = len(_EXPRESSION.findall(text)) + quantity_words + (1 if quantity_words and re.search(r"\d", text) else 0)
    code = len(_CODE.findall(text))
    if _PROOF.search(text):
        add(3, "proof")
    elif math:
        add(min(math, 3), "mathematics" if math >= 3 else "a quantity")
    if code >= 3:
        add(3, "code")
    elif code:
        add(2, "code")
    constraints = len(_CONSTRAINTS.findall(text)) if _WRITING.search(text) else 0
    if constraints:
        add(min(constraints + 1, 3), "constrained writing")
    heavy = points > 2 or math >= 2 or code >= 2  # beyond one code or quantity word
    kinds = [
        why
        for rx, why in (
            (_WHY_HOW, "why or how"),
            (_COMPARE, "comparison"),
            (_PLAN, "planning or analysis"),
            (_PUZZLE, "a puzzle"),
        )
        if rx.search(text)
    ]
    if kinds:
        add(min(len(kinds) + 1, 3), " + ".join(kinds))
    parts = text.count("?") + len(re.findall(r"(?m)^\s*(\d+[.)]|[-*•])\s", text))
    if parts >= 3:
        add(1, f"{parts} parts")
    if words > LONG_WORDS:
        add(1, f"{words} words")
    if not points and _QUESTION.search(text) and not _SOCIAL.search(text):
        add(1, "a question")
    level = 1 + points
    # A light instruction over pasted text ("tl;dr this: ...", "make this shorter: ..."): the
    # numbers and terms are the text's, not the task's (pasted code is not light).
    head = " ".join(text.split()[:HEAD_WORDS])
    over_text = words > 3 * HEAD_WORDS and _LIGHT.search(head) and not _CODE.search(head) and "```" not in text
    conversion = words <= HEAD_WORDS and _CONVERSION.search(text)
    if (over_text or conversion or not heavy and (_LIGHT.search(text) or _SOCIAL.search(text))) and level > 2:
        level, reasons = 2, [*reasons, "a light task"]
    return Effort(max(1, min(MAX_EFFORT, level)), tuple(reasons))


def last_user_text(messages: Sequence[dict]) -> str:
    """The content of the last user message (what the turn asks), "" without one."""
    for m in reversed(messages):
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            return m["content"]
    return ""
