"""Model fingerprints: config and weight contents, never the path; weight digests memoized."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.tiers import fingerprint as fingerprint_module
from mlxkv.cache.tiers import model_fingerprint


@pytest.fixture
def model(tmp_path):
    """A model directory: config.json, two weight files and a tokenizer."""
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}, indent=2))
    (directory / "model-00001.safetensors").write_bytes(b"\x01" * 1000)
    (directory / "model-00002.safetensors").write_bytes(b"\x02" * 1000)
    (directory / "tokenizer.json").write_text("{}")
    return directory


@pytest.fixture
def memo(tmp_path):
    return tmp_path / "memo" / "fingerprints.json"


@pytest.fixture
def digests(monkeypatch):
    """Counts the weight files actually read."""
    calls = []
    real = fingerprint_module.file_digest

    def counting(path):
        calls.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(fingerprint_module, "file_digest", counting)
    return calls


class TestModelFingerprint:
    def test_same_model_elsewhere_same_fingerprint(self, model, memo, tmp_path):
        """A copy of the model in another directory has the same fingerprint."""
        copy = shutil.copytree(model, tmp_path / "elsewhere")
        assert model_fingerprint(model, memo_path=memo) == model_fingerprint(copy, memo_path=memo)

    def test_reformatted_config_same_fingerprint(self, model, memo):
        """Whitespace and key order of config.json change nothing."""
        before = model_fingerprint(model, memo_path=memo)
        (model / "config.json").write_text('{"hidden_size":64,"model_type":"llama"}')
        assert model_fingerprint(model, memo_path=memo) == before

    def test_config_value_changes_it(self, model, memo):
        """Another config value is another model."""
        before = model_fingerprint(model, memo_path=memo)
        (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 65}))
        assert model_fingerprint(model, memo_path=memo) != before

    def test_one_weight_byte_changes_it(self, model, memo):
        """One changed weight byte (same size) is another model."""
        before = model_fingerprint(model, memo_path=memo)
        weights = model / "model-00002.safetensors"
        stat = weights.stat()
        weights.write_bytes(b"\x02" * 999 + b"\x03")
        # Even with the old mtime put back, ctime gives the change away.
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert model_fingerprint(model, memo_path=memo) != before

    def test_tokenizer_does_not_count(self, model, memo):
        """The tokenizer does not change KV for given token ids: it is not hashed."""
        before = model_fingerprint(model, memo_path=memo)
        (model / "tokenizer.json").write_text('{"other": 1}')
        assert model_fingerprint(model, memo_path=memo) == before

    def test_weights_are_read_once(self, model, memo, digests):
        """A second fingerprint reads no weight file: their digests are memoized."""
        first = model_fingerprint(model, memo_path=memo)
        assert sorted(digests) == ["model-00001.safetensors", "model-00002.safetensors"]
        digests.clear()
        assert model_fingerprint(model, memo_path=memo) == first
        assert digests == []

    def test_a_changed_file_is_read_again(self, model, memo, digests):
        """Only the weight file whose size or times changed is read again."""
        model_fingerprint(model, memo_path=memo)
        digests.clear()
        (model / "model-00001.safetensors").write_bytes(b"\x01" * 1001)
        model_fingerprint(model, memo_path=memo)
        assert digests == ["model-00001.safetensors"]

    def test_a_broken_memo_costs_only_time(self, model, memo, digests):
        """An unreadable memo file is ignored (and rewritten), never an error."""
        first = model_fingerprint(model, memo_path=memo)
        memo.write_text("{not json")
        digests.clear()
        assert model_fingerprint(model, memo_path=memo) == first
        assert len(digests) == 2
        assert json.loads(memo.read_text())["version"] == 1

    @pytest.mark.parametrize("missing", ["config.json", "weights", "directory"])
    def test_not_a_model_directory(self, model, memo, missing):
        """A directory without config.json or weights, or no directory, is refused."""
        if missing == "config.json":
            (model / "config.json").unlink()
        elif missing == "weights":
            for path in model.glob("*.safetensors"):
                path.unlink()
        else:
            model = model / "nope"
        with pytest.raises(InvalidInput):
            model_fingerprint(model, memo_path=memo)
