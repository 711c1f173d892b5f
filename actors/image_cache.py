"""The image cache actor: vision-encoder output per ordered list of images.

:class:`ImageCacheActor` owns one
:class:`~mlxkv.cache.mllm.MLLMPrefixCacheManager` (an LRU bounded by entry
count and bytes). Images are keyed by their full-strength, order-sensitive
digest (:func:`mlxkv.images.key_images`: a picture's decoded pixels), computed
by the caller -- keying reads files and decodes pictures, which does not
belong in a handler -- and namespaced by the tenant's ``cache_salt``.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs

from mlxkv.actors.actor import Actor, ActorHandle, Ask, Message
from mlxkv.cache.errors import InvalidInput, InvariantViolation
from mlxkv.cache.mllm import MLLMPrefixCacheManager

__all__ = [
    "CheckInvariants",
    "ImageCacheActor",
    "ImageCacheHandle",
    "ImageCacheStatistics",
    "ImageEntry",
    "LookupImages",
    "Statistics",
    "StoreImages",
]


@attrs.frozen(kw_only=True)
class ImageEntry:
    """What is cached for one ordered list of images.

    Attributes:
        vision_embeddings: the vision encoder's output (a private copy).
        num_image_tokens: how many prompt tokens the images stand for.
    """

    vision_embeddings: Any = attrs.field(eq=False, repr=False)
    num_image_tokens: int


@attrs.frozen(kw_only=True)
class ImageCacheStatistics:
    """A snapshot of the image cache.

    Attributes:
        num_entries: entries held.
        max_entries: the entry bound.
        num_bytes: bytes of arrays held.
        max_bytes: the byte bound.
        num_hits: lookups that found their images.
        num_misses: lookups that found nothing.
        num_evictions: entries dropped for count or memory.
    """

    num_entries: int
    max_entries: int
    num_bytes: int
    max_bytes: int
    num_hits: int
    num_misses: int
    num_evictions: int


@attrs.frozen(kw_only=True)
class LookupImages(Ask[Optional[ImageEntry]]):
    """Find the entry of ``images_key`` (a 64-hex images digest) for the salt."""

    images_key: str
    cache_salt: Optional[str] = None


@attrs.frozen(kw_only=True)
class StoreImages(Ask[None]):
    """Keep a copy of ``vision_embeddings`` for ``images_key``, evicting LRU entries."""

    images_key: str
    vision_embeddings: Any = attrs.field(eq=False, repr=False)
    num_image_tokens: int = 0
    cache_salt: Optional[str] = None


@attrs.frozen(kw_only=True)
class Statistics(Ask[ImageCacheStatistics]):
    """Report :class:`ImageCacheStatistics`."""

    polled = True


@attrs.frozen(kw_only=True)
class CheckInvariants(Ask[tuple[str, ...]]):
    """Verify the cache; reply with the violations found."""

    polled = True


class ImageCacheActor(Actor):
    """Owns the multimodal cache: vision embeddings per (salt, ordered images).

    Owns: one :class:`MLLMPrefixCacheManager` (entries, LRU order, byte count,
    statistics).

    Invariants:
        - the manager's invariants (count and byte bounds, index in step);
        - a handler that raises a CacheError has changed nothing.
    """

    name = "image_cache"

    def __init__(
        self,
        *,
        max_entries: int = 50,
        max_bytes: int = 2 << 30,
        **options: Any,
    ) -> None:
        """Create an empty cache.

        Args:
            max_entries: the most entries kept.
            max_bytes: the most bytes of arrays kept.
            **options: the :class:`Actor` options (``mailbox_size``, ``trace``,
                ``trace_polls``, ``intercept``).

        Raises:
            InvalidInput: a bound is not positive.
        """
        self._cache = MLLMPrefixCacheManager(
            max_entries=max_entries, max_memory_mb=max_bytes / (1 << 20)
        )
        super().__init__(**options)

    def handle(self, message: Message) -> Any:
        """Dispatch ``message`` to its handler.

        Raises:
            CacheError: the handler's domain error; nothing changed.
        """
        match message:
            case LookupImages():
                entry, _ = self._cache.fetch(
                    [_key(message.images_key)], "", cache_salt=message.cache_salt
                )
                if entry is None or entry.vision_embeddings is None:
                    return None
                return ImageEntry(
                    vision_embeddings=entry.vision_embeddings,
                    num_image_tokens=entry.num_image_tokens,
                )
            case StoreImages():
                count = message.num_image_tokens
                if count.__class__ is not int or count < 0:
                    raise InvalidInput("num_image_tokens", count, "must be an int >= 0")
                self._cache.store(
                    [_key(message.images_key)],
                    "",
                    message.vision_embeddings,
                    [],
                    [0] * count,
                    num_image_tokens=count,
                    cache_salt=message.cache_salt,
                )
                return None
            case Statistics():
                return self._statistics()
            case CheckInvariants():
                try:
                    self._cache.check_invariants()
                except InvariantViolation as error:
                    return (f"image_cache: {error}",)
                return ()
        return super().handle(message)

    def _statistics(self) -> ImageCacheStatistics:
        cache = self._cache
        stats = cache.get_stats()
        return ImageCacheStatistics(
            num_entries=stats["entries"],
            max_entries=cache.max_size,
            num_bytes=round(stats["memory_used_mb"] * (1 << 20)),
            max_bytes=cache.max_memory,
            num_hits=stats["hits"],
            num_misses=stats["misses"],
            num_evictions=stats["evictions"],
        )


def _key(images_key: str) -> bytes:
    try:
        key = bytes.fromhex(images_key)
    except (TypeError, ValueError):
        key = b""
    if len(key) != 32:
        raise InvalidInput("images_key", images_key, "must be a 64-hex images_digest")
    return key


class ImageCacheHandle(ActorHandle):
    """Typed calls to an :class:`ImageCacheActor`; messages stay inside."""

    async def lookup(
        self, images_key: str, *, cache_salt: Optional[str] = None, request_id: Optional[str] = None
    ) -> Optional[ImageEntry]:
        """See :class:`LookupImages`.

        Raises:
            InvalidInput: a malformed key or salt.
            ActorFailed: the actor is not running.
        """
        return await self._ref.ask(
            LookupImages, images_key=images_key, cache_salt=cache_salt, request_id=request_id
        )

    async def store(
        self,
        images_key: str,
        vision_embeddings: Any,
        *,
        num_image_tokens: int = 0,
        cache_salt: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> None:
        """See :class:`StoreImages`.

        Raises:
            InvalidInput: a malformed key, salt or token count.
            ActorFailed: the actor is not running.
        """
        await self._ref.ask(
            StoreImages,
            images_key=images_key,
            vision_embeddings=vision_embeddings,
            num_image_tokens=num_image_tokens,
            cache_salt=cache_salt,
            request_id=request_id,
        )

    async def statistics(self) -> ImageCacheStatistics:
        """See :class:`Statistics`."""
        return await self._ref.ask(Statistics)

    async def check_invariants(self) -> tuple[str, ...]:
        """See :class:`CheckInvariants`."""
        return await self._ref.ask(CheckInvariants)
