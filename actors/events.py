"""What a generation request's event streams carry, from the compute path.

A request has two streams (or one for both): its events -- :class:`Prefilled`,
one :class:`Token` per job that produced tokens, then :class:`Finished` or
:class:`Failed` -- and what is to be cached -- :class:`Published` blocks,
:class:`PromptPublished`, :class:`ImagesEncoded` (see
:func:`goes_to_cache`). Plain records, made by the scheduler (no anyio, no
MLX; payloads and logits are carried opaquely, evaluated).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import attrs

from mlxkv.cache.errors import CacheError
from mlxkv.actors.token_logprobs import TokenLogprob

__all__ = [
    "ComputeFailed",
    "Event",
    "Failed",
    "Finished",
    "ImagesEncoded",
    "Prefilled",
    "PromptPublished",
    "Published",
    "Token",
    "events_needed",
    "goes_to_cache",
]


class ComputeFailed(CacheError):
    """A step of a request's computation raised: a model call it took part
    in, or a step done for it alone (slicing, merging or keeping its cache,
    sampling its token).

    Attributes:
        request_id: the request whose computation failed.
        cause: the exception raised.
    """

    def __init__(self, request_id: Optional[str], cause: BaseException) -> None:
        self.request_id = request_id
        self.cause = cause
        super().__init__(
            f"computing request {request_id!r} failed: {type(cause).__name__}: {cause}"
        )


@attrs.frozen(kw_only=True)
class Published:
    """Full blocks ``[start, start + len(payloads))`` of the request, computed.

    Attributes:
        start: index of the first block.
        payloads: their KV, owned and evaluated; each block of a model with
            recurrent layers carries the state snapshot at its end.
        tokens: the token ids those blocks hold (prompt or answer),
            ``block_size`` per block.
    """

    start: int
    payloads: tuple[Any, ...] = attrs.field(eq=False, repr=lambda p: f"<{len(p)} blocks>")
    tokens: tuple[int, ...] = attrs.field(default=(), eq=False, repr=False)


@attrs.frozen(kw_only=True)
class PromptPublished:
    """Every full block of the prompt that the request publishes is out.

    Blocks it was asked to compute but could not publish (its KV cannot be
    sliced exactly) will not come: whoever waits for them should stop.
    """


@attrs.frozen(kw_only=True)
class ImagesEncoded:
    """The vision encoder ran for the request's images (before any token).

    Attributes:
        features: its output for all the images, in order (evaluated).
    """

    features: Any = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class Prefilled:
    """The prompt is computed; sent just before the first :class:`Token`.

    Attributes:
        num_cached: prompt tokens not computed: rebuilt from the cached
            prefix, or taken from a kept cache.
        cold_fallback: the prefix could not be rebuilt, so the whole prompt
            was computed.
        logits: the logits of the last prompt position (the first token is
            sampled from them), evaluated, ``(vocab,)``.
        prompt_logprobs: the records of the prompt's tokens but the first,
            in order, where the request asked for them, else empty.
    """

    num_cached: int
    cold_fallback: bool = False
    logits: Any = attrs.field(default=None, eq=False, repr=False)
    prompt_logprobs: tuple[TokenLogprob, ...] = attrs.field(default=(), repr=False)


@attrs.frozen(kw_only=True)
class Token:
    """The tokens a request generated in one job (one, or a decode burst's).

    Attributes:
        tokens: the token ids, in order.
        logprobs: each token's step log-probabilities ``(vocab,)`` when the
            request asked to keep them (``keep_logits``), else empty.
        token_logprobs: each token's
            :class:`~mlxkv.actors.token_logprobs.TokenLogprob` when the
            request asked for them (``top_logprobs``), else empty.
    """

    tokens: tuple[int, ...]
    logprobs: tuple[Any, ...] = attrs.field(default=(), eq=False, repr=False)
    token_logprobs: tuple[TokenLogprob, ...] = ()


@attrs.frozen(kw_only=True)
class Finished:
    """The request is done.

    Attributes:
        reason: ``"stop"`` (a stop token, not emitted) or ``"length"``.
        num_stored: tokens whose KV the published blocks cover in all.
    """

    reason: Literal["stop", "length"]
    num_stored: int = 0


@attrs.frozen(kw_only=True)
class Failed:
    """The request failed; nothing more follows.

    Attributes:
        error: why (:class:`ComputeFailed`, :class:`InvalidInput`...).
    """

    error: CacheError


#: What a request's event stream carries.
Event = Published | PromptPublished | ImagesEncoded | Prefilled | Token | Finished | Failed


def events_needed(num_prompt: int, max_tokens: int, block_size: int) -> int:
    """How many events a request can receive at most: size its stream so.

    One per published batch of the prompt's blocks (each holds at least one
    full block, however the prompt is cut into chunks), the images'
    features, the prompt-published and prefilled marks, one per token, the
    answer's blocks, and the end. Enough for either of a request's two
    streams, or for both on one.
    """
    return num_prompt // block_size + max_tokens + 6


def goes_to_cache(event: Event) -> bool:
    """Whether ``event`` is for whoever stores the request's blocks, not for
    its consumer."""
    return isinstance(event, (Published, PromptPublished, ImagesEncoded))
