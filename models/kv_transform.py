"""Query-aware key transforms for quantized KV formats (the `-pc` modifier of `--kv-cache-dtype`).

Attention only needs the scores q . k, so keys may be stored in any invertible linear image
k' = M k as long as queries are mapped by the inverse transpose, q' = M^-T q: q' . k' = q . k
exactly. The image matters for quantization. TurboQuant's error on a stored vector is
isotropic with energy proportional to |k'|^2, so the error of a score is about
|q'|^2 |k'|^2 / d. Over the data that is E|M k|^2 E|M^-T q|^2 = tr(M A M^T) tr(M^-T B M^-1) for
the key and query covariances A and B, which is smallest (Cauchy-Schwarz) when M^T M is the
matrix geometric mean of A^-1 and B:

    M^T M = A^-1 # B = A^-1/2 (A^1/2 B A^1/2)^1/2 A^-1/2.

M is fitted per layer and KV head on calibration text (post-RoPE keys, and the queries of the
heads that share the KV head) and shipped as data of the format. On SmolLM2-135M it predicts
about a third of the identity's score error, and measures half the KL divergence at 4-bit
keys (docs/BENCHMARKS.md). RoPE mixes positions into the keys, so M cannot be folded into the
weights: the model applies it after RoPE, two d x d products per token and head.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np

TRANSFORM_DIR = pathlib.Path(__file__).resolve().parent / "assets" / "kv_transforms"


def _sym_power(m: np.ndarray, p: float) -> np.ndarray:
    w, u = np.linalg.eigh(m)
    return (u * np.maximum(w, 1e-12) ** p) @ u.T


def key_transform(key_cov: np.ndarray, query_cov: np.ndarray) -> np.ndarray:
    """The symmetric M [d, d] with M^T M = A^-1 # B for key covariance A and query covariance B,
    scaled to determinant 1 (only its shape matters: norms are stored per vector)."""
    d = key_cov.shape[0]
    ridge = 1e-6 * np.trace(key_cov) / d
    a = key_cov.astype(np.float64) + ridge * np.eye(d)
    b = query_cov.astype(np.float64) + 1e-6 * np.trace(query_cov) / d * np.eye(d)
    a_half, a_inv_half = _sym_power(a, 0.5), _sym_power(a, -0.5)
    mean = a_inv_half @ _sym_power(a_half @ b @ a_half, 0.5) @ a_inv_half
    m = _sym_power((mean + mean.T) / 2, 0.5)
    sign, logdet = np.linalg.slogdet(m)
    return m / np.exp(logdet / d)


def score_error_ratio(m: np.ndarray, key_cov: np.ndarray, query_cov: np.ndarray) -> float:
    """Predicted score-error energy with keys stored as M k, relative to storing k itself."""
    m_inv = np.linalg.inv(m)
    with_m = np.trace(m @ key_cov @ m.T) * np.trace(m_inv.T @ query_cov @ m_inv)
    return float(with_m / (np.trace(key_cov) * np.trace(query_cov)))


def _covariances(queries: np.ndarray, keys: np.ndarray, group: int):
    """Yields (layer, KV head, key covariance, query covariance) in float64."""
    num_layers, _, hkv, d = keys.shape
    for layer in range(num_layers):
        for h in range(hkv):
            kk = keys[layer, :, h].astype(np.float64)
            qq = queries[layer, :, h * group : (h + 1) * group].reshape(-1, d).astype(np.float64)
            yield layer, h, kk.T @ kk / len(kk), qq.T @ qq / len(qq)


def fit_key_transforms(queries: np.ndarray, keys: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Post-RoPE queries [L, T, Hq, d] and keys [L, T, Hkv, d] -> (M [L, Hkv, d, d] float32, the
    predicted score-error ratio [L, Hkv] on the same data)."""
    num_layers, _, hkv, d = keys.shape
    m = np.zeros((num_layers, hkv, d, d), np.float32)
    ratios = np.zeros((num_layers, hkv))
    for layer, h, key_cov, query_cov in _covariances(queries, keys, group):
        m[layer, h] = key_transform(key_cov, query_cov)
        ratios[layer, h] = score_error_ratio(m[layer, h].astype(np.float64), key_cov, query_cov)
    return m, ratios


def transform_path(model: str | os.PathLike) -> pathlib.Path:
    return TRANSFORM_DIR / f"{os.fspath(model)}.npz"


def load_key_transforms(model: str | os.PathLike, num_layers: int, num_kv_heads: int, head_dim: int) -> np.ndarray:
    """The M [L, Hkv, d, d] (float32) shipped for a registered model, or read from an .npz path.

    Raises:
        ValueError: no transform was fitted for this model, or it has the wrong shape.
    """
    path = pathlib.Path(model) if os.fspath(model).endswith(".npz") else transform_path(model)
    if not path.is_file():
        known = sorted(p.stem for p in TRANSFORM_DIR.glob("*.npz"))
        raise ValueError(
            f"the -pc KV formats need a key transform fitted for the model; {os.fspath(model)!r} has none "
            f"(fitted: {known}; fit one with `python -m aither_jax.eval fit-key-transform --install`)"
        )
    with np.load(path) as f:
        m = f["key_transform"].astype(np.float32)
    if m.shape != (num_layers, num_kv_heads, head_dim, head_dim):
        raise ValueError(
            f"{path} holds a key transform of shape {m.shape}, the model needs "
            f"{(num_layers, num_kv_heads, head_dim, head_dim)}"
        )
    return m
