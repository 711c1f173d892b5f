"""model_key: a stable key of a model, and the seed's ``model_key`` attributes."""

from __future__ import annotations

import pathlib

import mlx.core as mx
import pytest
from mlx_lm import load

from mlxkv.cache.block_prefix import BlockAwarePrefixCache
from mlxkv.cache.model_key import model_key
from mlxkv.cache.paged import PagedCacheManager
from mlxkv.cache.prefix import PrefixCacheManager
from mlxkv.default_model import TINY_LLAMA, ensure_model


@pytest.fixture
def llama_path(model_dir):
    """The directory of the session's tiny Llama."""
    return ensure_model(TINY_LLAMA, model_dir)


class TestModelKey:
    def test_same_model_same_key(self, tiny_llama, llama_path):
        """Two loads of the same weights have the same key, whatever their id()."""
        again, _ = load(str(llama_path))
        key = model_key(tiny_llama[0])
        assert again is not tiny_llama[0]
        assert key == model_key(again)
        assert key.startswith("sha256:") and len(key) == len("sha256:") + 64

    def test_other_weights_other_key(self, tiny_llama, llama_path):
        """Changing one parameter changes the key."""
        changed, _ = load(str(llama_path))
        changed.model.norm.weight = changed.model.norm.weight + 1
        mx.eval(changed.parameters())
        assert model_key(changed) != model_key(tiny_llama[0])

    def test_names_and_stand_ins(self, llama_path):
        """A path or hub name is its own key; an object without weights has none."""
        assert model_key("mlx-community/Llama-3.2-1B-Instruct-4bit") == (
            "mlx-community/Llama-3.2-1B-Instruct-4bit"
        )
        assert model_key(pathlib.Path(llama_path)) == str(llama_path)
        assert model_key(None) is None
        assert model_key(object()) is None

    @pytest.mark.parametrize(
        "make",
        [
            lambda model: PrefixCacheManager(model),
            lambda model: BlockAwarePrefixCache(model, PagedCacheManager(block_size=4)),
        ],
        ids=["PrefixCacheManager", "BlockAwarePrefixCache"],
    )
    def test_managers_expose_it(self, tiny_llama, llama_path, make):
        """The seed's model_key attribute is the stable key, not id(model)."""
        model = tiny_llama[0]
        manager = make(model)
        assert manager.model_key == model_key(model) != id(model)
        assert make(load(str(llama_path))[0]).model_key == manager.model_key
        assert make(None).model_key is None
