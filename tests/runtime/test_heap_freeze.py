"""The runtime keeps the objects it starts with out of the garbage collector's scans,
and gives them back when it stops (real gc, real runtimes, no model needed)."""

from __future__ import annotations

import gc
import weakref

import anyio
import pytest

from mlxkv import CacheRuntime
from mlxkv.heap_freeze import HEAP_FREEZE, HeapFreeze


class Node:
    """A weak-referenceable object that can sit in a reference cycle."""

    def __init__(self) -> None:
        self.other: object = None


def cycle() -> weakref.ref:
    """A two-object cycle nobody else refers to; a weak reference to one of them."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


#: Something froze objects before the tests began (seen on the GPU image: 375
#: frozen at import). The runtime's last stop unfreezes the whole permanent
#: generation (as its docstring says: an application that freezes the heap
#: itself turns freeze_gc off), so these tests need a heap nobody else froze.
FROZEN_BEFORE = gc.get_freeze_count()
pytestmark = pytest.mark.skipif(
    FROZEN_BEFORE > 0, reason=f"{FROZEN_BEFORE} objects were frozen before the tests (by another library)"
)


@pytest.fixture(autouse=True)
def unfrozen():
    gc.collect()
    assert gc.get_freeze_count() == 0 and HEAP_FREEZE.holders == 0, "a test left the heap frozen"
    yield
    assert gc.get_freeze_count() == 0 and HEAP_FREEZE.holders == 0, "the heap stayed frozen"


class TestHeapFreeze:
    def test_the_last_release_unfreezes(self):
        """Each hold freezes what is alive; objects stay frozen until the last
        holder releases; a cycle that died meanwhile is collected only then."""
        freeze = HeapFreeze()
        before = cycle()
        gc.disable()  # no collection between making the cycle and freezing it
        try:
            bound = Node()
            bound.other = before()
            freeze.hold()
        finally:
            gc.enable()
        del bound
        freeze.hold()
        assert freeze.holders == 2 and gc.get_freeze_count() > 0
        gc.collect()
        assert before() is not None, "a frozen cycle was collected"
        freeze.release()
        gc.collect()
        assert before() is not None and gc.get_freeze_count() > 0
        freeze.release()
        assert freeze.holders == 0 and gc.get_freeze_count() == 0
        gc.collect()
        assert before() is None, "the cycle outlived the freeze"

    def test_releasing_more_than_held_is_a_bug(self):
        with pytest.raises(AssertionError, match="released more often than held"):
            HeapFreeze().release()


@pytest.mark.anyio
class TestRuntimeFreezesTheHeap:
    async def test_started_runtime_freezes_and_its_stop_unfreezes(self):
        """While a runtime runs, what was alive at its start is frozen (a full
        collection skips it) and new objects are not; after it stops nothing is
        frozen and both cycles are collected."""
        gc.disable()
        try:
            old = cycle()
            async with CacheRuntime():
                gc.enable()
                new = cycle()
                assert HEAP_FREEZE.holders == 1 and gc.get_freeze_count() > 0
                gc.collect()
                assert old() is not None, "an object alive at the start was scanned"
                assert new() is None, "an object made while running was frozen"
        finally:
            gc.enable()
        gc.collect()
        assert old() is None

    async def test_two_runtimes_share_the_freeze(self):
        """The heap stays frozen until the second of two runtimes stops."""
        async with CacheRuntime():
            async with CacheRuntime():
                assert HEAP_FREEZE.holders == 2
            assert HEAP_FREEZE.holders == 1 and gc.get_freeze_count() > 0

    async def test_off_freezes_nothing(self):
        async with CacheRuntime(freeze_gc=False):
            assert HEAP_FREEZE.holders == 0 and gc.get_freeze_count() == 0

    async def test_a_runtime_that_fails_to_start_holds_no_freeze(self, tmp_path):
        """A model that does not load: the runtime never started, nothing is frozen."""
        from mlxkv import ModelLoadError

        (tmp_path / "config.json").write_text("{}")
        with pytest.raises(ModelLoadError):
            async with CacheRuntime(model=str(tmp_path)):
                pass  # pragma: no cover

    async def test_a_crash_inside_still_unfreezes(self):
        with pytest.raises(RuntimeError, match="boom"):
            async with CacheRuntime():
                await anyio.sleep(0)
                raise RuntimeError("boom")
