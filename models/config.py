"""Model configuration: a frozen, hashable dataclass read from GGUF metadata (static under jit)."""

from __future__ import annotations

import dataclasses
from typing import Any

from models.gguf_file import GGUFError, GGUFFile

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")
# The tensors each block stores, as `blk.{i}.{name}.weight` (models.weights loads them). A file
# must hold this many tensors per layer it declares, which bounds `block_count` before anything
# is built per layer.
LAYER_TENSORS = {
    "llama": ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"),
    # Gemma 3 adds per-head query/key norms and norms after attention and after the MLP.
    "gemma3": (
        "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
        "attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm",
    ),
}  # fmt: skip
# Gemma 3 facts its GGUF files leave out (llama.cpp and transformers assume the same values):
# every sixth layer attends globally, the others over a sliding window with their own RoPE base.
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# Far above any model we load; `LLM()` sizes its block table from the context length by default.
MAX_CONTEXT = 1 << 24


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer.

    Fields beyond the llama set (sliding windows, norm offsets, embedding scale) are where a
    second architecture such as Gemma 3 plugs in; llama leaves them at their defaults.
    """

    arch: str
    num_layers: int
    hidden_size: int
    ffn_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    rms_norm_eps: float = 1e-5
    rope_base: float = 10000.0
    tie_embeddings: bool = True
    name: str = ""
    # Gemma 3. Layers in `window_layers` attend only to the last `sliding_window` positions
    # (themselves included) and rotate with `local_rope_base`; the rest attend to everything.
    sliding_window: int = 0
    window_layers: tuple[int, ...] = ()
    local_rope_base: float = 10000.0
    embed_scale: float = 1.0  # token embeddings are multiplied by this (sqrt(hidden) in Gemma)
    qk_norm: bool = False  # per-head RMSNorm of queries and keys before RoPE
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs before each residual add
    activation: str = "silu"  # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    def window(self, layer: int) -> int | None:
        """The sliding window of one layer, or None where it attends to every position."""
        return self.sliding_window if layer in self.window_layers else None

    def layer_rope_base(self, layer: int) -> float:
        return self.local_rope_base if layer in self.window_layers else self.rope_base

    @property
    def rope_bases(self) -> tuple[float, ...]:
        """The distinct RoPE bases the layers use, global first."""
        return (self.rope_base, self.local_rope_base) if self.window_layers else (self.rope_base,)

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> ModelConfig:
        """Reads and validates the architecture fields of a GGUF file's metadata."""
        arch = gguf.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(
                f"{gguf.path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

        def field(key: str, kind: type, default: Any = None, most: int | None = None) -> Any:
            full = f"{arch}.{key}"
            value = gguf.get(full, default)
            if value is None:
                raise GGUFError(f"{gguf.path}: missing metadata {full!r}")
            if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise GGUFError(f"{gguf.path}: metadata {full!r} must be a positive integer, got {value!r}")
            if kind is float and (not isinstance(value, int | float) or not value > 0):
                raise GGUFError(f"{gguf.path}: metadata {full!r} must be a positive number, got {value!r}")
            if most is not None and value > most:
                raise GGUFError(f"{gguf.path}: metadata {full!r} must be at most {most}, got {value!r}")
            return kind(value)

        hidden = field("embedding_length", int)
        num_heads = field("attention.head_count", int)
        num_kv_heads = field("attention.head_count_kv", int, num_heads)
        head_dim = field("attention.key_length", int, hidden // num_heads if hidden % num_heads == 0 else None)
        tokens = gguf.get("tokenizer.ggml.tokens")
        vocab = field("vocab_size", int, len(tokens) if tokens is not None else None)
        if num_heads % num_kv_heads:
            raise GGUFError(f"{gguf.path}: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
        if head_dim % 2:
            raise GGUFError(f"{gguf.path}: head dimension {head_dim} must be even for rotary embeddings")
        num_layers = field("block_count", int)
        per_layer = len(LAYER_TENSORS[arch])
        if num_layers * per_layer > len(gguf.tensors):
            raise GGUFError(
                f"{gguf.path}: metadata '{arch}.block_count' is {num_layers}, but {num_layers} layers need "
                f"{num_layers * per_layer} tensors and the file has {len(gguf.tensors)}"
            )
        gemma: dict[str, Any] = {}
        if arch == "gemma3":
            window = field("attention.sliding_window", int, most=MAX_CONTEXT)
            gemma = dict(
                sliding_window=window,
                window_layers=tuple(i for i in range(num_layers) if (i + 1) % GEMMA3_GLOBAL_EVERY),
                local_rope_base=GEMMA3_LOCAL_ROPE_BASE,
                embed_scale=float(hidden) ** 0.5,
                qk_norm=True,
                post_norms=True,
                activation="gelu_tanh",
            )
        cfg = cls(
            arch=arch,
            num_layers=num_layers,
            hidden_size=hidden,
            ffn_size=field("feed_forward_length", int),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            max_context=field("context_length", int, most=MAX_CONTEXT),
            rms_norm_eps=field("attention.layer_norm_rms_epsilon", float, 1e-5),
            rope_base=field("rope.freq_base", float, 10000.0),
            tie_embeddings="output.weight" not in gguf.tensors,
            name=str(gguf.get("general.name", "")),
            **gemma,
        )
        return cfg
