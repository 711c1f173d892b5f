"""The tiers below the pool, in lookup order, with a write-behind writer and KV events.

The pool is tier 0; a :class:`TierStack` is everything after it:

- :meth:`TierStack.lookup_chain` continues a chain where the pool missed:
  it asks each tier in order which of the chain's blocks it holds, takes the
  leading run of blocks that some tier holds (the first block missing
  everywhere ends the hit), reads each from the first tier that holds it
  (tiers read at once, each a chunk at a time), and decodes each chunk as it
  arrives, so a lookup holds one chunk's raw bytes per tier, not the run's.
  A block that vanished or failed to verify between the probe and the read
  is asked of the later tiers; if none has it, the run ends there. A single
  tier is not probed: it is read chunk by chunk until a block is missing.
  Every value must be the block of its position in the chain (a value
  stored for another position is corrupt), and a tier counts as loaded only
  the blocks the lookup returned, not those read past where the run ended.
- :meth:`TierStack.offer` hands a newly computed block to the writer. It
  never waits and never raises: the block goes into a bounded queue, or is
  dropped (and counted) when the queue is full. The writer task encodes
  each block once, in a worker thread, and writes it to every tier at once.
- every store and removal is published to :meth:`TierStack.subscribe`-rs
  (:mod:`~mlxkv.cache.tiers.kv_events`).

Every call to a tier is bounded by ``timeout``: a tier that is slow costs
misses (lookups) or dropped writes, never a delayed caller. Tiers never
raise for their storage's failures (see :mod:`~mlxkv.cache.tiers.tier`).

MLX: offered payloads must hold evaluated arrays (encoding reads their
bytes in a worker thread). Decoding builds new arrays from a value's bytes
in a worker thread and evaluates them there before they leave it: they
carry no graph to the MLX thread that uses them (the rule of
docs/architecture.md, "Threads").
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack
from functools import partial
from types import TracebackType
from typing import Any, Optional, TypeVar

import anyio
import anyio.lowlevel
import attrs
from anyio.abc import TaskStatus

from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.kv_state import BlockPayload
from mlxkv.cache.tiers.block_format import decode_payloads, encode_block
from mlxkv.cache.kv_events import KVEventHub, KVEventStatistics, KVEventSubscription
from mlxkv.cache.tiers.namespace import Namespace
from mlxkv.cache.tiers.storage_key import StorageKey, storage_key, storage_keys
from mlxkv.cache.tiers.tier import Tier, TierStatistics

__all__ = ["DEFAULT_QUEUE_SIZE", "DEFAULT_TIMEOUT", "TierStack", "TierStackStatistics"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Blocks the write queue holds before offers are dropped.
DEFAULT_QUEUE_SIZE = 256

#: Blocks one read asks a tier for (a tier's reads of one lookup run one
#: after another, each decoded before the next).
GET_CHUNK = 32

#: Seconds any one call to a tier may take.
DEFAULT_TIMEOUT = 1.0



@attrs.frozen
class TierStackStatistics:
    """A stack's counters at one moment.

    Attributes:
        num_offered: blocks offered.
        num_queued: offers accepted into the write queue.
        num_queue_dropped: offers dropped because the queue was full.
        num_refused: offers that are not a full block of the namespace,
            or came while the stack was not running.
        num_pending: queued blocks not yet written to every tier.
        num_lookups: chain lookups.
        num_blocks_found: blocks the lookups returned (the sum of the
            tiers' ``num_loaded``).
        lookup_seconds: time the lookups took in all: probing, reading,
            verifying and decoding (what a prefix from the tiers adds to its
            request's time to first token).
        num_timeouts: calls to a tier that took longer than ``timeout``.
        tiers: each tier's own statistics, in lookup order.
        events: the KV event hub's statistics.
    """

    num_offered: int
    num_queued: int
    num_queue_dropped: int
    num_refused: int
    num_pending: int
    num_lookups: int
    num_blocks_found: int
    lookup_seconds: float
    num_timeouts: int
    tiers: tuple[TierStatistics, ...]
    events: KVEventStatistics

    @property
    def num_blocks_written(self) -> int:
        """Blocks written behind that some tier holds, each counted once (the
        most any one tier wrote)."""
        return max((tier.num_written for tier in self.tiers), default=0)


@attrs.frozen
class _Write:
    key: StorageKey
    block_hash: bytes
    parent_hash: Optional[bytes]
    payload: BlockPayload
    #: The rest of the block's ``BlockStored`` (tokens, keys, salted).
    described: Mapping[str, Any]


class TierStack:
    """Tiers in lookup order, their write-behind writer and their KV events.

    Use as ``async with TierStack(tiers, namespace) as stack:``; entering
    enters every tier and starts the writer, leaving stops it (after
    writing what is queued, for at most ``drain_timeout`` seconds) and
    leaves the tiers.

    Owns: the tiers (entered and left with it), the write queue and its
    writer task, the event hub, and its counters (written on the event loop
    only).

    Invariants:
        - :meth:`offer` never waits and never raises;
        - ``num_offered == num_queued + num_queue_dropped + num_refused``;
        - ``num_pending`` is queued blocks not yet handled by the writer;
        - the tiers' ``num_loaded`` add up to ``num_blocks_found``: a tier
          counts as loaded the blocks a lookup returned from it, no others.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        namespace: Namespace,
        *,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        timeout: float = DEFAULT_TIMEOUT,
        drain_timeout: float = 5.0,
        events: Optional[KVEventHub] = None,
    ) -> None:
        """Args:
            tiers: in lookup order (fastest first: disk before Redis).
            namespace: the namespace of every block (the tiers' own too).
            queue_size: blocks the write queue holds, >= 1.
            timeout: seconds any one call to a tier may take.
            drain_timeout: seconds leaving the stack spends writing what
                is still queued before it gives up on it.
            events: where to announce stored and removed blocks (the
                runtime's hub, which its owner closes); by default a hub of
                the stack's own, closed when the stack is left.

        Raises:
            InvalidInput: bad sizes or times, or two tiers of one name.
        """
        if type(queue_size) is not int or queue_size < 1:
            raise InvalidInput("queue_size", queue_size, "must be an int >= 1")
        for argument, value in (("timeout", timeout), ("drain_timeout", drain_timeout)):
            if not (isinstance(value, (int, float)) and value > 0):
                raise InvalidInput(argument, value, "must be a positive number of seconds")
        names = [tier.name for tier in tiers]
        if len(set(names)) != len(names):
            raise InvalidInput("tiers", names, "two tiers have one name")
        self._tiers = tuple(tiers)
        self._namespace = namespace
        self._queue_size = queue_size
        self._timeout = float(timeout)
        self._drain_timeout = float(drain_timeout)
        self._owns_events = events is None
        self._events = KVEventHub(namespace.block_size) if events is None else events
        self._exit_stack: Optional[AsyncExitStack] = None
        self._send: Any = None
        self._entered = False
        # Made on entry: anyio events belong to a running event loop.
        self._writer_done: Any = None
        self._idle: Any = None
        self._slow: set[str] = set()
        self._warned_refusal = False
        self._num_offered = 0
        self._num_queued = 0
        self._num_queue_dropped = 0
        self._num_refused = 0
        self._num_handled = 0
        self._num_lookups = 0
        self._num_blocks_found = 0
        self._lookup_seconds = 0.0
        self._num_timeouts = 0

    @classmethod
    def from_urls(cls, urls: Iterable[str], namespace: Namespace, **options: Any) -> TierStack:
        """A stack of the tiers ``urls`` name (see :func:`~mlxkv.cache.tiers.tier_url.parse_tier_url`).

        Args:
            urls: ``file:///path?max_bytes=N``, ``redis://host:port/db?ttl=S``...
            namespace: the namespace of every block.
            options: the other arguments of :class:`TierStack`.

        Raises:
            InvalidInput: a URL that names no tier.
            MissingExtra: a ``redis://`` tier without the ``redis`` extra.
        """
        from mlxkv.cache.tiers.tier_url import open_tier

        return cls([open_tier(url, namespace) for url in urls], namespace, **options)

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers, in lookup order."""
        return self._tiers

    @property
    def namespace(self) -> Namespace:
        """The namespace of every block."""
        return self._namespace

    async def __aenter__(self) -> TierStack:
        if self._entered:
            raise RuntimeError("a TierStack is entered once; make a new one")
        self._entered = True
        self._writer_done = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        async with AsyncExitStack() as stack:
            for tier in self._tiers:
                await stack.enter_async_context(tier)
            if self._owns_events:
                stack.callback(self._events.close)
            send, receive = anyio.create_memory_object_stream[_Write](self._queue_size)
            stack.enter_context(send)
            stack.enter_context(receive)
            task_group = await stack.enter_async_context(anyio.create_task_group())
            stack.push_async_callback(self._stop_writer, task_group)
            await task_group.start(self._write_behind, receive)
            self._send = send
            self._exit_stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> Optional[bool]:
        stack, self._exit_stack = self._exit_stack, None
        if stack is None:
            return None
        return await stack.__aexit__(exc_type, exc, traceback)

    def offer(
        self,
        block_hash: bytes,
        payload: BlockPayload,
        *,
        parent_hash: Optional[bytes] = None,
        **described: Any,
    ) -> bool:
        """Queue a block for writing to every tier, without waiting.

        Never raises: a block that is not a full block of the namespace, or
        that comes while the stack is not running, is refused (counted,
        logged once); one that finds the queue full is dropped (counted).

        Args:
            block_hash: the block's chain hash.
            payload: its KV (evaluated arrays; the queue keeps a reference).
            parent_hash: the previous block's chain hash, for KV events.
            described: the rest of its KV event (``token_ids``,
                ``extra_keys``, ``salted``: see :class:`BlockStored`).

        Returns:
            Whether it was queued.
        """
        self._num_offered += 1
        refusal = self._refusal(block_hash, payload)
        if refusal is not None:
            self._refuse(refusal)
            return False
        try:
            key = storage_key(self._namespace, block_hash)
            self._send.send_nowait(_Write(key, bytes(block_hash), parent_hash, payload, described))
        except anyio.WouldBlock:
            self._num_queue_dropped += 1
            return False
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, InvalidInput) as exc:
            self._refuse(str(exc) or type(exc).__name__)
            return False
        self._num_queued += 1
        if self._idle.is_set():
            self._idle = anyio.Event()
        return True

    async def wait_written(self) -> None:
        """Wait until every block queued so far has been handled by the writer
        (written to every tier, or dropped by a tier)."""
        while self._num_handled < self._num_queued:
            await self._idle.wait()
        await anyio.lowlevel.checkpoint()

    async def lookup_chain(
        self, chain: Sequence[bytes], *, first_block: Optional[int] = None
    ) -> list[BlockPayload]:
        """The payloads of ``chain``'s leading blocks that some tier holds.

        Args:
            chain: chain hashes of consecutive blocks, in order (the part of
                a prompt's chain the pool did not have).
            first_block: the index of ``chain[0]``'s block in its sequence
                (the blocks before it are the pool's), when the caller knows
                it: each value must then be the block of its own position.
                Without it, the chain's first value says where the chain
                begins and every later value must follow it (a first value
                stored for another position is then taken at its word, and
                the one after it refused).

        Returns:
            Payloads of ``chain[0]``, ``chain[1]``, ... up to the first block
            that no tier holds (or that vanished or did not verify when it
            was read, its position included); empty if the first one is
            missing. Never raises for a tier's failure: that is a miss.

        Raises:
            InvalidInput: ``first_block`` is not an int >= 0.
        """
        if first_block is not None and (type(first_block) is not int or first_block < 0):
            raise InvalidInput("first_block", first_block, "must be an int >= 0 or None")
        self._num_lookups += 1
        if not chain or not self._tiers:
            return []
        started = time.perf_counter()
        try:
            return await self._lookup(chain, first_block)
        finally:
            self._lookup_seconds += time.perf_counter() - started

    async def _lookup(self, chain: Sequence[bytes], first_block: Optional[int]) -> list[BlockPayload]:
        keys = storage_keys(self._namespace, chain)
        size = self._namespace.block_size
        # One tier is read without a probe: its first missing value ends the run.
        probed = len(self._tiers) > 1
        owner: list[Optional[int]] = [None] * len(keys) if probed else [0] * len(keys)
        for index, tier in enumerate(self._tiers if probed else ()):
            wanted = [i for i, t in enumerate(owner) if t is None]
            if not wanted:
                break
            found = await self._bounded(tier, tier.contains_many([keys[i] for i in wanted]), None)
            for i, present in zip(wanted, found or ()):
                if present:
                    owner[i] = index
        run = next((i for i, t in enumerate(owner) if t is None), len(owner))
        holder = [t for t in owner[:run] if t is not None]  # the first tier holding each
        payloads: list[Optional[BlockPayload]] = [None] * run
        served: list[int] = [0] * run  # the tier each payload came from
        # Where each block must start (tokens); unknown until a first value says.
        starts: Optional[list[int]] = None
        if first_block is not None:
            starts = [(first_block + i) * size for i in range(run)]

        async def read(index: int, positions: list[int]) -> bool:
            """Read and decode ``positions`` from tier ``index``; whether the
            read answered in time (a value it lacks is left None)."""
            tier = self._tiers[index]
            expected = None if starts is None else [starts[i] for i in positions]
            got = await self._bounded(tier, tier.get_many([keys[i] for i in positions], starts=expected), None)
            if got is None:
                return False
            found = [(i, value) for i, value in zip(positions, got) if value is not None]
            if found:
                decoded = await anyio.to_thread.run_sync(decode_payloads, [value for _, value in found])
                for (i, _), payload in zip(found, decoded):
                    payloads[i] = payload
                    served[i] = index
            return True

        async def fetch(index: int) -> None:
            # In chunks, in chain order, each bounded by the timeout on its
            # own (a long chain of large blocks is not one call that must
            # finish within it) and decoded before the next is read, so a
            # lookup holds one chunk's raw bytes at a time. A chunk that
            # times out ends the run there: no later chunk is asked for.
            # (Reading the next chunk while one decodes was slower: the
            # reading and decoding threads take turns on the GIL.)
            positions = [i for i in range(run) if holder[i] == index and payloads[i] is None]
            for begin in range(0, len(positions), GET_CHUNK):
                chunk = positions[begin : begin + GET_CHUNK]
                if not await read(index, chunk):
                    return
                if not probed and any(payloads[i] is None for i in chunk):
                    return  # the run ends in this chunk: nothing after it is read

        async def retry() -> None:
            # A value that vanished or did not verify since the probe may still
            # be in a later tier: ask those, in order, before the run ends there.
            for index in range(len(self._tiers)):
                again = [i for i in range(run) if payloads[i] is None and holder[i] < index]
                if again:
                    await read(index, again)

        if run:
            async with anyio.create_task_group() as task_group:
                for index in range(len(self._tiers)):
                    task_group.start_soon(fetch, index)
        await retry()
        first = payloads[0] if run else None
        if starts is None and first is not None:
            # Where the chain begins is what its first value says; every
            # later value must follow it. The first that does not is read
            # again for its position, so its tier counts it corrupt (and
            # deletes it); a later tier may still hold the right one.
            starts = [first.start + i * size for i in range(run)]
            misplaced = [i for i, p in enumerate(payloads) if p is not None and p.start != starts[i]]
            for i in misplaced:
                payloads[i] = None
            if misplaced:
                await read(served[misplaced[0]], misplaced[:1])
                await retry()
        run = next((i for i, p in enumerate(payloads) if p is None), run)
        found = [p for p in payloads[:run] if p is not None]
        for index, count in Counter(served[:run]).items():
            self._tiers[index].count_loaded(count)
        self._num_blocks_found += len(found)
        self._publish_removals()
        return found

    def subscribe(self, buffer: int = 1024) -> KVEventSubscription:
        """KV events from now on (see :meth:`KVEventHub.subscribe`)."""
        return self._events.subscribe(buffer)

    def statistics(self) -> TierStackStatistics:
        """The counters now."""
        return TierStackStatistics(
            num_offered=self._num_offered,
            num_queued=self._num_queued,
            num_queue_dropped=self._num_queue_dropped,
            num_refused=self._num_refused,
            num_pending=self._num_queued - self._num_handled,
            num_lookups=self._num_lookups,
            num_blocks_found=self._num_blocks_found,
            lookup_seconds=self._lookup_seconds,
            num_timeouts=self._num_timeouts,
            tiers=tuple(tier.statistics() for tier in self._tiers),
            events=self._events.statistics(),
        )

    def _refusal(self, block_hash: Any, payload: Any) -> Optional[str]:
        if self._send is None:
            return "the tier stack is not running"
        if not isinstance(payload, BlockPayload):
            return f"not a BlockPayload: {type(payload).__name__}"
        if payload.num_tokens != self._namespace.block_size or payload.start % self._namespace.block_size:
            return f"not a full block: start {payload.start}, {payload.num_tokens} tokens"
        layout = self._namespace.layout
        if (tuple(payload.layers), tuple(payload.signature)) != (layout.layers, layout.signature):
            return "its layout is not the namespace's"
        if not isinstance(block_hash, (bytes, int)):
            return f"block_hash is not bytes: {type(block_hash).__name__}"
        return None

    def _refuse(self, reason: str) -> None:
        self._num_refused += 1
        if not self._warned_refusal:
            self._warned_refusal = True
            logger.warning("tier stack refused a block (%s); later refusals are counted only", reason)

    async def _write_behind(self, receive: Any, *, task_status: TaskStatus[None]) -> None:
        task_status.started()
        try:
            async for write in receive:
                try:
                    await self._write(write)
                finally:
                    self._num_handled += 1
                    if self._num_handled == self._num_queued:
                        self._idle.set()
        finally:
            self._writer_done.set()

    async def _write(self, write: _Write) -> None:
        try:
            value = await anyio.to_thread.run_sync(
                partial(encode_block, write.payload, key=write.key, namespace=self._namespace)
            )
        except InvalidInput as exc:
            self._refuse(exc.reason)
            return
        async with anyio.create_task_group() as task_group:
            for tier in self._tiers:
                task_group.start_soon(self._put, tier, write, value)

    async def _put(self, tier: Tier, write: _Write, value: bytes) -> None:
        if await self._bounded(tier, tier.put(write.key, value), False):
            self._events.stored(
                tier=tier.name,
                key=write.key,
                block_hash=write.block_hash,
                parent_hash=write.parent_hash,
                **write.described,
            )
        self._publish_removals()

    async def _stop_writer(self, task_group: Any) -> None:
        # No more offers; the writer finishes what is queued, for at most
        # drain_timeout (not at all when leaving because of a cancellation).
        self._send.close()
        self._send = None
        try:
            with anyio.move_on_after(self._drain_timeout):
                await self._writer_done.wait()
        finally:
            task_group.cancel_scope.cancel()

    async def _bounded(self, tier: Tier, call: Awaitable[T], default: T) -> T:
        with anyio.move_on_after(self._timeout) as scope:
            result = await call
            self._slow.discard(tier.name)
            return result
        if scope.cancelled_caught:
            self._num_timeouts += 1
            if tier.name not in self._slow:
                self._slow.add(tier.name)
                logger.warning(
                    "tier %s took over %.3g s: that call is a miss or a dropped write", tier.name, self._timeout
                )
        return default

    def _publish_removals(self) -> None:
        for tier in self._tiers:
            for removal in tier.take_removals():
                self._events.removed(tier=tier.name, key=removal.key, reason=removal.reason)
