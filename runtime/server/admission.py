"""Admission: at most N generating requests, a bounded queue behind them, and 503 beyond.

The runtime itself takes any number of concurrent generations (they batch);
what a server must bound is what it promises: each admitted request holds
KV blocks and a share of every decode step, and each waiting one holds a
connection. :class:`Admission` lets ``max_running`` generations run (a
request of ``n`` choices is ``n`` of them) and up to ``max_waiting``
requests wait, first come first served; a request beyond both is refused at
once (:class:`Overloaded`), never queued without bound.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import AsyncIterator

import anyio
import anyio.lowlevel
import attrs

__all__ = ["Admission", "AdmissionStatistics", "Overloaded", "Slot"]


class Overloaded(Exception):
    """Every slot is taken and the queue is full."""


@attrs.frozen(kw_only=True)
class AdmissionStatistics:
    """A snapshot of an :class:`Admission`.

    Attributes:
        max_running: the most slots held at once (a generation each).
        max_waiting: the most requests not yet admitted waiting at once.
        num_running: slots held now.
        num_waiting: requests waiting for slots now (widening ones too).
        num_admitted: requests that got a slot so far.
        num_refused: requests refused (:class:`Overloaded`) so far.
    """

    max_running: int
    max_waiting: int
    num_running: int
    num_waiting: int
    num_admitted: int
    num_refused: int


class _Waiter:
    """One request in the queue: woken once a leaving request hands it the
    ``need`` slots it waits for. ``widening``: admitted already (it gave its
    one slot back to wait for more), so it waits ahead of every request not
    yet admitted."""

    __slots__ = ("granted", "need", "widening", "woken")

    def __init__(self, need: int, widening: bool) -> None:
        self.need = need
        self.widening = widening
        self.granted = False
        self.woken = anyio.Event()


class Slot:
    """A request's hold on admission, from :meth:`Admission.slot`: one slot,
    or as many as :meth:`Admission.widen` made it (0 while it waits for them)."""

    __slots__ = ("weight",)

    def __init__(self) -> None:
        self.weight = 0


class Admission:
    """Slots for generations, and a bounded queue of requests waiting for them.

    A request takes one slot; one that generates several answers (``n``
    choices) widens its hold to a slot each (:meth:`widen`), so that
    ``max_running`` bounds the generations running, not the requests.

    Owns: the count of slots held and the FIFO queue of waiters, both
    touched only on the event loop (no lock: a request that leaves hands its
    slots straight to the queue's head while the head's need fits, and the
    waiter is woken holding them).

    Invariants:
        - ``0 <= num_running <= max_running`` (slots held) and at most
          ``max_waiting`` requests not yet admitted wait;
        - a waiter is queued only while its need, or the need of one ahead
          of it, exceeds the free slots (no request passes the queue's
          head: one that needs many is not starved by ones that need one);
        - a widening request waits ahead of the requests not yet admitted,
          holding no slot while it waits (so two of them never wait on each
          other's slots);
        - a waiter that is cancelled (its client left) leaves the queue and
          holds no slot: slots it was handed meanwhile go on to the next.
    """

    def __init__(self, max_running: int, max_waiting: int) -> None:
        if max_running < 1 or max_waiting < 0:
            raise ValueError(
                f"need max_running >= 1 and max_waiting >= 0, got {max_running}, {max_waiting}"
            )
        self._max_running = max_running
        self._max_waiting = max_waiting
        self._num_running = 0
        self._queue: collections.deque[_Waiter] = collections.deque()
        self._num_admitted = 0
        self._num_refused = 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[Slot]:
        """Hold a slot for the body of the ``async with``, waiting in the queue for one.

        Raises:
            Overloaded: no slot is free and the queue is full (raised at once).
        """
        # The checkpoint comes first: from taking a slot to the ``try`` that
        # gives it back, nothing may await (a cancellation there would leak it).
        await anyio.lowlevel.checkpoint()
        held = Slot()
        if not self._queue and self._num_running < self._max_running:
            self._num_running += 1
        elif sum(not waiter.widening for waiter in self._queue) >= self._max_waiting:
            self._num_refused += 1
            raise Overloaded
        else:
            await self._wait(_Waiter(1, widening=False))
        held.weight = 1
        self._num_admitted += 1
        try:
            yield held
        finally:
            self._leave(held.weight)

    async def widen(self, held: Slot, weight: int) -> None:
        """Make ``held`` (a slot of this admission's) hold ``weight`` slots,
        waiting for them: it gives back what it holds and waits ahead of every
        request not yet admitted (and behind earlier widening ones) until
        ``weight`` are free. Cancelled while waiting, it holds none.

        Raises:
            ValueError: ``weight`` past ``max_running`` (it could never run).
        """
        if weight > self._max_running:
            raise ValueError(f"cannot hold {weight} of {self._max_running} slots")
        await anyio.lowlevel.checkpoint()
        if weight <= held.weight:
            return
        self._leave(held.weight)
        held.weight = 0
        if not self._queue and self._max_running - self._num_running >= weight:
            self._num_running += weight
        else:
            await self._wait(_Waiter(weight, widening=True))
        held.weight = weight

    async def _wait(self, waiter: _Waiter) -> None:
        """Queue ``waiter`` (a widening one behind the widening ones already
        queued, else last) and wait until it is handed its slots."""
        if waiter.widening:
            self._queue.insert(sum(1 for queued in self._queue if queued.widening), waiter)
        else:
            self._queue.append(waiter)
        try:
            await waiter.woken.wait()
        except BaseException:
            if waiter.granted:
                self._leave(waiter.need)  # handed its slots while being cancelled: pass them on
            else:
                self._queue.remove(waiter)
                self._hand_over()  # it may have held back the ones behind it
            raise

    def _leave(self, weight: int) -> None:
        """Give up ``weight`` slots: to the queue's head while its need fits."""
        self._num_running -= weight
        self._hand_over()

    def _hand_over(self) -> None:
        while self._queue and self._max_running - self._num_running >= self._queue[0].need:
            waiter = self._queue.popleft()
            self._num_running += waiter.need
            waiter.granted = True
            waiter.woken.set()

    def statistics(self) -> AdmissionStatistics:
        """A snapshot of the slots and the queue."""
        return AdmissionStatistics(
            max_running=self._max_running,
            max_waiting=self._max_waiting,
            num_running=self._num_running,
            num_waiting=len(self._queue),
            num_admitted=self._num_admitted,
            num_refused=self._num_refused,
        )
