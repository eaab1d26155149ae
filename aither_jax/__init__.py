"""aither-jax: LLM inference in JAX on a paged KV cache.

import aither_jax as aj
llm = aj.LLM("smollm2-135m")
out = llm.generate(["Once upon a time"], aj.SamplingParams(max_tokens=32, temperature=0.0))[0]
"""

from aither_jax.device.sampling import SamplingParams
from aither_jax.fleet.fleet import Fleet
from aither_jax.llm import LLM, RequestOutput
from models.registry import MODELS, resolve_model

__all__ = ["LLM", "MODELS", "Fleet", "RequestOutput", "SamplingParams", "resolve_model"]
__version__ = "0.1.0"
