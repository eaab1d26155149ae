"""How to speculate: `SpeculativeConfig`, in vLLM's `--speculative-config` vocabulary (the drafts
shipped with the package are in models/assets/drafts, `models.registry.shipped_draft`)."""

from __future__ import annotations

import dataclasses
import json

import jax

METHODS = ("dflash", "ngram")
CPU_TREE = 3  # drafted nodes of a default dflash config on CPU (SpeculativeConfig.tree)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How to speculate, in vLLM's `--speculative-config` vocabulary.

    Args:
        method: "dflash" (block-diffusion draft) or "ngram" (prompt lookup).
        num_speculative_tokens: drafts per step (dflash: at most block_size - 1, the default;
            ngram: default 8).
        model: the dflash draft file (.npz); default: the draft shipped for the target.
        steps: dflash denoising steps (1 = one forward pass; more unmask the most confident
            positions first on a cosine schedule).
        prompt_lookup: dflash only, on by default: a row whose context has an n-gram match
            (prompt lookup, below) takes the lookup's drafts for that step, the others the
            draft model's. The two are right in different places: lookup where the text
            repeats earlier text (code, lists, names), the draft elsewhere. The draft model is
            not run in a step where every row has a match. False: the draft model alone.
        prompt_lookup_min, prompt_lookup_max: n-gram lengths to match (longest first).
        tree: dflash only: draft a tree of this many nodes per row instead of a chain (the
            most probable paths under the draft's per-position distributions, `draft_tree`),
            verified in one target pass (`verify_tree`). 0: a chain. Needs steps = 1; not
            with adaptive. Prompt-lookup rows still verify their chain. None (the default):
            `CPU_TREE` nodes on CPU when steps, drafts per step and adaptive are left at
            their defaults, a chain otherwise. On CPU a verify pass costs in proportion to
            the tokens it carries, and a tree of 3 measured ~1.4x the speed of a chain of 15
            (docs/DFLASH.md, "The default on CPU"); a GPU verifies 16 tokens for about the
            price of one, and its default stays the chain until trees are timed there.
        draft_kernels: run the draft's attention and unmasking with the Pallas kernels
            (pallas_kernels/draft_attention.py, unmask.py) instead of their jnp twins. Off by
            default until the kernels have been checked on a GPU.
        adaptive: choose the drafts of each step (0, 1, 3, 7, .. up to
            num_speculative_tokens) from measured acceptance and step times
            (aither_jax/speculative/draft_length.py); the output does not change, only the
            speed.
    """

    method: str
    num_speculative_tokens: int | None = None
    model: str | None = None
    steps: int = 1
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_kernels: bool = False
    adaptive: bool = False
    prompt_lookup: bool | None = None  # None: on for dflash
    tree: int | None = None  # None: `CPU_TREE` on CPU for a default dflash config, else 0

    def __post_init__(self):
        if self.prompt_lookup is None:
            object.__setattr__(self, "prompt_lookup", self.method == "dflash")
        if self.tree is None:  # a tree only for a dflash config left at its defaults, on CPU
            chain_set = self.num_speculative_tokens is not None or self.steps != 1 or self.adaptive
            on_cpu = jax.default_backend() == "cpu"
            object.__setattr__(self, "tree", CPU_TREE if self.method == "dflash" and not chain_set and on_cpu else 0)
        for name in ("draft_kernels", "adaptive", "prompt_lookup"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if self.prompt_lookup and self.method != "dflash":
            raise ValueError(
                "prompt_lookup joins prompt lookup to a dflash draft; method 'ngram' is prompt lookup alone"
            )
        n = self.num_speculative_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 63):
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 63], got {n!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {self.steps!r}")
        if isinstance(self.tree, bool) or not isinstance(self.tree, int) or not 0 <= self.tree <= 63:
            raise ValueError(f"tree must be an integer in [0, 63] (drafted nodes; 0: a chain), got {self.tree!r}")
        if self.tree and (self.method != "dflash" or self.steps != 1 or self.adaptive):
            raise ValueError("tree drafts need method dflash with steps 1 and without adaptive")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 16):
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max <= 16, got {lo}, {hi}")

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """Accepts None, a method name, a dict or a JSON object string."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = value.strip()
            if value.startswith("{"):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ValueError(f"speculative config is not valid JSON: {e}") from e
            else:
                value = {"method": value}
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a method name or an object, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ValueError(f"speculative config needs a method, one of {METHODS}")
        return cls(**value)
