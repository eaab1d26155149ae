"""A persistent cache of compiled steps, so a restarted server or a second script loads the
executables it compiled before instead of compiling them again.

Each decode or prefill shape of the model compiles once per process: about 10 s on 2 CPU
cores with the default TurboQuant cache. Loaded from this cache, the same shape costs the
tracing and lowering alone (about 4 s). The cache is JAX's own (`jax_compilation_cache_dir`);
this module only chooses its directory:

- the directory JAX was already given (`jax.config` or `JAX_COMPILATION_CACHE_DIR`), if any;
- otherwise `$AITHER_JAX_COMPILATION_CACHE`, where `0`, `off` or an empty value turn it off;
- otherwise `$XDG_CACHE_HOME/aither_jax/xla` (`~/.cache/aither_jax/xla`).

The directory is created private to the user and refused if it is not (JAX runs what it loads
from there, so whoever can write there can run code in this process). It is kept under
MAX_BYTES, least recently used entries first.
Only computations that took at least a second to compile are written.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import jax

ENV = "AITHER_JAX_COMPILATION_CACHE"
MAX_BYTES = 2 << 30
_OFF = ("", "0", "off", "false", "no", "none")

log = logging.getLogger(__name__)


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "aither_jax", "xla")


def enable() -> str | None:
    """Turns the persistent cache on (see the module doc); returns its directory, or None
    when it is off or cannot be used. Safe to call more than once, and never fatal: the cache
    only saves time, so a JAX without these options runs without it."""
    try:
        return _enable()
    except Exception as e:  # noqa: BLE001 - an optional speed-up must not stop the engine
        return _off(f"{type(e).__name__}: {e}")


def _off(reason: str) -> None:
    log.warning("compilation cache off: %s (set %s=0 to silence this)", reason, ENV)


def _enable() -> str | None:
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    setting = os.environ.get(ENV)
    if setting is not None and setting.strip().lower() in _OFF:
        return None
    path = os.path.abspath(os.path.expanduser(setting or default_dir()))
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        return _off(f"cannot create {path} ({e})")
    if not os.access(path, os.W_OK | os.X_OK):
        return _off(f"{path} is not writable")
    st = os.stat(path)
    if st.st_mode & 0o022 or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
        # Whoever can write there can make this process run their code.
        return _off(f"{path} is writable by other users or not yours; use a private directory")
    # The size bound needs file locks (several processes share the directory).
    if jax.config.jax_compilation_cache_max_size == -1 and importlib.util.find_spec("filelock"):
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    jax.config.update("jax_compilation_cache_dir", path)
    return path
