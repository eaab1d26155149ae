"""Stage 1 of draft training: the chat requests the target answers (standard-library docstrings,
general chat requests, and requests the target writes itself).

The requests are built from templates and hand-written topic lists in `requests.json` (beside
this file), so nothing is downloaded. The general chat requests (explanations, how-tos, lists
of tips, comparisons, short stories and poems, emails, small programs) make the target answer
the everyday requests a chat model sees; `check_disjoint` keeps them apart from an evaluation
set: no topic may occur in an evaluation prompt, and no request may equal one.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import itertools
import json
import logging
import pathlib
import re
import sysconfig

import numpy as np
from tqdm.auto import tqdm

from aither_jax.context.prompt import user_turn_prefix

log = logging.getLogger("aither_jax.train_draft")


EVAL_PROMPTS = pathlib.Path(__file__).resolve().parents[3] / "scripts" / "data" / "chat_eval.jsonl"
REQUESTS_FILE = pathlib.Path(__file__).with_name("requests.json")


@functools.cache
def training_requests() -> dict:
    """The request templates of `requests.json`: "docstring_requests" and "source_requests"
    are filled with a standard-library `{module}`, `{name}` and `{doc}`; each entry of
    "chat_requests" is one kind of everyday request, its "templates" filled with each of its
    "topics" (`{x}`) and, where a template asks for a count (`{n}`), one of "chat_counts"."""
    with REQUESTS_FILE.open(encoding="utf-8") as f:
        return json.load(f)


# -- stage 1: prompts -----------------------------------------------------------------------


def held_out(module: str) -> bool:
    """Whether a module belongs to the held-out tenth (never used for training)."""
    return hashlib.sha256(module.encode()).digest()[0] % 10 == 0


def stdlib_sources():
    """(module, source, parsed tree) of the standard library's own modules (no tests, IDLE,
    site-packages or demos), from the interpreter's source files, in a fixed order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(p in ("test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo") for p in rel.parts):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        yield module, source, tree


def public_definitions(tree: ast.AST) -> list[ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef) and not n.name.startswith("_")
    ]


def stdlib_docs() -> list[tuple[str, str, str]]:
    """(module, name, first paragraph) for documented modules, classes and functions of the
    standard library, read from source with `ast`, in a fixed order."""
    out = []
    for module, _, tree in stdlib_sources():
        nodes = [(module.rsplit(".", 1)[-1], tree)] + [(n.name, n) for n in public_definitions(tree)]
        for name, node in nodes:
            doc = ast.get_docstring(node)
            if not doc:
                continue
            para = doc.strip().split("\n\n")[0].strip()
            if 60 <= len(para) <= 700:
                out.append((module, name, para))
    return out


def build_prompts(num: int, *, seed: int, split: str = "train") -> list[list[dict]]:
    """`num` single-turn conversations from the standard library's docstrings (train split:
    modules outside the held-out tenth; eval split: only those)."""
    docs = [d for d in stdlib_docs() if held_out(d[0]) == (split == "eval")]
    if not docs:
        raise RuntimeError("no documented standard-library modules found")
    templates = training_requests()["docstring_requests"]
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(docs), size=min(num, len(docs)), replace=False)
    convs = []
    for i in picks:
        module, name, doc = docs[i]
        template = templates[int(rng.integers(len(templates)))]
        convs.append([{"role": "user", "content": template.format(module=module, name=name, doc=doc)}])
    return convs


def chat_topics() -> list[str]:
    """The topics of every kind of general chat request, in file order."""
    return [x for kind in training_requests()["chat_requests"] for x in kind["topics"]]


def chat_requests() -> list[str]:
    """Every general chat request the lists make, in a fixed order: each kind's templates
    crossed with its topics, the counts taken in turn."""
    lists = training_requests()
    counts = lists["chat_counts"]
    out = []
    for i, kind in enumerate(lists["chat_requests"]):
        for j, (t, x) in enumerate(itertools.product(kind["templates"], kind["topics"])):
            out.append(t.format(x=x, n=counts[(i + j) % len(counts)]))
    return out


def _spaced_words(text: str) -> str:
    return " " + " ".join(re.findall(r"[a-z0-9']+", text.lower())) + " "


def check_disjoint(eval_texts: list[str]) -> None:
    """Raises ValueError if a chat topic occurs in, or a chat request equals, an evaluation prompt."""
    evals = [_spaced_words(t) for t in eval_texts]
    for x in chat_topics():
        w = _spaced_words(x)
        hit = next((e for e in evals if w in e), None)
        if hit is not None:
            raise ValueError(f"training topic {x!r} occurs in the evaluation prompt {hit.strip()!r}")
    requests = {_spaced_words(r) for r in chat_requests()}
    for e in evals:
        if e in requests:
            raise ValueError(f"evaluation prompt {e.strip()!r} is also a training request")


def chat_prompts(num: int, *, seed: int) -> list[list[dict]]:
    """`num` single-turn conversations drawn without replacement from `chat_requests()`."""
    requests = chat_requests()
    if num > len(requests):
        raise ValueError(f"only {len(requests)} distinct chat requests, {num} asked")
    picks = np.random.default_rng(seed).choice(len(requests), size=num, replace=False)
    return [[{"role": "user", "content": requests[i]}] for i in picks]


# A line with its end, as the parser counts lines (form feeds do not end one).
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$")


def _source_segment(lines: list[str], node: ast.AST) -> str | None:
    """`ast.get_source_segment(source, node)` from the source's `lines`, split once per module
    (the ast function splits the whole source again for every node)."""
    if getattr(node, "end_lineno", None) is None or getattr(node, "end_col_offset", None) is None:
        return None
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:  # column offsets count UTF-8 bytes
        return lines[first].encode()[node.col_offset : node.end_col_offset].decode()
    head = lines[first].encode()[node.col_offset :].decode()
    tail = lines[last].encode()[: node.end_col_offset].decode()
    return head + "".join(lines[first + 1 : last]) + tail


@functools.lru_cache(maxsize=1)
def documented_definitions() -> tuple[tuple[str, str, str, str], ...]:
    """(module, name, docstring, source) of the public functions and classes with a docstring of
    60 characters or more in the standard library's training split, in a fixed order."""
    items = []
    for module, source, tree in stdlib_sources():
        if held_out(module):
            continue
        lines = _LINE.findall(source)
        for node in public_definitions(tree):
            doc = ast.get_docstring(node)
            code = _source_segment(lines, node)
            if doc and len(doc) >= 60 and code:
                items.append((module, node.name, doc.strip(), code))
    if not items:
        raise RuntimeError("no documented standard-library functions found")
    return tuple(items)


def document_conversations(num: int, *, seed: int, max_chars: int = 2400) -> list[tuple[list[dict], str]]:
    """`num` (conversation, answer) pairs whose answer is existing text: the full docstring of a
    public function or class of the standard library (training split), then its source in a
    Python code block, cut to `max_chars`. Read with `ast` from the interpreter's sources, in a
    fixed order, then sampled with `seed`."""
    items = documented_definitions()
    templates = training_requests()["source_requests"]
    rng = np.random.default_rng([seed, 3])
    picks = rng.choice(len(items), size=min(num, len(items)), replace=False)
    out = []
    for i in picks:
        module, name, doc, code = items[i]
        question = templates[int(rng.integers(len(templates)))].format(module=module, name=name)
        answer = f"{doc}\n\n```python\n{code}\n```"[:max_chars]
        out.append(([{"role": "user", "content": question}], answer))
    return out


def _word_set(text: str) -> frozenset[str]:
    return frozenset(re.findall(r"[a-z0-9']+", text.lower()))


def keep_self_prompt(text: str, seen: set[frozenset[str]], held_out: list[frozenset[str]]) -> bool:
    """Whether a sampled request is usable: 4-80 words, no chat-template markup, not a repeat
    of one already kept (same word set), and not a near-copy of a held-out evaluation prompt
    (word-set Jaccard similarity 0.5 or more, or containing all of its words)."""
    words = _word_set(text)
    if not 4 <= len(text.split()) <= 80 or "<|" in text or words in seen:
        return False
    for h in held_out:
        if h <= words or len(words & h) >= 0.5 * len(words | h):
            return False
    return True


def self_prompts(llm, num: int, *, seed: int, held_out_texts: list[str], batch: int = 32) -> list[list[dict]]:
    """`num` single-turn requests written by the target itself, for training data.

    Sampling from where the chat template starts a user message's content (`user_turn_prefix`;
    temperature 1, top-p 0.95, one seed per request) makes the instruction-tuned target write a
    user's request, ended by its end-of-turn token.
    Requests cut off by the length limit, repeats and near-copies of `held_out_texts` are
    dropped (`keep_self_prompt`). Deterministic for a given seed and machine."""
    from aither_jax.device.sampling import SamplingParams

    prefix = user_turn_prefix(llm.tokenizer)
    if prefix is None:
        raise RuntimeError("the chat template does not render the user message verbatim; cannot sample requests")
    held_out = [_word_set(t) for t in held_out_texts]
    seen: set[frozenset[str]] = set()
    out: list[list[dict]] = []
    tried = 0
    with tqdm(total=num, desc="self-written prompts", leave=False) as bar:
        while len(out) < num:
            if tried >= 20 * num + 10 * batch:
                raise RuntimeError(
                    f"only {len(out)} usable requests from {tried} samples; the target rarely writes one"
                )
            params = [
                SamplingParams(max_tokens=96, temperature=1.0, top_p=0.95, seed=(seed * 1_000_003 + tried + i) % 2**32)
                for i in range(batch)
            ]
            tried += batch
            for o in llm.generate([prefix] * batch, params, use_tqdm=False):
                text = o.text.strip()
                if o.finish_reason == "stop" and keep_self_prompt(text, seen, held_out) and len(out) < num:
                    seen.add(_word_set(text))
                    out.append([{"role": "user", "content": text}])
                    bar.update(1)
    log.info("%d self-written requests kept of %d sampled", len(out), tried)
    return out


def read_prompt_texts(path: pathlib.Path) -> list[str]:
    """The last user message of each `{"messages": [...]}` or `{"prompt": ...}` JSON line."""
    texts = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            texts.append(row["prompt"] if "prompt" in row else row["messages"][-1]["content"])
    return texts
