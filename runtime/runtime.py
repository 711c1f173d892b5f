"""CacheRuntime: the public, async face of the cache -- lifecycle, and a façade over its client.

``async with CacheRuntime(...) as rt:`` starts a :class:`PrefixIndexActor`,
an :class:`ImageCacheActor` and a :class:`BlockAllocatorActor` in one task
group. With ``model=`` it also starts a :class:`ComputeActor` that loads the model
and serves :meth:`CacheRuntime.generate` (see :mod:`mlxkv.generation`).

The runtime owns the lifecycle (the task group, the actors, the
:class:`~mlxkv.gate.Gate` its calls pass through) and checks every public
call's arguments once; the work is the :class:`~mlxkv.client.CacheClient`'s,
the same client that generations use, which takes checked arguments only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Optional

import anyio
import anyio.to_thread
import attrs
from anyio.abc import TaskGroup, TaskStatus

from mlxkv.actors.actor import Actor, ActorRef, Intercept
from mlxkv.actors.allocator import BlockAllocatorActor, BlockAllocatorHandle
from mlxkv.actors.compute import ComputeActor, ComputeHandle
from mlxkv.actors.image_cache import ImageCacheActor, ImageCacheHandle
from mlxkv.actors.model_info import ModelInfo
from mlxkv.actors.prompt_preparer import PromptPreparer
from mlxkv.actors.model_source import check_model_source
from mlxkv.actors.prefix_index import PrefixIndexActor, PrefixIndexHandle, RequestId
from mlxkv.actors.penalties import Penalties
from mlxkv.json_output import JsonOutputs, JsonText
from mlxkv.actors.sampling import Sampling
from mlxkv.cache.block_hash import ChainKeys
from mlxkv.cache.errors import InvalidInput, UnknownRequest
from mlxkv.cache.kv_events import KVEventHub, KVEventSubscription
from mlxkv.cache.tiers.namespace import Namespace, namespace_for_model
from mlxkv.cache.tiers.tier_stack import TierStack
from mlxkv.cache.token_ids import check_token_ids
from mlxkv.client import CacheClient, FetchResult, StoreResult
from mlxkv.errors import RuntimeClosed
from mlxkv.gate import Gate, Phase
from mlxkv.generation import (
    Generation,
    GenerationContext,
    GenerationCounters,
    GenerationRequest,
    GenerationStatistics,
)
from mlxkv.heap_freeze import HEAP_FREEZE
from mlxkv.images import ImageBudget
from mlxkv.runtime_config import RuntimeConfig
from mlxkv.runtime_statistics import KVMemoryStatistics, RuntimeStatistics
from mlxkv.units import format_bytes

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


class CacheRuntime:
    """The KV-cache runtime: the lifecycle of its actors, and the calls that use them.

    Owns: the task group, one handle (actor ref) per actor, the
    :class:`~mlxkv.gate.Gate` (phase, calls in flight, the crash that failed
    it), the :class:`~mlxkv.client.CacheClient` over the cache actors, the
    generation counters, and what the loaded model is. Cache state belongs
    to the actors.

    Invariants:
        - a call starts only while running, and checks its arguments before
          anything is sent;
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
            **overrides: ``RuntimeConfig`` fields (a part's by name too)
                that replace ``config``'s.

        Raises:
            InvalidInput: ``config`` is not a RuntimeConfig, an override is
                not a field, or a value is out of range.
        """
        if config is None:
            config = RuntimeConfig()
        elif not isinstance(config, RuntimeConfig):
            raise InvalidInput("config", config, "must be a RuntimeConfig")
        self.config = attrs.evolve(config, **overrides) if overrides else config
        self._intercept = intercept
        self._gate = Gate()
        self._task_group: Optional[TaskGroup] = None
        self._actors: tuple[Actor, ...] = ()
        self._stopped: tuple[anyio.Event, ...] = ()
        self._compute: Optional[ComputeHandle] = None
        self._allocator: Optional[BlockAllocatorHandle] = None
        self._images: Optional[ImageCacheHandle] = None
        self._index: Optional[PrefixIndexHandle] = None
        self._client: Optional[CacheClient] = None
        self._tiers: Optional[TierStack] = None
        self._events: Optional[KVEventHub] = None
        self._holds_heap = False  # a hold on HEAP_FREEZE, released on exit
        self._model_info: Optional[ModelInfo] = None
        self._preparer: Optional[PromptPreparer] = None
        self._generation: Optional[GenerationContext] = None
        #: Counted by generations (all on the event loop): see GenerationStatistics.
        self._counters = GenerationCounters()

    # -- lifecycle --------------------------------------------------------

    async def __aenter__(self) -> CacheRuntime:
        phase = self._gate.phase
        if phase is Phase.RUNNING or phase is Phase.CLOSING:
            raise InvalidInput("runtime", phase.value, "is already entered; enter it once")
        if phase is not Phase.NEW:
            raise RuntimeClosed(phase.value)
        config = self.config
        # Checked before anything starts: a bad path is one typed error.
        source = None if config.model is None else check_model_source(config.model)
        options = dict(
            mailbox_size=config.mailbox_size,
            trace=config.trace,
            trace_polls=config.trace_polls,
            intercept=self._intercept,
        )
        task_group = self._task_group = anyio.create_task_group()
        await task_group.__aenter__()
        try:
            if source is not None:
                # First: the pool is sized from the loaded model's bytes per token.
                compute = ComputeActor.loading(
                    source, scheduling=config.scheduling, runner_config=config.runner, **options
                )
                self._compute = ComputeHandle(await self._start_actor(compute))
                self._model_info = await self._compute.describe()
                self._preparer = await self._compute.preparer()
            num_blocks = _pool_size(config, self._model_info)
            allocator = BlockAllocatorActor(
                block_size=config.block_size, max_blocks=num_blocks + 1, **options
            )
            self._allocator = BlockAllocatorHandle(await self._start_actor(allocator))
            images = ImageCacheActor(
                max_entries=config.image_cache_entries, max_bytes=config.memory_budget, **options
            )
            self._images = ImageCacheHandle(await self._start_actor(images))
            index = PrefixIndexActor(
                block_size=config.block_size, max_hints=4 * num_blocks + 1024, **options
            )
            self._index = PrefixIndexHandle(await self._start_actor(index))
            self._events = KVEventHub(config.block_size)
            if config.kv_tiers:
                assert source is not None and self._model_info is not None, "checked by the config"
                namespace = await _tier_namespace(source.path, self._model_info, config.block_size)
                tiers = TierStack.from_urls(config.kv_tiers, namespace, events=self._events)
                await tiers.__aenter__()
                self._tiers = tiers
        except BaseException as error:
            self._close_handles()
            self._gate.closed()
            await self._exit_task_group(type(error), error, error.__traceback__)
            raise
        self._client = CacheClient(
            allocator=self._allocator,
            index=self._index,
            images=self._images,
            block_size=config.block_size,
            tiers=self._tiers,
            events=self._events,
            image_budget=ImageBudget(
                max_images=config.max_request_images, max_pixels=config.max_request_pixels
            ),
        )
        if self._compute is not None:
            assert self._model_info is not None and self._preparer is not None, "a model was loaded"
            self._generation = GenerationContext(
                client=self._client,
                gate=self._gate,
                compute=self._compute,
                model=self._model_info,
                preparer=self._preparer,
                block_size=config.block_size,
                pool_blocks=num_blocks,
                share_in_flight=config.share_in_flight,
                trace=config.trace,
                counters=self._counters,
                json_outputs=JsonOutputs(
                    self._preparer, self._model_info.vocab_size, self._model_info.eos_token_ids
                ),
            )
        if config.freeze_gc:
            HEAP_FREEZE.hold()
            self._holds_heap = True
        self._gate.open(task_group)
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
        gate = self._gate
        gate.close()
        try:
            await gate.wait_drained()
            await self._close_tiers(exc_type, exc, tb)
            self._close_handles()
            for stopped in self._stopped:
                await stopped.wait()
        except BaseException as error:  # cancelled: an actor crashed, or from outside
            with anyio.CancelScope(shield=True):
                await self._close_tiers(type(error), error, error.__traceback__)
            self._close_handles()
            if exc is None:
                exc_type, exc, tb = type(error), error, error.__traceback__
        gate.closed()
        try:
            return await self._exit_task_group(exc_type, exc, tb)
        finally:
            if self._holds_heap:
                self._holds_heap = False
                HEAP_FREEZE.release()

    async def _close_tiers(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Leave the tier stack (writing what is queued, bounded), then end the
        KV events' subscriptions; idempotent."""
        tiers, self._tiers = self._tiers, None
        try:
            if tiers is not None:
                await tiers.__aexit__(exc_type, exc, tb)
        finally:
            if self._events is not None:
                self._events.close()

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
        failed = self._gate.failure is not None
        leaves = []
        pending = [group]
        while pending:
            for error in pending.pop().exceptions:
                if isinstance(error, BaseExceptionGroup):
                    pending.append(error)
                elif not isinstance(error, cancelled) and not (failed and isinstance(error, RuntimeClosed)):
                    leaves.append(error)
        return leaves[0] if len(leaves) == 1 else None

    async def _run_actor(
        self, actor: Actor, stopped: anyio.Event, *, task_status: TaskStatus[None]
    ) -> None:
        try:
            await actor.run(task_status=task_status)
        except BaseException as error:
            if not isinstance(error, anyio.get_cancelled_exc_class()):
                self._gate.fail(error)
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
        return not self._gate.running

    @property
    def client(self) -> CacheClient:
        """The cache client under the low-level API and ``generate``.

        It takes checked arguments only and passes through no gate: use the
        runtime's own methods; this is for tests and tools that look inside.

        Raises:
            RuntimeClosed: the runtime was never started.
        """
        if self._client is None:
            raise self._gate.closed_error()
        return self._client

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
        with self._gate.call():
            client = self.client
            request_id = _request_id(request_id)
            token_ids = check_token_ids(tokens)
            salt = _salt(cache_salt)
            if images_start is not None:
                if isinstance(images_start, bool) or not isinstance(images_start, int):
                    raise InvalidInput("images_start", images_start, "must be an int or None")
                if not 0 <= images_start < len(token_ids):
                    raise InvalidInput("images_start", images_start, f"must index the {len(token_ids)} tokens")
                if images is None:
                    raise InvalidInput("images_start", images_start, "is given without images")
            keyed = await client.key_images(images, for_model=False)
            images_key = None if keyed is None else keyed.digest
            keys = ChainKeys.derive(
                cache_salt=salt,
                images_key=images_key,
                images_start=images_start,
                block_size=self.config.block_size,
            )
            return await client.fetch(request_id, token_ids, keys, images_key=images_key, cache_salt=salt)

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
        with self._gate.call():
            request_id = _request_id(request_id)
            token_ids = check_token_ids(tokens)
            if not isinstance(payloads, (list, tuple)):
                raise InvalidInput("payloads", payloads, "must be a list or tuple")
            return await self.client.store(request_id, token_ids, tuple(payloads))

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
        with self._gate.call():
            return await self.client.fork(_request_id(source_id), _request_id(request_id))

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
        with self._gate.call():
            return await self.client.release(_request_id(request_id))

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
        with self._gate.call():
            return await self.client.evict(num_blocks)

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
        with self._gate.call():
            client = self.client
            salt = _salt(cache_salt)
            keyed = await client.key_images(images, for_model=False)
            if keyed is None:
                raise InvalidInput("images", images, "must name at least one image")
            await client.store_images(
                keyed.digest, vision_embeddings, num_image_tokens=num_image_tokens, cache_salt=salt
            )

    async def stats(self) -> RuntimeStatistics:
        """Collect every actor's statistics.

        Raises:
            RuntimeClosed: the runtime is not running.
        """
        gate = self._gate
        with gate.call():
            allocator, index, images = await self.client.statistics()
            compute = None if self._compute is None else await self._compute.statistics()
            memory = generation = None
            if self._model_info is not None:
                generation = self._counters.statistics()
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
                num_calls=gate.num_calls,
                num_in_flight=gate.num_in_flight - 1,
                compute=compute,
                memory=memory,
                generation=generation,
                tiers=None if self._tiers is None else self._tiers.statistics(),
            )

    def kv_events(self, buffer: int = 1024) -> KVEventSubscription:
        """The KV events from now on, for prefix-aware routers: a
        ``BlockStored`` when the block pool or a tier holds a block, a
        ``BlockRemoved`` when it no longer does (see :mod:`mlxkv.cache.kv_events`).
        A subscriber that falls ``buffer`` events behind loses the newest
        (counted; gaps in ``seq`` say where). Iteration ends when the runtime
        closes.

        Use as ``with rt.kv_events() as events: async for event in events:``.

        Raises:
            RuntimeClosed: the runtime is not running.
        """
        with self._gate.call():
            assert self._events is not None, "made when the runtime starts"
            return self._events.subscribe(buffer)

    async def flush_tiers(self) -> None:
        """Wait until every block stored so far has been written to every tier
        (or dropped by one); at once without tiers.

        Raises:
            RuntimeClosed: the runtime is not running.
        """
        with self._gate.call():
            if self._tiers is not None:
                await self._tiers.wait_written()

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
        gate = self._gate
        with gate.call():
            quiet = gate.num_in_flight == 1
            calls = gate.num_calls
            violations, mismatches = await self.client.check_invariants()
            exact = quiet and gate.num_calls == calls
        if exact:
            violations += mismatches
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
        logprobs: Optional[int] = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Optional[Mapping[int, float]] = None,
        prompt_logprobs: Optional[int] = None,
        json_schema: Optional[Any] = None,
        json_text: Optional[JsonText] = None,
    ) -> Generation:
        """Generate from ``prompt``, reusing every cached block of its prefix.

        Returns at once; the work happens as the result is iterated. It
        yields one :class:`~mlxkv.generation.GeneratedToken` per token and
        ends with a :class:`~mlxkv.generation.GenerationReport`. Generation
        stops at an end-of-sequence token or after ``max_tokens``. The
        prompt's full blocks (and the generated tokens' ones) are stored for
        later requests; the request is released on every exit, and before
        the report is handed out. Use::

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
            logprobs: give each token its log-probability and this many of
                the most likely tokens at its step, 0 to 20 (the record:
                ``GeneratedToken.logprob``); None: none. They are the model's
                (the log-softmax of its logits, before ``temperature`` or any
                truncation, as mlx-lm's ``generate_step`` yields them),
                picked on the device: ``2k + 2`` numbers a token reach the
                host. With penalties or a bias, of the logits they made.
            presence_penalty: subtracted from the logit of each token
                generated so far, once (``[-2, 2]``; OpenAI's).
            frequency_penalty: subtracted from the logit of each token
                generated so far, once per time (``[-2, 2]``; OpenAI's).
            repetition_penalty: divides the positive logits of the tokens in
                the prompt or generated so far and multiplies the negative
                ones (``(0, 2]``, 1: off; vLLM's).
            logit_bias: ``{token id: bias}`` added to the logits, each bias
                in ``[-100, 100]`` (-100 bans a token; OpenAI's).
            prompt_logprobs: also give each prompt token but the first its
                record, with this many alternatives, 0 to 20
                (``Generation.prompt_logprobs`` from the first token on, and
                the report's); None: none. Such a request computes its whole
                prompt (it reuses no cached prefix, though it stores its
                blocks for others), and its chunks' logits over the
                vocabulary are made (a chunk's positions times the
                vocabulary, in memory while the chunk runs).
            json_schema: hold the answer to JSON text this schema allows
                (``{"type": "object"}``: any JSON object, OpenAI's JSON mode;
                the subset is :mod:`mlxkv.actors.json_grammar`'s): each token
                is drawn among those that keep the text a prefix of such a
                value, and an end-of-sequence token is allowed only once it
                is whole. An answer cut by ``max_tokens`` is a prefix. The
                log-probabilities are of the tokens allowed. None: free text.
                A step of a batch with such a request waits for the
                tokens drawn before it (the host finds what each row allows).
            json_text: with ``json_schema``, where the value sits in the
                answer's text (:class:`~mlxkv.json_output.JsonText`: text
                before and after it, such as a tool call's markers; a
                reasoning block it may begin with); None: the value alone.

        Returns:
            The :class:`~mlxkv.generation.Generation` to iterate.

        Raises:
            InvalidInput: the runtime has no model, or a bad argument (an
                empty prompt, ``max_tokens`` < 1, a token out of the
                vocabulary, bad sampling settings, images for a model that
                does not take them, a salt that is not a str, ``logprobs``
                not None or an int in ``[0, 20]``, a penalty out of range, a
                bias on a token past the vocabulary); nothing was
                sent. An image that cannot be read is refused the same way
                while iterating, before anything is computed or cached,
                naming the image.
            RuntimeClosed: the runtime is not running (also raised while
                iterating, if it stops meanwhile).
            DuplicateRequest: ``request_id`` is active (while iterating).
            ComputeFailed: a model call of this request raised (while
                iterating); other requests go on, this one holds nothing.
        """
        if not self._gate.running:
            raise self._gate.closed_error()
        context = self._generation
        if context is None:
            raise InvalidInput("model", None, "the runtime has no model: pass model=PATH")
        sampling = Sampling(
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed
        )
        penalties = Penalties(
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            logit_bias=logit_bias,
        )
        request = GenerationRequest.checked(
            prompt,
            max_tokens=max_tokens,
            sampling=sampling,
            images=images,
            cache_salt=cache_salt,
            request_id=request_id,
            info=context.model,
            logprobs=logprobs,
            penalties=penalties,
            prompt_logprobs=prompt_logprobs,
            grammar=None if json_schema is None else context.json_outputs.grammar(json_schema, json_text),
        )
        return Generation(request, context)

    async def tokenize(self, text: str) -> tuple[int, ...]:
        """The model's token ids for ``text`` (special tokens as its tokenizer
        adds them; an image placeholder, ``<|vision_start|><|image_pad|><|vision_end|>``
        for Qwen2-VL, stays one pad token, which ``generate`` widens to the
        image's tokens: a token-id prompt can place its images).

        Tokenizes on a worker thread: a long text takes seconds (about a
        second a megabyte), which the event loop never waits for.

        Raises:
            InvalidInput: the runtime has no model, or ``text`` is not a str.
            RuntimeClosed: the runtime is not running.
        """
        with self._gate.call():
            if self._preparer is None:
                raise InvalidInput("model", None, "the runtime has no model: pass model=PATH")
            if not isinstance(text, str):
                raise InvalidInput("text", text, "must be a str")
            return await anyio.to_thread.run_sync(self._preparer.encode, text)

    @property
    def model_info(self) -> Optional[ModelInfo]:
        """What the loaded model is (vocabulary, end tokens, cache layers), or None."""
        return self._model_info

    @property
    def preparer(self) -> Optional[PromptPreparer]:
        """The loaded model's prompt preparer, as ``generate`` uses it (text or
        token ids plus images -> the token ids the model sees), or None."""
        return self._preparer

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


# -- validation (before anything is sent) ---------------------------------------


def _request_id(value: Any) -> RequestId:
    if not isinstance(value, str) or not value:
        raise InvalidInput("request_id", value, "must be a non-empty str")
    return RequestId(value)


def _salt(value: Any) -> Optional[str]:
    if value is not None and not isinstance(value, str):
        raise InvalidInput("cache_salt", value, "must be a str or None")
    return value


async def _tier_namespace(model_path: str, info: ModelInfo, block_size: int) -> Namespace:
    """The namespace of this model's blocks in the tiers (fingerprinting reads
    the weight files once, memoized, in a worker thread).

    Raises:
        InvalidInput: the model's blocks have no layout a tier can check, or
            a Hugging Face id that is not in the local cache.
    """
    if info.kv_layout is None:
        raise InvalidInput("kv_tiers", info.cache_layers, "this model's blocks cannot be cut for a tier")
    path = model_path
    if not os.path.isdir(path):
        path = await anyio.to_thread.run_sync(_local_snapshot, model_path)
    return await anyio.to_thread.run_sync(
        partial(namespace_for_model, path, layout=info.kv_layout, block_size=block_size)
    )


def _local_snapshot(repo_id: str) -> str:
    """The local directory of a Hugging Face model that was loaded already."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except Exception as error:
        raise InvalidInput("model", repo_id, f"has no local copy to fingerprint for the tiers ({type(error).__name__})") from None
