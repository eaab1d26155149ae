"""What the host learns about KV pages as sequences fill them, for their block records and the
eviction advisor's graph: the tag and importance of the prompt span (or the model's answer)
on each page, the pages of retrieved memories and the request that read them, and the
attention mass each step put on each page."""

from __future__ import annotations

import numpy as np

from aither_jax.context.prompt import ROLE_IMPORTANCE, SectionSpan
from aither_jax.core.sequence import Sequence
from aither_jax.eviction.graph import EdgeType
from aither_jax.kv.blocks import BlockTable

# Sections whose pages came from a retrieved memory (MEMORY_REF edges to the request's page).
MEMORY_TAGS = frozenset({"memory", "memories", "retrieved", "retrieval"})


def page_span(seq: Sequence, i: int, page_size: int) -> SectionSpan | None:
    """The span that gives `seq`'s page i (tokens [i P, (i + 1) P)) its tag and importance:
    the prompt's tagged sections are followed by the model's own tokens (the generation
    prompt and the answer), tagged `assistant`. A page that spans several (a system
    message's last tokens and the user's first) takes the least important of them: it is as
    evictable as its least important part, and it belongs to one conversation, so it must
    not count as the shared system prompt it starts with (the protected share of the pool
    would fill with every conversation's first page). None for an untagged prompt page."""
    answer = max((s.stop for s in seq.sections), default=len(seq.prompt_ids))
    spans_all = (*seq.sections, SectionSpan("assistant", ROLE_IMPORTANCE["assistant"], answer, 1 << 62))
    lo, hi = i * page_size, (i + 1) * page_size  # the whole page: what fills it later is known
    spans = [s for s in spans_all if s.start < hi and s.stop > lo]
    return min(spans, key=lambda s: s.importance) if spans else None


def tag_pages(blocks: BlockTable, seq: Sequence, start: int, stop: int, page_size: int) -> None:
    """Block records of `seq`'s device pages holding tokens [start, stop): the tag and
    importance of `page_span`."""
    for i in range(start // page_size, -(-stop // page_size)):
        best = page_span(seq, i, page_size)
        page = None if best is None else seq.page_at(i)
        if page is not None:
            block = blocks[page]
            if block.importance is None or best.importance > block.importance:
                block.source_tag, block.importance = best.tag, best.importance


def link_memories(graph, seq: Sequence, page_size: int) -> None:
    """MEMORY_REF: the pages of the prompt's retrieved-memory sections and the prompt's last
    full page (the request that read them), once the prompt is computed."""
    spans = [s for s in seq.sections if s.tag in MEMORY_TAGS]
    if not spans or not seq.names:
        return
    reader = seq.names[min(len(seq.prompt_ids) // page_size, len(seq.names)) - 1]
    for span in spans:
        for i in range(span.start // page_size, min(-(-span.stop // page_size), len(seq.names))):
            graph.add(seq.names[i], reader, EdgeType.MEMORY_REF)


def attended(policy, blocks: BlockTable, rows, mass) -> None:
    """Hands the eviction policy each row's page records and attention mass per page held
    (`mass`: [rows, pages read], `models.llama.forward`'s `mass_layers`), as Python floats."""
    per_row = []
    for (seq, _), row in zip(rows, np.asarray(mass), strict=False):
        if seq.slot >= 0:
            records = [blocks[p] for p in seq.pages]
            per_row.append((records, row[: len(records)].tolist()))
    policy.attended(per_row)
