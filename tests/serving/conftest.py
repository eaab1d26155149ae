"""A real server on loopback: `python -m aither_jax.serve` in a subprocess, per test module."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest

STARTUP_SECONDS = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running server process and its base URL."""

    def __init__(self, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "aither_jax.serve", "--port", str(self.port), "--log-level", "warning", *flags]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.log_path = f"/tmp/aither-serve-{self.port}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not start within {STARTUP_SECONDS} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        """Unlabelled-by-reason series of /metrics as {name: value} (labels other than
        model_name are kept in the name)."""
        r = httpx.get(self.url + "/metrics", timeout=10, headers=headers)
        assert r.status_code == 200, r.text
        text = r.text
        out = {}
        for line in text.splitlines():
            if line.startswith("#") or not line:
                continue
            series, value = line.rsplit(" ", 1)
            series = re.sub(r'model_name="[^"]*"', "", series).replace("{,", "{").replace(",}", "}").replace("{}", "")
            out[series] = float(value)
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def start_server(*flags: str) -> Server:
    return Server(*flags)


# Small, fast settings for tests.
BASE_FLAGS = ("--max-model-len", "1024", "--max-prefill-chunk", "128")
# Exactness tests (batched == alone, caching on == off) run on float32 KV: with a quantized
# cache, float noise from a different batch shape can move a key across a code boundary.
EXACT_FLAGS = ("--kv-cache-dtype", "fp32")


@pytest.fixture(scope="session")
def server():
    """The server most tests share: float32 KV, prefix caching on, 16 sequences, room for 40
    waiting."""
    s = start_server(*BASE_FLAGS, *EXACT_FLAGS, "--max-num-seqs", "16", "--max-queue", "40", "--num-pages", "256")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def server_factory():
    """Starts extra servers with their own flags (on top of BASE_FLAGS); stops them at the end."""
    started = []

    def start(*flags: str) -> Server:
        s = start_server(*BASE_FLAGS, *flags)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()
