"""Chat templates by architecture, for GGUF files that ship none (as llama.cpp picks a template
by architecture). The server's `--chat-template` and `Tokenizer.set_chat_template` override.

Gemma 3 has two roles, `user` and `model`; its published template writes leading system
messages at the start of the first user turn. This one does the same, but opens that turn with
the system text alone (`<start_of_turn>user\\n` + system + a blank line) so that a conversation's
rendering starts with the rendering of its system messages: the system pages can be pinned and
tagged, and each message's rendering extends the one before (context/prompt.py `role_spans`).
Tool results are user turns. Content is trimmed, as in the published template.
"""

from __future__ import annotations

import dataclasses

_GEMMA = (
    "{%- set ns = namespace(open=false, leading=true) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' and ns.leading -%}"
    "{%- if not ns.open -%}{{ '<start_of_turn>user\\n' }}{%- set ns.open = true -%}{%- endif -%}"
    "{{ m['content'] | trim }}{{ '\\n\\n' }}"
    "{%- else -%}"
    "{%- set ns.leading = false -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else 'user' -%}"
    "{%- if ns.open and role == 'user' -%}{%- set ns.open = false -%}"
    "{%- else -%}"
    "{%- if ns.open -%}{{ '<end_of_turn>\\n' }}{%- set ns.open = false -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{%- endif -%}"
    "{{ m['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{%- if ns.open -%}{{ '<end_of_turn>\\n' }}{%- endif -%}"
    "{{ '<start_of_turn>model\\n' }}"
    "{%- endif -%}"
)


@dataclasses.dataclass(frozen=True)
class FamilyTemplate:
    source: str  # jinja2, rendered in the tokenizer's sandbox
    stop_tokens: tuple[str, ...]  # tokens that end a turn: generation stops on them


FAMILY_TEMPLATES = {"gemma3": FamilyTemplate(_GEMMA, ("<end_of_turn>",))}
