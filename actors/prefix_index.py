"""The prefix index actor: hash chains, hints and per-request block tables.

:class:`PrefixIndexActor` turns a request's tokens into its parent-chained
block hashes (once, in one pass), says how many leading blocks are *believed*
cached (hints), and keeps each request's table: the blocks it holds, their
hashes, and the tokens it knows beyond them (the tail).

A hint is only a hint: the allocator owns the blocks and validates every
grant. Hints go stale in both directions -- a hinted block may have been
evicted (the allocator then grants fewer blocks: a miss, and the stale hint is
dropped here), and an eviction announcement may arrive after the same hash was
stored again (a missed reuse until the next store republishes it). Neither
ever serves a wrong block.

A request table owns one reference to every block it lists. References move
into a table only through :class:`Record` and :class:`Adopt` (which callers
send shielded from cancellation), and out of it only through :class:`Close`,
whose reply the caller must release.

In-flight blocks. A request that will compute its prompt can *claim* the
hashes of the blocks it is about to compute (``Begin(claim=True)``): a
later request whose chain reaches a claimed hash is told to wait instead
(an ``anyio.Event`` in its :class:`PrefixMatch`) and claims nothing. The
event is set when the last claimed block it waits for is published (a
:class:`Record` of stored blocks) or when the claim is dropped -- the
claimant released its table, failed, or sent :class:`Unclaim` (it could not
store a block). The waiter then asks again (:class:`Rematch`): it takes the
blocks now cached, and waits again or claims the rest and computes it
itself. A request claims only while nothing ahead of it in its chain is in
flight, so no two requests wait on each other. Claims are hints too: a
missing or stale one costs a block computed twice, never a wrong block.
"""

from __future__ import annotations

from array import array
from collections import Counter
import anyio
from collections.abc import Mapping, Sequence
from typing import Any, NewType, Optional

import attrs

from mlxkv.actors.actor import Actor, ActorHandle, Ask, Message, Tell
from mlxkv.actors.allocator import BlockGrant, BlockId
from mlxkv.cache.block_hash import BlockHash, ChainKeys
from mlxkv.cache.errors import DuplicateRequest, InvalidInput, UnknownRequest
from mlxkv.cache.token_ids import TokenIds

__all__ = [
    "Adopt",
    "Begin",
    "CheckInvariants",
    "Close",
    "Discard",
    "Extend",
    "Extension",
    "Forget",
    "IndexReport",
    "PrefixIndexActor",
    "PrefixIndexHandle",
    "PrefixIndexStatistics",
    "PrefixMatch",
    "Record",
    "Rematch",
    "RequestId",
    "Snapshot",
    "Statistics",
    "TableSnapshot",
    "TokenIds",
    "Unclaim",
]

#: A caller-chosen request name, unique among active requests.
RequestId = NewType("RequestId", str)


@attrs.frozen(kw_only=True)
class PrefixMatch:
    """Reply to :class:`Begin`.

    Attributes:
        hashes: the chained hash of every full block of the tokens (for
            :class:`Rematch`, of those beyond the blocks the request holds).
        num_hinted: how many leading hashes are believed cached.
        wait: set when the blocks in flight right after the hinted ones are
            published or abandoned; then :class:`Rematch`. None if nothing
            ahead is in flight.
        num_claimed: hashes this request claimed to compute.
    """

    hashes: tuple[BlockHash, ...]
    num_hinted: int
    wait: Optional[anyio.Event] = attrs.field(default=None, eq=False, repr=False)
    num_claimed: int = 0

    def trace_fields(self) -> dict[str, Any]:
        """The lookup's result, for tracing."""
        return {
            "blocks": len(self.hashes),
            "hinted": self.num_hinted,
            "waits": self.wait is not None,
            "claimed": self.num_claimed,
        }


@attrs.frozen(kw_only=True)
class Extension:
    """Reply to :class:`Extend`: what a store must add to a request.

    Attributes:
        start: blocks the request held when asked.
        hashes: hashes of the new full blocks, in order.
        tail: tokens the request knows beyond the new blocks.
        tail_hashes: already computed hashes of the full blocks in ``tail``.
        parent_hash: the hash of the last block the request held when asked
            (the new blocks' parent), or None if it held none.
        keys: the request's namespace (what its hashes are keyed under).
    """

    start: int
    hashes: tuple[BlockHash, ...]
    tail: TokenIds
    tail_hashes: tuple[BlockHash, ...]
    parent_hash: Optional[BlockHash] = None
    keys: ChainKeys = ChainKeys()

    def after(
        self, num_stored: int, tokens: TokenIds, block_size: int
    ) -> tuple[TokenIds, tuple[BlockHash, ...]]:
        """The request's tail and its hashes once the first ``num_stored`` new
        blocks are stored (a store of the leading blocks that fit): the blocks
        not stored stay known tokens, with their hashes.

        Args:
            num_stored: how many of :attr:`hashes` were stored, from the first.
            tokens: the tokens the extension was planned for.
            block_size: tokens per block.
        """
        if num_stored == len(self.hashes):
            return self.tail, self.tail_hashes
        begin = (self.start + num_stored) * block_size
        end = (self.start + len(self.hashes)) * block_size
        return tokens[begin:end] + self.tail, self.hashes[num_stored:] + self.tail_hashes

    def trace_fields(self) -> dict[str, int]:
        """The planned store, for tracing."""
        return {"held": self.start, "new_blocks": len(self.hashes)}


@attrs.frozen(kw_only=True)
class TableSnapshot:
    """Reply to :class:`Snapshot`: a copy of one request table.

    Attributes:
        block_ids: the blocks held, in token order.
        hashes: their hashes.
        tail: tokens known beyond the blocks.
        tail_hashes: computed hashes of the full blocks in ``tail``.
        keys: the request's namespace (salt, images).
    """

    block_ids: tuple[BlockId, ...]
    hashes: tuple[BlockHash, ...]
    tail: TokenIds
    tail_hashes: tuple[BlockHash, ...]
    keys: ChainKeys = ChainKeys()


@attrs.frozen(kw_only=True)
class IndexReport:
    """Reply to :class:`CheckInvariants`.

    Attributes:
        violations: what is wrong (empty when all invariants hold).
        holdings: block id -> number of request tables listing it.
    """

    violations: tuple[str, ...]
    holdings: Mapping[BlockId, int]


@attrs.frozen(kw_only=True)
class PrefixIndexStatistics:
    """A snapshot of the index.

    Attributes:
        num_active_requests: request tables open.
        num_hints: hashes believed cached.
        num_lookups: requests begun.
        num_hits: lookups that got at least one cached block.
        num_hit_blocks: cached blocks those lookups got.
        num_hinted_blocks: blocks the hints promised at lookup.
        num_stale_hints: lookups that got fewer blocks than hinted.
        num_forgotten: hints dropped (evictions announced, stale hints).
        num_in_flight: hashes claimed by a request computing them now.
        num_claimed: hashes claimed in all.
        num_waits: lookups told to wait for blocks in flight.
        num_abandoned_claims: claims dropped before their block was
            published (the claimant failed, left or could not store).
    """

    num_active_requests: int
    num_hints: int
    num_lookups: int
    num_hits: int
    num_hit_blocks: int
    num_hinted_blocks: int
    num_stale_hints: int
    num_forgotten: int
    num_in_flight: int = 0
    num_claimed: int = 0
    num_waits: int = 0
    num_abandoned_claims: int = 0

    @property
    def num_misses(self) -> int:
        """Lookups that got no cached block."""
        return self.num_lookups - self.num_hits


@attrs.frozen(kw_only=True)
class Begin(Ask[PrefixMatch]):
    """Open a table for ``request_id`` and match its tokens against the hints.

    With ``claim``, also claim the blocks it will compute, or be told to wait
    for blocks in flight (see the module docstring). Raises DuplicateRequest
    if the request is active.

    ``keys`` is the request's namespace
    (:meth:`~mlxkv.cache.block_hash.ChainKeys.derive`: the salt, and the
    images from the block that holds the first image token on).
    """

    tokens: TokenIds
    keys: ChainKeys = ChainKeys()
    claim: bool = False


@attrs.frozen(kw_only=True)
class Rematch(Ask[PrefixMatch]):
    """Match the request's blocks beyond those it holds again, after a wait;
    claim them or wait again, as :class:`Begin` with ``claim``."""


@attrs.frozen(kw_only=True)
class Unclaim(Tell):
    """Drop every claim of ``request_id``: it will not publish those blocks."""


@attrs.frozen(kw_only=True)
class Discard(Tell):
    """Drop a table that holds no block (the undo of :class:`Begin`)."""


@attrs.frozen(kw_only=True)
class Record(Ask[int]):
    """Hand references to a request table, which then owns them.

    ``start`` is the number of blocks the table held when the caller looked
    (a table that changed since is refused). Without ``tail`` the grants
    continue into the tokens given to :class:`Begin` (a fetch); with it, they
    are the blocks of an :class:`Extension`. The granted hashes become hints;
    ``forget`` drops others (announced evictions). ``hit`` counts the grants
    as a cache hit. Replies with the number of blocks the table holds.
    """

    start: int
    grants: tuple[BlockGrant, ...] = attrs.field(converter=tuple)
    tail: Optional[TokenIds] = None
    tail_hashes: tuple[BlockHash, ...] = ()
    forget: tuple[BlockHash, ...] = attrs.field(default=(), converter=tuple)
    hit: bool = False


@attrs.frozen(kw_only=True)
class Adopt(Ask[None]):
    """Open a table for ``request_id`` that lists ``grants``, as ``snapshot`` did."""

    snapshot: TableSnapshot
    grants: tuple[BlockGrant, ...] = attrs.field(converter=tuple)


@attrs.frozen(kw_only=True)
class Extend(Ask[Extension]):
    """Plan a store of ``tokens`` (the request's whole sequence) with one payload
    per full block beyond those the request holds; changes nothing."""

    tokens: TokenIds
    num_payloads: int


@attrs.frozen(kw_only=True)
class Snapshot(Ask[TableSnapshot]):
    """Copy the table of ``request_id``, to fork it into ``fork_to`` (which must be free)."""

    fork_to: str


@attrs.frozen(kw_only=True)
class Close(Ask[tuple[BlockId, ...]]):
    """Remove the table of ``request_id``; reply with the blocks it held, which
    the caller must release (ask it shielded: the reply cannot be undone here)."""


@attrs.frozen(kw_only=True)
class Forget(Tell):
    """Drop hints: the allocator announced these hashes evicted."""

    hashes: tuple[BlockHash, ...] = attrs.field(converter=tuple)

    def trace_fields(self) -> dict[str, int]:
        """How many hints were announced gone, for tracing."""
        return {"forgotten": len(self.hashes)}


@attrs.frozen(kw_only=True)
class Statistics(Ask[PrefixIndexStatistics]):
    """Report :class:`PrefixIndexStatistics`."""

    polled = True


@attrs.frozen(kw_only=True)
class CheckInvariants(Ask[IndexReport]):
    """Verify the tables; report the violations and the blocks they hold."""

    polled = True


@attrs.define(slots=True)
class _Table:
    keys: ChainKeys
    block_ids: list[BlockId] = attrs.field(factory=list)
    hashes: list[BlockHash] = attrs.field(factory=list)
    tail: TokenIds = attrs.field(factory=lambda: array("I"))
    tail_hashes: tuple[BlockHash, ...] = ()
    num_hinted: int = 0
    claimed: set[BlockHash] = attrs.field(factory=set)


@attrs.define(slots=True)
class _Claim:
    """A hash a request is computing; ``event`` is made once someone waits."""

    owner: str
    event: Optional[anyio.Event] = None


class PrefixIndexActor(Actor):
    """Owns the hints of what is cached and the table of every active request.

    Owns: the hint set (hashes believed cached, oldest first, at most
    ``max_hints``), one table per active request (held block ids and hashes,
    the tail of known tokens with its precomputed hashes, the request's extra
    keys, the hashes it claimed), the claims in flight and hit statistics.

    Messages arrive checked: the runtime validates every argument once, at
    its public boundary (token ids as ``TokenIds``, request ids as non-empty
    strs, the namespace as :class:`~mlxkv.cache.block_hash.ChainKeys`); a
    handler checks only what depends on its state (a request that is active
    or not, tokens that extend what a request holds, a table that changed).

    Invariants:
        - a table lists as many hashes as block ids, in chain order;
        - a table's ``tail_hashes`` cover at most its tail's full blocks;
        - every claim's owner has a table that lists the claimed hash, and
          every hash a table lists as claimed has that claim;
        - every block a table lists carries one reference owned by the table
          (checked against the allocator by the runtime);
        - a handler that raises a CacheError has changed nothing.
    """

    name = "prefix_index"

    def __init__(
        self,
        *,
        block_size: int = 64,
        max_hints: int = 1 << 16,
        **options: Any,
    ) -> None:
        """Create an empty index.

        Args:
            block_size: tokens per block (the allocator's).
            max_hints: the most hints kept; the oldest go first beyond it.
            **options: the :class:`Actor` options (``mailbox_size``, ``trace``,
                ``trace_polls``, ``intercept``).

        Raises:
            InvalidInput: ``block_size`` or ``max_hints`` is below 1.
        """
        for argument, value in (("block_size", block_size), ("max_hints", max_hints)):
            if value.__class__ is not int or value < 1:
                raise InvalidInput(argument, value, "must be an int >= 1")
        super().__init__(**options)
        self._block_size = block_size
        self._max_hints = max_hints
        self._hints: dict[BlockHash, None] = {}
        self._tables: dict[str, _Table] = {}
        self._claims: dict[BlockHash, _Claim] = {}
        self._num_claimed = 0
        self._num_waits = 0
        self._num_abandoned_claims = 0
        self._num_lookups = 0
        self._num_hits = 0
        self._num_hit_blocks = 0
        self._num_hinted_blocks = 0
        self._num_stale_hints = 0
        self._num_forgotten = 0

    def handle(self, message: Message) -> Any:
        """Dispatch ``message`` to its handler.

        Raises:
            CacheError: the handler's domain error; nothing changed.
        """
        match message:
            case Begin():
                return self._begin(message)
            case Rematch():
                return self._rematch(message)
            case Unclaim():
                table = self._tables.get(message.request_id)  # type: ignore[arg-type]
                return None if table is None else self._unclaim(table)
            case Record():
                return self._record(message)
            case Extend():
                return self._extend(message)
            case Close():
                table = self._table(message.request_id, pop=True)
                self._unclaim(table)
                return tuple(table.block_ids)
            case Snapshot():
                return self._snapshot(message)
            case Adopt():
                return self._adopt(message)
            case Discard():
                return self._discard(message)
            case Forget():
                return self._forget(message.hashes)
            case Statistics():
                return self._statistics()
            case CheckInvariants():
                return self._check()
        return super().handle(message)

    def undo(self, message: Ask[Any], reply: Any) -> Optional[Tell]:
        """A :class:`Begin` nobody heard of is discarded; nothing else grants."""
        if isinstance(message, Begin):
            return Discard(request_id=message.request_id)
        return None

    def outcome(self, message: Message, result: Any) -> dict[str, Any]:
        """Trace fields; a record says what the table holds, a close what it gave back."""
        if isinstance(message, Record):
            return {"recorded": len(message.grants), "held": result}
        if isinstance(message, Close):
            return {"released": len(result)}
        return super().outcome(message, result)

    # -- handlers ---------------------------------------------------------

    def _begin(self, message: Begin) -> PrefixMatch:
        request_id = message.request_id
        assert request_id is not None, "Begin names its request"
        if request_id in self._tables:
            raise DuplicateRequest(request_id)
        tokens, keys = message.tokens, message.keys
        table = _Table(keys=keys, tail=tokens)
        hashes = tuple(keys.hash_chain(tokens, self._block_size))
        num_hinted = self._num_hinted(hashes)
        table.tail_hashes, table.num_hinted = hashes, num_hinted
        self._tables[request_id] = table
        self._num_lookups += 1
        self._num_hinted_blocks += num_hinted
        if not message.claim:
            return PrefixMatch(hashes=hashes, num_hinted=num_hinted)
        return self._claim_or_wait(request_id, table, hashes, num_hinted)

    def _rematch(self, message: Rematch) -> PrefixMatch:
        request_id = message.request_id
        table = self._table(request_id)
        hashes = table.tail_hashes
        table.num_hinted = self._num_hinted(hashes)
        self._num_hinted_blocks += table.num_hinted
        return self._claim_or_wait(request_id, table, hashes, table.num_hinted)

    def _num_hinted(self, hashes: Sequence[BlockHash]) -> int:
        hints = self._hints
        count = 0
        for block_hash in hashes:
            if block_hash not in hints:
                break
            count += 1
        return count

    def _claim_or_wait(
        self, request_id: str, table: _Table, hashes: tuple[BlockHash, ...], start: int
    ) -> PrefixMatch:
        """Wait for the run of blocks in flight at ``start``, or claim every
        unclaimed block from there on."""
        claims = self._claims
        position = start
        while position < len(hashes):
            claim = claims.get(hashes[position])
            if claim is None or claim.owner == request_id:
                break
            position += 1
        if position > start:
            last = claims[hashes[position - 1]]
            if last.event is None:
                last.event = anyio.Event()
            self._num_waits += 1
            return PrefixMatch(hashes=hashes, num_hinted=start, wait=last.event)
        hints = self._hints
        claimed = 0
        for block_hash in hashes[start:]:
            if block_hash not in claims and block_hash not in hints:
                claims[block_hash] = _Claim(owner=request_id)
                table.claimed.add(block_hash)
                claimed += 1
        self._num_claimed += claimed
        return PrefixMatch(hashes=hashes, num_hinted=start, num_claimed=claimed)

    def _unclaim(self, table: _Table) -> None:
        """Drop a table's claims; whoever waits on them takes over."""
        for block_hash in table.claimed:
            claim = self._claims.pop(block_hash)
            self._num_abandoned_claims += 1
            if claim.event is not None:
                claim.event.set()
        table.claimed.clear()

    def _record(self, message: Record) -> int:
        table = self._table(message.request_id)
        held = len(table.block_ids)
        if message.start != held:
            raise InvalidInput(
                "start", message.start, f"the request now holds {held} blocks (changed meanwhile)"
            )
        grants = message.grants
        granted = tuple(grant.block_hash for grant in grants)
        if message.tail is None:
            if granted != table.tail_hashes[: len(grants)]:
                raise InvalidInput("grants", len(grants), "do not continue the request's chain")
            tail = table.tail[len(grants) * self._block_size :]
            tail_hashes = table.tail_hashes[len(grants) :]
        else:
            tail, tail_hashes = message.tail, message.tail_hashes
        stale = ()
        if message.hit:
            if grants:
                self._num_hits += held == 0
                self._num_hit_blocks += len(grants)
            if len(grants) < table.num_hinted:
                self._num_stale_hints += 1
                stale = (table.tail_hashes[len(grants)],)
        table.block_ids.extend(grant.block_id for grant in grants)
        table.hashes.extend(granted)
        table.tail, table.tail_hashes = tail, tail_hashes
        self._forget(message.forget + stale)
        self._publish(granted)
        return len(table.block_ids)

    def _extend(self, message: Extend) -> Extension:
        table = self._table(message.request_id)
        size = self._block_size
        tokens = message.tokens
        start = len(table.block_ids)
        held_tokens = start * size
        if len(tokens) < held_tokens:
            raise InvalidInput(
                "tokens",
                message.tokens,
                f"its {len(tokens)} tokens must extend the {held_tokens} tokens the request holds",
            )
        new = tokens[held_tokens:]
        known = table.tail
        overlap = min(len(new), len(known))
        if new[:overlap] != known[:overlap]:
            first = next(i for i in range(overlap) if new[i] != known[i])
            at = held_tokens + first
            raise InvalidInput(
                "tokens",
                message.tokens,
                f"token {new[first]} at index {at} differs from the request's token there"
                f" ({known[first]})",
            )
        num_new = len(new) // size
        if message.num_payloads != num_new:
            raise InvalidInput(
                "payloads", message.num_payloads, f"must be one per new full block ({num_new})"
            )
        reusable = min(len(table.tail_hashes), overlap // size, num_new)
        hashes = table.tail_hashes[:reusable]
        if num_new > reusable:
            parent = hashes[-1] if hashes else (table.hashes[-1] if table.hashes else None)
            hashes += tuple(
                table.keys.hash_chain(
                    new[reusable * size : num_new * size],
                    size,
                    start_block=start + reusable,
                    parent_hash=parent,
                )
            )
        longest = new if len(new) >= len(known) else known
        return Extension(
            start=start,
            hashes=hashes,
            tail=longest[num_new * size :],
            tail_hashes=table.tail_hashes[num_new:],
            parent_hash=table.hashes[-1] if table.hashes else None,
            keys=table.keys,
        )

    def _snapshot(self, message: Snapshot) -> TableSnapshot:
        table = self._table(message.request_id)
        fork_to = message.fork_to
        if fork_to in self._tables:
            raise DuplicateRequest(fork_to)
        return TableSnapshot(
            block_ids=tuple(table.block_ids),
            hashes=tuple(table.hashes),
            tail=table.tail,
            tail_hashes=table.tail_hashes,
            keys=table.keys,
        )

    def _adopt(self, message: Adopt) -> None:
        request_id = message.request_id
        assert request_id is not None, "Adopt names its request"
        if request_id in self._tables:
            raise DuplicateRequest(request_id)
        snapshot = message.snapshot
        if tuple(grant.block_id for grant in message.grants) != snapshot.block_ids:
            raise InvalidInput("grants", len(message.grants), "are not the snapshot's blocks")
        self._tables[request_id] = _Table(
            keys=snapshot.keys,
            block_ids=list(snapshot.block_ids),
            hashes=list(snapshot.hashes),
            tail=snapshot.tail,
            tail_hashes=snapshot.tail_hashes,
        )

    def _discard(self, message: Discard) -> None:
        table = self._tables.get(message.request_id)  # type: ignore[arg-type]
        if table is not None and not table.block_ids:
            self._unclaim(table)
            del self._tables[message.request_id]  # type: ignore[arg-type]

    def _forget(self, hashes: tuple[BlockHash, ...]) -> None:
        hints = self._hints
        for block_hash in hashes:
            if block_hash in hints:
                del hints[block_hash]
                self._num_forgotten += 1

    def _publish(self, hashes: tuple[BlockHash, ...]) -> None:
        hints = self._hints
        claims = self._claims
        for block_hash in hashes:
            hints[block_hash] = None
            claim = claims.pop(block_hash, None)
            if claim is not None:
                self._tables[claim.owner].claimed.discard(block_hash)
                if claim.event is not None:
                    claim.event.set()
        # A bound on memory, not on correctness: dropping a hint only costs
        # a missed reuse.
        excess = len(hints) - self._max_hints
        if excess > 0:
            for block_hash in list(iter(hints))[:excess]:
                del hints[block_hash]
            self._num_forgotten += excess

    def _statistics(self) -> PrefixIndexStatistics:
        return PrefixIndexStatistics(
            num_active_requests=len(self._tables),
            num_hints=len(self._hints),
            num_lookups=self._num_lookups,
            num_hits=self._num_hits,
            num_hit_blocks=self._num_hit_blocks,
            num_hinted_blocks=self._num_hinted_blocks,
            num_stale_hints=self._num_stale_hints,
            num_forgotten=self._num_forgotten,
            num_in_flight=len(self._claims),
            num_claimed=self._num_claimed,
            num_waits=self._num_waits,
            num_abandoned_claims=self._num_abandoned_claims,
        )

    def _check(self) -> IndexReport:
        violations = []
        holdings: Counter[BlockId] = Counter()
        size = self._block_size
        for request_id, table in self._tables.items():
            if len(table.block_ids) != len(table.hashes):
                violations.append(
                    f"prefix_index: table {request_id!r} lists {len(table.block_ids)} blocks"
                    f" but {len(table.hashes)} hashes"
                )
            if len(table.tail_hashes) > len(table.tail) // size:
                violations.append(
                    f"prefix_index: table {request_id!r} has more tail hashes than tail blocks"
                )
            if len(set(table.block_ids)) != len(table.block_ids):
                violations.append(f"prefix_index: table {request_id!r} lists a block twice")
            for block_hash in table.claimed:
                claim = self._claims.get(block_hash)
                if claim is None or claim.owner != request_id:
                    violations.append(f"prefix_index: table {request_id!r} lists a claim it does not own")
            holdings.update(table.block_ids)
        for block_hash, claim in self._claims.items():
            owner = self._tables.get(claim.owner)
            if owner is None or block_hash not in owner.claimed:
                violations.append(f"prefix_index: a claim of {claim.owner!r} has no table listing it")
        if len(self._hints) > self._max_hints:
            violations.append(f"prefix_index: {len(self._hints)} hints, bound is {self._max_hints}")
        return IndexReport(violations=tuple(violations), holdings=dict(holdings))

    # -- helpers ----------------------------------------------------------

    def _table(self, request_id: Optional[str], *, pop: bool = False) -> _Table:
        tables = self._tables
        table = tables.pop(request_id, None) if pop else tables.get(request_id)  # type: ignore[arg-type]
        if table is None:
            raise UnknownRequest(str(request_id))
        return table


class PrefixIndexHandle(ActorHandle):
    """Typed calls to a :class:`PrefixIndexActor`; messages stay inside.

    Every call is a cancellation point unless documented otherwise.
    """

    async def begin(
        self,
        request_id: str,
        tokens: TokenIds,
        keys: ChainKeys = ChainKeys(),
        *,
        claim: bool = False,
    ) -> PrefixMatch:
        """See :class:`Begin`.

        Raises:
            DuplicateRequest: the request is active.
            InvalidInput: bad request id or keys; nothing changed.
            ActorFailed: the actor is not running.
        """
        return await self._ref.ask(Begin, request_id=request_id, tokens=tokens, keys=keys, claim=claim)

    async def record(
        self,
        request_id: str,
        start: int,
        grants: tuple[BlockGrant, ...],
        *,
        tail: Optional[TokenIds] = None,
        tail_hashes: tuple[BlockHash, ...] = (),
        forget: tuple[BlockHash, ...] = (),
        hit: bool = False,
    ) -> int:
        """See :class:`Record`; shielded, so that the references' owner is
        always known: the table if it returns, the caller if it raises.

        Raises:
            UnknownRequest: the request is not active.
            InvalidInput: the table changed meanwhile.
            ActorFailed: the actor is not running.
        """
        with _shield():
            return await self._ref.ask(
                Record,
                request_id=request_id,
                start=start,
                grants=grants,
                tail=tail,
                tail_hashes=tail_hashes,
                forget=forget,
                hit=hit,
            )

    async def adopt(
        self, request_id: str, snapshot: TableSnapshot, grants: tuple[BlockGrant, ...]
    ) -> None:
        """See :class:`Adopt`; shielded like :meth:`record`.

        Raises:
            DuplicateRequest: the request is active.
            ActorFailed: the actor is not running.
        """
        with _shield():
            await self._ref.ask(Adopt, request_id=request_id, snapshot=snapshot, grants=grants)

    async def extend(self, request_id: str, tokens: TokenIds, num_payloads: int) -> Extension:
        """See :class:`Extend`.

        Raises:
            UnknownRequest: the request is not active.
            InvalidInput: the tokens do not extend the request's, or the
                payload count is wrong.
            ActorFailed: the actor is not running.
        """
        return await self._ref.ask(
            Extend, request_id=request_id, tokens=tokens, num_payloads=num_payloads
        )

    async def snapshot(self, request_id: str, fork_to: str) -> TableSnapshot:
        """See :class:`Snapshot`.

        Raises:
            UnknownRequest: ``request_id`` is not active.
            DuplicateRequest: ``fork_to`` is active.
            ActorFailed: the actor is not running.
        """
        return await self._ref.ask(Snapshot, request_id=request_id, fork_to=fork_to)

    async def close_table(self, request_id: str) -> tuple[BlockId, ...]:
        """See :class:`Close`; shielded, because its reply cannot be undone.

        Raises:
            UnknownRequest: the request is not active.
            ActorFailed: the actor is not running.
        """
        with _shield():
            return await self._ref.ask(Close, request_id=request_id)

    async def rematch(self, request_id: str) -> PrefixMatch:
        """See :class:`Rematch`.

        Raises:
            UnknownRequest: the request is not active.
            ActorFailed: the actor is not running.
        """
        return await self._ref.ask(Rematch, request_id=request_id)

    async def unclaim(self, request_id: str) -> None:
        """Send :class:`Unclaim`; shielded.

        Raises:
            ActorFailed: the actor is not running.
        """
        await self._ref.tell_shielded(Unclaim(request_id=request_id))

    async def discard(self, request_id: str) -> None:
        """Send :class:`Discard`; shielded.

        Raises:
            ActorFailed: the actor is not running.
        """
        await self._ref.tell_shielded(Discard(request_id=request_id))

    async def forget(self, hashes: tuple[BlockHash, ...], *, request_id: Optional[str] = None) -> None:
        """Send :class:`Forget`; shielded.

        Raises:
            ActorFailed: the actor is not running.
        """
        if hashes:
            await self._ref.tell_shielded(Forget(hashes=hashes, request_id=request_id))

    async def statistics(self) -> PrefixIndexStatistics:
        """See :class:`Statistics`."""
        return await self._ref.ask(Statistics)

    async def check_invariants(self) -> IndexReport:
        """See :class:`CheckInvariants`."""
        return await self._ref.ask(CheckInvariants)


def _shield() -> anyio.CancelScope:
    return anyio.CancelScope(shield=True)
