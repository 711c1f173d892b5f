"""CacheRuntime: the public, async face of the cache, over three actors.

``async with CacheRuntime(...) as rt:`` starts a :class:`PrefixIndexActor`,
an :class:`ImageCacheActor` and a :class:`BlockAllocatorActor` in one task
group. With ``model=`` it also starts a :class:`ComputeActor` that loads the model
and serves :meth:`CacheRuntime.generate` (see :mod:`mlxkv.generation`).
The runtime is the only place that talks to several actors in
sequence; each of its calls follows one rule so that cancellation, at any
await, leaves nothing behind:

    Take (cancellable) -> hand over (shielded) -> done.

*Taking* asks one actor for something (a table, block references). If the
caller is cancelled while asking, the actor-ref machinery gives back whatever
the reply granted (:meth:`ActorRef.ask`). *Handing over* moves references
from the caller's hands into the request's table with one shielded
:class:`Record`/:class:`Adopt`: it either succeeds (the table owns them) or
raises (the caller still owns them and releases them, shielded). Releasing
is always shielded. So at every await the owner of each reference is known.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Optional

import anyio
import attrs
from anyio.abc import TaskGroup, TaskStatus

from mlxkv.actors.actor import Actor, ActorFailed, ActorRef, ActorStatistics, Intercept
from mlxkv.actors.allocator import (
    BlockAllocatorActor,
    BlockAllocatorHandle,
    BlockGrant,
    BlockId,
    Grants,
)
from mlxkv.actors.compute import (
    DEFAULT_PREFILL_BATCH,
    DEFAULT_PREFILL_BUDGET,
    DEFAULT_PREFILL_CHUNK,
    ComputeActor,
    ComputeHandle,
    ComputeStatistics,
)
from mlxkv.actors.model_runner import ModelInfo, PromptPreparer
from mlxkv.actors.sampling import Sampling
from mlxkv.actors.model_source import check_model_source
from mlxkv.actors.image_cache import (
    ImageCacheActor,
    ImageCacheHandle,
    ImageCacheStatistics,
)
from mlxkv.actors.prefix_index import (
    PrefixIndexActor,
    PrefixIndexHandle,
    PrefixIndexStatistics,
    RequestId,
    TokenIds,
)
from mlxkv.cache.block_hash import ChainKeys
from mlxkv.cache.errors import InvalidInput, UnknownRequest
from mlxkv.cache.pool import PoolStatistics
from mlxkv.cache.token_ids import check_token_ids
from mlxkv.errors import RuntimeClosed
from mlxkv.images import PixelMemo, key_images
from mlxkv.units import format_bytes, format_count, parse_bytes
from mlxkv.generation import Generation, make_request, run_generation

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = [
    "CacheRuntime",
    "FetchResult",
    "GenerationStatistics",
    "KVMemoryStatistics",
    "RequestHandle",
    "RuntimeConfig",
    "RuntimeStatistics",
    "StoreResult",
]


def _int_at_least(minimum: int) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value.__class__ is not int or value < minimum:
            raise InvalidInput(attribute.name, value, f"must be an int >= {minimum}")

    return check


def _is_bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value.__class__ is not bool:
        raise InvalidInput(attribute.name, value, "must be a bool")


def _model_path(value: Any) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise InvalidInput("model", value, "must be a model directory (str or path) or None")
    return value


def _byte_budget(value: Any) -> Optional[int]:
    return None if value is None else parse_bytes(value, argument="kv_memory")


@attrs.frozen(kw_only=True)
class RuntimeConfig:
    """Everything a :class:`CacheRuntime` is built from; change with ``attrs.evolve``.

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
        prefill_chunk: the most prompt tokens of one request one prefill
            plan runs.
        prefill_budget: the most work one prefill plan runs over all the
            requests it serves, in token units: a chunk of ``n`` new tokens
            after ``c`` earlier ones costs ``n * (1 + (c + n/2) / u)`` with
            ``u`` the model's ``model_info.context_unit`` (attention over a
            long context counts), and the oldest request's chunk always
            fits: a decode step waits behind at most one such plan.
        prefill_batch: the most requests whose chunks one prefill plan runs
            (in one model call where the model batches prefill).
        share_in_flight: a generation whose prefix another generation is
            computing right now waits for those blocks instead of computing
            them again (on by default; off only to measure what it saves).
        shared_prefix: requests that begin with the same cached blocks hold
            that prefix's KV once (one buffer per prefix, attended to once
            per step for all of them) and own only their suffix, where the
            model allows (``model_info.shared_prefix``: a text model whose
            layers are all plain KV); off, each request holds a copy (only
            to measure what it saves).
        kv_bits: quantize the model's attention KV to 4 or 8 bits (mlx-lm's
            ``QuantizedKVCache``) in live caches and in the block pool, so
            each block takes about 3.8x (8 bits) or 6.4x (4 bits) less
            memory than float32; requests then decode one at a time (mlx-lm
            cannot batch quantized caches) and hold their own prefix copies.
            None (the default) keeps the model's precision.
        keep_last_cache: the compute actor keeps the KV of the generation
            that finished last (one request's, beside the block pool) and
            hands it to the next one that shares its first tokens, which
            then computes only the rest: all shared tokens within one cache
            salt and set of images, only its cached blocks' tokens across
            salts (on by default).

    Raises:
        InvalidInput: a field is out of range, or ``kv_memory`` without a model.
    """

    block_size: int = attrs.field(default=64, validator=_int_at_least(1))
    max_blocks: int = attrs.field(default=1024, validator=_int_at_least(1))
    mailbox_size: int = attrs.field(default=64, validator=_int_at_least(1))
    image_cache_entries: int = attrs.field(default=50, validator=_int_at_least(1))
    memory_budget: int = attrs.field(default=2 << 30, validator=_int_at_least(1))
    trace: bool = attrs.field(default=False, validator=_is_bool)
    trace_polls: bool = attrs.field(default=False, validator=_is_bool)
    model: Optional[str] = attrs.field(default=None, converter=_model_path)
    kv_memory: Optional[int] = attrs.field(default=None, converter=_byte_budget)
    prefill_chunk: int = attrs.field(default=DEFAULT_PREFILL_CHUNK, validator=_int_at_least(1))
    prefill_budget: int = attrs.field(default=DEFAULT_PREFILL_BUDGET, validator=_int_at_least(1))
    prefill_batch: int = attrs.field(default=DEFAULT_PREFILL_BATCH, validator=_int_at_least(1))
    share_in_flight: bool = attrs.field(default=True, validator=_is_bool)
    shared_prefix: bool = attrs.field(default=True, validator=_is_bool)
    kv_bits: Optional[int] = attrs.field(default=None)
    keep_last_cache: bool = attrs.field(default=True, validator=_is_bool)

    @kv_bits.validator
    def _check_kv_bits(self, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and (isinstance(value, bool) or value not in (4, 8)):
            raise InvalidInput("kv_bits", value, "must be 4, 8 or None")

    def __attrs_post_init__(self) -> None:
        if self.kv_memory is not None and self.model is None:
            raise InvalidInput("kv_memory", self.kv_memory, "sizes the pool from a model: pass model=PATH")


@attrs.frozen(kw_only=True)
class FetchResult:
    """What a request holds after :meth:`CacheRuntime.fetch` (or ``fork``).

    Attributes:
        request_id: the request.
        num_cached_tokens: tokens covered by the cached blocks it now holds.
        grants: those blocks, in token order, with their payloads.
        remaining: the request's tokens after the cached blocks: still to
            compute (and then :meth:`CacheRuntime.store`).
        vision_embeddings: cached vision-encoder output for the request's
            images, or None.
    """

    request_id: RequestId
    num_cached_tokens: int
    # Payloads are arrays, whose == is elementwise: not part of equality.
    grants: tuple[BlockGrant, ...] = attrs.field(eq=False)
    remaining: tuple[int, ...] = attrs.field(repr=lambda tokens: f"<{len(tokens)} tokens>")
    vision_embeddings: Any = attrs.field(default=None, eq=False, repr=False)

    @property
    def payloads(self) -> tuple[Any, ...]:
        """The cached blocks' payloads, in token order."""
        return tuple(grant.payload for grant in self.grants)

    @property
    def block_ids(self) -> tuple[BlockId, ...]:
        """The cached blocks, in token order."""
        return tuple(grant.block_id for grant in self.grants)


@attrs.frozen(kw_only=True)
class StoreResult:
    """What :meth:`CacheRuntime.store` did.

    Attributes:
        num_blocks: blocks added to the request.
        num_reused: of those, blocks found cached (the payload given for
            them was dropped).
        num_held_blocks: blocks the request holds now.
    """

    num_blocks: int
    num_reused: int
    num_held_blocks: int


@attrs.frozen(kw_only=True)
class KVMemoryStatistics:
    """The KV block pool in bytes (known once a model is loaded).

    Attributes:
        block_bytes: bytes one block takes on this model.
        pool_bytes: bytes the whole pool can hold (usable blocks x block bytes).
        cached_bytes: bytes of the blocks that hold cached KV now.
        referenced_bytes: bytes of the blocks requests hold now.
        budget: the ``kv_memory`` the pool was sized from, or None if it was
            sized by ``max_blocks``.
    """

    block_bytes: int
    pool_bytes: int
    cached_bytes: int
    referenced_bytes: int
    budget: Optional[int]


@attrs.frozen(kw_only=True)
class GenerationStatistics:
    """What ``generate`` calls did.

    Attributes:
        num_started: generations that began.
        num_finished: generations that ended with their report.
        num_stopped: generations that ended otherwise (cancelled, failed,
            closed early by their consumer).
        num_blocks_not_stored: computed blocks not cached because the pool
            had no room (``OutOfBlocks``); each case is also a warning.
        num_requests_not_stored: generations that stopped storing because
            the pool had no room (one warning each).
        num_cold_fallbacks: cached prefixes that could not be rebuilt, so
            the whole prompt was computed; each is also a warning.
        num_prompts_over_pool: prompts whose full blocks alone outnumber the
            pool; each is also a warning.
    """

    num_started: int
    num_finished: int
    num_stopped: int
    num_blocks_not_stored: int
    num_requests_not_stored: int
    num_cold_fallbacks: int
    num_prompts_over_pool: int


@attrs.frozen(kw_only=True)
class RuntimeStatistics:
    """A snapshot of every actor (each consistent; together, approximately).

    ``str()`` gives a readable summary (:meth:`format`).

    Attributes:
        allocator: the block pool.
        index: hints, request tables, hits.
        images: the image cache.
        actors: each actor's counters and mailbox, once per actor.
        num_calls: calls made to the runtime so far.
        num_in_flight: calls in progress, this one excluded.
        compute: the compute actor, or None without a model.
        memory: the pool in bytes, or None without a model.
        generation: what ``generate`` calls did, or None without a model.
    """

    allocator: PoolStatistics
    index: PrefixIndexStatistics
    images: ImageCacheStatistics
    actors: tuple[ActorStatistics, ...]
    num_calls: int
    num_in_flight: int
    compute: Optional[ComputeStatistics] = None
    memory: Optional[KVMemoryStatistics] = None
    generation: Optional[GenerationStatistics] = None

    def format(self) -> str:
        """A few aligned lines a person can read."""
        pool, index, images = self.allocator, self.index, self.images
        rows = [
            (
                "blocks",
                f"{pool.num_blocks} x {pool.block_size} tokens: {pool.num_referenced} held by"
                f" requests, {pool.num_reusable} cached (reusable), {pool.num_empty} empty",
            ),
            (
                "block traffic",
                f"{pool.num_hits} taken from the cache, {pool.num_stored} stored new,"
                f" {pool.num_reused} found stored already, {pool.num_evictions} evicted",
            ),
            (
                "lookups",
                f"{index.num_lookups} ({index.num_hits} hit, {index.num_misses} missed),"
                f" {format_count(index.num_active_requests, 'request')} open",
            ),
            (
                "images",
                f"{format_count(images.num_entries, 'entry', 'entries')}, {format_bytes(images.num_bytes)},"
                f" {images.num_hits} hit, {images.num_misses} missed",
            ),
        ]
        if self.memory is not None:
            memory = self.memory
            budget = "" if memory.budget is None else f" (budget {format_bytes(memory.budget)})"
            rows.append(
                (
                    "KV memory",
                    f"{format_bytes(memory.cached_bytes)} cached of"
                    f" {format_bytes(memory.pool_bytes)}{budget},"
                    f" {format_bytes(memory.block_bytes)} per block",
                )
            )
        if self.compute is not None:
            compute = self.compute
            rows.append(
                (
                    "compute",
                    f"{compute.num_prefill_tokens} prompt tokens computed,"
                    f" {compute.num_cached_tokens} reused from cache"
                    f" ({format_count(compute.num_last_cache_reuses, 'request')} took the kept"
                    f" last cache), {compute.num_decode_steps} decode steps (mean batch"
                    f" {compute.mean_batch_size:.1f}), {compute.num_live} live",
                )
            )
        if self.generation is not None:
            generation = self.generation
            rows.append(
                (
                    "generations",
                    f"{generation.num_finished} finished, {generation.num_stopped} stopped,"
                    f" {format_count(generation.num_blocks_not_stored, 'block')} not stored"
                    f" (pool full, {format_count(generation.num_requests_not_stored, 'request')}),"
                    f" {format_count(generation.num_cold_fallbacks, 'cold fallback')}",
                )
            )
        rows.append(
            (
                "mailboxes",
                ", ".join(
                    f"{actor.name} {actor.mailbox.current_buffer_used}/{actor.mailbox.max_buffer_size}"
                    for actor in self.actors
                ),
            )
        )
        rows.append(("calls", f"{self.num_calls} made, {self.num_in_flight} in flight"))
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)

    def __str__(self) -> str:
        return self.format()


_NO_GRANTS = Grants()

_NEW, _RUNNING, _CLOSING, _CLOSED, _FAILED = "not started", "running", "closing", "closed", "failed"


class CacheRuntime:
    """The KV-cache runtime: one task group of actors, and calls that orchestrate them.

    Owns: the task group, one handle (actor ref) per actor, the lifecycle
    state, and the count of calls in flight. Cache state belongs to the
    actors; the runtime holds references only between a take and its
    hand-over (see the module docstring).

    Invariants:
        - a call starts only while running; ``num_in_flight`` counts calls
          between their start and their end;
        - when every call has ended, every block reference is owned by a
          request table (checked by :meth:`check_invariants`).

    Example::

        async with CacheRuntime(block_size=16, max_blocks=256) as rt:
            async with rt.request("r1", prompt_tokens) as req:
                ...  # compute req.result.remaining, then
                await req.store(prompt_tokens, payloads)
    """

    def __init__(
        self,
        config: Optional[RuntimeConfig] = None,
        *,
        intercept: Optional[Intercept] = None,
        **overrides: Any,
    ) -> None:
        """Describe a runtime; nothing starts until ``async with``.

        Args:
            config: the configuration (default: ``RuntimeConfig()``).
            intercept: called with ``(actor name, message)`` before every
                message is handled, for tests and fault injection: a
                CacheError it raises is answered as the handler's, anything
                else crashes the actor.
            **overrides: ``RuntimeConfig`` fields that replace ``config``'s.

        Raises:
            InvalidInput: ``config`` is not a RuntimeConfig, an override is
                not a field, or a value is out of range.
        """
        if config is None:
            config = RuntimeConfig()
        elif not isinstance(config, RuntimeConfig):
            raise InvalidInput("config", config, "must be a RuntimeConfig")
        fields = attrs.fields_dict(RuntimeConfig)
        for name, value in overrides.items():
            if name not in fields:
                raise InvalidInput(name, value, "is not a RuntimeConfig field")
        self.config = attrs.evolve(config, **overrides) if overrides else config
        self._intercept = intercept
        self._state = _NEW
        self._failure: Optional[BaseException] = None
        self._task_group: Optional[TaskGroup] = None
        self._actors: tuple[Actor, ...] = ()
        self._stopped: tuple[anyio.Event, ...] = ()
        self._drained: Optional[anyio.Event] = None
        self._in_flight = 0
        self._num_calls = 0
        self._compute: Optional[ComputeHandle] = None
        self._allocator: Optional[BlockAllocatorHandle] = None
        self._images: Optional[ImageCacheHandle] = None
        self._index: Optional[PrefixIndexHandle] = None
        self._model_info: Optional[ModelInfo] = None
        self._preparer: Optional[PromptPreparer] = None
        #: Usable blocks in the pool (the allocator's null block excluded).
        self._num_blocks = self.config.max_blocks
        #: Counted by generations (all on the event loop): see GenerationStatistics.
        self._generation_counts: collections.Counter[str] = collections.Counter()
        #: Pixel keys of the encoded images read, for every entry point (on the event loop).
        self._pixel_memo = PixelMemo()

    # -- lifecycle --------------------------------------------------------

    async def __aenter__(self) -> CacheRuntime:
        if self._state is _RUNNING or self._state is _CLOSING:
            raise InvalidInput("runtime", self._state, "is already entered; enter it once")
        if self._state is not _NEW:
            raise RuntimeClosed(self._state)
        config = self.config
        # Checked before anything starts: a bad path is one typed error.
        source = None if config.model is None else check_model_source(config.model)
        options = dict(
            mailbox_size=config.mailbox_size,
            trace=config.trace,
            trace_polls=config.trace_polls,
            intercept=self._intercept,
        )
        self._drained = anyio.Event()
        task_group = self._task_group = anyio.create_task_group()
        await task_group.__aenter__()
        try:
            if source is not None:
                # First: the pool is sized from the loaded model's bytes per token.
                compute = ComputeActor.loading(
                    source,
                    prefill_chunk=config.prefill_chunk,
                    prefill_budget=config.prefill_budget,
                    prefill_batch=config.prefill_batch,
                    keep_last_cache=config.keep_last_cache,
                    shared_prefix=config.shared_prefix,
                    kv_bits=config.kv_bits,
                    **options,
                )
                self._compute = ComputeHandle(await self._start_actor(compute))
                self._model_info = await self._compute.describe()
                self._preparer = await self._compute.preparer()
            self._num_blocks = _pool_size(config, self._model_info)
            allocator = BlockAllocatorActor(
                block_size=config.block_size, max_blocks=self._num_blocks + 1, **options
            )
            self._allocator = BlockAllocatorHandle(await self._start_actor(allocator))
            images = ImageCacheActor(
                max_entries=config.image_cache_entries, max_bytes=config.memory_budget, **options
            )
            self._images = ImageCacheHandle(await self._start_actor(images))
            index = PrefixIndexActor(
                block_size=config.block_size, max_hints=4 * self._num_blocks + 1024, **options
            )
            self._index = PrefixIndexHandle(await self._start_actor(index))
        except BaseException as error:
            self._close_handles()
            self._state = _CLOSED
            await self._exit_task_group(type(error), error, error.__traceback__)
            raise
        self._state = _RUNNING
        return self

    async def _start_actor(self, actor: Actor) -> ActorRef:
        """Start ``actor`` in the task group; its ref becomes its only sender.

        Raises:
            Exception: what the actor raised before it reported started
                (a model that does not load: :class:`ModelLoadError`).
        """
        ref = actor.ref()
        actor.close()
        stopped = anyio.Event()
        try:
            await self._task_group.start(self._run_actor, actor, stopped)  # type: ignore[union-attr]
        except BaseException:
            ref.close()
            raise
        self._actors += (actor,)
        self._stopped += (stopped,)
        return ref

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if self._state is _RUNNING:
            self._state = _CLOSING
        try:
            if self._in_flight:
                await self._drained.wait()  # type: ignore[union-attr]
            self._close_handles()
            for stopped in self._stopped:
                await stopped.wait()
        except BaseException as error:  # cancelled: an actor crashed, or from outside
            self._close_handles()
            if exc is None:
                exc_type, exc, tb = type(error), error, error.__traceback__
        if self._state is _CLOSING:
            self._state = _CLOSED
        return await self._exit_task_group(exc_type, exc, tb)

    async def _exit_task_group(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        task_group = self._task_group
        assert task_group is not None, "runtime exited without a task group"
        try:
            return bool(await task_group.__aexit__(exc_type, exc, tb))
        except BaseExceptionGroup as group:
            cause = self._single_cause(group)
            if cause is None:
                raise
        # Raised outside the except clause, so it does not chain to the group.
        raise cause

    def _single_cause(self, group: BaseExceptionGroup) -> Optional[BaseException]:
        """The one meaningful exception in ``group``, if there is one.

        Cancellations are the task group's own doing, and RuntimeClosed
        errors after a crash are consequences of the crash.
        """
        cancelled = anyio.get_cancelled_exc_class()
        leaves = []
        pending = [group]
        while pending:
            for error in pending.pop().exceptions:
                if isinstance(error, BaseExceptionGroup):
                    pending.append(error)
                elif not isinstance(error, cancelled) and not (
                    self._failure is not None and isinstance(error, RuntimeClosed)
                ):
                    leaves.append(error)
        return leaves[0] if len(leaves) == 1 else None

    async def _run_actor(
        self, actor: Actor, stopped: anyio.Event, *, task_status: TaskStatus[None]
    ) -> None:
        try:
            await actor.run(task_status=task_status)
        except BaseException as error:
            if not isinstance(error, anyio.get_cancelled_exc_class()) and self._failure is None:
                self._failure = error
                self._state = _FAILED
            raise
        finally:
            stopped.set()

    def _close_handles(self) -> None:
        """Close every actor's mailbox, downstream last; idempotent."""
        for handle in (self._compute, self._index, self._images, self._allocator):
            if handle is not None:
                handle.close()

    @property
    def closed(self) -> bool:
        """Whether calls are refused (not started, closing, closed or failed)."""
        return self._state is not _RUNNING

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        """Count a call in flight; refuse it unless running; report a stopped
        actor as RuntimeClosed."""
        if self._state is not _RUNNING:
            raise self._closed_error()
        self._in_flight += 1
        self._num_calls += 1
        try:
            yield
        except ActorFailed as error:
            raise self._closed_error(error) from error
        finally:
            self._in_flight -= 1
            if not self._in_flight and self._state is not _RUNNING:
                self._drained.set()  # type: ignore[union-attr]

    def _start_task(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run ``fn(*args)`` in the runtime's task group (it must not raise:
        an exception there would crash the runtime)."""
        if self._state is not _RUNNING or self._task_group is None:
            raise self._closed_error()
        self._task_group.start_soon(fn, *args)

    def _closed_error(self, stopped: Optional[ActorFailed] = None) -> RuntimeClosed:
        """Why calls are refused; ``stopped``: the actor a call found stopped
        (its crash counts before the task group has recorded it)."""
        failure = self._failure
        if failure is None and stopped is not None:
            failure = stopped.cause
        if failure is not None:
            return RuntimeClosed(_FAILED, failure)
        return RuntimeClosed(_CLOSED if self._state is _RUNNING else self._state)

    # -- the low-level API --------------------------------------------------

    async def fetch(
        self,
        request_id: str,
        tokens: Sequence[int],
        *,
        images: Optional[Sequence[Any]] = None,
        images_start: Optional[int] = None,
        cache_salt: Optional[str] = None,
    ) -> FetchResult:
        """Start a request: take a reference to each cached block of its prefix.

        The request then holds those blocks until :meth:`release`. A hit is
        exact: blocks match by parent-chained hash over the salt, the ordered
        images and every token before them.

        Args:
            request_id: a name not used by any active request.
            tokens: the prompt's token ids (ints in ``[0, 2**32)``): a
                sequence of ints or a 1-D integer array (NumPy, MLX).
            images: the request's images, in order, keyed as ``generate``
                keys them (:mod:`mlxkv.images`: a picture by its pixels,
                whether a path, bytes, data URL, PIL image or uint8 array;
                another source -- a URL, an identifier, other bytes or
                arrays -- as it is); they namespace the blocks and are
                looked up in the image cache.
            images_start: the index in ``tokens`` of the first image token:
                the images then namespace the blocks from the one holding
                it on, and the blocks before are shared with any request
                (as ``generate`` keys them); None: every block.
            cache_salt: a tenant namespace: requests with different salts
                never share blocks.

        Returns:
            What the request now holds and what remains to compute.

        Raises:
            InvalidInput: a bad argument; nothing changed.
            DuplicateRequest: ``request_id`` is active.
            RuntimeClosed: the runtime is not running.
        """
        with self._call():
            return await self._fetch(
                request_id, tokens, images=images, images_start=images_start, cache_salt=cache_salt
            )

    async def _fetch(
        self,
        request_id: str,
        tokens: Sequence[int],
        *,
        images: Optional[Sequence[Any]] = None,
        images_key: Optional[str] = None,
        images_start: Optional[int] = None,
        cache_salt: Optional[str] = None,
        share: bool = False,
    ) -> FetchResult:
        """:meth:`fetch`; with ``share``, also wait for prefix blocks that other
        requests are computing right now, and claim the rest (generation's way:
        see :mod:`mlxkv.actors.prefix_index`). ``images_key`` is the images'
        digest when the caller has it (and has looked them up in the image
        cache) already; ``images_start``, the index of the prompt's first
        image token, when the caller knows it: the images then key the blocks
        from the one that holds it on, and the blocks before are shared with
        any request (with the images of the whole chain otherwise). The
        caller counts the call."""
        request_id = _request_id(request_id)
        token_ids = check_token_ids(tokens)
        salt = _salt(cache_salt)
        if images_start is not None:
            if isinstance(images_start, bool) or not isinstance(images_start, int):
                raise InvalidInput("images_start", images_start, "must be an int or None")
            if not 0 <= images_start < len(token_ids):
                raise InvalidInput("images_start", images_start, f"must index the {len(token_ids)} tokens")
            if images is None and images_key is None:
                raise InvalidInput("images_start", images_start, "is given without images")
        # A caller with the key has looked the images up itself.
        look_up = images_key is None
        if look_up:
            keyed = await key_images(images, self._pixel_memo, for_model=False)
            images_key = None if keyed is None else keyed.digest
        # The images key the whole chain, or, their first token known, the
        # blocks from the one that holds it on.
        keys = ChainKeys.derive(
            cache_salt=salt,
            images_key=images_key,
            images_start=images_start,
            block_size=self.config.block_size,
        )
        match = await self._index.begin(request_id, token_ids, keys, claim=share)
        grants: list[BlockGrant] = []
        try:
            entry = None
            if look_up and images_key is not None:
                entry = await self._images.lookup(images_key, cache_salt=salt, request_id=request_id)
            while True:
                if match.num_hinted:
                    # The whole chain, not just the hinted part: the allocator
                    # decides, so a hint missing for a cached block costs nothing.
                    acquired = await self._allocator.acquire(match.hashes, request_id=request_id)
                    await self._hand_over(request_id, len(grants), acquired, hit=True)
                    grants.extend(acquired.grants)
                if match.wait is None:
                    break
                await match.wait.wait()
                match = await self._index.rematch(request_id)
        except BaseException:
            await self._abandon(request_id)
            raise
        num_cached = len(grants) * self.config.block_size
        return FetchResult(
            request_id=request_id,
            num_cached_tokens=num_cached,
            grants=tuple(grants),
            remaining=tuple(token_ids[num_cached:]),
            vision_embeddings=None if entry is None else entry.vision_embeddings,
        )

    async def store(
        self, request_id: str, tokens: Sequence[int], payloads: Sequence[Any]
    ) -> StoreResult:
        """Keep the request's newly computed full blocks; the request holds them.

        A block whose hash is already cached (another request computed it) is
        shared instead, and its given payload dropped. All or nothing.

        Args:
            request_id: an active request.
            tokens: the request's whole token sequence so far (a sequence of
                ints or a 1-D integer array); it must extend
                what the request holds and agree with what it was given.
            payloads: one object per full block of ``tokens`` beyond the
                blocks the request holds (typically that block's KV slices).

        Returns:
            What was added.

        Raises:
            InvalidInput: bad tokens or the wrong number of payloads; nothing
                changed.
            UnknownRequest: the request is not active.
            OutOfBlocks: the new blocks do not fit; nothing changed.
            RuntimeClosed: the runtime is not running.
        """
        with self._call():
            request_id = _request_id(request_id)
            token_ids = check_token_ids(tokens)
            if not isinstance(payloads, (list, tuple)):
                raise InvalidInput("payloads", payloads, "must be a list or tuple")
            payloads = tuple(payloads)
            extension = await self._index.extend(request_id, token_ids, len(payloads))
            if not extension.hashes:
                return StoreResult(num_blocks=0, num_reused=0, num_held_blocks=extension.start)
            grants = await self._allocator.store_blocks(
                extension.hashes, payloads, request_id=request_id
            )
            held = await self._hand_over(
                request_id,
                extension.start,
                grants,
                tail=extension.tail,
                tail_hashes=extension.tail_hashes,
            )
            return StoreResult(
                num_blocks=len(grants.grants), num_reused=grants.num_reused, num_held_blocks=held
            )

    async def fork(self, source_id: str, request_id: str) -> FetchResult:
        """Start ``request_id`` holding the same blocks and tokens as ``source_id``.

        Blocks are shared (one more reference each), never copied: stored
        blocks are immutable, and each request stores its own new blocks.

        Args:
            source_id: an active request.
            request_id: a name not used by any active request.

        Returns:
            What the new request holds and what remains to compute.

        Raises:
            InvalidInput: bad ids, or ``source_id`` changed meanwhile.
            UnknownRequest: ``source_id`` is not active.
            DuplicateRequest: ``request_id`` is active.
            RuntimeClosed: the runtime is not running.
        """
        with self._call():
            source_id = _request_id(source_id)
            request_id = _request_id(request_id)
            snapshot = await self._index.snapshot(source_id, request_id)
            grants = _NO_GRANTS
            if snapshot.block_ids:
                grants = await self._allocator.retain(
                    tuple(zip(snapshot.block_ids, snapshot.hashes)), request_id=request_id
                )
            try:
                await self._index.adopt(request_id, snapshot, grants.grants)
            except BaseException:
                await self._allocator.release(
                    grants.block_ids, reannounce=grants.evicted, request_id=request_id
                )
                raise
            await self._index.forget(grants.evicted, request_id=request_id)
            return FetchResult(
                request_id=request_id,
                num_cached_tokens=len(grants.grants) * self.config.block_size,
                grants=grants.grants,
                remaining=tuple(snapshot.tail),
            )

    async def release(self, request_id: str) -> int:
        """End a request: drop its table and every reference it holds.

        Shielded from cancellation: once called, it completes. Released
        blocks stay cached (reusable) until allocation needs them.

        Args:
            request_id: an active request.

        Returns:
            How many block references were released.

        Raises:
            InvalidInput: a bad id.
            UnknownRequest: the request is not active.
            RuntimeClosed: the runtime is not running.
        """
        with self._call():
            request_id = _request_id(request_id)
            with anyio.CancelScope(shield=True):
                block_ids = await self._index.close_table(request_id)
                if block_ids:
                    await self._allocator.release(_tail_first(block_ids), request_id=request_id)
            return len(block_ids)

    async def evict(self, num_blocks: int) -> int:
        """Drop the cached content of up to ``num_blocks`` unreferenced blocks, LRU first.

        Args:
            num_blocks: the most to evict.

        Returns:
            How many were evicted.

        Raises:
            InvalidInput: ``num_blocks`` is not a non-negative int.
            RuntimeClosed: the runtime is not running.
        """
        with self._call():
            eviction = await self._allocator.evict(num_blocks)
            await self._index.forget(eviction.evicted)
            return eviction.num_evicted

    async def store_images(
        self,
        images: Sequence[Any],
        vision_embeddings: Any,
        *,
        num_image_tokens: int = 0,
        cache_salt: Optional[str] = None,
    ) -> None:
        """Cache the vision encoder's output for these images, in this order.

        Args:
            images: the images, in order (any form :meth:`fetch` takes).
            vision_embeddings: the encoder's output (copied).
            num_image_tokens: prompt tokens the images stand for.
            cache_salt: tenant namespace.

        Raises:
            InvalidInput: bad images, salt or count; nothing changed.
            RuntimeClosed: the runtime is not running.
        """
        with self._call():
            salt = _salt(cache_salt)
            keyed = await key_images(images, self._pixel_memo, for_model=False)
            if keyed is None:
                raise InvalidInput("images", images, "must name at least one image")
            await self._images.store(
                keyed.digest, vision_embeddings, num_image_tokens=num_image_tokens, cache_salt=salt
            )

    async def stats(self) -> RuntimeStatistics:
        """Collect every actor's statistics.

        Raises:
            RuntimeClosed: the runtime is not running.
        """
        with self._call():
            allocator = await self._allocator.statistics()
            index = await self._index.statistics()
            images = await self._images.statistics()
            compute = None if self._compute is None else await self._compute.statistics()
            memory = generation = None
            if self._model_info is not None:
                counts = self._generation_counts
                generation = GenerationStatistics(
                    num_started=counts["started"],
                    num_finished=counts["finished"],
                    num_stopped=counts["stopped"],
                    num_blocks_not_stored=counts["blocks_not_stored"],
                    num_requests_not_stored=counts["requests_not_stored"],
                    num_cold_fallbacks=counts["cold_fallbacks"],
                    num_prompts_over_pool=counts["prompts_over_pool"],
                )
                block_bytes = self._model_info.block_bytes(self.config.block_size)
                memory = KVMemoryStatistics(
                    block_bytes=block_bytes,
                    pool_bytes=allocator.num_blocks * block_bytes,
                    cached_bytes=allocator.num_cached * block_bytes,
                    referenced_bytes=allocator.num_referenced * block_bytes,
                    budget=self.config.kv_memory,
                )
            return RuntimeStatistics(
                allocator=allocator,
                index=index,
                images=images,
                actors=tuple(actor.statistics() for actor in self._actors),
                num_calls=self._num_calls,
                num_in_flight=self._in_flight - 1,
                compute=compute,
                memory=memory,
                generation=generation,
            )

    async def check_invariants(self) -> bool:
        """Verify every actor's invariants and, when quiet, that references add up.

        Each actor checks its own state. If no other call is in flight or
        starts meanwhile, it also checks across actors that every block's
        reference count equals the number of request tables listing it (so
        with no active request, that no block is referenced).

        Returns:
            Whether the cross-actor check was made.

        Raises:
            AssertionError: listing every violation found.
            RuntimeClosed: the runtime is not running.
        """
        with self._call():
            quiet = self._in_flight == 1
            calls = self._num_calls
            index = await self._index.check_invariants()
            allocator = await self._allocator.check_invariants(index.holdings)
            images = await self._images.check_invariants()
            exact = quiet and self._num_calls == calls
        violations = [*index.violations, *allocator.violations, *images]
        if exact:
            violations += allocator.reference_mismatches
        if violations:
            raise AssertionError("; ".join(violations))
        return exact

    # -- the high-level API ---------------------------------------------------

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 0.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: Optional[int] = None,
        images: Optional[Sequence[Any]] = None,
        cache_salt: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> Generation:
        """Generate from ``prompt``, reusing every cached block of its prefix.

        Returns at once; the work happens as the result is iterated. It
        yields one :class:`~mlxkv.generation.GeneratedToken` per token and
        ends with a :class:`~mlxkv.generation.GenerationReport`. Generation
        stops at an end-of-sequence token or after ``max_tokens``. The
        prompt's full blocks (and the generated tokens' ones) are stored for
        later requests; the request is released on every exit. Use::

            async with rt.generate("Hello", max_tokens=32) as stream:
                async for record in stream:
                    ...

        Args:
            prompt: text (tokenized by the model's tokenizer) or token ids (a
                sequence of ints or a 1-D integer array, NumPy or MLX).
            max_tokens: the most tokens to generate, >= 1.
            temperature: 0 for greedy decoding, else the sampling temperature.
            top_p: nucleus sampling; off at 0 or 1.
            top_k: sample among the ``k`` most likely tokens; off at 0.
            min_p: drop tokens below ``min_p`` times the top probability.
            seed: makes sampling reproducible.
            images: the request's images, in order (paths, data URLs,
                encoded bytes, PIL images or uint8 arrays), for a
                vision-language model; they also key the cache, so requests
                share blocks only with the same images in the same order.
            cache_salt: a tenant namespace: requests with different salts
                never share blocks.
            request_id: a name not used by any active request (default: a
                fresh one).

        Returns:
            The :class:`~mlxkv.generation.Generation` to iterate.

        Raises:
            InvalidInput: the runtime has no model, or a bad argument (an
                empty prompt, ``max_tokens`` < 1, a token out of the
                vocabulary, bad sampling settings, images for a model that
                does not take them); nothing was sent. An image that cannot
                be read is refused the same way while iterating, before
                anything is computed or cached, naming the image.
            RuntimeClosed: the runtime is not running (also raised while
                iterating, if it stops meanwhile).
            DuplicateRequest: ``request_id`` is active (while iterating).
            ComputeFailed: a model call of this request raised (while
                iterating); other requests go on, this one holds nothing.
        """
        if self._state is not _RUNNING:
            raise self._closed_error()
        if self._compute is None or self._model_info is None:
            raise InvalidInput("model", None, "the runtime has no model: pass model=PATH")
        sampling = Sampling(
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed
        )
        request = make_request(
            prompt,
            max_tokens=max_tokens,
            sampling=sampling,
            images=images,
            cache_salt=cache_salt,
            request_id=request_id,
            info=self._model_info,
        )
        return Generation(run_generation(self, self._compute, self._model_info, request))

    async def tokenize(self, text: str) -> tuple[int, ...]:
        """The model's token ids for ``text`` (special tokens as its tokenizer
        adds them; an image placeholder, ``<|vision_start|><|image_pad|><|vision_end|>``
        for Qwen2-VL, stays one pad token, which ``generate`` widens to the
        image's tokens: a token-id prompt can place its images).

        Raises:
            InvalidInput: the runtime has no model, or ``text`` is not a str.
            RuntimeClosed: the runtime is not running.
        """
        with self._call():
            if self._preparer is None:
                raise InvalidInput("model", None, "the runtime has no model: pass model=PATH")
            if not isinstance(text, str):
                raise InvalidInput("text", text, "must be a str")
            return self._preparer.encode(text)

    @property
    def model_info(self) -> Optional[ModelInfo]:
        """What the loaded model is (vocabulary, end tokens, cache layers), or None."""
        return self._model_info

    def request(
        self,
        request_id: str,
        tokens: Sequence[int],
        *,
        images: Optional[Sequence[Any]] = None,
        images_start: Optional[int] = None,
        cache_salt: Optional[str] = None,
    ) -> RequestHandle:
        """A request as an async context manager: fetched on enter, released on exit.

        The release runs on normal exit, on error and on cancellation
        (shielded). Arguments are those of :meth:`fetch`.

        Returns:
            The handle; ``handle.result`` is the :class:`FetchResult`.
        """
        return RequestHandle(
            self, request_id, tokens, images=images, images_start=images_start, cache_salt=cache_salt
        )

    # -- orchestration helpers -------------------------------------------------

    async def _hand_over(
        self,
        request_id: RequestId,
        start: int,
        grants: Grants,
        *,
        tail: Optional[TokenIds] = None,
        tail_hashes: tuple = (),
        hit: bool = False,
    ) -> int:
        """Move ``grants`` into the request's table (shielded), or release them."""
        try:
            return await self._index.record(
                request_id,
                start,
                grants.grants,
                tail=tail,
                tail_hashes=tail_hashes,
                forget=grants.evicted,
                hit=hit,
            )
        except BaseException:
            await self._allocator.release(
                grants.block_ids, reannounce=grants.evicted, request_id=request_id
            )
            raise

    async def _abandon(self, request_id: RequestId) -> None:
        """Close a request whose start failed, releasing what its table held (shielded)."""
        with anyio.CancelScope(shield=True):
            try:
                block_ids = await self._index.close_table(request_id)
                if block_ids:
                    await self._allocator.release(_tail_first(block_ids), request_id=request_id)
            except (UnknownRequest, ActorFailed):
                pass  # gone already, or the runtime is going down with it


class RequestHandle:
    """One request's scope: fetched on ``__aenter__``, released on ``__aexit__``.

    Owns: nothing but the request id and its fetch result; the request's
    references live in its table.

    Invariants:
        - after ``__aexit__`` the request holds nothing: it was released
          there (shielded, whatever the exit) or explicitly before.
    """

    def __init__(
        self,
        runtime: CacheRuntime,
        request_id: str,
        tokens: Sequence[int],
        *,
        images: Optional[Sequence[Any]] = None,
        images_start: Optional[int] = None,
        cache_salt: Optional[str] = None,
    ) -> None:
        self._runtime = runtime
        self.request_id = request_id
        self._tokens = tokens
        self._images = images
        self._images_start = images_start
        self._cache_salt = cache_salt
        self.result: Optional[FetchResult] = None

    async def __aenter__(self) -> RequestHandle:
        self.result = await self._runtime.fetch(
            self.request_id,
            self._tokens,
            images=self._images,
            images_start=self._images_start,
            cache_salt=self._cache_salt,
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self._runtime.release(self.request_id)
            except (UnknownRequest, RuntimeClosed):
                pass  # released explicitly already, or gone with the runtime

    async def store(self, tokens: Sequence[int], payloads: Sequence[Any]) -> StoreResult:
        """:meth:`CacheRuntime.store` for this request."""
        return await self._runtime.store(self.request_id, tokens, payloads)

    async def fork(self, request_id: str) -> FetchResult:
        """:meth:`CacheRuntime.fork` of this request into ``request_id``."""
        return await self._runtime.fork(self.request_id, request_id)


def _pool_size(config: RuntimeConfig, info: Optional[ModelInfo]) -> int:
    """Usable blocks in the pool (the null block excluded): ``max_blocks``, or as
    many as ``kv_memory`` holds on the loaded model.

    Raises:
        InvalidInput: ``kv_memory`` holds not even one block.
    """
    if config.kv_memory is None:
        return config.max_blocks
    assert info is not None, "kv_memory is checked to come with a model"
    block_bytes = info.block_bytes(config.block_size)
    blocks = config.kv_memory // block_bytes
    if blocks < 1:
        raise InvalidInput(
            "kv_memory",
            config.kv_memory,
            f"holds no block: a block of {config.block_size} tokens takes"
            f" {format_bytes(block_bytes)} on this model",
        )
    return blocks


def _tail_first(block_ids: tuple[BlockId, ...]) -> tuple[BlockId, ...]:
    """A table's blocks in the order they should become evictable: tail first.

    The free queue evicts the block released longest ago. Releasing a chain
    head first would evict its head first and strand every later block (a
    hit needs the whole chain before it); tail first keeps the longest
    reusable prefix, as vLLM does.
    """
    return block_ids[::-1]


# -- validation (before anything is sent) ---------------------------------------


def _request_id(value: Any) -> RequestId:
    if not isinstance(value, str) or not value:
        raise InvalidInput("request_id", value, "must be a non-empty str")
    return RequestId(value)


def _salt(value: Any) -> Optional[str]:
    if value is not None and not isinstance(value, str):
        raise InvalidInput("cache_salt", value, "must be a str or None")
    return value

