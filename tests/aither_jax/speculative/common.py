"""What the speculative engine tests share: prompts, settings, the chain-of-drafts config."""

import aither_jax as aj

PROMPTS = [
    "Write a haiku about the sea.",
    "What is the difference between a list and a tuple in Python?",
    "Give me three tips for a job interview.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Count from 1 to 15, separated by commas.",
    "Explain photosynthesis to a ten-year-old.",
    "Write a Python function that reverses a string.",
    "What are the planets of the solar system?",
]
GREEDY = aj.SamplingParams(max_tokens=40, temperature=0.0)
COMMON = dict(dtype="float32", max_model_len=512, progress=False)
MAX_GAP = 0.5  # nats between the target's best token and a speculative token (TurboQuant caches)
CHAIN = {"method": "dflash", "tree": 0}  # a chain of 15 drafts on every backend (CPU's default is a tree)
