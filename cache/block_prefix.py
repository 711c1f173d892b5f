"""Block-level prefix cache over a :class:`~mlxkv.cache.paged.PagedCacheManager` (seed API).

:class:`BlockAwarePrefixCache` stores a request's KV state block by block in
the paged manager and serves later requests from the longest run of cached
blocks that starts their prompt. It keeps vllm-mlx 0.6.0's names, signatures
and return values, but:

* lookups are exact and linear: a prompt's parent-chained hash chain is
  computed once per call (:func:`~mlxkv.cache.block_hash.hash_block_chain`)
  and matched through the manager's ``lookup``/``acquire``; there is no
  content-only hash and no per-prefix re-hashing;
* blocks hold owned per-block slices (:mod:`mlxkv.cache.kv_state`), never the
  caller's cache objects, so evicting blocks frees memory;
* cache data that cannot be sliced (placeholders, caches it cannot rebuild
  exactly) still gets the seed's full bookkeeping: its blocks are allocated,
  hashed and found, each marked with an :class:`OpaquePayload`, and the data
  is kept by reference for the request that stored it, as the seed keeps it;
* ``reconstruct_cache`` returns real mlx-lm cache objects with room for the
  request's suffix, and refuses (``None``, logged) whatever it cannot rebuild
  exactly; a hybrid model's hit stops at the last block that carries the
  recurrent layers' snapshot;
* blocks written through the paged API in the seed's declared format (a
  ``(keys, values)`` pair per layer) are read as KV state where they are
  exactly that, and are a miss otherwise;
* an optional ``cache_salt``, ``images`` (from the block that holds the
  first image token on, with ``images_start``) and ``extra_keys`` enter the
  hash chain through :class:`~mlxkv.cache.block_hash.ChainKeys`, the same
  derivation the runtime uses: a prompt keys alike through either API, and
  requests with different salts never share a block;
* no ``id(model)`` keys, no wall clock (a logical tick), no locks.

All MLX work (slicing, rebuilding) happens on the calling thread and returns
evaluated arrays only.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Sequence
from typing import Any, Optional

import attrs

from mlxkv.cache import kv_state
from mlxkv.cache.block_hash import BlockHash, ChainKeys
from mlxkv.cache.errors import CacheError, InvalidInput, InvariantViolation, OutOfBlocks
from mlxkv.cache.mllm import images_digest
from mlxkv.cache.model_key import model_key
from mlxkv.cache.paged import BlockTable, CacheBlock, PagedCacheManager

__all__ = ["BlockAwarePrefixCache", "BlockCacheEntry", "OpaquePayload"]

logger = logging.getLogger(__name__)


@attrs.frozen
class OpaquePayload:
    """The payload of a block stored from cache data this cache cannot slice.

    The seed does a request's block bookkeeping whatever its cache data is
    (placeholders, legacy cache lists) and keeps the data itself in the
    request's entry; so does :class:`BlockAwarePrefixCache`. Each such block
    carries this marker instead of KV state, so that a fetch can tell it from
    a block published without data (a miss), and the mark leaves with the
    block when it is evicted or reused. It holds no reference to the data.

    Attributes:
        start: position of the block's first token.
        num_tokens: tokens the block covers.
    """

    start: int
    num_tokens: int


@attrs.define(eq=False)
class BlockCacheEntry:
    """One request's blocks, as this cache tracks them.

    Unlike the seed's entry, it keeps no reference to the caller's caches
    when they could be sliced into blocks, and stamps ``last_access`` with a
    logical tick, not the wall clock.

    Attributes:
        block_table: the request's table in the paged manager.
        blocks: the blocks the table lists, in the same order.
        last_access: logical tick of the last operation on the request.
        keys: the namespace (salt, images...) its hash chain was computed with.
        block_hashes: chain hashes of its leading full blocks.
        num_prompt_tokens: length of the prompt it fetched or stored; the
            tokens past ``block_table.num_tokens`` are its pending suffix.
        tail_tokens: token ids of its trailing partial block, if it has one.
        opaque: whether the request's last store was of data this cache could
            not slice.
        opaque_data: that data, by reference (the seed's "stores
            references"); None unless ``opaque``.

    Invariants:
        - ``[b.block_id for b in blocks] == block_table.block_ids``.
        - ``block_hashes`` covers the leading full blocks; a trailing partial
          block (``tail_tokens``) is never hashed.
        - ``opaque_data is None`` unless ``opaque``.
    """

    block_table: BlockTable
    blocks: list[CacheBlock]
    last_access: int
    keys: ChainKeys = ChainKeys()
    block_hashes: list[BlockHash] = attrs.field(factory=list)
    num_prompt_tokens: int = 0
    tail_tokens: tuple[int, ...] = ()
    opaque: bool = False
    opaque_data: Any = None

    @property
    def cache_data(self) -> list[Any]:
        """The per-block payloads of the request's blocks, in token order.

        Unlike the seed, not the caller's cache objects (those would keep
        their whole KV buffers alive for as long as the request lives); data
        that could not be sliced is ``opaque_data``.
        """
        return [block.cache_data for block in self.blocks]


def _kv_payloads(blocks: Sequence[CacheBlock]) -> list[Optional[kv_state.BlockPayload]]:
    """Each block's payload read as KV state at its position in ``blocks``.

    Our own payloads come as they are; payloads written in the seed's format
    are read where they are exactly KV state; anything else is None.
    """
    payloads: list[Optional[kv_state.BlockPayload]] = []
    position = 0
    for block in blocks:
        payloads.append(
            kv_state.as_block_payload(
                block.cache_data, start=position, num_tokens=block.token_count
            )
        )
        position += block.token_count
    return payloads


def _num_opaque(blocks: Sequence[CacheBlock]) -> int:
    """How many leading blocks carry the opaque mark for their position."""
    position = 0
    for count, block in enumerate(blocks):
        mark = block.cache_data
        if not (
            isinstance(mark, OpaquePayload)
            and mark.start == position
            and mark.num_tokens == block.token_count
        ):
            return count
        position += block.token_count
    return len(blocks)


def _chain_keys(
    tokens: Sequence[int],
    block_size: int,
    cache_salt: Optional[Any],
    extra_keys: Optional[Sequence[Any]],
    images: Optional[Sequence[Any]],
    images_start: Optional[int],
) -> ChainKeys:
    """The request's namespace, derived as the runtime derives it.

    Raises:
        InvalidInput: bad images, or an ``images_start`` that is not the index
            of a token (or comes without images).
    """
    images_key = images_digest(images) if images else None
    if images_start is not None:
        if images_start.__class__ is not int or not 0 <= images_start < len(tokens):
            raise InvalidInput("images_start", images_start, f"must index the {len(tokens)} tokens")
        if images_key is None:
            raise InvalidInput("images_start", images_start, "is given without images")
    return ChainKeys.derive(
        cache_salt=cache_salt,
        images_key=images_key,
        images_start=images_start,
        block_size=block_size,
        extra_keys=extra_keys or (),
    )


class BlockAwarePrefixCache:
    """Prefix cache that stores KV state per block in a paged manager.

    It owns the per-request entries (``_request_tables``: request id ->
    :class:`BlockCacheEntry`), the hit/miss statistics and a logical clock.
    The paged manager owns the blocks, their reference counts and the hash ->
    block index; this class goes through its typed core (``lookup``,
    ``acquire``, ``allocate``, ``commit``, ``release``) and its table methods.
    Use one instance per model: blocks carry no model identity.

    Invariants:
        - Every entry's ``block_table`` is the paged manager's table for that
          request, and ``entry.blocks[i].block_id == block_table.block_ids[i]``.
        - ``block_table.num_tokens`` is the sum of the blocks' token counts;
          every block but the last is full.
        - ``entry.block_hashes`` lists the chain hashes of the leading full
          blocks; a block that is cached (hashed) in the manager holds exactly
          the KV state of the tokens its hash covers, or an
          :class:`OpaquePayload` mark.
        - A payload of ours (KV state or mark) in an entry's block covers
          exactly that block's tokens at that block's position.
        - An entry holds one reference to each listed block (through its
          table) and gives all of them back exactly once, on release.
        - The trailing partial block of a request is never hashed (shared).

    Check them with :meth:`check_invariants`.
    """

    def __init__(self, model: Any, paged_cache_manager: PagedCacheManager) -> None:
        """Create a prefix cache over ``paged_cache_manager``.

        Args:
            model: the MLX model whose caches are stored (kept for reference
                and :attr:`model_key`; nothing is looked up by it).
            paged_cache_manager: the manager that owns the blocks.
        """
        self.model = model
        self.paged_cache = paged_cache_manager
        self.block_size = paged_cache_manager.block_size
        self._request_tables: dict[str, BlockCacheEntry] = {}
        self._hits = 0
        self._misses = 0
        self._tokens_saved = 0
        self._tick = 0

    @functools.cached_property
    def model_key(self) -> Optional[str]:
        """A stable key of :attr:`model` (see :func:`~mlxkv.cache.model_key.model_key`).

        The seed's is ``id(model)``, which a later model can inherit. Computed
        on first read.
        """
        return model_key(self.model)

    def _in_use(self, request_id: str) -> bool:
        return (
            request_id in self._request_tables
            or self.paged_cache.get_block_table(request_id) is not None
        )

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    # Lookup and storage.

    def fetch_cache(
        self,
        request_id: str,
        tokens: list[int],
        *,
        cache_salt: Optional[Any] = None,
        extra_keys: Optional[Sequence[Any]] = None,
        images: Optional[Sequence[Any]] = None,
        images_start: Optional[int] = None,
    ) -> tuple[Optional[BlockTable], list[int]]:
        """Find the longest cached prefix of ``tokens`` that can be served.

        A cached run of full blocks is served as far as its blocks can be
        rebuilt exactly into KV state; a run whose first block was stored
        from data this cache could not slice (an :class:`OpaquePayload`) is
        served as far as such blocks go, for its bookkeeping: its table
        cannot be rebuilt. Blocks that hold neither (published without data,
        or with data that is not exactly KV) are a miss.

        On a hit, ``request_id`` gets a table holding one reference to each
        block of that prefix, until :meth:`release_cache`. Only full blocks
        are shared; when every token is cached, ``remaining`` is empty (a
        caller that needs logits fetches ``tokens[:-1]``).

        Args:
            request_id: the request, which must not hold anything here yet.
            tokens: its prompt.
            cache_salt: namespace of the request (tenant); only blocks stored
                with the same salt are found.
            extra_keys: further namespace keys (an adapter's name...),
                hashable with a stable ``repr``.
            images: the request's images, in order, keyed as
                :func:`~mlxkv.cache.mllm.images_digest` keys them; only blocks
                stored with the same images in the same order are found.
            images_start: the index of the first image token: the images key
                the blocks from the one that holds it on, and the blocks
                before are shared with any request; None: every block.

        Returns:
            ``(block_table, remaining_tokens)`` on a hit; ``(None, tokens)`` on
            a miss, for empty ``tokens``, bad token ids, images or
            ``images_start``, or a request id that is already in use (all but
            the miss are logged).
        """
        if not tokens:
            return None, tokens
        if self._in_use(request_id):
            logger.warning("fetch_cache(%r): request already holds blocks", request_id)
            return None, tokens
        try:
            keys = _chain_keys(tokens, self.block_size, cache_salt, extra_keys, images, images_start)
            chain = keys.hash_chain(tokens, self.block_size)
        except CacheError as exc:
            logger.warning("fetch_cache(%r): %s", request_id, exc)
            return None, tokens
        usable = 0
        blocks: list[CacheBlock] = []
        if self.paged_cache.pool.lookup(chain[:1]):
            blocks = self.paged_cache.pool.acquire(chain)
            usable = kv_state.num_reconstructable_blocks(_kv_payloads(blocks))
            if not usable:
                usable = _num_opaque(blocks)
            if usable < len(blocks):
                # Deepest first: they should be evicted before their parents.
                self.paged_cache.pool.release(blocks[usable:][::-1])
                del blocks[usable:]
        if not usable:
            self._misses += 1
            logger.debug("fetch_cache(%r): miss, %d tokens", request_id, len(tokens))
            return None, tokens
        table = self.paged_cache.create_block_table(request_id)
        for block in blocks:
            table.add_block(block.block_id, block.token_count)
        self._request_tables[request_id] = BlockCacheEntry(
            block_table=table,
            blocks=blocks,
            last_access=self._next_tick(),
            keys=keys,
            block_hashes=chain[:usable],
            num_prompt_tokens=len(tokens),
        )
        self._hits += 1
        self._tokens_saved += table.num_tokens
        logger.debug(
            "fetch_cache(%r): hit, %d blocks, %d of %d tokens",
            request_id,
            usable,
            table.num_tokens,
            len(tokens),
        )
        return table, tokens[table.num_tokens :]

    def store_cache(
        self,
        request_id: str,
        tokens: list[int],
        cache_data: list[Any],
        *,
        cache_salt: Optional[Any] = None,
        extra_keys: Optional[Sequence[Any]] = None,
        images: Optional[Sequence[Any]] = None,
        images_start: Optional[int] = None,
    ) -> Optional[BlockTable]:
        """Store the KV state of ``tokens`` for reuse, block by block.

        Full blocks already cached under the same chain hash are shared (the
        request takes a reference); the others are cut from ``cache_data``
        into owned slices and cached. A trailing partial block is kept for the
        request alone. A request that already holds blocks (from a fetch or
        an earlier store) keeps them and stores only what follows, provided
        its tokens and keys are the same as before.

        The cache may hold fewer tokens than ``tokens`` (the last generated
        token not fed back yet): only the tokens it holds are stored.

        Cache data that cannot be sliced exactly -- a placeholder, an object
        of another kind, a cache that holds no tokens or that could not be
        rebuilt exactly (a wrapped sliding window) -- gets the same
        bookkeeping as in the seed: blocks for all of ``tokens`` are
        allocated (or shared, whatever they hold), hashed and found by later
        fetches, each marked with an :class:`OpaquePayload`, and the data is
        kept by reference for :meth:`get_cache_for_generation`.

        Args:
            request_id: the request.
            tokens: the token ids the cache was computed from.
            cache_data: the model's per-layer caches: mlx-lm cache objects,
                seed-style dicts ``{'state': (keys, values), ...}`` or
                ``(keys, values)`` pairs; or anything else, kept as it is.
            cache_salt: namespace of the request, as in :meth:`fetch_cache`.
            extra_keys: further namespace keys, as in :meth:`fetch_cache`.
            images: the request's images, as in :meth:`fetch_cache`.
            images_start: the first image token's index, as in :meth:`fetch_cache`.

        Returns:
            The request's table, or None (logged) when nothing could be
            stored: empty ``tokens``, bad token ids, images or
            ``images_start``, tokens or keys that
            disagree with what the request already holds, or no free block
            at all.
        """
        if not tokens:
            return None
        layout: Optional[kv_state.CacheLayout]
        try:
            layout = kv_state.describe_cache(cache_data)
        except CacheError as exc:
            logger.debug("store_cache(%r): keeping opaque cache data: %s", request_id, exc)
            layout = None
        num_tokens = len(tokens)
        if layout is not None and layout.num_tokens is not None:
            if layout.num_tokens == 0:
                logger.debug("store_cache(%r): keeping a cache with no tokens", request_id)
                layout = None
            else:
                num_tokens = min(num_tokens, layout.num_tokens)
        try:
            keys = _chain_keys(tokens, self.block_size, cache_salt, extra_keys, images, images_start)
            chain = keys.hash_chain(tokens[:num_tokens], self.block_size)
        except CacheError as exc:
            logger.warning("store_cache(%r): %s", request_id, exc)
            return None

        entry = self._request_tables.get(request_id)
        if entry is None and self.paged_cache.get_block_table(request_id) is not None:
            logger.warning("store_cache(%r): request has a table not made here", request_id)
            return None
        if entry is not None:
            held = entry.block_hashes
            tail_start = len(held) * self.block_size
            overlap = max(min(num_tokens, entry.block_table.num_tokens) - tail_start, 0)
            if (
                entry.keys != keys
                or chain[: len(held)] != held[: len(chain)]
                or tuple(tokens[tail_start : tail_start + overlap]) != entry.tail_tokens[:overlap]
            ):
                logger.warning(
                    "store_cache(%r): tokens or keys differ from those the request holds",
                    request_id,
                )
                return None
            entry.last_access = self._next_tick()
            entry.num_prompt_tokens = max(entry.num_prompt_tokens, len(tokens))
            if num_tokens <= entry.block_table.num_tokens:
                return entry.block_table
            first = len(held)
        else:
            first = 0
        return self._store_blocks(
            request_id, entry, cache_data, layout, tokens, chain, num_tokens, first, keys
        )

    def _add_snapshots(
        self, block: CacheBlock, cached: kv_state.BlockPayload, ours: kv_state.BlockPayload
    ) -> None:
        """Give a cached block the recurrent snapshots it lacks and ``ours`` has.

        The block's KV slices (``cached``) are kept; the snapshots are the
        recurrent state after the same tokens under the same hash chain, so
        every holder of the block sees the same tokens, now rebuildable up to
        its end.
        """
        arrays = tuple(
            theirs if spec.sequential or theirs is not None else mine
            for spec, theirs, mine in zip(cached.layers, cached.arrays, ours.arrays)
        )
        self.paged_cache.pool.fill(block, attrs.evolve(cached, arrays=arrays))

    def _drop_partial_tail(self, entry: BlockCacheEntry) -> None:
        """Release a request's trailing partial block: blocks that extend it follow."""
        if len(entry.blocks) == len(entry.block_hashes):
            return
        tail = entry.blocks.pop()
        entry.tail_tokens = ()
        table = entry.block_table
        table.block_ids.pop()
        table.num_tokens -= tail.token_count
        self.paged_cache.pool.release([tail])

    def _reusable_kv(
        self, block: CacheBlock, index: int, layout: kv_state.CacheLayout
    ) -> Optional[kv_state.BlockPayload]:
        """The KV state of a cached block, if it can stand for block ``index``.

        It can if it holds KV state (ours, or the seed's format) of the same
        layout for the same full block of tokens.
        """
        payload = kv_state.as_block_payload(
            block.cache_data, start=index * self.block_size, num_tokens=block.token_count
        )
        if (
            payload is None
            or payload.layers != layout.layers
            or payload.start != index * self.block_size
            or payload.num_tokens != self.block_size
        ):
            return None
        return payload

    def _store_blocks(
        self,
        request_id: str,
        entry: Optional[BlockCacheEntry],
        cache_data: Any,
        layout: Optional[kv_state.CacheLayout],
        tokens: Sequence[int],
        chain: list[BlockHash],
        num_tokens: int,
        first: int,
        keys: ChainKeys,
    ) -> Optional[BlockTable]:
        size = self.block_size
        num_blocks = -(-num_tokens // size)
        paged = self.paged_cache
        pool = paged.pool
        # Share what is cached already; take the references before allocating,
        # which could otherwise evict those very blocks.
        reused: dict[int, CacheBlock] = {}
        upgrade: Optional[tuple[int, kv_state.BlockPayload]] = None
        # The block that ends where the cache ends is the one that can carry
        # the recurrent layers' snapshots.
        boundary = num_tokens if layout is None or layout.num_tokens is None else layout.num_tokens
        snapshot_index = boundary // size - 1 if boundary % size == 0 else -1
        for index in range(first, len(chain)):
            if not pool.lookup(chain[index : index + 1]):
                continue
            (block,) = pool.acquire(chain[index : index + 1])
            if layout is None:
                # Opaque data has no KV state to compare: share whatever is
                # cached for these tokens, as the seed does.
                reused[index] = block
                continue
            payload = self._reusable_kv(block, index, layout)
            if payload is None:
                # Cached without KV state we can use (e.g. published by the
                # seed's cache_full_blocks): store ours next to it.
                pool.release([block])
                continue
            reused[index] = block
            if index == snapshot_index and not payload.has_snapshots:
                upgrade = (index, payload)
        fresh_indices = [i for i in range(first, num_blocks) if i not in reused]
        if layout is None:
            payloads: list[Any] = [
                OpaquePayload(start=i * size, num_tokens=min(size, num_tokens - i * size))
                for i in fresh_indices
            ]
        else:
            to_slice = fresh_indices if upgrade is None else [*fresh_indices, upgrade[0]]
            try:
                payloads = kv_state.slice_blocks(cache_data, size, to_slice, num_tokens=num_tokens)
            except CacheError as exc:
                pool.release(list(reused.values())[::-1])
                logger.warning("store_cache(%r): %s", request_id, exc)
                return None
            if upgrade is not None:
                self._add_snapshots(reused[upgrade[0]], upgrade[1], payloads.pop())
        try:
            fresh = pool.allocate(len(fresh_indices))
        except OutOfBlocks as exc:
            fresh = pool.allocate(exc.available)
            stop = fresh_indices[len(fresh)]
            logger.warning(
                "store_cache(%r): out of blocks, storing %d of %d tokens",
                request_id,
                stop * size,
                num_tokens,
            )
            dropped = [reused.pop(i) for i in sorted(reused) if i >= stop]
            pool.release(dropped[::-1])
            num_blocks = stop
        stored = min(num_blocks * size, num_tokens)
        if entry is not None and stored <= entry.block_table.num_tokens:
            # Too few blocks to add anything: keep what the request holds.
            pool.release([*fresh, *list(reused.values())[::-1]])
            return entry.block_table
        if num_blocks <= first:
            logger.warning("store_cache(%r): nothing stored", request_id)
            pool.release(fresh)
            return None

        if entry is not None:
            self._drop_partial_tail(entry)
        else:
            table = paged.create_block_table(request_id)
            entry = BlockCacheEntry(
                block_table=table,
                blocks=[],
                last_access=self._next_tick(),
                keys=keys,
                num_prompt_tokens=len(tokens),
            )
            self._request_tables[request_id] = entry
        entry.opaque = layout is None
        entry.opaque_data = cache_data if layout is None else None
        table = entry.block_table
        fresh_iter = iter(zip(fresh, payloads))
        for index in range(first, num_blocks):
            block = reused.get(index)
            if block is None:
                block, payload = next(fresh_iter)
                if index < len(chain):
                    pool.commit(block, chain[index], num_tokens=size, cache_data=payload)
                else:
                    # The partial tail: the request's own, never published.
                    pool.fill(block, payload, num_tokens=payload.num_tokens)
                    entry.tail_tokens = tuple(
                        tokens[payload.start : payload.start + payload.num_tokens]
                    )
            entry.blocks.append(block)
            table.add_block(block.block_id, block.token_count)
        entry.block_hashes.extend(chain[first : min(num_blocks, len(chain))])
        logger.debug(
            "store_cache(%r): %d blocks (%d shared, %d new), %d tokens%s",
            request_id,
            len(entry.blocks),
            len(reused),
            num_blocks - first - len(reused),
            table.num_tokens,
            ", opaque data" if layout is None else "",
        )
        return table

    # Request lifecycle.

    def get_cache_for_generation(
        self, request_id: str, *, extra_tokens: Optional[int] = None
    ) -> tuple[Optional[list[Any]], bool]:
        """A request's cache for generation, copying shared blocks first.

        The paged manager gives the request private copies of its shared
        blocks (copy-on-write, with real copies of the KV arrays). If the
        request's last store was of data this cache could not slice, that
        data is returned as the seed returns it: the stored object itself, or
        a deep copy of it if a block was copied. Otherwise the cache is
        rebuilt from the request's blocks.

        Args:
            request_id: the request.
            extra_tokens: room to leave for tokens about to be appended; by
                default the request's pending suffix (at least one token).

        Returns:
            ``(caches, was_copied)``: the stored data or rebuilt mlx-lm cache
            objects (None, logged, if they cannot be rebuilt exactly) and
            whether any block was copied; ``(None, False)`` for an unknown
            request.
        """
        entry = self._request_tables.get(request_id)
        if entry is None:
            logger.warning("get_cache_for_generation(%r): unknown request", request_id)
            return None, False
        blocks, was_copied = self.paged_cache.get_blocks_for_generation(entry.block_table)
        entry.blocks = blocks
        entry.last_access = self._next_tick()
        if entry.opaque:
            data = copy.deepcopy(entry.opaque_data) if was_copied else entry.opaque_data
            return data, was_copied
        room = self._room(entry, blocks, extra_tokens)
        return self._rebuild(request_id, blocks, room), was_copied

    def release_cache(self, request_id: str) -> None:
        """Give back every block reference a request holds; then forget it.

        Blocks that are cached stay cached (evictable); the request's private
        blocks lose their KV state at once. Releasing an unknown (or already
        released) request is logged and does nothing.

        Args:
            request_id: the request.
        """
        entry = self._request_tables.pop(request_id, None)
        if entry is None:
            logger.warning("release_cache(%r): unknown request", request_id)
            return
        self.paged_cache.delete_block_table(request_id)
        logger.debug("release_cache(%r): %d blocks", request_id, len(entry.blocks))

    def fork_cache(self, source_request_id: str, new_request_id: str) -> Optional[BlockTable]:
        """Give ``new_request_id`` a share of every block of ``source_request_id``.

        The new request also shares the source's opaque data, if it has any
        (by reference, as in the seed).

        Args:
            source_request_id: a request that holds blocks here.
            new_request_id: a request that holds nothing yet.

        Returns:
            The new request's table; None (logged) if the source is unknown
            or the new id is already in use.
        """
        source = self._request_tables.get(source_request_id)
        if source is None:
            logger.warning("fork_cache(%r): unknown request", source_request_id)
            return None
        if self._in_use(new_request_id):
            logger.warning("fork_cache(%r): request already holds blocks", new_request_id)
            return None
        table = self.paged_cache.fork_block_table(source.block_table, new_request_id)
        self._request_tables[new_request_id] = attrs.evolve(
            source,
            block_table=table,
            blocks=list(source.blocks),
            block_hashes=list(source.block_hashes),
            last_access=self._next_tick(),
        )
        logger.debug("fork_cache: %r -> %r", source_request_id, new_request_id)
        return table

    def reconstruct_cache(
        self, block_table: BlockTable, *, extra_tokens: Optional[int] = None
    ) -> Optional[list[Any]]:
        """Rebuild mlx-lm cache objects from the blocks a table lists.

        The table is one returned by this cache (fetch, store, fork), another
        table the paged manager holds, or a leading part of either (a
        ``BlockTable`` built from its first block ids). The caches hold
        exactly the tokens of those blocks, in buffers with room for the
        request's suffix, so the first append does not copy them again.

        Args:
            block_table: the table.
            extra_tokens: room to leave for tokens about to be appended; by
                default what remains of the prompt of the request that holds
                the table (at least one token).

        Returns:
            One cache object per layer; None for an empty table, and None
            (logged) for a table that is not a leading part of a table the
            paged manager holds, or blocks that cannot be rebuilt exactly
            (opaque data, a payload that is not exactly KV state).
        """
        if not block_table or not block_table.block_ids:
            return None
        blocks = self._held_blocks(block_table)
        if blocks is None:
            logger.warning(
                "reconstruct_cache(%r): table is not held by this cache", block_table.request_id
            )
            return None
        entry = self._request_tables.get(block_table.request_id)
        if entry is not None and entry.blocks[: len(blocks)] != blocks:
            entry = None
        room = self._room(entry, blocks, extra_tokens)
        return self._rebuild(block_table.request_id, blocks, room)

    def _held_blocks(self, block_table: BlockTable) -> Optional[list[CacheBlock]]:
        """The blocks of ``block_table`` if it leads a table the manager holds.

        Any other list of ids could mix blocks of unrelated sequences.
        """
        ids = list(block_table.block_ids)
        paged = self.paged_cache
        own = paged.get_block_table(block_table.request_id)
        candidates = [own] if own is not None else []
        candidates.extend(t for t in paged.request_tables.values() if t is not own)
        for table in candidates:
            if table.block_ids[: len(ids)] == ids:
                blocks = [paged.allocated_blocks.get(ident) for ident in ids]
                if all(b is not None and not b.is_null for b in blocks):
                    return blocks
                return None
        return None

    @staticmethod
    def _room(
        entry: Optional[BlockCacheEntry], blocks: Sequence[CacheBlock], extra_tokens: Optional[int]
    ) -> int:
        """Tokens to leave room for: ``extra_tokens``, or the prompt's rest."""
        if extra_tokens is not None:
            return extra_tokens
        if entry is None:
            return 0
        return max(entry.num_prompt_tokens - sum(b.token_count for b in blocks), 0)

    def _rebuild(
        self, request_id: str, blocks: Sequence[CacheBlock], extra_tokens: int
    ) -> Optional[list[Any]]:
        payloads = _kv_payloads(blocks)
        usable = kv_state.num_reconstructable_blocks(payloads)
        if usable < len(payloads):
            logger.warning(
                "cannot rebuild %r exactly: %d of %d blocks usable",
                request_id,
                usable,
                len(payloads),
            )
            return None
        try:
            caches = kv_state.reconstruct(payloads, extra_tokens=extra_tokens)
        except CacheError as exc:
            logger.warning("cannot rebuild %r: %s", request_id, exc)
            return None
        logger.debug(
            "rebuilt %r: %d layers, %d tokens from %d blocks",
            request_id,
            len(caches),
            payloads[-1].end,
            len(payloads),
        )
        return caches

    @staticmethod
    def _cache_state_seq_axis(state: Any) -> Optional[int]:
        """The token axis of a seed-style ``(keys, values)`` state (2, 1 or None)."""
        return kv_state.state_seq_axis(state)

    # Statistics and housekeeping.

    def get_stats(self) -> dict[str, Any]:
        """Hit statistics of this cache plus the paged manager's memory usage.

        Returns:
            ``hits``, ``misses``, ``hit_rate``, ``tokens_saved``,
            ``active_requests`` and every key of the manager's
            ``get_memory_usage()``.
        """
        lookups = self._hits + self._misses
        return {
            "hits": self._hits,
            "misses": self._misses,
            "hit_rate": self._hits / lookups if lookups else 0,
            "tokens_saved": self._tokens_saved,
            "active_requests": len(self._request_tables),
            **self.paged_cache.get_memory_usage(),
        }

    def reset_stats(self) -> None:
        """Zero the hit statistics, here and in the paged manager."""
        self._hits = 0
        self._misses = 0
        self._tokens_saved = 0
        self.paged_cache.reset_stats()

    def clear(self) -> None:
        """Forget every request and every block (the paged manager is cleared)."""
        self._request_tables.clear()
        self.paged_cache.clear()
        self.reset_stats()

    def __len__(self) -> int:
        """Number of requests that hold blocks here."""
        return len(self._request_tables)

    def check_invariants(self) -> None:
        """Verify the invariants of the class docstring (and the manager's).

        Raises:
            InvariantViolation: naming the first request or block found wrong.
        """
        self.paged_cache.check_invariants()
        size = self.block_size
        for request_id, entry in self._request_tables.items():
            table = entry.block_table
            where = f"request {request_id!r}"
            if self.paged_cache.get_block_table(request_id) is not table:
                raise InvariantViolation(f"{where}: table is not the manager's")
            if [b.block_id for b in entry.blocks] != table.block_ids:
                raise InvariantViolation(f"{where}: blocks disagree with its table")
            if sum(b.token_count for b in entry.blocks) != table.num_tokens:
                raise InvariantViolation(f"{where}: num_tokens is not the blocks' sum")
            if any(b.token_count != size for b in entry.blocks[:-1]):
                raise InvariantViolation(f"{where}: a block before the last is partial")
            if len(entry.block_hashes) > len(entry.blocks):
                raise InvariantViolation(f"{where}: more hashes than blocks")
            if not entry.opaque and entry.opaque_data is not None:
                raise InvariantViolation(f"{where}: keeps opaque data it did not store")
            for index, block in enumerate(entry.blocks):
                if block.ref_count < 1:
                    raise InvariantViolation(f"{where}: block {block.block_id} is free")
                hashes = entry.block_hashes
                if block.block_hash is not None and (
                    index >= len(hashes) or block.block_hash != hashes[index]
                ):
                    raise InvariantViolation(
                        f"{where}: block {block.block_id} is cached under another hash"
                    )
                payload = block.cache_data
                if isinstance(payload, (kv_state.BlockPayload, OpaquePayload)) and (
                    payload.start != index * size or payload.num_tokens != block.token_count
                ):
                    raise InvariantViolation(
                        f"{where}: block {block.block_id} holds the wrong tokens"
                    )
