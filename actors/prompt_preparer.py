"""Prompts made ready for a model: a request's text (or token ids) and images
become :class:`PreparedPrompt` token ids through the model's
:class:`PromptPreparer` (:class:`TextPreparer` for a text model, its
tokenizer; a vision-language model's is in :mod:`mlxkv.actors.vision_runner`),
and tokens become text again.

A preparer is made once a model and shared: it holds read-only tokenizer and
processor state only, and may run on any thread, never touching the MLX
thread's graphs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence as Seq
from typing import Any, Optional, Protocol

import attrs

from mlxkv.actors.token_bound import max_chars_per_token
from mlxkv.cache.errors import InvalidInput

__all__ = ["ImageEncoding", "PreparedPrompt", "PromptPreparer", "TextPreparer", "encode_text"]


@attrs.frozen(kw_only=True)
class PreparedPrompt:
    """A prompt ready for the model: its token ids, and what else the runner needs.

    Attributes:
        tokens: the token ids (a vision-language prompt's include one
            image-pad token per image token).
        inputs: runner-specific inputs (a vision model's pixels); None for
            text.
        num_image_tokens: image tokens among ``tokens``.
        image_start: the index of the first image token (None without):
            the KV before it depends on the tokens alone.
    """

    tokens: tuple[int, ...] = attrs.field(repr=lambda t: f"<{len(t)} tokens>")
    inputs: Any = attrs.field(default=None, eq=False, repr=False)
    num_image_tokens: int = 0
    image_start: Optional[int] = None


@attrs.frozen(kw_only=True)
class ImageEncoding:
    """What became of a request's images when its prefill started.

    Attributes:
        ran: the vision encoder ran (else the features came from the image
            cache, or the cached prefix covered every image token).
        features: what the image cache should keep for these images (the
            encoder's output and whatever else the preparer needs to do
            without pixels next time), evaluated; None unless it ran.
    """

    ran: bool
    features: Any = attrs.field(default=None, eq=False, repr=False)


class PromptPreparer(Protocol):
    """Turns a request's prompt (and images) into token ids, and tokens back into text.

    Made once per model and shared: it holds only read-only tokenizer and
    processor state, and may run on any thread (a worker thread for images),
    never touching MLX graphs of the MLX thread.
    """

    def prepare(self, prompt: str | Seq[int], images: Seq[Any] = (), encoded: Any = None) -> PreparedPrompt:
        """The prompt's token ids.

        Args:
            prompt: text or token ids.
            images: decoded pictures (``PIL.Image``), in order.
            encoded: what the image cache holds for the images (an
                :class:`ImageEncoding`'s ``features``), instead of ``images``.

        Raises:
            InvalidInput: images given to a model that does not take them,
                or image tokens that do not match the images.
        """
        ...

    def encode(self, text: str) -> tuple[int, ...]:
        """The tokenizer's ids for ``text`` as written: an image placeholder
        stays one pad token (for building prompts; :meth:`prepare` widens it)."""
        ...

    @property
    def max_chars_per_token(self) -> Optional[int]:
        """The most characters of text one token can stand for, or None if the
        tokenizer may drop text (:func:`~mlxkv.actors.token_bound.max_chars_per_token`):
        a text longer than this times a context cannot fit it."""
        ...

    def new_detokenizer(self) -> Any:
        """A fresh mlx-lm streaming detokenizer, owned by the caller."""
        ...

    def decode(self, tokens: Seq[int]) -> str:
        """The text of ``tokens``."""
        ...

    def token_pieces(self) -> list[Optional[bytes]]:
        """Each token's bytes in the text, None for one that adds none
        (:func:`~mlxkv.actors.json_constraint.token_pieces`)."""
        ...


def encode_text(tokenizer: Any, text: str) -> tuple[int, ...]:
    """``text``'s token ids, special tokens as ``tokenizer`` adds them.

    ``verbose=False``: transformers would warn about a text longer than the
    tokenizer's ``model_max_length``; generation checks the model's context
    itself and refuses what does not fit (``InvalidInput``), so the warning
    would only repeat it, on the application's console.
    """
    return tuple(tokenizer.encode(text, verbose=False))


class TextPreparer:
    """The :class:`PromptPreparer` of a text model: its mlx-lm tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    @functools.cached_property
    def max_chars_per_token(self) -> Optional[int]:
        # Read off the tokenizer's description once, when first asked (the
        # server asks as it starts; a runtime alone never does).
        return max_chars_per_token(self._tokenizer)

    def prepare(self, prompt: str | Seq[int], images: Seq[Any] = (), encoded: Any = None) -> PreparedPrompt:
        if images or encoded is not None:
            raise InvalidInput("images", images, "this model does not take images")
        if isinstance(prompt, str):
            return PreparedPrompt(tokens=self.encode(prompt))
        return PreparedPrompt(tokens=tuple(prompt))

    def encode(self, text: str) -> tuple[int, ...]:
        return encode_text(self._tokenizer, text)

    def new_detokenizer(self) -> Any:
        return self._tokenizer.detokenizer

    def token_pieces(self) -> list[Optional[bytes]]:
        from mlxkv.actors.json_constraint import token_pieces

        return token_pieces(self._tokenizer)

    def decode(self, tokens: Seq[int]) -> str:
        return self._tokenizer.decode(list(tokens))
