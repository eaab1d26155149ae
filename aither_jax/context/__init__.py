"""The context pipeline: what a request asks for -> the token ids the engine runs.

`prompt.py` assembles a prompt: a conversation through the model's chat template, or a
completion's text or token ids, encoded, with the span of leading tokens to pin in the prefix
cache. It sits on `models/` only, so every caller (the server's routes, `aj.LLM`, evaluation,
draft training) shares it.
"""
