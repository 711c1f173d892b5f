"""The model runner for vision-language models (mlx-vlm, Qwen2-VL's family).

A request's prompt holds one ``<|image_pad|>`` token per image token. The
runner computes the multimodal rope positions of the whole prompt once
(``get_rope_index`` over every token and image grid: image tokens get 2-D
positions, and text after an image continues from the image's largest
position, so ``position = index + delta``), embeds the uncached part of the
prompt with the image features merged in at the pad tokens, and runs the
language model on explicit ``inputs_embeds`` and ``position_ids`` slices,
chunk by chunk, against an mlx-lm ``KVCache`` per layer. A decode step feeds
each row its token at ``index + delta``. Because positions are passed
explicitly, the model's own position state (``_position_ids``,
``_rope_deltas``) is never read or written.

Vision encoder. The features of a request's images are needed only for the
image tokens in the part of the prompt that is not cached. They come from
the image cache when the same images were seen (a *skip*), else the encoder
runs once (a *run*) and the features are handed back to be cached. A prompt
whose image tokens all lie in its cached prefix needs no features at all
(also a skip).

Exactness, measured here on the built-in tiny Qwen2-VL: chunked prefill, a
prefix rebuilt from blocks (also cut through an image), cached features,
multi-turn continuation and batched decode with per-row positions all give
the same logits as mlx-vlm's own one-shot path (max abs difference 0).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence as Seq
from typing import Any, Optional

import attrs

from mlxkv.actors.compiled_decode import compile_checked
from mlxkv.actors.compute_config import RunnerConfig
from mlxkv.actors.model_info import ModelInfo
from mlxkv.actors.model_runner import CacheRunner
from mlxkv.actors.prompt_preparer import ImageEncoding, PreparedPrompt, encode_text
from mlxkv.actors.sequence import SequenceState
from mlxkv.actors.token_bound import max_chars_per_token
from mlxkv.actors.weight_layout import hold_weights, loading
from mlxkv.cache.errors import InvalidInput, counted, plural

__all__ = ["EncodedImages", "VisionInputs", "VisionPreparer", "VisionRunner"]

#: What stands for one image in a text prompt (the processor then repeats the
#: pad token once per image token).
_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


@attrs.frozen(kw_only=True)
class EncodedImages:
    """What the image cache keeps for an ordered list of images: the vision
    encoder's output and the images' patch grid (which sets their rope
    positions), so a request about cached images needs neither the pixels
    nor the encoder.

    Attributes:
        features: ``(image tokens, hidden)`` encoder output, in image order.
        grid: ``(num_images, 3)`` patch grid (t, h, w) of each image.
    """

    features: Any = attrs.field(eq=False, repr=False)
    grid: Any = attrs.field(eq=False, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays held (what the image cache's budget counts)."""
        return int(self.features.nbytes + self.grid.nbytes)


@attrs.frozen(kw_only=True)
class VisionInputs:
    """A prompt's images as the model takes them.

    Attributes:
        grid: ``(num_images, 3)`` patch grid (t, h, w) of each image.
        token_counts: image tokens of each image, in order.
        pixel_values: the processor's patches of every image, in order, or
            None when ``features`` are known.
        features: the vision encoder's output for these images (from the
            image cache), or None to run the encoder if needed.
    """

    grid: Any = attrs.field(eq=False, repr=False)
    token_counts: tuple[int, ...]
    pixel_values: Any = attrs.field(default=None, eq=False, repr=False)
    features: Any = attrs.field(default=None, eq=False, repr=False)


class VisionPreparer:
    """The :class:`~mlxkv.actors.prompt_preparer.PromptPreparer` of a vision-language model.

    A prompt gets one image placeholder per image, at the start, unless it
    holds them already: a text prompt one ``<|image_pad|>`` per image; a
    token-id prompt one pad token per image, or each image's whole run of
    pad tokens as a previous request laid them out (a conversation's next
    turn: the previous ``prompt_ids``, its answer and new text). Each
    image's placeholder is then widened to its number of image tokens.
    Pixels are computed with the model's image processor, unless the image
    cache knows the images (``encoded``): then neither pixels nor the
    encoder are needed.
    """

    def __init__(self, processor: Any, tokenizer: Any, image_token_id: int) -> None:
        self._processor = processor
        self._tokenizer = tokenizer
        self._pad = image_token_id
        self._merge = int(getattr(processor.image_processor, "merge_size", 1)) ** 2
        vocab = processor.tokenizer
        self._frame = (
            vocab.convert_tokens_to_ids("<|vision_start|>"),
            vocab.convert_tokens_to_ids("<|vision_end|>"),
        )

    @functools.cached_property
    def max_chars_per_token(self) -> Optional[int]:
        return max_chars_per_token(self._tokenizer)

    def prepare(
        self, prompt: str | Seq[int], images: Seq[Any] = (), encoded: Optional[EncodedImages] = None
    ) -> PreparedPrompt:
        import mlx.core as mx

        pixels = None
        if encoded is not None:
            grid, features = encoded.grid, encoded.features
        elif images:
            try:
                processed = self._processor.image_processor(images=list(images), return_tensors="np")
            except (ValueError, OSError) as error:
                raise InvalidInput(
                    "images", counted(len(images), "image"), f"the image processor refused them: {error}"
                ) from error
            grid, features = mx.array(processed["image_grid_thw"]), None
            pixels = mx.array(processed["pixel_values"])
        else:
            grid = None
        num_images = 0 if grid is None else grid.shape[0]
        tokens = self._tokens(prompt, num_images)
        if grid is None:
            if self._pad in tokens:
                raise InvalidInput("prompt", counted(len(tokens), "token"), "holds image tokens but no images were given")
            return PreparedPrompt(tokens=tokens)
        counts = tuple(int(t * h * w) // self._merge for t, h, w in grid.tolist())
        tokens = self._widen(tokens, counts)
        inputs = VisionInputs(grid=grid, token_counts=counts, pixel_values=pixels, features=features)
        return PreparedPrompt(
            tokens=tokens, inputs=inputs, num_image_tokens=sum(counts), image_start=tokens.index(self._pad)
        )

    def _tokens(self, prompt: str | Seq[int], num_images: int) -> tuple[int, ...]:
        """The prompt's ids, with one placeholder per image at the start if it
        has none, and every image's pad tokens framed."""
        if not isinstance(prompt, str):
            tokens = tuple(prompt)
            if num_images and self._pad not in tokens:
                start, end = self._frame
                tokens = (start, self._pad, end) * num_images + tokens
            return self._framed(tokens)
        placeholders = prompt.count("<|image_pad|>")
        if placeholders and placeholders != num_images:
            raise InvalidInput(
                "prompt",
                prompt,
                f"has {plural(placeholders, 'image placeholder')} for {plural(num_images, 'image')}",
            )
        if num_images and not placeholders:
            prompt = _PLACEHOLDER * num_images + prompt
        return self._framed(self.encode(prompt))

    def _framed(self, tokens: tuple[int, ...]) -> tuple[int, ...]:
        """``tokens`` with ``<|vision_start|>`` before and ``<|vision_end|>``
        after every run of pad tokens that lacks them.

        The model finds an image by the start token before its pads (its
        rope positions, ``get_rope_index``): unframed pads would be text
        positions to it, and 2-D image positions to a prefix rebuilt from
        cache, so a bare placeholder is framed as the chat template frames it.
        """
        start, end = self._frame
        runs = _pad_runs(tokens, self._pad)
        if all(at > 0 and tokens[at - 1] == start for at, _ in runs):
            return tokens
        out: list[int] = []
        previous = 0
        for at, length in runs:
            out.extend(tokens[previous:at])
            stop = at + length
            if not (at > 0 and tokens[at - 1] == start):
                out.append(start)
            out.extend(tokens[at:stop])
            if not (stop < len(tokens) and tokens[stop] == end):
                out.append(end)
            previous = stop
        out.extend(tokens[previous:])
        return tuple(out)

    def encode(self, text: str) -> tuple[int, ...]:
        return encode_text(self._tokenizer, text)

    def _widen(self, tokens: tuple[int, ...], counts: tuple[int, ...]) -> tuple[int, ...]:
        """Each image's single pad token repeated once per image token (runs
        already that wide are left as they are)."""
        runs = _pad_runs(tokens, self._pad)
        if [length for _, length in runs] == list(counts):
            return tokens
        if len(runs) != len(counts) or any(length != 1 for _, length in runs):
            raise InvalidInput(
                "prompt",
                counted(len(tokens), "token"),
                f"holds image-token runs of {[n for _, n in runs]}, but the images need {list(counts)}",
            )
        out: list[int] = []
        previous = 0
        for (at, _), count in zip(runs, counts):
            out.extend(tokens[previous:at])
            out.extend([self._pad] * count)
            previous = at + 1
        out.extend(tokens[previous:])
        return tuple(out)

    def new_detokenizer(self) -> Any:
        return self._tokenizer.detokenizer

    def decode(self, tokens: Seq[int]) -> str:
        return self._tokenizer.decode(list(tokens))

    def token_pieces(self) -> list[Optional[bytes]]:
        from mlxkv.actors.json_constraint import token_pieces

        return token_pieces(self._tokenizer)


def _pad_runs(tokens: tuple[int, ...], pad: int) -> list[tuple[int, int]]:
    """(start, length) of each run of ``pad`` in ``tokens``."""
    runs: list[tuple[int, int]] = []
    for index, token in enumerate(tokens):
        if token != pad:
            continue
        if runs and runs[-1][0] + runs[-1][1] == index:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
    return runs


@attrs.define
class _Placement:
    """Where a request's prompt stands in rope space (the runner's per-request state)."""

    positions: Any  # (3, 1, prompt length - offset)
    delta: int
    #: the prompt index of ``positions``' first column
    offset: int = 0
    #: inputs_embeds of the uncached part, or None when it holds no image token
    embeds: Optional[Any] = None
    #: what happened to the request's images, until taken
    encoding: Optional[ImageEncoding] = None


class VisionRunner(CacheRunner):
    """A model runner for mlx-vlm's Qwen2-VL family (``get_rope_index``, mrope).

    Owns: the model (vision tower and language model) and its processor.
    """

    def __init__(self, model: Any, processor: Any, config: RunnerConfig = RunnerConfig()) -> None:
        """Describe ``model`` (on the MLX thread).

        Args:
            config: how to hold the model and its caches
                (:class:`~mlxkv.actors.compute_config.RunnerConfig`). Requests
                hold their own copy of a prefix here: ``shared_prefix`` and
                ``prefix_attention`` are not served. ``transpose_weights`` and
                ``fuse_projections`` change the linear weights of the vision
                tower and the language model in place, and ``compile_decode``
                its known decoder layers, only when True: a model handed in
                is the caller's (:meth:`load` decides for its own).

        Raises:
            ValueError: the model is not of the Qwen2-VL family (no
                ``get_rope_index``, ``vision_tower`` or feature merging), or
                ``kv_bits`` (not served for vision-language models).
        """
        if config.kv_bits:
            raise ValueError("kv_bits is not served for vision-language models")
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        language = getattr(model, "language_model", None)
        if not (
            hasattr(language, "get_rope_index")
            and hasattr(model, "vision_tower")
            and hasattr(model, "merge_input_ids_with_image_features")
        ):
            raise ValueError(
                f"vision-language model type {getattr(model.config, 'model_type', '?')!r} is not"
                " supported: mlxkv runs Qwen2-VL-style models (mrope positions)"
            )
        fused, transposed = hold_weights(model, config)
        compiled = compile_checked(model) if config.compile_decode is True else 0
        self._runner_config = config
        self._model = model
        self._language = language
        self._processor = processor
        self._config = model.config
        self._tokenizer = TokenizerWrapper(processor.tokenizer)
        fields, self._layout = self._measure()
        self._info = ModelInfo.from_args(
            language.args,
            self._tokenizer.eos_token_ids or (),
            takes_images=True,
            transposed_layers=transposed,
            fused_projections=fused,
            compiled_layers=compiled,
            **fields,
        )

    @classmethod
    def load(cls, path: str, config: RunnerConfig = RunnerConfig()) -> VisionRunner:
        """Load a vision-language model directory with ``mlx_vlm.load``
        (``config.transpose_weights`` None: where MLX runs on the CPU;
        ``fuse_projections`` None: fused).

        Raises:
            ValueError: mlx-vlm is not installed, or the constructor's.
        """
        try:
            from mlx_vlm import load
        except ImportError as error:
            raise ValueError(
                "this is a vision-language model: install the vlm extra (pip install 'mlxkv[vlm]')"
            ) from error
        model, processor = load(str(path))
        return cls(model, processor, loading(config))

    def preparer(self) -> VisionPreparer:
        return VisionPreparer(self._processor, self._tokenizer, self._config.image_token_id)

    def _new_cache(self) -> list[Any]:
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self._language.layers]

    def _probe(self, cache: list[Any]) -> None:
        import mlx.core as mx

        self._language(mx.array([[0]]), cache=cache, position_ids=mx.zeros((3, 1, 1), dtype=mx.int32))

    # -- one request ------------------------------------------------------------

    def start(self, sequence: SequenceState) -> None:
        import mlx.core as mx

        super().start(sequence)
        inputs: Optional[VisionInputs] = sequence.spec.inputs
        pad = self._config.image_token_id
        cached = sequence.num_cached
        needed = 0 if inputs is None else sequence.prompt[cached:].count(pad)
        if needed:
            # Image tokens still to compute: their 2-D positions from the model.
            ids = mx.array(sequence.prompt)[None]
            positions, deltas = self._language.get_rope_index(ids, inputs.grid)
            placement = _Placement(positions=positions, delta=int(deltas.reshape(-1)[0].item()))
        else:
            # Text only from here on: index + delta, where each image before
            # advanced the position by its largest grid side, not its tokens.
            delta = 0 if inputs is None else self._image_delta(inputs.grid)
            span = mx.arange(cached + delta, len(sequence.prompt) + delta, dtype=mx.int32)
            positions = mx.broadcast_to(span[None, None], (3, 1, span.size))
            placement = _Placement(positions=positions, delta=delta, offset=cached)
        if inputs is not None:
            before = sequence.prompt[:cached].count(pad)
            placement.encoding = ImageEncoding(ran=False)
            if needed:
                ids = mx.array(sequence.prompt)[None]
                features = inputs.features
                if features is None:
                    features = self._encode(inputs)
                    placement.encoding = ImageEncoding(
                        ran=True, features=EncodedImages(features=features, grid=inputs.grid)
                    )
                suffix = ids[:, sequence.num_cached :]
                embeds = self._language.model.embed_tokens(suffix)
                placement.embeds = self._model.merge_input_ids_with_image_features(
                    pad, self._config.video_token_id, features[before : before + needed], embeds, suffix
                )
        sequence.prepare(placement)

    def _text_only(self, sequence: SequenceState) -> bool:
        return sequence.spec.inputs is None

    def _image_delta(self, grid: Any) -> int:
        """How far text after these images sits from its index: each image
        spans ``max(t, h, w)`` positions (its merged grid) but ``t*h*w`` tokens."""
        merge = int(getattr(self._config.vision_config, "spatial_merge_size", 1))
        delta = 0
        for t, h, w in grid.tolist():
            h, w = h // merge, w // merge
            delta += max(t, h, w) - t * h * w
        return delta

    def _encode(self, inputs: VisionInputs) -> Any:
        import mlx.core as mx

        assert inputs.pixel_values is not None, "images without features come with their pixels"
        tower = self._model.vision_tower
        features = tower(inputs.pixel_values.astype(tower.patch_embed.proj.weight.dtype), inputs.grid)
        mx.eval(features)
        return features

    def _run(self, sequence: SequenceState, cache: list[Any], start: int, stop: int) -> Any:
        import mlx.core as mx

        placement: _Placement = sequence.prepared
        embeds = None
        if placement.embeds is not None:
            offset = sequence.num_cached
            embeds = placement.embeds[:, start - offset : stop - offset]
        ids = mx.array(sequence.prompt[start:stop])[None]
        at = placement.offset
        out = self._language(
            ids, inputs_embeds=embeds, cache=cache, position_ids=placement.positions[:, :, start - at : stop - at]
        )
        return out.logits

    def decode(self, inputs: Any, cache: list[Any], rows: Seq[SequenceState], positions: Seq[int]) -> Any:
        import mlx.core as mx

        at = mx.array(
            [[index + row.prepared.delta] for index, row in zip(positions, rows)], dtype=mx.int32
        )
        position_ids = mx.broadcast_to(at[None], (3, len(rows), 1))
        out = self._language(inputs[:, None], cache=cache, position_ids=position_ids)
        return out.logits[:, -1]

    def take_encoding(self, sequence: SequenceState) -> Optional[ImageEncoding]:
        placement = sequence.prepared
        if not isinstance(placement, _Placement):
            return None
        encoding, placement.encoding = placement.encoding, None
        return encoding
