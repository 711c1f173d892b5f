"""The disk tier's bookkeeping: LRU order and a byte budget that holds."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.tiers.disk_index import DiskIndex


class TestDiskIndex:
    def test_make_room_evicts_least_recently_used(self):
        """Room is made by dropping the least recently used entries first."""
        index = DiskIndex(100)
        for name in "abc":
            index.touch(name, 30)
        index.touch("a", 30)  # a is now the most recent
        assert index.make_room(30) == ["b"]
        assert index.names() == ["c", "a"] and index.num_bytes == 60

    def test_kept_names_are_never_evicted(self):
        """Entries being written are passed over; fits() says if room was found."""
        index = DiskIndex(100)
        index.touch("a", 50)
        index.touch("b", 50)
        assert index.make_room(60, keep={"a"}) == ["b"]
        assert not index.fits(60)

    def test_replace_orders_by_last_use_and_keeps_writes(self):
        """A rescan rebuilds the order from use times and keeps in-flight writes."""
        index = DiskIndex(1000)
        index.replace([("new", 10, 300), ("old", 20, 100), ("mid", 30, 200)], keep={"writing": 5})
        assert index.names() == ["old", "mid", "new", "writing"]
        assert index.num_bytes == 65

    def test_replace_breaks_time_ties_by_known_order(self):
        """Files with equal times keep the order this index knew, after unknown ones."""
        index = DiskIndex(1000)
        for name in ("b", "a"):
            index.touch(name, 1)
        index.replace([("a", 1, 5), ("b", 1, 5), ("x", 1, 5)])
        assert index.names() == ["x", "b", "a"]

    def test_bad_budget_refused(self):
        """A budget must be a positive int."""
        for bad in (0, -1, 1.5, None):
            with pytest.raises(InvalidInput):
                DiskIndex(bad)


class IndexMachine(RuleBasedStateMachine):
    """Random writes, hits and forgets against a plain-dict model."""

    def __init__(self) -> None:
        super().__init__()
        self.index = DiskIndex(1000)
        self.model: dict[str, int] = {}

    @rule(name=st.sampled_from("abcdefgh"), size=st.integers(0, 400))
    def write(self, name, size):
        victims = self.index.make_room(size, keep={name})
        for victim in victims:
            del self.model[victim]
        self.index.touch(name, size)
        self.model[name] = size
        assert self.index.num_bytes <= self.index.max_bytes

    @rule(name=st.sampled_from("abcdefgh"))
    def forget(self, name):
        assert self.index.forget(name) == self.model.pop(name, None)

    @invariant()
    def agrees(self):
        self.index.check_invariants()
        assert {n: self.index.size_of(n) for n in self.index.names()} == self.model


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
