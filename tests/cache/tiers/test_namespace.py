"""Namespaces and storage keys: everything that makes KV differ makes another key."""

from __future__ import annotations

import shutil

import attrs
import mlx.core as mx
import pytest
from tier_blocks import kv_blocks, mixed_blocks, namespace_of

from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.kv_state import KVLayer, QuantizedLayer
from mlxkv.cache.tiers import (
    KVLayout,
    Namespace,
    model_fingerprint,
    namespace_for_model,
    namespace_from_fields,
    storage_key,
    storage_keys,
)
from mlxkv.cache.tiers.cache_dir import default_cache_dir
from mlxkv.default_model import TINY_LLAMA, ensure_model


def _fields(**changes):
    (block,) = kv_blocks(1)
    fields = {
        "model_fingerprint": "sha256:model-a",
        "layers": block.layers,
        "signature": block.signature,
        "block_size": 4,
        "extra": "",
    }
    return {**fields, **changes}


class TestKVLayout:
    def test_json_round_trip(self):
        """A layout of every layer kind survives its JSON form exactly."""
        import json

        layout = KVLayout.of(mixed_blocks(1)[0])
        assert KVLayout.from_json(json.loads(json.dumps(layout.to_json()))) == layout

    def test_probe_reads_a_real_model(self, tiny_llama):
        """Probing a real mlx-lm model gives the layout of the blocks it makes."""
        model, _ = tiny_llama
        layout = KVLayout.probe(model)
        assert layout.layers == (KVLayer(), KVLayer())
        dtype, heads, head_dim = layout.signature[0][0]
        assert heads == (1, model.args.num_key_value_heads)
        assert head_dim == (model.args.hidden_size // model.args.num_attention_heads,)

    def test_malformed_signature_refused(self):
        """A signature that JSON would not give back exactly is refused."""
        with pytest.raises(InvalidInput):
            KVLayout(layers=(KVLayer(),), signature=([1, 2],))
        with pytest.raises(InvalidInput):
            KVLayout(layers=(KVLayer(),), signature=())


class TestNamespace:
    def test_equal_fields_equal_digest(self):
        """The same fields give the same namespace and digest, in any process."""
        assert namespace_from_fields(**_fields()) == namespace_from_fields(**_fields())
        assert namespace_from_fields(**_fields()).digest == namespace_from_fields(**_fields()).digest

    @pytest.mark.parametrize(
        "changes",
        [
            pytest.param({"model_fingerprint": "sha256:model-b"}, id="model"),
            pytest.param({"block_size": 8}, id="block-size"),
            pytest.param({"extra": "adapter"}, id="extra"),
            pytest.param({"signature": kv_blocks(1, dtype=mx.float32)[0].signature}, id="dtype"),
            pytest.param({"signature": kv_blocks(1, heads=2)[0].signature}, id="kv-heads"),
            pytest.param({"signature": kv_blocks(1, head_dim=16)[0].signature}, id="head-dim"),
            pytest.param({"layers": (QuantizedLayer(64, 4),) * 2}, id="layer-kind"),
        ],
    )
    def test_every_field_counts(self, changes):
        """Changing any one field changes the digest."""
        assert namespace_from_fields(**_fields(**changes)).digest != namespace_from_fields(**_fields()).digest

    def test_versions_count(self):
        """Another schema or payload format version is another namespace."""
        base = namespace_from_fields(**_fields())
        for change in ({"schema_version": base.schema_version + 1}, {"payload_format": base.payload_format + 1}):
            other = Namespace(**{**attrs.asdict(base, recurse=False, filter=lambda a, _: a.init), **change})
            assert other.digest != base.digest

    def test_quantization_parameters_count(self):
        """Other quantization bits or group size are another namespace."""
        q4 = namespace_from_fields(**_fields(layers=(QuantizedLayer(64, 4), QuantizedLayer(64, 4))))
        q8 = namespace_from_fields(**_fields(layers=(QuantizedLayer(64, 8), QuantizedLayer(64, 8))))
        g32 = namespace_from_fields(**_fields(layers=(QuantizedLayer(32, 4), QuantizedLayer(32, 4))))
        assert len({q4.digest, q8.digest, g32.digest}) == 3

    @pytest.mark.parametrize(
        "changes",
        [{"block_size": 0}, {"model_fingerprint": ""}, {"signature": ()}, {"extra": None}],
    )
    def test_bad_fields_refused(self, changes):
        """Bad fields are refused before a namespace exists."""
        with pytest.raises(InvalidInput):
            namespace_from_fields(**_fields(**changes))


class TestNamespaceForModel:
    def test_real_model_by_contents_not_path(self, model_dir, tmp_path, tiny_llama):
        """A real model's namespace is the same from a copy of its directory,
        and its fingerprint is the directory's."""
        model, _ = tiny_llama
        path = ensure_model(TINY_LLAMA, model_dir)
        layout = KVLayout.probe(model)
        memo = tmp_path / "memo.json"
        here = namespace_for_model(path, layout=layout, block_size=16, memo_path=memo)
        copy = shutil.copytree(path, tmp_path / "copy")
        assert namespace_for_model(copy, layout=layout, block_size=16, memo_path=memo) == here
        assert here.model_fingerprint == model_fingerprint(path, memo_path=memo)

    def test_model_without_a_directory(self, tiny_llama):
        """A model given without a path is fingerprinted from its parameters."""
        model, _ = tiny_llama
        layout = KVLayout.probe(model)
        namespace = namespace_for_model(None, model=model, layout=layout, block_size=16)
        assert namespace.model_fingerprint.startswith("sha256:")

    def test_neither_refused(self):
        """No directory and no model is refused."""
        with pytest.raises(InvalidInput):
            namespace_for_model(None, layout=KVLayout.of(kv_blocks(1)[0]), block_size=4)


class TestStorageKey:
    def test_deterministic_and_namespaced(self):
        """A key depends on the chain hash and on the namespace, nothing else."""
        (block,) = kv_blocks(1)
        a, b = namespace_of(block), namespace_of(block, model="sha256:model-b")
        assert storage_key(a, b"h") == storage_key(namespace_of(block), b"h")
        assert storage_key(a, b"h") != storage_key(b, b"h")
        assert storage_key(a, b"h") != storage_key(a, b"g")
        assert len(storage_key(a, b"h")) == 32

    def test_reveals_no_chain_hash(self):
        """The key is a digest: the chain hash does not appear in it."""
        namespace = namespace_of(kv_blocks(1)[0])
        chain_hash = bytes(range(32))
        assert chain_hash not in storage_key(namespace, chain_hash)

    def test_int_and_bytes_hashes_apart(self):
        """An int hash and the bytes that spell it never share a key."""
        namespace = namespace_of(kv_blocks(1)[0])
        assert storage_key(namespace, 7) != storage_key(namespace, b"7")
        assert storage_keys(namespace, [b"a", 7]) == [storage_key(namespace, b"a"), storage_key(namespace, 7)]

    @pytest.mark.parametrize("bad", [b"", "text", None, 1.5])
    def test_bad_hash_refused(self, bad):
        """Anything but non-empty bytes or an int is refused."""
        with pytest.raises(InvalidInput):
            storage_key(namespace_of(kv_blocks(1)[0]), bad)


class TestCacheDir:
    @pytest.mark.parametrize(
        "env", [{}, {"XDG_CACHE_HOME": "/x/cache"}, {"MLXKV_CACHE_DIR": "/y/mlxkv", "XDG_CACHE_HOME": "/x"}]
    )
    def test_same_rule_as_the_runtime(self, monkeypatch, env):
        """The tiers' cache directory is the runtime's (the same rule, written twice)."""
        from mlxkv.default_model import default_cache_dir as runtime_cache_dir

        monkeypatch.delenv("MLXKV_CACHE_DIR", raising=False)
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert default_cache_dir() == runtime_cache_dir()
