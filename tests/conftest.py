"""Shared fixtures: real mlx-lm models with deterministic random weights.

Every model is written once per test session into a temporary directory and
loaded with ``mlx_lm.load`` -- the same path a user's model takes.
"""

from __future__ import annotations

import pytest

from mlxkv.default_model import TINY_HYBRID, TINY_LLAMA, TINY_SLIDING_LLAMA, ModelSpec, ensure_model


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
