"""The prefix index actor: chains, hints and request tables."""

from __future__ import annotations

from array import array

import pytest

from mlxkv.actors.allocator import BlockGrant, BlockId
from mlxkv.actors.prefix_index import Begin, Discard, PrefixIndexActor, PrefixIndexHandle
from mlxkv.cache.block_hash import ChainKeys, hash_block_chain
from mlxkv.cache.errors import DuplicateRequest, InvalidInput, UnknownRequest

BS = 4
TOKENS = tuple(range(1, 4 * BS + 3))  # 4 full blocks and 2 tokens


def grants(hashes, first_id: int = 1) -> tuple[BlockGrant, ...]:
    return tuple(
        BlockGrant(block_id=BlockId(first_id + i), block_hash=h, num_tokens=BS)
        for i, h in enumerate(hashes)
    )


class Handle(PrefixIndexHandle):
    """The handle, given tokens as tuples here (the runtime sends checked arrays)."""

    async def begin(self, request_id, tokens, keys=ChainKeys(), **options):
        return await super().begin(request_id, array("I", tokens), keys, **options)

    async def extend(self, request_id, tokens, num_payloads):
        return await super().extend(request_id, array("I", tokens), num_payloads)


@pytest.fixture
def index() -> PrefixIndexActor:
    return PrefixIndexActor(block_size=BS, max_hints=64)


class TestBegin:
    async def test_chain_is_the_block_hash_chain(self, index, running):
        """Begin hashes every full block once, with the extra keys in the first."""
        async with running(index) as ref:
            handle = Handle(ref)
            match = await handle.begin("r1", TOKENS, ChainKeys((("salt", "a"),)))
        assert match.hashes == tuple(hash_block_chain(TOKENS, BS, extra_keys=(("salt", "a"),)))
        assert match.num_hinted == 0

    async def test_late_keys_namespace_the_chain_from_their_block(self, index, running):
        """Images keyed from their block enter there; the blocks before carry the salt alone."""
        keys = ChainKeys.derive(cache_salt="a", images_key="k", images_start=2 * BS + 1, block_size=BS)
        salt, images = (("salt", "a"),), (("images", "k"),)
        async with running(index) as ref:
            handle = Handle(ref)
            late = await handle.begin("r1", TOKENS, keys)
        assert late.hashes == tuple(
            hash_block_chain(TOKENS, BS, extra_keys=salt, late_keys=images, late_block=2)
        )
        assert late.hashes[:2] == tuple(hash_block_chain(TOKENS, BS, extra_keys=salt))[:2]

    async def test_recorded_hashes_become_hints(self, index, running):
        """After a request records blocks, the next one with that prefix is hinted."""
        async with running(index) as ref:
            handle = Handle(ref)
            match = await handle.begin("r1", TOKENS)
            await handle.record("r1", 0, grants(match.hashes[:3]))
            other = await handle.begin("r2", TOKENS[: 2 * BS] + (99,) * 9)
            stats = await handle.statistics()
        assert other.num_hinted == 2
        assert (stats.num_lookups, stats.num_hints, stats.num_active_requests) == (2, 3, 2)

    async def test_duplicate_request_changes_nothing(self, index, running):
        """Beginning an active request is refused and counts no lookup."""
        async with running(index) as ref:
            handle = Handle(ref)
            await handle.begin("r1", TOKENS)
            with pytest.raises(DuplicateRequest):
                await handle.begin("r1", TOKENS)
            assert (await handle.statistics()).num_lookups == 1


class TestRecord:
    async def test_stale_hint_is_counted_and_forgotten(self, index, running):
        """A fetch that gets fewer blocks than hinted drops the first missing hint."""
        async with running(index) as ref:
            handle = Handle(ref)
            match = await handle.begin("r1", TOKENS)
            await handle.record("r1", 0, grants(match.hashes))
            again = await handle.begin("r2", TOKENS)
            assert again.num_hinted == 4
            await handle.record("r2", 0, grants(again.hashes[:1], 10), hit=True)
            assert (await handle.begin("r3", TOKENS)).num_hinted == 1
            stats = await handle.statistics()
        assert (stats.num_stale_hints, stats.num_hits, stats.num_hit_blocks) == (1, 1, 1)

    async def test_changed_table_is_refused(self, index, running):
        """A record whose start no longer matches the table changes nothing."""
        async with running(index) as ref:
            handle = Handle(ref)
            match = await handle.begin("r1", TOKENS)
            await handle.record("r1", 0, grants(match.hashes[:1]))
            with pytest.raises(InvalidInput, match="meanwhile"):
                await handle.record("r1", 0, grants(match.hashes[:1]))
            with pytest.raises(InvalidInput, match="chain"):
                await handle.record("r1", 1, grants(match.hashes[2:3]))
            with pytest.raises(UnknownRequest):
                await handle.record("nobody", 0, ())
            assert await handle.close_table("r1") == (1,)

    async def test_forget_drops_hints(self, index, running):
        """Announced evictions remove hints."""
        async with running(index) as ref:
            handle = Handle(ref)
            match = await handle.begin("r1", TOKENS)
            await handle.record("r1", 0, grants(match.hashes))
            await handle.forget(match.hashes[1:2])
            assert (await handle.begin("r2", TOKENS)).num_hinted == 1
            assert (await handle.statistics()).num_forgotten == 1

    async def test_hints_are_bounded(self, running):
        """Beyond max_hints the oldest hints go first."""
        index = PrefixIndexActor(block_size=BS, max_hints=3)
        async with running(index) as ref:
            handle = Handle(ref)
            match = await handle.begin("r1", TOKENS)
            await handle.record("r1", 0, grants(match.hashes))
            stats = await handle.statistics()
            report = await handle.check_invariants()
        assert stats.num_hints == 3 and report.violations == ()


class TestExtend:
    async def test_store_plan_reuses_the_chain(self, index, running):
        """Extending reuses the hashes Begin computed and hashes only new blocks."""
        longer = TOKENS + tuple(range(100, 100 + 2 * BS))
        async with running(index) as ref:
            handle = Handle(ref)
            match = await handle.begin("r1", TOKENS)
            await handle.record("r1", 0, grants(match.hashes[:1]))
            plan = await handle.extend("r1", longer, 5)
        assert plan.start == 1
        assert plan.hashes == tuple(hash_block_chain(longer, BS))[1:6]
        assert tuple(plan.tail) == longer[6 * BS :]

    async def test_disagreeing_tokens_are_refused(self, index, running):
        """Tokens that contradict the request's, or a wrong payload count, change nothing."""
        async with running(index) as ref:
            handle = Handle(ref)
            match = await handle.begin("r1", TOKENS)
            changed = TOKENS[:5] + (0,) + TOKENS[6:]
            with pytest.raises(InvalidInput, match=r"token 0 at index 5 differs from the request's token there \(6\)") as info:
                await handle.extend("r1", changed, 4)
            assert tuple(info.value.value) == changed  # the tokens, not the position
            with pytest.raises(InvalidInput, match="one per new full block"):
                await handle.extend("r1", TOKENS, 3)
            with pytest.raises(UnknownRequest):
                await handle.extend("r2", TOKENS, 4)
            await handle.record("r1", 0, grants(match.hashes[:1]))
            with pytest.raises(InvalidInput, match="its 3 tokens must extend the 4 tokens") as info:
                await handle.extend("r1", TOKENS[:3], 0)
            assert tuple(info.value.value) == TOKENS[:3]  # the tokens, not their count

    async def test_shorter_store_keeps_the_known_tail(self, index, running):
        """Storing a prefix of the known tokens keeps the rest as the tail."""
        async with running(index) as ref:
            handle = Handle(ref)
            match = await handle.begin("r1", TOKENS)
            plan = await handle.extend("r1", TOKENS[: 2 * BS], 2)
            assert plan.hashes == match.hashes[:2]
            await handle.record("r1", 0, grants(plan.hashes), tail=plan.tail, tail_hashes=plan.tail_hashes)
            rest = await handle.extend("r1", TOKENS, 2)
        assert rest.hashes == match.hashes[2:]

    async def test_a_partial_store_keeps_the_blocks_not_stored_as_tail(self, index, running):
        """After storing only the first new blocks, the others are tail with their
        hashes: the next store plans exactly them, hashing nothing again."""
        longer = TOKENS + tuple(range(100, 100 + BS))
        async with running(index) as ref:
            handle = Handle(ref)
            await handle.begin("r1", TOKENS)
            plan = await handle.extend("r1", longer, 5)
            tail, tail_hashes = plan.after(2, array("I", longer), BS)
            assert tuple(tail) == longer[2 * BS :] and tail_hashes == plan.hashes[2:]
            await handle.record("r1", 0, grants(plan.hashes[:2]), tail=tail, tail_hashes=tail_hashes)
            rest = await handle.extend("r1", longer, 3)
            assert (await handle.check_invariants()).violations == ()
        assert rest.start == 2 and rest.hashes == plan.hashes[2:]
        assert plan.after(5, array("I", longer), BS) == (plan.tail, plan.tail_hashes)


class TestTables:
    async def test_a_fork_extends_under_the_late_keys(self, index, running):
        """A forked table stores an extension across the late block as the original would."""
        images = (("images", "k"),)
        prompt = TOKENS[: 2 * BS + 1]  # the late block (2) is not full yet
        async with running(index) as ref:
            handle = Handle(ref)
            match = await handle.begin("r1", prompt, ChainKeys(late=images, late_block=2))
            given = grants(match.hashes)
            await handle.record("r1", 0, given)
            snapshot = await handle.snapshot("r1", "r2")
            await handle.adopt("r2", snapshot, given)
            extension = await handle.extend("r2", TOKENS, 2)
        assert extension.hashes == tuple(
            hash_block_chain(TOKENS, BS, late_keys=images, late_block=2)
        )[2:4]

    async def test_snapshot_and_adopt_fork_a_table(self, index, running):
        """A snapshot adopted under a new id lists the same blocks."""
        async with running(index) as ref:
            handle = Handle(ref)
            match = await handle.begin("r1", TOKENS)
            given = grants(match.hashes[:2])
            await handle.record("r1", 0, given)
            snapshot = await handle.snapshot("r1", "r2")
            with pytest.raises(DuplicateRequest):
                await handle.snapshot("r1", "r1")
            await handle.adopt("r2", snapshot, given)
            with pytest.raises(DuplicateRequest):
                await handle.adopt("r2", snapshot, given)
            report = await handle.check_invariants()
            assert await handle.close_table("r2") == (1, 2)
        assert report.holdings == {1: 2, 2: 2}

    async def test_close_returns_the_blocks_once(self, index, running):
        """Close hands back the table's blocks; a second close is UnknownRequest."""
        async with running(index) as ref:
            handle = Handle(ref)
            match = await handle.begin("r1", TOKENS)
            await handle.record("r1", 0, grants(match.hashes[:2]))
            assert await handle.close_table("r1") == (1, 2)
            with pytest.raises(UnknownRequest):
                await handle.close_table("r1")

    async def test_discard_drops_only_empty_tables(self, index, running):
        """Discard (the undo of Begin) never drops a table that holds blocks."""
        async with running(index) as ref:
            handle = Handle(ref)
            await handle.begin("empty", TOKENS)
            match = await handle.begin("full", TOKENS)
            await handle.record("full", 0, grants(match.hashes[:1]))
            await handle.discard("empty")
            await handle.discard("full")
            assert (await handle.statistics()).num_active_requests == 1

    def test_undo_of_begin_is_discard(self, index):
        """A Begin reply that nobody received is undone by discarding the table."""
        message = Begin(request_id="r1", tokens=(), reply=None)
        assert index.undo(message, None) == Discard(request_id="r1")
        index.discard()
