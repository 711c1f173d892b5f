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


class TestWiden:
    """``Admission.widen()``: a request of several generations holds a slot each."""

    async def test_a_widening_request_waits_ahead_of_new_ones(self):
        """B widens to 3 of 3 slots while A holds one: B waits holding none, a
        new request C queues behind B although a slot is free (no request
        passes the head), and A leaving lets B run with 3, then C."""
        admission = Admission(max_running=3, max_waiting=4)
        order: list[str] = []
        leave = {name: anyio.Event() for name in "ABC"}

        async def request(name: str, weight: int) -> None:
            async with admission.slot() as slot:
                await admission.widen(slot, weight)
                order.append(name)
                assert slot.weight == weight
                await leave[name].wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(request, "A", 1)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(request, "B", 3)
            await anyio.wait_all_tasks_blocked()
            stats = admission.statistics()
            assert (stats.num_running, stats.num_waiting, order) == (1, 1, ["A"])
            tg.start_soon(request, "C", 1)
            await anyio.wait_all_tasks_blocked()
            assert admission.statistics().num_waiting == 2 and order == ["A"]
            leave["A"].set()
            await anyio.wait_all_tasks_blocked()
            assert order == ["A", "B"] and admission.statistics().num_running == 3
            leave["B"].set()
            await anyio.wait_all_tasks_blocked()
            assert order == ["A", "B", "C"] and admission.statistics().num_running == 1
            leave["C"].set()
        stats = admission.statistics()
        assert (stats.num_running, stats.num_waiting, stats.num_admitted) == (0, 0, 3)

    async def test_a_widening_request_goes_ahead_of_requests_queued_before(self):
        """Both slots held (A, B), C and D queued: B widening to 2 hands its slot
        to C and waits ahead of D, holding none; A leaving frees one, which D
        may not take past B; C leaving gives B its two; then D."""
        admission = Admission(max_running=2, max_waiting=4)
        order: list[str] = []
        leave = {name: anyio.Event() for name in "ABCD"}
        widen = anyio.Event()

        async def request(name: str) -> None:
            async with admission.slot() as slot:
                if name == "B":
                    await widen.wait()
                    await admission.widen(slot, 2)
                order.append(name)
                await leave[name].wait()

        async with anyio.create_task_group() as tg:
            for name in "ABCD":
                tg.start_soon(request, name)
                await anyio.wait_all_tasks_blocked()
            assert order == ["A"] and admission.statistics().num_waiting == 2
            widen.set()
            await anyio.wait_all_tasks_blocked()
            assert order == ["A", "C"]
            leave["A"].set()
            await anyio.wait_all_tasks_blocked()
            assert order == ["A", "C"] and admission.statistics().num_running == 1
            leave["C"].set()
            await anyio.wait_all_tasks_blocked()
            assert order == ["A", "C", "B"] and admission.statistics().num_running == 2
            leave["B"].set()
            await anyio.wait_all_tasks_blocked()
            assert order == ["A", "C", "B", "D"]
            leave["D"].set()
        assert admission.statistics().num_running == 0

    async def test_two_widening_requests_do_not_wait_on_each_other(self):
        """Both slots held, both holders widen to 2: the first gives its slot
        back and waits, the second's given back slot completes the first's
        two, and the second runs after it (no deadlock)."""
        admission = Admission(max_running=2, max_waiting=0)
        order: list[str] = []
        both_in = anyio.Event()
        admitted = 0

        async def request(name: str) -> None:
            nonlocal admitted
            async with admission.slot() as slot:
                admitted += 1
                if admitted == 2:
                    both_in.set()
                await both_in.wait()
                await admission.widen(slot, 2)
                order.append(name)
                await anyio.sleep(0)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(request, "a")
                tg.start_soon(request, "b")
        assert sorted(order) == ["a", "b"] and admission.statistics().num_running == 0

    async def test_a_cancelled_widening_head_lets_the_next_through(self):
        """A widening request at the queue's head that is cancelled (its client
        left) holds nothing, and the free slot it held back goes to the next."""
        admission = Admission(max_running=2, max_waiting=2)
        entered: list[str] = []
        scope = anyio.CancelScope()

        async def widening() -> None:
            with scope:
                async with admission.slot() as slot:
                    await admission.widen(slot, 2)
                    entered.append("widening")

        async def plain() -> None:
            async with admission.slot():
                entered.append("plain")

        async with admission.slot():
            async with anyio.create_task_group() as tg:
                tg.start_soon(widening)
                await anyio.wait_all_tasks_blocked()
                tg.start_soon(plain)
                await anyio.wait_all_tasks_blocked()
                assert entered == [] and admission.statistics().num_waiting == 2
                scope.cancel()
                await anyio.wait_all_tasks_blocked()
                assert entered == ["plain"]
        assert admission.statistics().num_running == 0

    async def test_more_than_every_slot_is_refused(self):
        """A weight past ``max_running`` could never run: ValueError, and the
        request keeps the slot it had."""
        admission = Admission(max_running=2, max_waiting=0)
        async with admission.slot() as slot:
            with pytest.raises(ValueError):
                await admission.widen(slot, 3)
            assert slot.weight == 1 and admission.statistics().num_running == 1
        assert admission.statistics().num_running == 0

    @pytest.mark.parametrize("seed", range(5))
    async def test_random_weights_and_cancellations_keep_the_bounds(self, seed):
        """Forty requests of random weights (1-4 of 4 slots), a third of them
        cancelled at random moments: the slots held never pass the bound, every
        request not cancelled runs, and at the end nothing is held or queued."""
        import random

        rng = random.Random(seed)
        admission = Admission(max_running=4, max_waiting=64)
        ran: list[int] = []
        peak = 0

        async def request(i: int, weight: int, scope: anyio.CancelScope) -> None:
            nonlocal peak
            with scope:
                async with admission.slot() as slot:
                    await anyio.sleep(rng.random() * 0.002)
                    await admission.widen(slot, weight)
                    peak = max(peak, admission.statistics().num_running)
                    assert admission.statistics().num_running <= 4
                    ran.append(i)
                    await anyio.sleep(rng.random() * 0.003)

        scopes = [anyio.CancelScope() for _ in range(40)]
        cancelled = set(rng.sample(range(40), 13))
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for i in range(40):
                    tg.start_soon(request, i, rng.randint(1, 4), scopes[i])
                for i in sorted(cancelled, key=lambda _: rng.random()):
                    await anyio.sleep(rng.random() * 0.002)
                    scopes[i].cancel()
        stats = admission.statistics()
        assert (stats.num_running, stats.num_waiting) == (0, 0)
        assert set(range(40)) - cancelled <= set(ran) and peak <= 4
