"""A transparent effort scorer: how much reasoning a request needs, 1 (chit-chat) to 5 (proofs,
system design), from markers anyone can read and argue with, weighed by a fit anyone can rerun.

The markers are named regular expressions over the last user message: mathematics
(expressions with numbers, quantitative words, proofs), code (snippets, languages, debugging),
multi-step work (explanations of why or how, comparisons and trade-offs, plans, design,
analysis, logic puzzles), light tasks (translating, summarizing or rewording given text,
definitions, unit conversions), greetings, writing requests and their constraints, and
questions; with the message's length, its number of parts, and four gates: a light
instruction over a long pasted text, a short unit conversion, and a light task or a greeting
with no heavy marker.

Four logistic cuts over those markers, one per boundary between levels (effort at least 2, 3,
4 and 5), are fitted on the labeled prompt sets (`effort_prompts.json` here and the sets in
tests/aither_jax/fleet) by `scripts/fit_effort.py` and stored, weight by marker, in
`effort_weights.json`. The cut at 3 (the default routing threshold) decides whether a request
is heavy; on each side the neighbouring cuts set the level. A score's reasons are the markers
that pushed the cut at 3 hardest towards its answer.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import re
from collections.abc import Sequence

import numpy as np

MAX_EFFORT = 5
HEAD_WORDS = 15  # a message's instruction, before the text it is about
WEIGHTS = pathlib.Path(__file__).with_name("effort_weights.json")
CUTS = (2, 3, 4, 5)  # a cut k answers: is the effort at least k?
L2 = 1.0  # the fit's ridge penalty, on standardized markers
MAX_PARTS = 5


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


_MARKERS = (
    ("an expression", _EXPRESSION),
    ("a quantity", _MATH),
    ("proof", _PROOF),
    ("code", _CODE),
    ("why or how", _WHY_HOW),
    ("comparison", _COMPARE),
    ("a puzzle", _PUZZLE),
    ("planning or analysis", _PLAN),
    ("a light task", _LIGHT),
    ("a conversion", _CONVERSION),
    ("a greeting", _SOCIAL),
    ("a writing request", _WRITING),
    ("constraints", _CONSTRAINTS),
    ("a question", _QUESTION),
)
FEATURES = (
    *(name for name, _ in _MARKERS),
    "length",  # log(1 + words)
    "parts",  # question marks and list items, up to MAX_PARTS
    "a light instruction over pasted text",
    "a short conversion",
    "a light task, nothing heavy",
    "a greeting, nothing heavy",
)


def markers(text: str) -> dict[str, float]:
    """The scorer's inputs for one message, by name (`FEATURES`, in order)."""
    counts = {name: len(rx.findall(text)) for name, rx in _MARKERS}
    words = len(text.split())
    parts = text.count("?") + len(re.findall(r"(?m)^\s*(\d+[.)]|[-*•])\s", text))
    head = " ".join(text.split()[:HEAD_WORDS])
    # The numbers and terms of a pasted text ("tl;dr this: ...") are the text's, not the task's;
    # pasted code is not light.
    over_text = words > 3 * HEAD_WORDS and _LIGHT.search(head) and not _CODE.search(head) and "```" not in text
    heavy = counts["an expression"] + counts["a quantity"] >= 2 or counts["code"] >= 2 or counts["proof"] > 0
    return {
        **{name: float(n > 0) for name, n in counts.items()},
        "length": math.log1p(words),
        "parts": float(min(parts, MAX_PARTS)),
        "a light instruction over pasted text": float(bool(over_text)),
        "a short conversion": float(words <= HEAD_WORDS and counts["a conversion"] > 0),
        "a light task, nothing heavy": float(counts["a light task"] > 0 and not heavy),
        "a greeting, nothing heavy": float(counts["a greeting"] > 0 and not heavy),
    }


class EffortScorer:
    """Scores messages with fitted cuts (`fit_cuts`' output, or `effort_weights.json`)."""

    def __init__(self, fitted: dict):
        if list(fitted["features"]) != list(FEATURES):
            raise ValueError(f"the cuts were fitted on other markers: {fitted['features']} (now {list(FEATURES)})")
        self.cuts = {
            int(k): (float(c["bias"]), np.array([c["weights"][f] for f in FEATURES])) for k, c in fitted["cuts"].items()
        }

    @classmethod
    def load(cls, path: pathlib.Path = WEIGHTS) -> EffortScorer:
        return cls(json.loads(path.read_text(encoding="utf-8")))

    def __call__(self, text: str) -> Effort:
        m = markers(text)
        x = np.array([m[f] for f in FEATURES])
        z = {k: bias + float(w @ x) for k, (bias, w) in self.cuts.items()}
        if z[3] >= 0:
            level = 3 + (z[4] >= 0) + (z[4] >= 0 and z[5] >= 0)
        else:
            level = 2 if z[2] >= 0 else 1
        # The markers whose terms pushed the cut at 3 towards its answer, strongest first.
        sign = 1.0 if z[3] >= 0 else -1.0
        terms = sorted(((sign * w * v, f) for f, w, v in zip(FEATURES, self.cuts[3][1], x, strict=True)), reverse=True)
        named = {"length": f"{len(text.split())} words", "parts": f"{int(m['parts'])} parts"}
        return Effort(int(level), tuple(named.get(f, f) for push, f in terms[:4] if push > 0))

    def agreement(self, texts: Sequence[str], efforts: Sequence[int], threshold: int = 3) -> float:
        """The share of `texts` put on the same side of `threshold` as their labels `efforts`."""
        pairs = zip(texts, efforts, strict=True)
        return sum((self(t).level >= threshold) == (e >= threshold) for t, e in pairs) / len(texts)


@functools.cache
def _shipped() -> EffortScorer:
    return EffortScorer.load()


def score_effort(text: str) -> Effort:
    """The effort a message needs (see the module docstring), by the shipped cuts."""
    return _shipped()(text)


def fit_cuts(texts: Sequence[str], efforts: Sequence[int], *, l2: float = L2) -> dict:
    """Fits the four cuts (L2-penalized logistic regression by Newton's method, on markers
    standardized over `texts`) and returns them in `effort_weights.json`'s form, weights on
    the markers' own scale."""
    x = np.array([[m[f] for f in FEATURES] for m in map(markers, texts)])
    efforts = np.asarray(efforts)
    mean, std = x.mean(0), x.std(0)
    std[std == 0] = 1.0
    z = np.hstack([np.ones((len(x), 1)), (x - mean) / std])
    penalty = np.diag([0.0] + [l2] * len(FEATURES))  # the bias is not penalized
    cuts = {}
    for k in CUTS:
        y, beta = (efforts >= k).astype(float), np.zeros(z.shape[1])
        for _ in range(50):
            p = 1.0 / (1.0 + np.exp(-(z @ beta)))
            grad = z.T @ (p - y) + penalty @ beta
            hess = (z * (p * (1 - p))[:, None]).T @ z + penalty
            step = np.linalg.solve(hess, grad)
            beta -= step
            if np.abs(step).max() < 1e-10:
                break
        w = beta[1:] / std
        cuts[str(k)] = {
            "bias": round(float(beta[0] - w @ mean), 6),
            "weights": {f: round(float(v), 6) for f, v in zip(FEATURES, w, strict=True)},
        }
    return {"features": list(FEATURES), "l2": l2, "cuts": cuts}


def last_user_text(messages: Sequence[dict]) -> str:
    """The content of the last user message (what the turn asks), "" without one."""
    for m in reversed(messages):
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            return m["content"]
    return ""
