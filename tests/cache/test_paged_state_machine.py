"""Random operation sequences on PagedCacheManager and its block pool keep every invariant.

The machine mixes the seed's methods with the pool's operations (allocate,
acquire, store all or nothing and the leading blocks that fit, retain,
release, evict, forget), holds references the way a caller would (a list of
references it owns, plus the request tables it created) and checks after
every step that each block's reference count is exactly what it holds,
besides the manager's and the pool's own ``check_invariants``. Its budget
scales with the Hypothesis profile (``--hypothesis-profile=deep``).
"""

from __future__ import annotations

from collections import Counter

from budget import examples
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mlxkv.cache.block_hash import hash_block_chain
from mlxkv.cache.errors import DoubleFree, InvalidInput, OutOfBlocks
from mlxkv.cache.paged import CacheBlock, PagedCacheManager

BS = 2
MAX_BLOCKS = 6

# A few prompts whose chains overlap: shared prefixes, and one that holds the
# same block content as another at a different position.
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8],
    [1, 2, 3, 4, 9, 9, 8, 8],
    [6, 6, 1, 2, 3, 4, 5, 6],
    [1, 2, 7, 7],
]
CHAINS = [hash_block_chain(prompt, BS) for prompt in PROMPTS]
prompt_index = st.integers(0, len(PROMPTS) - 1)


class PagedCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr = PagedCacheManager(block_size=BS, max_blocks=MAX_BLOCKS)
        self.held: list[CacheBlock] = []
        self.tables: dict[str, list[int]] = {}
        self.next_request = 0

    # Helpers.

    def pick_held(self, data, *, min_size: int = 1) -> list[int]:
        return data.draw(
            st.lists(st.sampled_from(range(len(self.held))), unique=True, min_size=min_size),
            label="held positions",
        )

    def take_held(self, positions: list[int]) -> list[CacheBlock]:
        taken = [self.held[i] for i in positions]
        for i in sorted(positions, reverse=True):
            del self.held[i]
        return taken

    def new_request(self) -> str:
        self.next_request += 1
        return f"r{self.next_request}"

    def state(self):
        mgr = self.mgr
        return (
            [(b.ref_count, b.block_hash, b.token_count, b.cache_data) for b in mgr.blocks],
            [b.block_id for b in mgr.free_block_queue.get_all_free_blocks()],
        )

    def in_use(self) -> bool:
        return bool(self.held) or any(ident != 0 for ids in self.tables.values() for ident in ids)

    # Rules.

    @rule(n=st.integers(0, 4))
    def allocate(self, n):
        free = self.mgr.free_blocks
        if n > free:
            before = self.state()
            try:
                self.mgr.pool.allocate(n)
            except OutOfBlocks as exc:
                assert (exc.requested, exc.available) == (n, free)
            else:
                raise AssertionError("allocate beyond the free blocks succeeded")
            assert self.state() == before
            return
        blocks = self.mgr.pool.allocate(n)
        for block in blocks:
            assert block.ref_count == 1 and block.block_hash is None
            assert block.cache_data is None and block.token_count == 0 and not block.is_null
        self.held.extend(blocks)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), by_id=st.booleans())
    def release(self, data, by_id):
        blocks = self.take_held(self.pick_held(data))
        self.mgr.pool.release([b.block_id for b in blocks] if by_id else blocks)

    @rule(ident=st.integers(1, MAX_BLOCKS - 1))
    def over_release(self, ident):
        """Releasing a block once more than it is referenced raises DoubleFree, changing nothing."""
        times = self.mgr.blocks[ident].ref_count + 1
        before = self.state()
        try:
            self.mgr.pool.release([ident] * times)
        except DoubleFree as exc:
            assert exc.block_id == ident
        else:
            raise AssertionError("over-release succeeded")
        assert self.state() == before

    @precondition(lambda self: any(b.block_hash is None for b in self.held))
    @rule(data=st.data(), p=prompt_index)
    def commit(self, data, p):
        candidates = [b for b in self.held if b.block_hash is None]
        block = data.draw(st.sampled_from(candidates), label="block")
        block_hash = data.draw(st.sampled_from(CHAINS[p]), label="hash")
        self.mgr.pool.commit(block, block_hash, num_tokens=BS, cache_data=("kv", block_hash))
        assert block.block_hash == block_hash

    @rule(p=prompt_index, data=st.data())
    def acquire(self, p, data):
        hashes = CHAINS[p][: data.draw(st.integers(0, len(CHAINS[p])), label="length")]
        expected = self.mgr.pool.lookup(hashes)
        blocks = self.mgr.pool.acquire(hashes)
        assert len(blocks) == expected
        for block, block_hash in zip(blocks, hashes):
            assert block.block_hash == block_hash
        self.held.extend(blocks)

    @rule(p=prompt_index, data=st.data(), leading=st.booleans())
    def store(self, p, data, leading):
        """The pool keeps a chain's blocks, sharing cached ones; all or nothing, or the leading ones that fit."""
        pool = self.mgr.pool
        start = data.draw(st.integers(0, len(CHAINS[p])), label="start")
        hashes = CHAINS[p][start : data.draw(st.integers(start, len(CHAINS[p])), label="stop")]
        payloads = [("kv", h) for h in hashes]
        cached = [pool.cached_block_hash_to_block.get_block(h) for h in hashes]
        before = self.state()
        try:
            stored = pool.store(hashes, payloads, leading=leading)
        except OutOfBlocks:
            assert not leading
            assert self.state() == before
            return
        assert [b.block_hash for b in stored.blocks] == hashes[: len(stored.blocks)]
        assert leading or len(stored.blocks) == len(hashes)
        assert (stored.refused is None) == (len(stored.blocks) == len(hashes))
        for block, was in zip(stored.blocks, cached):
            assert (block in stored.fresh) == (was is None)
            assert was is None or block is was
        self.held.extend(stored.blocks)

    @rule(data=st.data())
    def retain(self, data):
        """retain takes references only to blocks that still hold the hash they were seen with."""
        pool = self.mgr.pool
        ident = data.draw(st.integers(1, MAX_BLOCKS - 1), label="block")
        block_hash = data.draw(st.sampled_from([h for chain in CHAINS for h in chain]), label="hash")
        block = pool.blocks[ident]
        if block.block_hash != block_hash:
            before = self.state()
            try:
                pool.retain([(ident, block_hash)])
            except InvalidInput:
                assert self.state() == before
                return
            raise AssertionError("retain of a block that does not hold the hash succeeded")
        assert pool.retain([(ident, block_hash)]) == [block]
        self.held.append(block)

    @rule(n=st.integers(0, 3))
    def forget(self, n):
        """forget clears free blocks where they are; it refuses referenced ones."""
        pool = self.mgr.pool
        front = pool.free_block_queue.get_all_free_blocks()[:n]
        pool.forget(front)
        for block in front:
            assert block.block_hash is None and block.cache_data is None

    @rule(p=prompt_index)
    def get_computed_blocks(self, p):
        blocks, num_tokens = self.mgr.get_computed_blocks(PROMPTS[p])
        assert num_tokens == len(blocks) * BS
        assert [b.block_hash for b in blocks] == CHAINS[p][: len(blocks)]

    @rule(p=prompt_index)
    def find_shared_prefix(self, p):
        ids, rest = self.mgr.find_shared_prefix(PROMPTS[p])
        assert rest == PROMPTS[p][len(ids) * BS :]
        for ident, block_hash in zip(ids, CHAINS[p]):
            block = self.mgr.blocks[ident]
            assert block.ref_count > 0 and block.block_hash == block_hash

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def touch(self, data):
        blocks = [self.held[i] for i in self.pick_held(data)]
        self.mgr.touch(blocks)
        self.held.extend(blocks)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), p=prompt_index)
    def cache_full_blocks(self, data, p):
        limit = min(len(self.held), len(CHAINS[p]))
        positions = data.draw(
            st.lists(st.sampled_from(range(len(self.held))), min_size=1, max_size=limit),
            label="held positions",
        )
        blocks = [self.held[i] for i in positions]
        fresh = all(b.block_hash is None for b in blocks) and len(set(map(id, blocks))) == len(
            blocks
        )
        self.mgr.cache_full_blocks(blocks, PROMPTS[p], 0, len(blocks))
        if fresh:
            assert [b.block_hash for b in blocks] == CHAINS[p][: len(blocks)]

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def create_table(self, data):
        """Hand some held references over to a new request table."""
        blocks = self.take_held(self.pick_held(data))
        name = self.new_request()
        table = self.mgr.create_block_table(name)
        for block in blocks:
            self.mgr.add_block_to_table(table, block, BS)
        self.tables[name] = [b.block_id for b in blocks]

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork_block_table(self, data):
        source = data.draw(st.sampled_from(sorted(self.tables)), label="source")
        name = self.new_request()
        table = self.mgr.fork_block_table(self.mgr.get_block_table(source), name)
        assert table.block_ids == self.tables[source]
        self.tables[name] = list(table.block_ids)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def delete_block_table(self, data):
        name = data.draw(st.sampled_from(sorted(self.tables)), label="request")
        self.mgr.delete_block_table(name)
        del self.tables[name]

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def get_blocks_for_generation(self, data):
        name = data.draw(st.sampled_from(sorted(self.tables)), label="request")
        table = self.mgr.get_block_table(name)
        before = [self.mgr.blocks[i] for i in table.block_ids]
        payloads = [b.cache_data for b in before]
        blocks, was_copied = self.mgr.get_blocks_for_generation(table)
        assert [b.block_id for b in blocks] == table.block_ids
        changed = [i for i, (old, new) in enumerate(zip(before, blocks)) if old is not new]
        assert was_copied == bool(changed)
        for i in changed:
            assert blocks[i].ref_count == 1 and blocks[i].block_hash is None
            assert blocks[i].cache_data == payloads[i]
        self.tables[name] = list(table.block_ids)

    @rule(n=st.integers(0, 5))
    def evict(self, n):
        mgr = self.mgr
        cached_free = sum(
            1 for b in mgr.free_block_queue.get_all_free_blocks() if b.block_hash is not None
        )
        assert mgr.pool.evict(n) == min(n, cached_free)

    @rule(n=st.integers(0, 5))
    def evict_lru_blocks(self, n):
        """The seed's eviction clears the n free blocks at the LRU end, hashed or not."""
        mgr = self.mgr
        front = mgr.free_block_queue.get_all_free_blocks()[:n]
        assert mgr.evict_lru_blocks(n) == len(front) == min(n, mgr.free_blocks)
        for block in front:
            assert block.block_hash is None and block.cache_data is None

    @rule()
    def take_evicted(self):
        for block_hash in self.mgr.pool.take_evicted():
            assert self.mgr.pool.lookup([block_hash]) == 0

    @rule()
    def reset_prefix_cache(self):
        done = self.mgr.reset_prefix_cache()
        assert done == (not self.in_use())
        if done:
            assert len(self.mgr.cached_block_hash_to_block) == 0

    @precondition(lambda self: self.mgr.free_blocks == 0)
    @rule()
    def clear(self):
        self.mgr.clear()
        self.held.clear()
        self.tables.clear()

    # Checked after every step.

    @invariant()
    def manager_invariants(self):
        self.mgr.check_invariants()

    @invariant()
    def references_match_holders(self):
        """Each block has exactly the references the test holds, in hand or in tables."""
        expected = Counter(b.block_id for b in self.held)
        for ids in self.tables.values():
            expected.update(i for i in ids if i != 0)
        for block in self.mgr.blocks[1:]:
            assert block.ref_count == expected[block.block_id], block
        assert self.mgr.pool.check_references(expected) == []
        assert self.mgr.null_block.ref_count == 1
        assert sorted(self.mgr.request_tables) == sorted(self.tables)

    @invariant()
    def tokens_cached_are_those_of_table_blocks(self):
        """total_tokens_cached sums the token counts of the distinct blocks in tables."""
        listed = {i for ids in self.tables.values() for i in ids if i != 0}
        expected = sum(self.mgr.blocks[i].token_count for i in listed)
        assert self.mgr.get_memory_usage()["total_tokens_cached"] == expected


PagedCacheMachine.TestCase.settings = settings(
    max_examples=examples(75),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPagedCacheMachine = PagedCacheMachine.TestCase
