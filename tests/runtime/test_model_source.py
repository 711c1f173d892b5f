"""A model that cannot be loaded is one typed error naming the path, before anything runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mlxkv import CacheRuntime, ModelLoadError
from mlxkv.actors.model_source import check_model_source
from mlxkv.cli import main
from mlxkv.default_model import TINY_LLAMA, ensure_model


@pytest.fixture
def model_copy(tmp_path: Path, model_dir: Path) -> Path:
    """A private copy of the tiny model's directory, to break."""
    target = tmp_path / "model"
    shutil.copytree(ensure_model(TINY_LLAMA, model_dir), target)
    return target


class TestCheckModelSource:
    def test_a_model_directory_is_text(self, model_copy: Path):
        """A complete mlx-lm directory is accepted as a text model with its type."""
        source = check_model_source(str(model_copy))
        assert (source.kind, source.model_type, source.path) == ("text", "llama", str(model_copy))

    def test_a_vision_config_makes_it_a_vision_model(self, model_copy: Path):
        """A config with a vision part is a vision-language model."""
        config = json.loads((model_copy / "config.json").read_text())
        (model_copy / "config.json").write_text(json.dumps({**config, "vision_config": {}}))
        assert check_model_source(str(model_copy)).kind == "vision"

    def test_a_repo_id_is_left_to_the_loader(self):
        """A string shaped like org/name that is no local path is a hub id."""
        assert check_model_source("mlx-community/some-model").kind == "hub"

    @pytest.mark.parametrize(
        "breakage, reason",
        [
            (lambda d: shutil.rmtree(d), "no such directory"),
            (lambda d: (shutil.rmtree(d), d.write_text("x")), "not a directory"),
            (lambda d: (d / "config.json").unlink(), "no config.json"),
            (lambda d: (d / "config.json").write_text("{oops"), "config.json cannot be read"),
            (lambda d: (d / "config.json").write_text("{}"), "no model_type"),
            (lambda d: (d / "model.safetensors").unlink(), r"no \*\.safetensors"),
            (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer"),
        ],
        ids=["missing", "file", "no-config", "bad-json", "no-type", "no-weights", "no-tokenizer"],
    )
    def test_what_is_wrong_is_named(self, model_copy: Path, breakage, reason: str):
        """Each broken directory is a ModelLoadError naming the path and the problem."""
        breakage(model_copy)
        with pytest.raises(ModelLoadError, match=reason) as info:
            check_model_source(str(model_copy))
        assert info.value.path == str(model_copy)


class TestRuntimeStart:
    async def test_missing_directory_is_one_typed_error(self, tmp_path: Path):
        """A path that does not exist raises ModelLoadError from async with, not a group."""
        runtime = CacheRuntime(model=str(tmp_path / "nowhere"))
        with pytest.raises(ModelLoadError, match="no such directory"):
            async with runtime:
                pass
        assert runtime.closed

    async def test_a_load_failure_is_one_typed_error(self, model_copy: Path):
        """Files that pass the check but do not load (an unknown model type) raise
        ModelLoadError with the loader's reason."""
        config = json.loads((model_copy / "config.json").read_text())
        (model_copy / "config.json").write_text(json.dumps({**config, "model_type": "nonesuch"}))
        with pytest.raises(ModelLoadError, match="nonesuch") as info:
            async with CacheRuntime(model=str(model_copy)):
                pass
        assert info.value.path == str(model_copy)

    async def test_an_unreachable_repo_id_is_one_typed_error(self, monkeypatch):
        """A repo id goes to mlx-lm's loader; offline, its failure is a ModelLoadError."""
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        with pytest.raises(ModelLoadError, match="mlx-community/no-such-model"):
            async with CacheRuntime(model="mlx-community/no-such-model"):
                pass


class TestCommandLine:
    def test_one_line_and_a_non_zero_exit(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
        """mlxkv run on a bad model prints one line on stderr and exits 2."""
        assert main(["run", "--quiet", "--model", str(tmp_path / "nowhere")]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.count("\n") == 1 and "no such directory" in captured.err


class TestModelLoadError:
    def test_the_message_is_one_line(self):
        """A loader's several-line message (a hub error's advice) is cut to its
        first line in the error's message; the whole stays in ``reason``."""
        reason = "LocalEntryNotFoundError: cannot reach the hub\nAn error happened while...\n"
        error = ModelLoadError("someone/nonexistent", reason)
        assert str(error) == (
            "cannot load the model 'someone/nonexistent': LocalEntryNotFoundError: cannot reach the hub"
        )
        assert error.reason == reason
