"""Admission: slots, a bounded FIFO queue, refusals at once, cancellation leaves no trace."""

from __future__ import annotations

import anyio
import pytest

from mlxkv.server.admission import Admission, Overloaded


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


class TestAdmission:
    """``Admission.slot()``."""

    async def test_queue_then_refuse(self):
        """Two run, two wait, the fifth is refused at once; each freed slot goes
        to the longest waiter."""
        admission = Admission(max_running=2, max_waiting=2)
        order: list[int] = []
        done = [anyio.Event() for _ in range(4)]

        async def request(i: int) -> None:
            async with admission.slot():
                order.append(i)
                await done[i].wait()

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(request, i)
                await anyio.wait_all_tasks_blocked()
            stats = admission.statistics()
            assert (stats.num_running, stats.num_waiting) == (2, 2) and order == [0, 1]
            with pytest.raises(Overloaded):
                async with admission.slot():
                    pass
            for i in (1, 0):  # the later one leaves first: the queue's head still goes next
                done[i].set()
                await anyio.wait_all_tasks_blocked()
            assert order == [0, 1, 2, 3]
            done[2].set()
            done[3].set()
        stats = admission.statistics()
        counts = (stats.num_running, stats.num_waiting, stats.num_admitted, stats.num_refused)
        assert counts == (0, 0, 4, 1)

    async def test_cancelled_waiter_leaves_the_queue(self):
        """A waiter cancelled (its client left) frees its place and holds no slot."""
        admission = Admission(max_running=1, max_waiting=1)
        async with admission.slot():
            with anyio.move_on_after(0.05):
                async with admission.slot():
                    pytest.fail("admitted beyond the limit")
            assert admission.statistics().num_waiting == 0
        async with admission.slot():
            assert admission.statistics().num_running == 1
        assert admission.statistics().num_running == 0

    async def test_a_slot_handed_to_a_cancelled_waiter_goes_on_to_the_next(self):
        """The head of the queue is cancelled in the same step a slot is handed to
        it: it never runs, and the slot goes to the next waiter, not lost."""
        admission = Admission(max_running=1, max_waiting=2)
        entered: list[str] = []
        release_c = anyio.Event()

        async def wait(name: str, scope: anyio.CancelScope) -> None:
            with scope:
                async with admission.slot():
                    entered.append(name)
                    await release_c.wait()

        scope_b, scope_c = anyio.CancelScope(), anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            async with admission.slot():
                tg.start_soon(wait, "b", scope_b)
                await anyio.wait_all_tasks_blocked()
                tg.start_soon(wait, "c", scope_c)
                await anyio.wait_all_tasks_blocked()
                assert admission.statistics().num_waiting == 2
                scope_b.cancel()  # b is cancelled, and is handed the slot below
            await anyio.wait_all_tasks_blocked()
            assert entered == ["c"]
            stats = admission.statistics()
            assert (stats.num_running, stats.num_waiting) == (1, 0)
            release_c.set()
        stats = admission.statistics()
        assert (stats.num_running, stats.num_waiting, stats.num_admitted) == (0, 0, 2)

    async def test_cancelled_on_entry_holds_no_slot(self):
        """A request cancelled as it asks for a free slot (its client closed the
        connection at once) takes none: the count stays at zero."""
        admission = Admission(max_running=1, max_waiting=0)
        for _ in range(3):
            with anyio.CancelScope() as scope:
                scope.cancel()
                async with admission.slot():
                    pytest.fail("entered a cancelled scope")
            assert admission.statistics().num_running == 0
        async with admission.slot():  # the one slot is still there
            assert admission.statistics().num_running == 1

    def test_bounds_are_checked(self):
        """At least one slot; a queue of zero means refuse whenever every slot is taken."""
        with pytest.raises(ValueError):
            Admission(max_running=0, max_waiting=4)
        assert Admission(max_running=1, max_waiting=0).statistics().max_waiting == 0
