"""Saving and loading a shipped draft: one .npz with float16 parameters, the frozen config and
how it was made. (Training checkpoints are orbax directories; this is the small artifact.)"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.draft import DraftConfig, DraftParams, param_shapes

CONFIG_KEY = "__config__"
META_KEY = "__meta__"
VOCAB_KEY = "__vocab__"


def _flat(tree) -> dict[str, Any]:
    flat, _ = jax.tree.flatten_with_path(tree, is_leaf=lambda s: isinstance(s, tuple))
    return {"/".join(p.key for p in path): leaf for path, leaf in flat}


def check_vocab(cfg: DraftConfig, vocab) -> np.ndarray | None:
    """The draft's token ids as int32 (None for the whole vocabulary); ValueError if they do
    not match the config (sorted, unique, in range, draft_vocab_size of them)."""
    if cfg.draft_vocab_size == 0:
        if vocab is not None:
            raise ValueError("the config drafts from the whole vocabulary but a token list was given")
        return None
    ids = np.asarray(vocab, np.int64) if vocab is not None else np.zeros(0, np.int64)
    if ids.shape != (cfg.draft_vocab_size,) or np.any(np.diff(ids) <= 0) or ids[0] < 0 or ids[-1] >= cfg.vocab_size:
        raise ValueError(
            f"the draft's token list must be {cfg.draft_vocab_size} sorted unique ids below {cfg.vocab_size}"
        )
    return ids.astype(np.int32)


def save_draft(
    path: str | os.PathLike, cfg: DraftConfig, params: DraftParams, meta: dict | None = None, vocab=None
) -> None:
    """Writes the draft atomically (a temporary file renamed into place)."""
    arrays = {k: np.asarray(v, np.float32).astype(np.float16) for k, v in _flat(params).items()}
    ids = check_vocab(cfg, vocab)
    if ids is not None:
        arrays[VOCAB_KEY] = ids
    arrays[CONFIG_KEY] = np.frombuffer(cfg.to_json().encode(), np.uint8)
    arrays[META_KEY] = np.frombuffer(json.dumps(meta or {}).encode(), np.uint8)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def load_draft(path: str | os.PathLike, dtype=jnp.float32) -> tuple[DraftConfig, DraftParams, dict, np.ndarray | None]:
    """Reads a draft written by `save_draft`: (config, parameters, metadata, token ids or None).
    ValueError on a missing, extra or misshapen tensor."""
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a draft file ({e})") from e
    with z:
        if CONFIG_KEY not in z.files:
            raise ValueError(f"{path}: not a draft file (no {CONFIG_KEY})")
        cfg = DraftConfig.from_json(z[CONFIG_KEY].tobytes().decode())
        meta = json.loads(z[META_KEY].tobytes().decode()) if META_KEY in z.files else {}
        shapes = _flat(param_shapes(cfg))
        vocab = check_vocab(cfg, z[VOCAB_KEY] if VOCAB_KEY in z.files else None)
        names = set(z.files) - {CONFIG_KEY, META_KEY, VOCAB_KEY}
        if names != set(shapes):
            raise ValueError(f"{path}: tensors {sorted(names ^ set(shapes))} missing or unexpected")
        leaves = {}
        for name, shape in shapes.items():
            if z[name].shape != tuple(shape):
                raise ValueError(f"{path}: {name} has shape {z[name].shape}, the config says {tuple(shape)}")
            leaves[name] = jnp.asarray(z[name], dtype)
    tree = param_shapes(cfg)
    params = jax.tree.map_with_path(
        lambda p, _: leaves["/".join(k.key for k in p)], tree, is_leaf=lambda s: isinstance(s, tuple)
    )
    return cfg, params, meta, vocab
