"""The built-in models are written deterministically and load through mlx_lm."""

from __future__ import annotations

import hashlib

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from mlxkv.default_model import TINY_LLAMA, ensure_model


def _digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


class TestEnsureModel:
    def test_same_spec_writes_same_bytes(self, tmp_path):
        """Two directories written from one spec hold identical weights."""
        a = ensure_model(TINY_LLAMA, tmp_path / "a")
        b = ensure_model(TINY_LLAMA, tmp_path / "b")
        assert _digest(a) == _digest(b)

    def test_second_call_reuses_directory(self, tmp_path):
        """A written model is reused, not rewritten."""
        first = ensure_model(TINY_LLAMA, tmp_path)
        mtime = (first / "model.safetensors").stat().st_mtime_ns
        again = ensure_model(TINY_LLAMA, tmp_path)
        assert again == first
        assert (again / "model.safetensors").stat().st_mtime_ns == mtime
        assert [p.name for p in tmp_path.iterdir()] == [first.name]


class TestLoadedModels:
    def test_tokenizer_round_trips_bytes(self, tiny_llama):
        """The byte-level tokenizer maps text to one id per UTF-8 byte and back."""
        _, tokenizer = tiny_llama
        text = "Hello, wörld!\n\tok"
        ids = tokenizer.encode(text)
        assert ids == list(text.encode())
        assert tokenizer.decode(ids) == text

    def test_cache_kinds(self, tiny_llama, sliding_llama, hybrid_model):
        """Each test model produces the cache kinds it is meant to exercise."""
        assert {type(c) for c in make_prompt_cache(tiny_llama[0])} == {KVCache}
        assert {type(c) for c in make_prompt_cache(sliding_llama[0])} == {KVCache, RotatingKVCache}
        assert {type(c) for c in make_prompt_cache(hybrid_model[0])} == {KVCache, ArraysCache}

    def test_forward_is_deterministic(self, tiny_llama):
        """The same prompt gives the same logits twice."""
        model, _ = tiny_llama
        x = mx.array([[1, 2, 3, 4, 5]])
        a = model(x, cache=make_prompt_cache(model))
        b = model(x, cache=make_prompt_cache(model))
        assert mx.array_equal(a, b).item()
