"""Which calls a runtime may serve now, and the calls it is serving.

A :class:`Gate` is the runtime's lifecycle as its callers see it: a call
starts only while the runtime runs, is counted while it is in flight (so that
``async with`` exit waits for it), and reports a stopped actor as
:class:`~mlxkv.errors.RuntimeClosed`, with the crash that stopped the runtime
as its cause. :class:`~mlxkv.runtime.CacheRuntime` opens and closes it; the
cache client and generations pass through it.

No anyio primitive is shared beyond the one event that says the calls in
flight have drained; everything here runs on the event loop.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Optional

import anyio
from anyio.abc import TaskGroup

from mlxkv.actors.actor import ActorFailed
from mlxkv.errors import RuntimeClosed

__all__ = ["Gate", "Phase"]


class Phase(enum.Enum):
    """Where a runtime is in its life; its value is what errors say."""

    NEW = "not started"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"
    FAILED = "failed"


class Gate:
    """Owns the runtime's phase, the crash that failed it, and its calls in flight.

    Invariants:
        - a call starts only in ``Phase.RUNNING``; ``num_in_flight`` counts
          the calls between their start and their end;
        - ``failure`` is set once, by the first crash, and the phase is then
          ``FAILED``;
        - once the phase has left ``RUNNING`` and no call is in flight, the
          drained event is set.
    """

    def __init__(self) -> None:
        self.phase = Phase.NEW
        #: The exception that crashed an actor, if one did.
        self.failure: Optional[BaseException] = None
        #: Calls in progress.
        self.num_in_flight = 0
        #: Calls made so far.
        self.num_calls = 0
        # Made when the runtime starts: an anyio event needs its event loop.
        self._drained: Optional[anyio.Event] = None
        self._task_group: Optional[TaskGroup] = None

    def open(self, task_group: TaskGroup) -> None:
        """The runtime runs: calls are served, tasks start in ``task_group``."""
        self._drained = anyio.Event()
        self._task_group = task_group
        self.phase = Phase.RUNNING

    def close(self) -> None:
        """Refuse new calls (``CLOSING``); those in flight go on."""
        if self.phase is Phase.RUNNING:
            self.phase = Phase.CLOSING
        self._set_drained()

    def closed(self) -> None:
        """The runtime has stopped (unless it failed, which it stays)."""
        if self.phase is not Phase.FAILED:
            self.phase = Phase.CLOSED
        self._set_drained()

    def fail(self, error: BaseException) -> None:
        """An actor crashed with ``error``: every later call is refused with it."""
        if self.failure is None:
            self.failure = error
            self.phase = Phase.FAILED

    async def wait_drained(self) -> None:
        """Wait until no call is in flight (after :meth:`close`)."""
        if self.num_in_flight:
            assert self._drained is not None, "calls were in flight, so the runtime was opened"
            await self._drained.wait()

    @property
    def running(self) -> bool:
        """Whether calls are served."""
        return self.phase is Phase.RUNNING

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Count a call in flight; refuse it unless running; report a stopped
        actor as RuntimeClosed.

        Raises:
            RuntimeClosed: the runtime is not running, or an actor stopped
                during the call.
        """
        if self.phase is not Phase.RUNNING:
            raise self.closed_error()
        self.num_in_flight += 1
        self.num_calls += 1
        try:
            yield
        except ActorFailed as error:
            raise self.closed_error(error) from error
        finally:
            self.num_in_flight -= 1
            if self.phase is not Phase.RUNNING:
                self._set_drained()

    def _set_drained(self) -> None:
        if not self.num_in_flight and self._drained is not None:
            self._drained.set()

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` in the runtime's task group (it must not raise:
        an exception there would crash the runtime).

        Raises:
            RuntimeClosed: the runtime is not running.
        """
        if self.phase is not Phase.RUNNING or self._task_group is None:
            raise self.closed_error()
        self._task_group.start_soon(fn, *args)

    def closed_error(self, stopped: Optional[ActorFailed] = None) -> RuntimeClosed:
        """Why calls are refused; ``stopped``: the actor a call found stopped
        (its crash counts before the task group has recorded it)."""
        failure = self.failure
        if failure is None and stopped is not None:
            failure = stopped.cause
        if failure is not None:
            return RuntimeClosed(Phase.FAILED.value, failure)
        phase = Phase.CLOSED if self.phase is Phase.RUNNING else self.phase
        return RuntimeClosed(phase.value)
