"""The cache as its callers use it: one client under the low-level API and generation.

:class:`CacheClient` is the only code that talks to the allocator, prefix-index
and image-cache actors in sequence. ``CacheRuntime.fetch``/``store``/``fork``/
``release``/``store_images`` check their arguments and call it; a
:class:`~mlxkv.generation.Generation` and its
:class:`~mlxkv.storer.RequestStorer` call it with what they checked when the
generation was asked for. Its arguments are therefore checked already
(``TokenIds``, non-empty request ids, :class:`~mlxkv.cache.block_hash.ChainKeys`);
nothing here checks them again.

Its callers pass through the runtime's :class:`~mlxkv.gate.Gate` around each
operation (counted in flight, refused once the runtime stops, a stopped actor
reported as ``RuntimeClosed``); :meth:`CacheClient.abandon` needs no gate, it
works on the way out too. Every operation follows one rule so that
cancellation, at any await, leaves nothing behind:

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

from collections.abc import Sequence
from typing import Any, Optional

import anyio
import attrs

from mlxkv.actors.actor import ActorFailed
from mlxkv.actors.allocator import BlockAllocatorHandle, BlockGrant, BlockId, Grants
from mlxkv.actors.image_cache import ImageCacheHandle, ImageCacheStatistics, ImageEntry
from mlxkv.actors.prefix_index import PrefixIndexHandle, PrefixIndexStatistics, RequestId
from mlxkv.cache.block_hash import BlockHash, ChainKeys
from mlxkv.cache.errors import OutOfBlocks, UnknownRequest
from mlxkv.cache.kv_events import POOL, KVEventHub
from mlxkv.cache.pool import PoolStatistics
from mlxkv.cache.tiers.tier_stack import TierStack
from mlxkv.cache.token_ids import TokenIds
from mlxkv.images import ImageBudget, KeyedImages, PixelMemo, key_images

__all__ = ["CacheClient", "FetchResult", "StoreResult"]

_NO_GRANTS = Grants()


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
        refused: for a store of the leading blocks that fit (generation's),
            the :class:`OutOfBlocks` storing them all would have raised;
            None when every block was stored.
    """

    num_blocks: int
    num_reused: int
    num_held_blocks: int
    refused: Optional[OutOfBlocks] = attrs.field(default=None, eq=False)


class CacheClient:
    """Cache operations over the allocator, prefix-index and image-cache actors.

    Owns: the three actor handles (shared with the runtime, which closes
    them), the block size, the runtime's :class:`TierStack` if it has tiers
    (entered and left by the runtime), and the runtime's :class:`~mlxkv.images.PixelMemo`
    (pixel keys of the encoded images read, for every entry point; touched
    only on the event loop). Cache state belongs to the actors; the client
    holds references only between a take and its hand-over.

    The pool's KV events are published here, where the allocator's replies
    reach the index: a ``BlockStored`` for each block a store committed
    (computed, or loaded from a tier), a ``BlockRemoved`` for each eviction
    the allocator announced, once the index has it.

    Invariants:
        - when an operation returns or raises, every reference it took is
          owned by a request table or given back;
        - every hash the allocator announces evicted is published as removed
          exactly once (an announcement whose reply was undone is announced
          again by the allocator, and published then).
    """

    def __init__(
        self,
        *,
        allocator: BlockAllocatorHandle,
        index: PrefixIndexHandle,
        images: ImageCacheHandle,
        block_size: int,
        tiers: Optional[TierStack] = None,
        image_budget: Optional[ImageBudget] = None,
        events: Optional[KVEventHub] = None,
    ) -> None:
        self._allocator = allocator
        self._index = index
        self._images = images
        self._tiers = tiers
        self._events = events
        self.block_size = block_size
        #: Pixel keys of the encoded images read, for every entry point.
        self.pixel_memo = PixelMemo()
        #: What the images of a request the model sees may cost.
        self.image_budget = image_budget

    async def key_images(self, images: Any, *, for_model: bool) -> Optional[KeyedImages]:
        """Key ``images`` the one way every entry point keys them
        (:func:`mlxkv.images.key_images`, with this runtime's memo).

        Raises:
            InvalidInput: not a list of images, an image that cannot be used,
                or (``for_model``) images past the runtime's image budget.
        """
        budget = self.image_budget if for_model else None
        return await key_images(images, self.pixel_memo, for_model=for_model, budget=budget)

    async def fetch(
        self,
        request_id: RequestId,
        tokens: TokenIds,
        keys: ChainKeys,
        *,
        wait: bool = False,
        images_key: Optional[str] = None,
        cache_salt: Optional[str] = None,
    ) -> FetchResult:
        """Start a request: take a reference to each cached block of its prefix.

        Args:
            request_id: a name no active request uses.
            tokens: the prompt.
            keys: its namespace.
            wait: also wait for prefix blocks that other requests are
                computing right now, and claim the rest (generation's way:
                see :mod:`mlxkv.actors.prefix_index`).
            images_key: look these images up in the image cache (under
                ``cache_salt``) and return their cached features.
            cache_salt: the tenant, for that lookup.

        Raises:
            DuplicateRequest: ``request_id`` is active.
        """
        match = await self._index.begin(request_id, tokens, keys, claim=wait)
        grants: list[BlockGrant] = []
        try:
            entry: Optional[ImageEntry] = None
            if images_key is not None:
                entry = await self._images.lookup(
                    images_key, cache_salt=cache_salt, request_id=request_id
                )
            while True:
                missing = match.hashes
                if match.num_hinted:
                    # The whole chain, not just the hinted part: the allocator
                    # decides, so a hint missing for a cached block costs nothing.
                    acquired = await self._allocator.acquire(match.hashes, request_id=request_id)
                    await self._hand_over(request_id, len(grants), acquired, hit=True)
                    grants.extend(acquired.grants)
                    missing = match.hashes[len(acquired.grants) :]
                if match.wait is None:
                    break
                await match.wait.wait()
                match = await self._index.rematch(request_id)
            if self._tiers is not None and missing:
                parent = grants[-1].block_hash if grants else None
                grants.extend(await self._load(request_id, len(grants), missing, parent, tokens, keys))
        except BaseException:
            await self.abandon(request_id)
            raise
        num_cached = len(grants) * self.block_size
        return FetchResult(
            request_id=request_id,
            num_cached_tokens=num_cached,
            grants=tuple(grants),
            remaining=tuple(tokens[num_cached:]),
            vision_embeddings=None if entry is None else entry.vision_embeddings,
        )

    async def store(
        self,
        request_id: RequestId,
        tokens: TokenIds,
        payloads: tuple[Any, ...],
        *,
        leading: bool = False,
    ) -> StoreResult:
        """Keep the request's newly computed full blocks; the request holds them.

        A block whose hash is already cached is shared instead, and its given
        payload dropped. All or nothing -- or, with ``leading``, the leading
        blocks that fit (``StoreResult.refused`` says what did not).

        Args:
            request_id: an active request.
            tokens: its whole token sequence so far.
            payloads: one per full block of ``tokens`` beyond those it holds.
            leading: keep the leading blocks that fit instead of raising.

        Raises:
            InvalidInput: the tokens do not extend the request's, or the
                wrong number of payloads; nothing changed.
            UnknownRequest: the request is not active.
            OutOfBlocks: without ``leading``, the new blocks do not fit;
                nothing changed.
        """
        extension = await self._index.extend(request_id, tokens, len(payloads))
        if not extension.hashes:
            return StoreResult(num_blocks=0, num_reused=0, num_held_blocks=extension.start)
        grants = await self._allocator.store_blocks(
            extension.hashes, payloads, leading=leading, request_id=request_id
        )
        tail, tail_hashes = extension.after(len(grants.grants), tokens, self.block_size)
        held = await self._hand_over(
            request_id, extension.start, grants, tail=tail, tail_hashes=tail_hashes
        )
        if grants.fresh:
            self._committed(
                grants, extension.start, extension.parent_hash, tokens, extension.keys, write_behind=True
            )
        return StoreResult(
            num_blocks=len(grants.grants),
            num_reused=grants.num_reused,
            num_held_blocks=held,
            refused=grants.refused,
        )

    async def fork(self, source_id: RequestId, request_id: RequestId) -> FetchResult:
        """Start ``request_id`` holding the same blocks and tokens as ``source_id``.

        Raises:
            InvalidInput: ``source_id`` changed meanwhile.
            UnknownRequest: ``source_id`` is not active.
            DuplicateRequest: ``request_id`` is active.
        """
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
        self._removed(grants.evicted)
        return FetchResult(
            request_id=request_id,
            num_cached_tokens=len(grants.grants) * self.block_size,
            grants=grants.grants,
            remaining=tuple(snapshot.tail),
        )

    async def release(self, request_id: RequestId) -> int:
        """End a request: drop its table and every reference it holds (shielded).

        Returns:
            How many block references were released.

        Raises:
            UnknownRequest: the request is not active.
        """
        with anyio.CancelScope(shield=True):
            block_ids = await self._index.close_table(request_id)
            if block_ids:
                await self._allocator.release(_tail_first(block_ids), request_id=request_id)
        return len(block_ids)

    async def abandon(self, request_id: RequestId) -> None:
        """Release whatever ``request_id`` holds, if it is still active
        (shielded; also while the runtime closes, or after an actor stopped)."""
        with anyio.CancelScope(shield=True):
            try:
                block_ids = await self._index.close_table(request_id)
                if block_ids:
                    await self._allocator.release(_tail_first(block_ids), request_id=request_id)
            except (UnknownRequest, ActorFailed):
                pass  # gone already, or the runtime is going down with it

    async def unclaim(self, request_id: RequestId) -> None:
        """Drop the request's claims on blocks it will not publish (shielded):
        whoever waits for them computes them."""
        await self._index.unclaim(request_id)

    async def evict(self, num_blocks: int) -> int:
        """Drop the cached content of up to ``num_blocks`` free blocks, LRU first.

        Raises:
            InvalidInput: ``num_blocks`` is not a non-negative int.
        """
        eviction = await self._allocator.evict(num_blocks)
        await self._index.forget(eviction.evicted)
        self._removed(eviction.evicted)
        return eviction.num_evicted

    async def lookup_images(
        self, images_key: str, *, cache_salt: Optional[str], request_id: Optional[str] = None
    ) -> Optional[ImageEntry]:
        """The cached vision-encoder output for these images, or None."""
        return await self._images.lookup(images_key, cache_salt=cache_salt, request_id=request_id)

    async def store_images(
        self,
        images_key: str,
        vision_embeddings: Any,
        *,
        num_image_tokens: int,
        cache_salt: Optional[str],
        request_id: Optional[str] = None,
    ) -> None:
        """Cache the vision encoder's output for these images.

        Raises:
            InvalidInput: a bad count; nothing changed.
        """
        await self._images.store(
            images_key,
            vision_embeddings,
            num_image_tokens=num_image_tokens,
            cache_salt=cache_salt,
            request_id=request_id,
        )

    async def statistics(self) -> tuple[PoolStatistics, PrefixIndexStatistics, ImageCacheStatistics]:
        """The block pool's, the index's and the image cache's statistics."""
        return (
            await self._allocator.statistics(),
            await self._index.statistics(),
            await self._images.statistics(),
        )

    async def index_statistics(self) -> PrefixIndexStatistics:
        """The index's statistics alone: they never wait for the compute
        actor, which answers only between plans (what shows a request in
        flight while a plan runs)."""
        return await self._index.statistics()

    async def check_invariants(self) -> tuple[list[str], list[str]]:
        """Every cache actor's violations, and the blocks whose reference count
        differs from the request tables listing them."""
        index = await self._index.check_invariants()
        allocator = await self._allocator.check_invariants(index.holdings)
        images = await self._images.check_invariants()
        return [*index.violations, *allocator.violations, *images], list(allocator.reference_mismatches)

    async def _load(
        self,
        request_id: RequestId,
        start: int,
        missing: tuple[BlockHash, ...],
        parent_hash: Optional[BlockHash],
        tokens: TokenIds,
        keys: ChainKeys,
    ) -> tuple[BlockGrant, ...]:
        """Continue the request's chain (``tokens`` under ``keys``) from the
        tiers where the pool missed, at block ``start``: the leading
        ``missing`` blocks some tier holds enter the pool as cached blocks
        (those that fit) and the request holds them."""
        assert self._tiers is not None
        payloads = await self._tiers.lookup_chain(missing, first_block=start)
        if not payloads:
            return ()
        stored = await self._allocator.store_blocks(
            missing[: len(payloads)], tuple(payloads), leading=True, request_id=request_id
        )
        # Not a hit at the index: its hit counters are the pool's; the tiers count theirs.
        await self._hand_over(request_id, start, stored)
        if stored.fresh:
            self._committed(stored, start, parent_hash, tokens, keys, write_behind=False)
        return stored.grants

    def _committed(
        self,
        grants: Grants,
        start: int,
        parent_hash: Optional[BlockHash],
        tokens: TokenIds,
        keys: ChainKeys,
        *,
        write_behind: bool,
    ) -> None:
        """Announce the blocks a store newly committed to the pool (blocks
        ``start``, ``start + 1``, ... of ``tokens``), and offer them to the
        tiers if ``write_behind`` (never waits)."""
        tiers = self._tiers if write_behind else None
        events = self._events
        described = events is not None and events.num_subscribers > 0
        if tiers is None and not described:
            return
        fresh = set(grants.fresh)
        size = self.block_size
        salted = keys.salted
        for block, grant in enumerate(grants.grants, start):
            if grant.block_hash in fresh:
                fields = {}
                if described:
                    fields = {
                        "token_ids": tuple(tokens[block * size : (block + 1) * size]),
                        "extra_keys": keys.entering(block),
                        "salted": salted,
                    }
                    events.stored(tier=POOL, block_hash=grant.block_hash, parent_hash=parent_hash, **fields)
                if tiers is not None:
                    tiers.offer(grant.block_hash, grant.payload, parent_hash=parent_hash, **fields)
            parent_hash = grant.block_hash

    def _removed(self, evicted: tuple[BlockHash, ...]) -> None:
        """Announce the pool's evictions the index has just been told of."""
        if self._events is not None:
            for block_hash in evicted:
                self._events.removed(tier=POOL, reason="evicted", block_hash=block_hash)

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
            held = await self._index.record(
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
        self._removed(grants.evicted)
        return held


def _tail_first(block_ids: Sequence[BlockId]) -> tuple[BlockId, ...]:
    """A table's blocks in the order they should become evictable: tail first.

    The free queue evicts the block released longest ago. Releasing a chain
    head first would evict its head first and strand every later block (a
    hit needs the whole chain before it); tail first keeps the longest
    reusable prefix, as vLLM does.
    """
    return tuple(block_ids[::-1])
