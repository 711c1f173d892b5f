"""The built-in VLM is written deterministically, loads offline through mlx_vlm and generates."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from mlxkv.default_model import TINY_LLAMA, ensure_model
from mlxkv.default_vlm import DEFAULT_VLM, ensure_vlm, is_vlm_directory


def _digests(directory) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
    }


@pytest.fixture
def vlm(tiny_vlm):
    """The session's tiny VLM, its position state cleared after the test.

    mlx-vlm's qwen2_vl language model keeps the last request's mrope positions
    on itself (``_position_ids``, ``_rope_deltas``); a later request must not
    see them.
    """
    yield tiny_vlm
    tiny_vlm[0].language_model._position_ids = None
    tiny_vlm[0].language_model._rope_deltas = None


def _png(tmp_path, width=64, height=64, seed=0):
    """A noise PNG written with Pillow."""
    np = pytest.importorskip("numpy")
    from PIL import Image

    rng = np.random.default_rng(seed)
    path = tmp_path / f"image-{width}x{height}-{seed}.png"
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB").save(path)
    return str(path)


class TestImport:
    def test_import_needs_no_mlx_vlm(self):
        """Importing mlxkv.default_vlm works where mlx-vlm cannot be imported."""
        code = (
            "import sys; sys.modules['mlx_vlm'] = None\n"
            "import mlxkv.default_vlm as m\n"
            "assert m.DEFAULT_VLM.image_token_id == 261\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


class TestEnsureVLM:
    def test_same_spec_writes_same_bytes(self, tmp_path):
        """Two directories written from one spec hold byte-identical files."""
        pytest.importorskip("mlx_vlm")
        a = ensure_vlm(DEFAULT_VLM, tmp_path / "a")
        b = ensure_vlm(DEFAULT_VLM, tmp_path / "b")
        assert a.name == b.name
        assert _digests(a) == _digests(b)

    def test_writes_every_file_mlx_vlm_reads(self, vlm_path):
        """The directory holds the config, weights, tokenizer and processor files."""
        assert {p.name for p in vlm_path.iterdir()} == {
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "preprocessor_config.json",
            "video_preprocessor_config.json",
            "processor_config.json",
        }
        config = json.loads((vlm_path / "config.json").read_text())
        assert config["model_type"] == "qwen2_vl"
        assert isinstance(config["vision_config"]["mlp_ratio"], int)

    def test_second_call_reuses_directory(self, tmp_path):
        """A written model is reused, not rewritten."""
        pytest.importorskip("mlx_vlm")
        first = ensure_vlm(DEFAULT_VLM, tmp_path)
        mtime = (first / "model.safetensors").stat().st_mtime_ns
        again = ensure_vlm(DEFAULT_VLM, tmp_path)
        assert again == first
        assert (again / "model.safetensors").stat().st_mtime_ns == mtime
        assert [p.name for p in tmp_path.iterdir()] == [first.name]


class TestIsVLMDirectory:
    def test_text_model_is_not_a_vlm(self, model_dir):
        """The built-in text model's directory is not detected as a VLM."""
        assert is_vlm_directory(ensure_model(TINY_LLAMA, model_dir)) is False

    def test_vlm_is_a_vlm(self, vlm_path):
        """The built-in VLM's directory is detected as a VLM."""
        assert is_vlm_directory(vlm_path) is True
        assert is_vlm_directory(str(vlm_path)) is True

    def test_directory_without_config_is_an_error(self, tmp_path):
        """A directory without config.json raises instead of guessing."""
        with pytest.raises(FileNotFoundError):
            is_vlm_directory(tmp_path)


class TestLoadedVLM:
    def test_loads_offline(self, vlm):
        """mlx_vlm.load reads the directory with the hub switched off."""
        from huggingface_hub import constants

        model, processor = vlm
        assert constants.HF_HUB_OFFLINE is True
        assert model.config.model_type == "qwen2_vl"
        assert type(processor).__name__ == "Qwen2VLProcessor"
        assert processor.image_token_id == model.config.image_token_id == DEFAULT_VLM.image_token_id

    def test_tokenizer_round_trips_bytes_and_specials(self, vlm):
        """Text maps to one id per UTF-8 byte; Qwen special tokens stay whole."""
        _, processor = vlm
        tokenizer = processor.tokenizer
        text = "Hello, wörld!\n"
        assert tokenizer.encode(text, add_special_tokens=False) == list(text.encode())
        ids = tokenizer.encode("<|im_start|>a<|im_end|>", add_special_tokens=False)
        assert ids == [257, ord("a"), 258]
        assert tokenizer.decode(ids) == "<|im_start|>a<|im_end|>"

    def test_image_becomes_one_token_per_16x16_pixels(self, vlm, tmp_path):
        """A 64x64 image expands <|image_pad|> to 16 tokens on an 8x8 patch grid."""
        from mlx_vlm.utils import prepare_inputs

        model, processor = vlm
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}
        ]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = prepare_inputs(processor, images=[_png(tmp_path)], prompts=prompt)
        assert inputs["image_grid_thw"].tolist() == [[1, 8, 8]]
        assert inputs["pixel_values"].shape == (64, 3 * 2 * 8 * 8)
        assert inputs["input_ids"][0].tolist().count(model.config.image_token_id) == 16

    def test_generates_from_png(self, vlm, tmp_path):
        """mlx-vlm's own generate runs on a PNG and returns the requested tokens."""
        from mlx_vlm import generate
        from mlx_vlm.prompt_utils import apply_chat_template

        model, processor = vlm
        prompt = apply_chat_template(processor, model.config, "Describe it.", num_images=1)
        result = generate(
            model, processor, prompt, image=[_png(tmp_path)], max_tokens=4, temperature=0.0
        )
        assert result.generation_tokens == 4
        # The one <|image_pad|> of the prompt became 16 image tokens.
        text_tokens = len(processor.tokenizer.encode(prompt, add_special_tokens=False))
        assert result.prompt_tokens == text_tokens - 1 + 16

    def test_image_changes_the_output(self, vlm, tmp_path):
        """Two different images give different first-token logits for the same prompt."""
        import mlx.core as mx
        from mlx_vlm.utils import prepare_inputs

        model, processor = vlm
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}
        ]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        logits = []
        for seed in (1, 2):
            inputs = prepare_inputs(processor, images=[_png(tmp_path, seed=seed)], prompts=prompt)
            out = model(
                inputs["input_ids"], inputs["pixel_values"],
                image_grid_thw=inputs["image_grid_thw"],
            )
            logits.append(out.logits[0, -1])
        assert not mx.allclose(logits[0], logits[1]).item()
