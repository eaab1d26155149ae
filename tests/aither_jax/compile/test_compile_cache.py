"""The persistent compilation cache (aither_jax.compile.cache): where it goes, how it is turned
off, and that a second process loads what the first one compiled (and counts the load)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from aither_jax.compile import cache as compile_cache

ROOT = Path(__file__).resolve().parents[3]

# A fresh interpreter: enables the cache, compiles one small function (written to the cache
# whatever its compile time) and reports the cache directory, the persistent-cache hits it
# saw and what the engine's compile counter read.
CHILD = """
import json, jax, jax.numpy as jnp
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from jax._src import monitoring
from aither_jax.compile import cache as compile_cache
from aither_jax.compile.counter import CompileCounter
hits = []
monitoring.register_event_listener(lambda e, **k: hits.append(e) if e.endswith("cache_hits") else None)
path = compile_cache.enable()
x = jnp.arange(5.0)
before, hits[:] = CompileCounter.count(), []
jax.jit(lambda x: jnp.sin(x) * 3 + 1)(x).block_until_ready()
print(json.dumps({"path": path, "hits": len(hits), "counted": CompileCounter.count() - before}))
"""


def _run_child(env_value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (compile_cache.ENV, "JAX_COMPILATION_CACHE_DIR")}
    if env_value is not None:
        env[compile_cache.ENV] = env_value
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_process_loads_what_the_first_compiled(tmp_path):
    cache_dir = tmp_path / "xla"
    first = _run_child(str(cache_dir))
    assert first["path"] == str(cache_dir)
    assert first["hits"] == 0 and first["counted"] == 1
    assert any(cache_dir.iterdir()), "nothing was written to the cache"
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700
    second = _run_child(str(cache_dir))
    assert second["hits"] == 1
    # A load stands in for a compilation: the engine's counter sees it once.
    assert second["counted"] == 1


def test_turned_off_by_the_environment(tmp_path):
    for value in ("0", "off", ""):
        assert _run_child(value)["path"] is None


@pytest.fixture
def restore_jax_cache_config():
    saved = jax.config.jax_compilation_cache_dir, jax.config.jax_compilation_cache_max_size
    yield
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_compilation_cache_max_size", saved[1])


def test_a_directory_jax_was_given_wins(tmp_path, monkeypatch, restore_jax_cache_config):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "ours"))
    assert compile_cache.enable() == str(tmp_path / "mine")
    assert not (tmp_path / "ours").exists()


def test_default_directory_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.default_dir() == str(tmp_path / "aither_jax" / "xla")


def test_unusable_directory_turns_the_cache_off(tmp_path, monkeypatch, restore_jax_cache_config, caplog):
    jax.config.update("jax_compilation_cache_dir", None)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(compile_cache.ENV, str(blocker / "xla"))
    assert compile_cache.enable() is None
    assert jax.config.jax_compilation_cache_dir is None
    assert any("compilation cache off" in r.getMessage() for r in caplog.records)


def test_a_directory_others_can_write_is_refused(tmp_path, monkeypatch, restore_jax_cache_config, caplog):
    jax.config.update("jax_compilation_cache_dir", None)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv(compile_cache.ENV, str(shared))
    assert compile_cache.enable() is None
    assert jax.config.jax_compilation_cache_dir is None
    assert any("writable by other users" in r.getMessage() for r in caplog.records)
    shared.chmod(0o700)
    assert compile_cache.enable() == str(shared)


def test_a_failure_inside_jax_config_is_not_fatal(tmp_path, monkeypatch, restore_jax_cache_config, caplog):
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "xla"))

    def broken(name, value):
        raise AttributeError(f"no option {name}")

    with monkeypatch.context() as patch:  # undone before the fixture restores the options
        patch.setattr(jax.config, "update", broken)
        assert compile_cache.enable() is None
    assert any("compilation cache off: AttributeError" in r.getMessage() for r in caplog.records)
