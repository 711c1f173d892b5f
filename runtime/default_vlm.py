"""The built-in vision-language model: a tiny Qwen2-VL with deterministic random weights.

Like :mod:`mlxkv.default_model`, no weights can be downloaded, so the project
writes its own model directory in the mlx-vlm format and loads it with
``mlx_vlm.load``, the same code path as any real model. The architecture is
Qwen2-VL (``model_type: qwen2_vl``), because it is the one that works here
end to end:

* it builds offline from mlx-vlm's own classes (vision tower, patch merger,
  mrope language model), so the weights are just the classes' initialisers
  under a seeded generator;
* mlx-vlm's processor for it is a numpy port (``Qwen3VLImageProcessor``): no
  torch or torchvision, and it reads its settings from the local json files,
  so with ``processor_config.json`` present nothing is asked of the hub;
* its dynamic resolution (any image size, rounded to the patch grid) and
  multimodal rope (``mrope``: image tokens get 2-D positions, the text after
  an image continues from the image's largest position) are what current
  Qwen VLMs do, so the runtime is built against the hard case.

(llava, the other obvious choice, does not load with transformers 5:
mlx-vlm#870.)

The model directory holds ``config.json``, ``model.safetensors``, a byte-level
``tokenizer.json`` with the Qwen special tokens (``<|im_start|>``,
``<|vision_start|>``, ``<|image_pad|>`` ...), ``tokenizer_config.json`` with a
Qwen2-VL chat template, ``preprocessor_config.json`` (also written as
``video_preprocessor_config.json``) and ``processor_config.json``.

Importing this module needs neither mlx-vlm nor transformers; only writing a
model (MLX and mlx-vlm's model classes) and loading one do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Union

import attrs

from mlxkv.default_model import (
    BYTE_VOCAB,
    MATRIX_SCALE,
    UNTIED_SHARP,
    ensure_written,
    shape_weights,
    spec_digest,
    write_byte_tokenizer,
)

__all__ = [
    "DEFAULT_VLM",
    "VISIBLE_IMAGES",
    "VLMSpec",
    "ensure_vlm",
    "is_vlm_directory",
    "write_vlm",
]

#: Qwen2-VL's special tokens, given ids 256.. in this order after the bytes.
_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_TOKEN_ID = {token: BYTE_VOCAB + i for i, token in enumerate(_SPECIAL_TOKENS)}

#: Qwen2-VL's chat template without the default system prompt: a message's
#: content is a string or a list of ``{"type": "text" | "image", ...}`` parts,
#: and each image part becomes ``<|vision_start|><|image_pad|><|vision_end|>``
#: (the processor then repeats ``<|image_pad|>`` once per image token).
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@attrs.frozen(kw_only=True)
class VLMSpec:
    """What to write: a Qwen2-VL's text, vision and image-processor fields.

    ``text`` holds the language model's fields (mlx-vlm's qwen2_vl
    ``TextConfig`` less ``model_type`` and ``vocab_size``; the vocabulary is
    always the byte-level tokenizer's), ``vision`` the vision tower's
    (``VisionConfig`` less ``model_type`` and ``hidden_size``, which is the
    text model's), ``image`` the image processor's (``min_pixels``,
    ``max_pixels``, ``image_mean``, ``image_std``). ``weight_scales`` shapes
    the random weights (:func:`mlxkv.default_model.shape_weights`). ``seed``
    makes the weights deterministic.
    """

    name: str
    text: Mapping[str, Any] = attrs.field(converter=lambda c: dict(sorted(c.items())))
    vision: Mapping[str, Any] = attrs.field(converter=lambda c: dict(sorted(c.items())))
    image: Mapping[str, Any] = attrs.field(converter=lambda c: dict(sorted(c.items())))
    weight_scales: Mapping[str, float] = attrs.field(
        factory=lambda: dict(VISIBLE_IMAGES), converter=lambda c: dict(sorted(c.items()))
    )
    seed: int = 0

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB + len(_SPECIAL_TOKENS)

    @property
    def image_token_id(self) -> int:
        """Id of ``<|image_pad|>``, the token each image feature replaces."""
        return _TOKEN_ID["<|image_pad|>"]

    def full_config(self) -> dict[str, Any]:
        """``config.json``: text fields at the top level, as Qwen2-VL has them."""
        return {
            "model_type": "qwen2_vl",
            "architectures": ["Qwen2VLForConditionalGeneration"],
            "vocab_size": self.vocab_size,
            "bos_token_id": _TOKEN_ID["<|endoftext|>"],
            "eos_token_id": _TOKEN_ID["<|im_end|>"],
            "pad_token_id": _TOKEN_ID["<|endoftext|>"],
            "image_token_id": _TOKEN_ID["<|image_pad|>"],
            "video_token_id": _TOKEN_ID["<|video_pad|>"],
            "vision_start_token_id": _TOKEN_ID["<|vision_start|>"],
            "vision_end_token_id": _TOKEN_ID["<|vision_end|>"],
            **self.text,
            "vision_config": {
                "model_type": "qwen2_vl",
                "hidden_size": self.text["hidden_size"],
                **self.vision,
            },
        }

    def preprocessor_config(self) -> dict[str, Any]:
        """``preprocessor_config.json``: patch geometry comes from the vision tower."""
        return {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2VLProcessor",
            "patch_size": self.vision["patch_size"],
            "temporal_patch_size": self.vision["temporal_patch_size"],
            "merge_size": self.vision["spatial_merge_size"],
            "do_convert_rgb": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            **self.image,
        }

    def digest(self) -> str:
        return spec_digest(
            {
                "config": self.full_config(),
                "preprocessor": self.preprocessor_config(),
                "chat_template": _CHAT_TEMPLATE,
                "weight_scales": self.weight_scales,
                "seed": self.seed,
                "format": 1,
            }
        )


#: The VLM's weight shaping: the text model's (:data:`UNTIED_SHARP`), and
#: image features large enough against text embeddings (patch embedding x8,
#: merger x4), so different pictures continue differently, not only the
#: same prompt with slightly different logits.
VISIBLE_IMAGES = {
    **UNTIED_SHARP,
    "vision_tower.patch_embed": 8 * MATRIX_SCALE,
    "vision_tower.merger": 4 * MATRIX_SCALE,
}

#: The built-in VLM. Text: hidden 64, 2 layers, 4 query / 2 KV heads
#: (head_dim 16, mrope sections 2+3+3 = 8 frequency pairs). Vision: 2 blocks of
#: width 32, patch 8, 2x2 merge, so one image token covers 16x16 pixels: a
#: 64x64 image is 16 tokens. Images are resized to between 32x32 (4 tokens)
#: and 128x128 pixels (64 tokens) of area.
DEFAULT_VLM = VLMSpec(
    name="mlxkv-default-qwen2-vl",
    text={
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    vision={
        "depth": 2,
        "embed_dim": 32,
        "num_heads": 2,
        # mlx-vlm sizes the MLP with int(embed_dim * mlp_ratio); an int keeps
        # the json loader's dataclass happy too.
        "mlp_ratio": 2,
        "in_channels": 3,
        "patch_size": 8,
        "spatial_patch_size": 8,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    image={
        "min_pixels": 32 * 32,
        "max_pixels": 128 * 128,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    },
)


def ensure_vlm(spec: VLMSpec = DEFAULT_VLM, cache_dir: Path | None = None) -> Path:
    """Return the directory of ``spec``'s model, writing it first if missing.

    Written once, atomically, under a name that carries the spec's digest (see
    :func:`mlxkv.default_model.ensure_written`); the same spec always writes
    the same bytes.

    Args:
        spec: the model to write.
        cache_dir: parent directory; defaults to ``$MLXKV_CACHE_DIR``, else
            ``$XDG_CACHE_HOME/mlxkv``, else ``~/.cache/mlxkv``.

    Returns:
        A directory that ``mlx_vlm.load`` accepts offline.

    Raises:
        ModuleNotFoundError: mlx-vlm is not installed (the ``vlm`` extra) and
            the directory has not been written yet.
    """
    return ensure_written(f"{spec.name}-{spec.digest()}", lambda d: write_vlm(spec, d), cache_dir)


def write_vlm(spec: VLMSpec, directory: Path) -> None:
    """Write ``spec`` in the mlx-vlm format into ``directory`` (which must exist).

    The weights come from mlx-vlm's qwen2_vl classes' own initialisers under a
    seeded MLX generator, shaped by ``spec.weight_scales`` (see
    :func:`mlxkv.default_model.shape_weights`: an untied head and sharper
    text attention, so continuations depend on the prompt and the image),
    and stored as float32.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import qwen2_vl

    directory = Path(directory)
    config = spec.full_config()
    model_config = qwen2_vl.ModelConfig.from_dict(dict(config))
    model_config.text_config = qwen2_vl.TextConfig.from_dict(model_config.text_config)
    model_config.vision_config = qwen2_vl.VisionConfig.from_dict(config["vision_config"])
    mx.random.seed(spec.seed)
    model = qwen2_vl.Model(model_config)
    weights = shape_weights(dict(tree_flatten(model.parameters())), spec.weight_scales)
    mx.eval(weights)
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    write_byte_tokenizer(
        directory,
        _SPECIAL_TOKENS,
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        chat_template=_CHAT_TEMPLATE,
    )
    preprocessor = json.dumps(spec.preprocessor_config(), indent=2, sort_keys=True)
    (directory / "preprocessor_config.json").write_text(preprocessor)
    (directory / "video_preprocessor_config.json").write_text(preprocessor)
    # Without this file mlx-vlm's Qwen processor asks the hub for it first.
    processor = {"processor_class": "Qwen2VLProcessor", "chat_template": _CHAT_TEMPLATE}
    (directory / "processor_config.json").write_text(json.dumps(processor, indent=2))


def is_vlm_directory(path: Union[str, Path]) -> bool:
    """Whether the model directory at ``path`` is a vision-language model.

    Decided from ``config.json`` alone: a VLM's config has a ``vision_config``
    section (Qwen2-VL, Qwen2.5-VL, Gemma 3, LLaVA ... all do); a text model's
    has none. Use it to pick the loader (``mlx_vlm.load`` or ``mlx_lm.load``).

    Args:
        path: a model directory.

    Returns:
        True for a VLM directory, False for a text-model directory.

    Raises:
        FileNotFoundError: ``path`` has no ``config.json``.
        ValueError: ``config.json`` is not a JSON object.
    """
    config = json.loads((Path(path) / "config.json").read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path}/config.json is not a JSON object")
    return isinstance(config.get("vision_config"), dict)
