"""Tokens' log-probabilities in the OpenAI API's two shapes.

A request that asks for them (``logprobs: k`` on ``/v1/completions``;
``logprobs: true`` with ``top_logprobs: k`` on ``/v1/chat/completions``) gets,
for every token its choice generated (as many as its usage counts, the
token that completed a stop string included), the token's log-probability
under the model and the ``k`` most likely tokens at its step
(:class:`~mlxkv.actors.token_logprobs.TokenLogprob`, picked on the device).

A token is shown as its own text (the tokenizer's decoding of it alone) and,
in the chat shape, that text's UTF-8 bytes: a token that holds part of a
multi-byte character decodes to U+FFFD there, as the tokenizer decodes it.

:class:`TokenTexts` owns the decoded texts (bounded: a vocabulary's worth at
most). The shapes:

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}, ...]}, ...]}``;
- completions: ``{"tokens": [...], "token_logprobs": [...], "top_logprobs":
  [{token: logprob, ...}, ...], "text_offset": [...]}`` (two alternatives of
  the same text keep the likelier, as a JSON object must).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Callable

import attrs

from mlxkv.actors.token_logprobs import TokenLogprob

__all__ = ["LoggedToken", "TokenTexts", "chat_logprobs", "completion_logprobs", "echoed_logprobs"]

#: The most token texts kept (a vocabulary of up to this many is decoded once a token).
MAX_CACHED_TEXTS = 1 << 18


@attrs.frozen
class LoggedToken:
    """A generated token's record and where its text starts in its choice's text.

    Attributes:
        record: its log-probability and alternatives.
        offset: the number of characters its choice's text had before it.
    """

    record: TokenLogprob
    offset: int


class TokenTexts:
    """Each token id's text, decoded once (bounded by :data:`MAX_CACHED_TEXTS`).

    Owns: the cache of decoded texts. Runs on the event loop: decoding one
    token is microseconds.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self.text = functools.lru_cache(maxsize=MAX_CACHED_TEXTS)(self._decoded)

    def _decoded(self, token: int) -> str:
        return self._decode([token])


def chat_logprobs(tokens: Sequence[LoggedToken], texts: TokenTexts) -> dict[str, Any]:
    """The chat shape of ``tokens``' log-probabilities."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = texts.text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {
                **entry(logged.record.token, logged.record.logprob),
                "top_logprobs": [entry(token, logprob) for token, logprob in logged.record.top],
            }
            for logged in tokens
        ]
    }


def completion_logprobs(tokens: Sequence[LoggedToken], texts: TokenTexts) -> dict[str, Any]:
    """The completions shape of ``tokens``' log-probabilities."""
    top: list[dict[str, float]] = []
    for logged in tokens:
        alternatives: dict[str, float] = {}
        for token, logprob in logged.record.top:  # most likely first: a repeated text keeps the likelier
            alternatives.setdefault(texts.text(token), logprob)
        top.append(alternatives)
    return {
        "tokens": [texts.text(logged.record.token) for logged in tokens],
        "token_logprobs": [logged.record.logprob for logged in tokens],
        "top_logprobs": top,
        "text_offset": [logged.offset for logged in tokens],
    }


def echoed_logprobs(
    prompt: Sequence[int], records: Sequence[TokenLogprob], texts: TokenTexts, echoed: int, answer: dict[str, Any]
) -> dict[str, Any]:
    """``answer``'s completions shape (:func:`completion_logprobs`) after the
    prompt's own entries: the prompt's first token with none (null), then
    ``records`` (one for each prompt token after it); the prompt's offsets
    are its tokens' texts' (joined, which a tokenizer's decoding of the whole
    may not quite be), the answer's moved past the ``echoed`` characters of
    the prompt's text."""
    shown = [texts.text(token) for token in prompt]
    offsets = [sum(map(len, shown[:i])) for i in range(len(shown))]
    logged = [LoggedToken(record, offset) for record, offset in zip(records, offsets[1:])]
    own = completion_logprobs(logged, texts)
    return {
        "tokens": shown + answer["tokens"],
        "token_logprobs": [None, *own["token_logprobs"], *answer["token_logprobs"]],
        "top_logprobs": [None, *own["top_logprobs"], *answer["top_logprobs"]],
        "text_offset": [0, *own["text_offset"], *(echoed + offset for offset in answer["text_offset"])],
    }
