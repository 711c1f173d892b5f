"""Shared fixtures: real mlx-lm and mlx-vlm models with deterministic random weights.

Every model is written once per test session into a temporary directory and
loaded with ``mlx_lm.load`` or ``mlx_vlm.load`` -- the same path a user's model
takes. The VLM fixtures skip their tests when mlx-vlm (the ``vlm`` extra) is not
installed.
"""

from __future__ import annotations

import os

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

