"""Model weights as pytrees, loaded from GGUF.

Each block keeps its own arrays (no per_layer [L, ...] leaves): under `lax.scan`, XLA's CPU
backend copies a layer's slice out of a per_layer weight before every matmul, doubling the
bytes a memory-bound decode step moves. Matrices are stored [out, in], as GGUF stores them;
models.llama.linear multiplies them from either side of the residual stream. The query/key/value
projections and the gate/up projections are fused into one matrix each, which halves the
number of matmul launches per layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from tqdm.auto import tqdm

from models.config import LAYER_TENSORS, ModelConfig
from models.gguf_file import GGUFError, GGUFFile

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@struct.dataclass
class LayerWeights:
    """One transformer block's weights."""

    attn_norm: jax.Array  # [D] float32
    # Projections are stored [out, in], as GGUF and HF store them (see models.llama.linear).
    wqkv: jax.Array  # [(Hq + 2 Hkv) Dh, D]
    wo: jax.Array  # [D, Hq Dh]
    mlp_norm: jax.Array  # [D] float32
    w_gate_up: jax.Array  # [2 F, D]
    w_down: jax.Array  # [D, F]
    # Gemma 3 only (None for llama), float32: per-head query/key norms [Dh] and the norms of
    # the attention and MLP outputs [D].
    q_norm: jax.Array | None = None
    k_norm: jax.Array | None = None
    post_attn_norm: jax.Array | None = None
    post_mlp_norm: jax.Array | None = None


@struct.dataclass
class ModelWeights:
    embed: jax.Array  # [V, D]
    layers: tuple[LayerWeights, ...]  # one pytree per block, in order
    final_norm: jax.Array  # [D] float32
    lm_head: jax.Array  # [V, D]; the embedding itself when the two are tied (see models.llama.vocab_logits)


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's row order for Q/K projections.

    llama GGUFs store each head's output rows interleaved (pairs (x0, x1), (x2, x3), ...) to
    suit pairwise RoPE; we apply RoPE in rotate-half form (first half, second half), so each
    head's rows go back to [evens..., odds...]. `w` is [out, in] in numpy order.
    """
    out, rest = w.shape[0], w.shape[1:]
    head_dim = out // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(out, *rest)


def required_tensors(cfg: ModelConfig) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"]
    names += [f"blk.{i}.{p}.weight" for i in range(cfg.num_layers) for p in LAYER_TENSORS[cfg.arch]]
    if not cfg.tie_embeddings:
        names.append("output.weight")
    return names


def check_tensor_shapes(gguf: GGUFFile, cfg: ModelConfig) -> None:
    """Every tensor the model needs is present with the shape the config implies."""
    missing = [n for n in required_tensors(cfg) if n not in gguf.tensors]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise GGUFError(f"{gguf.path}: missing tensors {missing[:5]}{more}")
    d, f, v = cfg.hidden_size, cfg.ffn_size, cfg.vocab_size
    expected = {
        "token_embd.weight": (v, d),
        "output_norm.weight": (d,),
        "output.weight": (v, d),
    }
    per_layer = {
        "attn_norm": (d,),
        "attn_q": (cfg.q_size, d),
        "attn_k": (cfg.kv_size, d),
        "attn_v": (cfg.kv_size, d),
        "attn_output": (d, cfg.q_size),
        "ffn_norm": (d,),
        "ffn_gate": (f, d),
        "ffn_up": (f, d),
        "ffn_down": (d, f),
        "attn_q_norm": (cfg.head_dim,),
        "attn_k_norm": (cfg.head_dim,),
        "post_attention_norm": (d,),
        "post_ffw_norm": (d,),
    }
    for i in range(cfg.num_layers):
        expected.update({f"blk.{i}.{k}.weight": s for k, s in per_layer.items()})
    for name, shape in expected.items():
        if name in gguf.tensors and gguf.tensors[name].shape != shape:
            raise GGUFError(f"{gguf.path}: tensor {name!r} has shape {gguf.tensors[name].shape}, expected {shape}")


def load_weights(gguf: GGUFFile, cfg: ModelConfig, dtype: str = "bfloat16", progress: bool = True) -> ModelWeights:
    """Dequantizes a llama or Gemma 3 GGUF into device arrays of `dtype`.

    Norm scales stay float32 (they are tiny and the norms run in float32). Gemma's norms
    scale by (1 + w); llama.cpp stores them with the 1 already added, so every norm here
    multiplies by its weight as stored.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_tensor_shapes(gguf, cfg)
    jdtype = DTYPES[dtype]
    bar = tqdm(total=len(required_tensors(cfg)), desc="loading weights", unit="tensor", disable=not progress)

    def get(name: str) -> np.ndarray:
        out = gguf.dequantize(name)
        bar.update(1)
        return out

    gemma_norms = {"q_norm": "attn_q_norm", "k_norm": "attn_k_norm"} if cfg.qk_norm else {}
    if cfg.post_norms:
        gemma_norms.update(post_attn_norm="post_attention_norm", post_mlp_norm="post_ffw_norm")
    keys = ("attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down", *gemma_norms)
    per_layer: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    # llama.cpp interleaves llama's query/key rows for pairwise RoPE; Gemma's it leaves in
    # rotate-half order.
    order = unpermute_rope_rows if cfg.arch == "llama" else (lambda w, heads: w)
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        q = order(get(p + "attn_q.weight"), cfg.num_heads)
        k = order(get(p + "attn_k.weight"), cfg.num_kv_heads)
        v = get(p + "attn_v.weight")
        for key, name in gemma_norms.items():
            per_layer[key].append(get(f"{p}{name}.weight"))
        per_layer["attn_norm"].append(get(p + "attn_norm.weight"))
        per_layer["wqkv"].append(np.concatenate([q, k, v], axis=0))
        per_layer["wo"].append(get(p + "attn_output.weight"))
        per_layer["mlp_norm"].append(get(p + "ffn_norm.weight"))
        per_layer["w_gate_up"].append(np.concatenate([get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")], axis=0))
        per_layer["w_down"].append(get(p + "ffn_down.weight"))

    def dev(x: np.ndarray, dt) -> jax.Array:
        return jnp.asarray(x, dtype=dt)

    norm_keys = ("attn_norm", "mlp_norm", *gemma_norms)
    layers = tuple(
        LayerWeights(**{k: dev(vs[i], jnp.float32 if k in norm_keys else jdtype) for k, vs in per_layer.items()})
        for i in range(cfg.num_layers)
    )
    embed = dev(get("token_embd.weight"), jdtype)
    final_norm = dev(get("output_norm.weight"), jnp.float32)
    lm_head = embed if cfg.tie_embeddings else dev(get("output.weight"), jdtype)
    bar.close()
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


def random_weights(cfg: ModelConfig, dtype: str = "float32", seed: int = 0) -> ModelWeights:
    """Weights drawn at random (projections scaled by 1/sqrt(fan-in), unit norms) in `cfg`'s
    shapes: a model whose outputs mean nothing but depend on every token of the context, for
    tests of the engine rather than of the model (llama and gemma3 architectures)."""
    if cfg.arch not in ("llama", "gemma3"):
        raise ValueError(f"random weights are made for the llama and gemma3 architectures, got {cfg.arch!r}")
    rng = np.random.default_rng(seed)
    jdtype = DTYPES[dtype]
    d, f, dh = cfg.hidden_size, cfg.ffn_size, cfg.head_dim

    def mat(out: int, fan_in: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal((out, fan_in), np.float32) / np.sqrt(fan_in), jdtype)

    ones = jnp.ones(d, jnp.float32)
    # Gemma 3's per-head query and key norms (x2 each) take the place of the 4x larger
    # projections below, which they would normalize away; its output norms are plain.
    head_norm = 2 * jnp.ones(dh, jnp.float32) if cfg.qk_norm else None
    post = ones if cfg.post_norms else None
    layers = tuple(
        LayerWeights(
            attn_norm=ones,
            # Queries and keys 4x larger: sharp attention, so every context token can matter.
            wqkv=jnp.concatenate([4 * mat((cfg.num_heads + cfg.num_kv_heads) * dh, d), mat(cfg.num_kv_heads * dh, d)]),
            wo=mat(d, cfg.num_heads * dh),
            mlp_norm=ones,
            w_gate_up=mat(2 * f, d),
            w_down=mat(d, f),
            q_norm=head_norm,
            k_norm=head_norm,
            post_attn_norm=post,
            post_mlp_norm=post,
        )
        for _ in range(cfg.num_layers)
    )
    embed = jnp.asarray(rng.standard_normal((cfg.vocab_size, d), np.float32), jdtype)
    # Its own head, even for a tied config: a tied one would make each token predict itself.
    return ModelWeights(embed=embed, layers=layers, final_norm=ones, lm_head=mat(cfg.vocab_size, d))
