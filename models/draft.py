"""The DFlash draft: a few bidirectional transformer layers that fill a block of masked tokens.

The draft predicts a block of `block_size` tokens in one forward pass. The block starts with
the last committed token (its embedding) followed by mask positions; the output at masked
position i is the draft's guess for the token at that position. It is conditioned on the
target model: hidden states tapped after a few target layers (spread over depth) are
concatenated, projected to the draft's width and normalized ("context features"), and every
draft layer projects them into extra keys and values that the block attends to (KV
injection). Attention is non-causal within the block and sees the whole context before it.

The draft has the target's width and reuses the target's token embedding and LM head, so
only the layers, the projection and a learned mask embedding are trained and shipped.

Parameters are a plain dict pytree (optax and orbax take it as is); layer weights are stacked
on a leading axis. Attention is a callback so the same block pass serves training (context
in a dense array) and serving (context in pages, `pallas_kernels.draft_attention`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.llama import apply_rope, rms_norm, rope_tables
from pallas_kernels.paged_attention import dot_precision

MASK = -1  # token id that marks a masked block position
DraftParams = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """Everything that fixes the draft's shapes and behaviour; stored beside the checkpoint."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_layers: tuple[int, ...]  # target layers whose output hidden states feed the draft
    target_num_layers: int
    block_size: int = 16
    rope_base: float = 10000.0
    rms_norm_eps: float = 1e-5
    # Drafts come from this many token ids (a list stored beside the weights); 0 = the whole
    # vocabulary. The LM head over a frequent-token subset is most of the draft's compute.
    draft_vocab_size: int = 0

    def __post_init__(self):
        object.__setattr__(self, "target_layers", tuple(int(i) for i in self.target_layers))
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"draft config: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("draft config: num_heads must be a multiple of num_kv_heads")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft config: draft_vocab_size must be in [0, {self.vocab_size}]")
        if not 2 <= self.block_size <= 64:
            raise ValueError(f"draft config: block_size must be in [2, 64], got {self.block_size}")
        if not self.target_layers or any(not 0 <= i < self.target_num_layers for i in self.target_layers):
            raise ValueError(
                f"draft config: target_layers {self.target_layers} must be non-empty and within "
                f"[0, {self.target_num_layers})"
            )

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        *,
        num_layers: int = 2,
        intermediate_size: int = 1024,
        num_taps: int = 3,
        block_size: int = 16,
        draft_vocab_size: int = 0,
    ) -> DraftConfig:
        """A draft with the target's width and attention shape, tapping `num_taps` layers
        spread from the second to the third-last."""
        last = max(1, target.num_layers - 3)
        taps = sorted({round(1 + (last - 1) * i / max(1, num_taps - 1)) for i in range(num_taps)})
        return cls(
            vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            num_layers=num_layers,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            intermediate_size=intermediate_size,
            target_layers=tuple(taps),
            target_num_layers=target.num_layers,
            block_size=block_size,
            rope_base=target.rope_base,
            rms_norm_eps=target.rms_norm_eps,
            draft_vocab_size=draft_vocab_size,
        )

    def check_target(self, target: ModelConfig) -> None:
        """Raises ValueError if this draft cannot run beside `target`."""
        mine = (self.vocab_size, self.hidden_size, self.target_num_layers)
        theirs = (target.vocab_size, target.hidden_size, target.num_layers)
        if mine != theirs:
            raise ValueError(
                f"the draft was made for a target with (vocab, width, layers) = {mine}, this model has {theirs}"
            )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DraftConfig:
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"draft config: unknown fields {sorted(unknown)}")
        return cls(**data)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        shapes = jax.tree.leaves(param_shapes(self), is_leaf=lambda s: isinstance(s, tuple))
        return sum(int(np.prod(s)) for s in shapes)


def param_shapes(cfg: DraftConfig) -> DraftParams:
    d, n, i = cfg.hidden_size, cfg.num_layers, cfg.intermediate_size
    return {
        "fc": (len(cfg.target_layers) * d, d),
        "fc_norm": (d,),
        "mask_embed": (d,),
        "final_norm": (d,),
        "layers": {
            "attn_norm": (n, d),
            "wq": (n, d, cfg.q_size),
            "wk": (n, d, cfg.kv_size),
            "wv": (n, d, cfg.kv_size),
            "wo": (n, cfg.q_size, d),
            "mlp_norm": (n, d),
            "w_gate": (n, d, i),
            "w_up": (n, d, i),
            "w_down": (n, i, d),
        },
    }


def init_params(cfg: DraftConfig, key: jax.Array, *, final_norm: jax.Array | None = None) -> DraftParams:
    """Random float32 parameters: norms at one (the final norm copies the target's when
    given), matrices scaled by 1/sqrt(fan_in), residual outputs scaled down by depth."""
    shapes = param_shapes(cfg)
    flat, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(key, len(flat))
    leaves = []
    for (path, shape), k in zip(flat, keys, strict=True):
        name = path[-1].key
        if name.endswith("norm"):
            leaves.append(jnp.ones(shape, jnp.float32))
        elif name == "mask_embed":
            leaves.append(0.02 * jax.random.normal(k, shape, jnp.float32))
        else:
            scale = 1.0 / math.sqrt(shape[-2])
            if name in ("wo", "w_down"):
                scale /= math.sqrt(2 * cfg.num_layers)
            leaves.append(scale * jax.random.normal(k, shape, jnp.float32))
    params = jax.tree.unflatten(treedef, leaves)
    if final_norm is not None:
        params["final_norm"] = jnp.asarray(final_norm, jnp.float32)
    return params


def copy_target_layers(params: DraftParams, cfg: DraftConfig, target_layers: Sequence[Any]) -> DraftParams:
    """Starts the draft from target blocks instead of noise: draft layer j gets the weights of
    `target_layers[j]` (a `models.weights.LayerWeights`), and the feature projection starts
    as the identity on the deepest tap, normed with the first copied block's attention norm,
    so the first layer's context keys and values start equal to that block's own over the
    context when it follows the deepest tap. The draft needs the target's block shapes
    (its `intermediate_size` included)."""
    if len(target_layers) != cfg.num_layers:
        raise ValueError(f"copy_target_layers: {len(target_layers)} target layers for {cfg.num_layers} draft layers")
    d, f = cfg.hidden_size, cfg.intermediate_size
    wanted = {
        "wqkv": (cfg.q_size + 2 * cfg.kv_size, d),
        "wo": (d, cfg.q_size),
        "w_gate_up": (2 * f, d),
        "w_down": (d, f),
    }
    for lw in target_layers:
        for name, shape in wanted.items():
            if tuple(getattr(lw, name).shape) != shape:
                raise ValueError(
                    f"copy_target_layers: target {name} has shape {tuple(getattr(lw, name).shape)}, the draft "
                    f"needs {shape} (same heads, head_dim and intermediate size as the target)"
                )

    def stack(fn) -> jax.Array:
        return jnp.stack([jnp.asarray(fn(lw), jnp.float32) for lw in target_layers])

    q, kv = cfg.q_size, cfg.kv_size
    layers = {
        "attn_norm": stack(lambda lw: lw.attn_norm),
        "wq": stack(lambda lw: lw.wqkv[:q].T),
        "wk": stack(lambda lw: lw.wqkv[q : q + kv].T),
        "wv": stack(lambda lw: lw.wqkv[q + kv :].T),
        "wo": stack(lambda lw: lw.wo.T),
        "mlp_norm": stack(lambda lw: lw.mlp_norm),
        "w_gate": stack(lambda lw: lw.w_gate_up[:f].T),
        "w_up": stack(lambda lw: lw.w_gate_up[f:].T),
        "w_down": stack(lambda lw: lw.w_down.T),
    }
    taps = len(cfg.target_layers)
    fc = jnp.zeros((taps * d, d), jnp.float32).at[(taps - 1) * d :].set(jnp.eye(d, dtype=jnp.float32))
    return params | {"layers": layers, "fc": fc, "fc_norm": layers["attn_norm"][0]}


def cast_params(params: DraftParams, dtype) -> DraftParams:
    return jax.tree.map(lambda x: x.astype(dtype), params)


def _mm(x: jax.Array, w: jax.Array) -> jax.Array:
    out = jnp.matmul(x, w.astype(x.dtype), precision=dot_precision(x.dtype), preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def context_features(params: DraftParams, cfg: DraftConfig, taps: jax.Array) -> jax.Array:
    """[..., len(target_layers) * D] tapped target hidden states -> [..., D] context features."""
    return rms_norm(_mm(taps, params["fc"]), params["fc_norm"].astype(jnp.float32), cfg.rms_norm_eps)


def context_kv(
    params: DraftParams, cfg: DraftConfig, feats: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Each draft layer's keys and values of the context features.

    feats [B, S, D], positions [B, S] -> k, v [L, B, S, Hkv, Dh] (keys RoPE'd at `positions`).
    """
    b, s, _ = feats.shape
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_base)
    ks, vs = [], []
    for i in range(cfg.num_layers):
        k = _mm(feats, params["layers"]["wk"][i]).reshape(b, s, cfg.num_kv_heads, cfg.head_dim)
        ks.append(apply_rope(k, cos, sin))
        vs.append(_mm(feats, params["layers"]["wv"][i]).reshape(b, s, cfg.num_kv_heads, cfg.head_dim))
    return jnp.stack(ks), jnp.stack(vs)


Attend = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


def block_forward(
    params: DraftParams,
    cfg: DraftConfig,
    embed: jax.Array,  # [V, D] the target's token embedding
    tokens: jax.Array,  # [R, T] int32, MASK for masked positions
    positions: jax.Array,  # [R, T] int32
    attend: Attend,
) -> jax.Array:
    """Runs a block through the draft layers; returns the final-normed hidden states [R, T, D].

    `attend(layer, q, k, v)` gets the block's queries [R, T, Hq, Dh] and keys/values
    [R, T, Hkv, Dh] (RoPE applied) and returns the attention output [R, T, Hq, Dh] over the
    layer's context keys/values plus the block (non-causal).
    """
    r, t = tokens.shape
    dtype = embed.dtype
    x = jnp.where((tokens >= 0)[..., None], embed[jnp.maximum(tokens, 0)], params["mask_embed"].astype(dtype))
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_base)
    lw = params["layers"]
    for i in range(cfg.num_layers):
        h = rms_norm(x, lw["attn_norm"][i].astype(jnp.float32), cfg.rms_norm_eps)
        q = apply_rope(_mm(h, lw["wq"][i]).reshape(r, t, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(_mm(h, lw["wk"][i]).reshape(r, t, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = _mm(h, lw["wv"][i]).reshape(r, t, cfg.num_kv_heads, cfg.head_dim)
        x = x + _mm(attend(i, q, k, v).reshape(r, t, cfg.q_size), lw["wo"][i])
        h = rms_norm(x, lw["mlp_norm"][i].astype(jnp.float32), cfg.rms_norm_eps)
        x = x + _mm(jax.nn.silu(_mm(h, lw["w_gate"][i])) * _mm(h, lw["w_up"][i]), lw["w_down"][i])
    return rms_norm(x, params["final_norm"].astype(jnp.float32), cfg.rms_norm_eps)


def unmask_schedule(num_masked: int, steps: int) -> tuple[int, ...]:
    """How many masked positions each denoising step reveals: a cosine schedule, most first.

    Step s (1..S) gets a share proportional to cos(pi * s / (2 (S + 1))), rounded by largest
    remainder so the counts sum to `num_masked`: 16 masks in 4 steps -> (6, 5, 3, 2).
    """
    if not 1 <= steps <= num_masked:
        raise ValueError(f"steps must be in [1, {num_masked}], got {steps}")
    weights = np.cos(np.pi * np.arange(1, steps + 1) / (2 * (steps + 1)))
    exact = weights / weights.sum() * num_masked
    counts = np.floor(exact).astype(int)
    for j in np.argsort(-(exact - counts), kind="stable")[: num_masked - counts.sum()]:
        counts[j] += 1
    counts = np.maximum(counts, 1)  # every step reveals something
    while counts.sum() > num_masked:  # only when many steps share few masks
        counts[np.argmax(counts)] -= 1
    return tuple(sorted((int(c) for c in counts), reverse=True))
