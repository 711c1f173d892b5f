"""Admission: at most N generating requests, a bounded queue behind them, and 503 beyond.

The runtime itself takes any number of concurrent generations (they batch);
what a server must bound is what it promises: each admitted request holds
KV blocks and a share of every decode step, and each waiting one holds a
connection. :class:`Admission` lets ``max_running`` requests run and up to
``max_waiting`` wait, first come first served; a request beyond both is
refused at once (:class:`Overloaded`), never queued without bound.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import AsyncIterator

import anyio
import anyio.lowlevel
import attrs

__all__ = ["Admission", "AdmissionStatistics", "Overloaded"]


class Overloaded(Exception):
    """Every slot is taken and the queue is full."""


@attrs.frozen(kw_only=True)
class AdmissionStatistics:
    """A snapshot of an :class:`Admission`.

    Attributes:
        max_running: the most requests running at once.
        max_waiting: the most requests waiting at once.
        num_running: requests holding a slot now.
        num_waiting: requests waiting for one now.
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
    """One request in the queue: woken when a leaving request hands it its slot."""

    __slots__ = ("granted", "woken")

    def __init__(self) -> None:
        self.granted = False
        self.woken = anyio.Event()


class Admission:
    """Slots for generating requests, and a bounded queue for them.

    Owns: the count of running requests and the FIFO queue of waiters, both
    touched only on the event loop (no lock: a request that leaves hands its
    slot straight to the queue's head, which is woken holding it).

    Invariants:
        - ``0 <= num_running <= max_running`` and ``0 <= num_waiting <= max_waiting``;
        - a waiter is queued only while every slot is taken;
        - a waiter that is cancelled (its client left) leaves the queue and holds
          no slot: one it was handed meanwhile goes on to the next.
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
    async def slot(self) -> AsyncIterator[None]:
        """Hold a slot for the body of the ``async with``, waiting in the queue for one.

        Raises:
            Overloaded: no slot is free and the queue is full (raised at once).
        """
        # The checkpoint comes first: from taking a slot to the ``try`` that
        # gives it back, nothing may await (a cancellation there would leak it).
        await anyio.lowlevel.checkpoint()
        if self._num_running < self._max_running:
            self._num_running += 1
        elif len(self._queue) >= self._max_waiting:
            self._num_refused += 1
            raise Overloaded
        else:
            waiter = _Waiter()
            self._queue.append(waiter)
            try:
                await waiter.woken.wait()
            except BaseException:
                if waiter.granted:
                    self._leave()  # handed a slot while being cancelled: pass it on
                else:
                    self._queue.remove(waiter)
                raise
        self._num_admitted += 1
        try:
            yield
        finally:
            self._leave()

    def _leave(self) -> None:
        """Give up a slot: to the longest waiter if there is one, else free it."""
        if self._queue:
            waiter = self._queue.popleft()
            waiter.granted = True
            waiter.woken.set()
        else:
            self._num_running -= 1

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
