"""RuntimeConfig: everything a :class:`~mlxkv.runtime.CacheRuntime` is built from.

One frozen record of the runtime's own fields and its parts (the compute
actor's :class:`~mlxkv.actors.compute_config.SchedulingConfig` and
:class:`~mlxkv.actors.compute_config.RunnerConfig`), each value checked as
the record is built, so a runtime never starts on a bad one. The command
line builds it in :mod:`mlxkv.runtime_options`.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import attrs

from mlxkv.actors.compute_config import RunnerConfig, SchedulingConfig
from mlxkv.cache.errors import InvalidInput, Shown
from mlxkv.cache.validators import int_at_least, is_bool
from mlxkv.images import MAX_PIXELS
from mlxkv.units import parse_bytes

__all__ = ["RuntimeConfig"]


def _model_path(value: Any) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise InvalidInput("model", value, "must be a model directory (str or path) or None")
    return value


def _tier_urls(value: Any) -> tuple[str, ...]:
    """``kv_tiers`` as a tuple of checked URLs (one string is one URL)."""
    from mlxkv.cache.tiers.tier_url import parse_tier_url

    urls = (value,) if isinstance(value, str) else value
    try:
        urls = tuple(urls)
    except TypeError:
        raise InvalidInput("kv_tiers", value, "must be a URL or a sequence of URLs") from None
    for url in urls:
        parse_tier_url(url)
    return urls


def _shown_tier_urls(urls: tuple[str, ...]) -> str:
    """``kv_tiers`` as a repr may show it: passwords redacted."""
    from mlxkv.cache.tiers.tier_url import redact_url

    return repr(tuple(redact_url(url) for url in urls))


def _byte_budget(value: Any) -> Optional[int]:
    return None if value is None else parse_bytes(value, argument="kv_memory")


#: The parts of a :class:`RuntimeConfig`: its field name, and the class whose
#: fields may also be given to it by name.
_PARTS: dict[str, type] = {"scheduling": SchedulingConfig, "runner": RunnerConfig}
#: Each part's field names, and the part that declares them.
_PART_OF: dict[str, str] = {
    field.name: part for part, cls in _PARTS.items() for field in attrs.fields(cls)
}
#: Names a field had before, still taken and read (with a DeprecationWarning): old name -> field.
_RENAMED = {"keep_last_cache": "keep_caches"}


@attrs.frozen(kw_only=True, init=False)
class RuntimeConfig:
    """Everything a :class:`CacheRuntime` is built from; change with ``attrs.evolve``.

    Made of the parts its components take whole -- ``scheduling``
    (:class:`~mlxkv.actors.compute_config.SchedulingConfig`) and ``runner``
    (:class:`~mlxkv.actors.compute_config.RunnerConfig`), each validated
    where it is built -- and the fields of the runtime itself. A part's
    fields may be given, and read, by name too: ``RuntimeConfig(prefill_chunk=64)``
    is ``RuntimeConfig(scheduling=SchedulingConfig(prefill_chunk=64))``, and
    its ``prefill_chunk`` is ``scheduling.prefill_chunk``; a name given
    beside its part changes that part. ``keep_last_cache`` is still taken
    and read as the old name of ``keep_caches``, with a ``DeprecationWarning``.

    Attributes:
        block_size: tokens per KV block.
        max_blocks: usable blocks in the pool (>= 1): the pool holds this
            many blocks of KV (the allocator's null block, a placeholder that
            holds none, comes on top).
        mailbox_size: messages each actor buffers before senders wait.
        image_cache_entries: the most image entries kept.
        memory_budget: bytes of arrays the image cache may hold (vision
            embeddings); the KV block pool is bounded by ``max_blocks``.
        trace: emit one ``message.handled`` event per message handled
            (and one ``generation.finished`` per generation).
        trace_polls: with ``trace``, also trace the messages that callers
            poll (statistics, invariant checks); off by default.
        model: an mlx-lm model directory (or a Hugging Face repo id, where
            the machine can download), loaded by a compute actor so that
            :meth:`CacheRuntime.generate` works; None (the default) runs the
            cache without a model.
        kv_memory: bytes the KV block pool may hold (an int or a size such as
            ``"2GiB"``, see :func:`~mlxkv.units.parse_bytes`). With it, the
            pool holds as many blocks as fit, sized from the loaded model's
            KV bytes per token, and ``max_blocks`` is ignored; it needs a
            model.
        share_in_flight: a generation whose prefix another generation is
            computing right now waits for those blocks instead of computing
            them again (on by default; off only to measure what it saves).
        kv_tiers: tiers below the block pool, fastest first, as URLs:
            ``file:///path?max_bytes=N`` (a directory; ``file://`` alone is
            the default one under the cache directory) and
            ``redis://host:port/db?ttl=S&timeout=S`` (Redis or Valkey, with
            the ``redis`` extra). Every full block stored in the pool is
            also written behind to each tier; a prefix the pool misses
            continues from them. Needs a model. Empty (the default): no tiers.
        max_request_images: the most images one generation request may have.
        max_request_pixels: the most pixels one generation request's images
            may have together (checked from their headers, before any is
            decoded: a decoded picture takes 3 bytes a pixel); each image
            also has at most :data:`mlxkv.images.MAX_PIXELS`.
        freeze_gc: once started, move every object alive then (the model
            and its libraries) out of the cyclic garbage collector's scans
            (``gc.freeze()``), so that a full collection does not stall the
            requests in flight for as long as it scans the model's objects;
            the last such runtime of the process to stop unfreezes them (see
            :mod:`mlxkv.heap_freeze`). Off for an application that freezes
            the heap itself.
        scheduling: how the compute actor cuts its work into plans (see
            :class:`~mlxkv.actors.compute_config.SchedulingConfig` for its fields).
        runner: how the model and its caches are held (see
            :class:`~mlxkv.actors.compute_config.RunnerConfig` for its fields).

    Raises:
        InvalidInput: a field is out of range or not a field, ``kv_memory``
            or ``kv_tiers`` without a model, or a tier URL that names no tier.
    """

    block_size: int = attrs.field(default=64, validator=int_at_least(1))
    max_blocks: int = attrs.field(default=1024, validator=int_at_least(1))
    mailbox_size: int = attrs.field(default=64, validator=int_at_least(1))
    image_cache_entries: int = attrs.field(default=50, validator=int_at_least(1))
    memory_budget: int = attrs.field(default=2 << 30, validator=int_at_least(1))
    trace: bool = attrs.field(default=False, validator=is_bool)
    trace_polls: bool = attrs.field(default=False, validator=is_bool)
    model: Optional[str] = attrs.field(default=None, converter=_model_path)
    kv_memory: Optional[int] = attrs.field(default=None, converter=_byte_budget)
    share_in_flight: bool = attrs.field(default=True, validator=is_bool)
    kv_tiers: tuple[str, ...] = attrs.field(default=(), converter=_tier_urls, repr=_shown_tier_urls)
    max_request_images: int = attrs.field(default=16, validator=int_at_least(1))
    max_request_pixels: int = attrs.field(default=MAX_PIXELS, validator=int_at_least(1))
    freeze_gc: bool = attrs.field(default=True, validator=is_bool)
    scheduling: SchedulingConfig = attrs.field(
        factory=SchedulingConfig, validator=attrs.validators.instance_of(SchedulingConfig)
    )
    runner: RunnerConfig = attrs.field(factory=RunnerConfig, validator=attrs.validators.instance_of(RunnerConfig))

    def __init__(self, **options: Any) -> None:
        for old, name in _RENAMED.items():
            if old in options:
                if name in options:
                    raise InvalidInput(old, options[old], f"is the old name of {name}: give one of them")
                warnings.warn(f"{old} is the old name of {name}", DeprecationWarning, stacklevel=2)
                options[name] = options.pop(old)
        own = {name: value for name, value in options.items() if name not in _PART_OF}
        for name in own:
            if name not in _OWN_FIELDS:
                raise InvalidInput(name, own[name], "is not a RuntimeConfig field")
        for part, cls in _PARTS.items():
            named = {name: value for name, value in options.items() if _PART_OF.get(name) == part}
            base = own.get(part, cls())
            if not isinstance(base, cls):
                raise InvalidInput(part, base, f"must be a {cls.__name__}")
            own[part] = attrs.evolve(base, **named) if named else base
        self.__attrs_init__(**own)  # type: ignore[attr-defined]

    @classmethod
    def field_names(cls) -> frozenset[str]:
        """Every name the constructor takes: its own fields and each part's."""
        return _OWN_FIELDS | frozenset(_PART_OF) | frozenset(_RENAMED)

    def __getattr__(self, name: str) -> Any:
        if name in _RENAMED:
            warnings.warn(f"{name} is the old name of {_RENAMED[name]}", DeprecationWarning, stacklevel=2)
            name = _RENAMED[name]
        part = _PART_OF.get(name)
        if part is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, part), name)

    def __attrs_post_init__(self) -> None:
        if self.kv_memory is not None and self.model is None:
            raise InvalidInput("kv_memory", self.kv_memory, "sizes the pool from a model: pass model=PATH")
        if self.kv_tiers and self.model is None:
            raise InvalidInput("kv_tiers", Shown(_shown_tier_urls(self.kv_tiers)), "store a model's KV: pass model=PATH")


_OWN_FIELDS = frozenset(field.name for field in attrs.fields(RuntimeConfig))
