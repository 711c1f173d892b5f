"""One dedicated OS thread that owns one MLX stream and runs MLX jobs in order.

An unevaluated MLX array belongs to the stream of the thread that built it;
evaluating it on another thread raises ``There is no Stream(cpu, N) in current
thread``. ``anyio.to_thread.run_sync`` does not pin a thread, so it cannot host
MLX work. :class:`MLXThread` is the one place where MLX graphs are built and
evaluated: async code submits a synchronous function, the thread runs it under
its own stream, evaluates every array in the result, and hands the result back.

Wake-up: the caller takes its event loop's token
(``anyio.lowlevel.current_token()``) when it submits; when the job is done the
thread schedules ``settle`` on the event-loop thread through the token's
backend (``run_sync_soon``: asyncio's ``call_soon_threadsafe``, trio's
``TrioToken.run_sync_soon``) and goes on to the next job without waiting for
the loop, so a busy loop never stalls MLX work. ``settle`` either sets the
caller's ``anyio.Event`` or, if the caller has stopped waiting, hands the
result to the job's orphan callback; it cannot raise. Both the caller's "I
stopped waiting" and ``settle`` run on the event-loop thread, so exactly one
of them decides, without a lock. A wake-up can fail only because the loop has
finished (``anyio.RunFinishedError``): then nobody can be waiting and the
result is given back from the thread. Any other failure to wake is a bug that
would leave a caller waiting forever: it kills the thread loudly (logged, and
every later job fails with :class:`MLXThreadStopped`).

Cancellation: a job that is running cannot be interrupted. A caller cancelled
while its job is queued or running gets its cancellation at once; the job
still runs to the end and its result goes to ``on_orphan`` (on the event-loop
thread), which must give back whatever the result holds.

Shutdown: :meth:`MLXThread.aclose` queues a stop sentinel after the jobs
already queued (they still run), waits for the thread to reach it and joins
the thread. The thread's last MLX act is ``mx.clear_streams()`` (which also
drops streams its jobs made, such as a model runner's prefill streams): MLX requires
every thread that used streams to destroy them before it ends, or the process
can abort at exit (``terminate called without an active exception``). A
thread still running when the interpreter exits (its runtime was never
closed) is stopped and joined by an ``atexit`` hook, which also clears the
main thread's streams. A job that raises an ``Exception`` fails only its caller, who gets
the exception. Anything else escaping a job (``SystemExit``, a
``BaseException`` of MLX's own) kills the thread's ability to run jobs: that
job's caller and every later one get :class:`MLXThreadStopped`.
"""

from __future__ import annotations

import atexit
import queue
import threading
import traceback
import weakref
from collections.abc import Callable
from typing import Any, Generic, Optional, TypeVar, Union

import anyio
import anyio.lowlevel
import attrs

from mlxkv.actors.event_log import EventLog

__all__ = ["Job", "MLXThread", "MLXThreadStatistics", "MLXThreadStopped", "evaluate_arrays"]

#: Every MLX thread started and not yet joined, for the exit hook.
_LIVE: weakref.WeakSet[MLXThread] = weakref.WeakSet()
_EXIT_HOOK: list[bool] = []


def _at_exit() -> None:
    """Stop and join MLX threads nobody closed, then clear this thread's streams.

    Runs from ``atexit`` (on the main thread, before the interpreter tears
    down MLX's state). Waiting is bounded by the job each thread is running.
    """
    for thread in list(_LIVE):
        thread.close()
    import mlx.core as mx

    mx.clear_streams()


def _register_exit_hook() -> None:
    if not _EXIT_HOOK:
        _EXIT_HOOK.append(True)
        atexit.register(_at_exit)

T = TypeVar("T")


class MLXThreadStopped(RuntimeError):
    """The MLX thread cannot run the job: it was closed, or it crashed.

    Not a domain error: code that needs MLX cannot go on without the thread.

    Attributes:
        cause: what killed the thread, or ``None`` if it was closed.
    """

    def __init__(self, cause: Optional[BaseException] = None) -> None:
        self.cause = cause
        detail = "closed" if cause is None else f"crashed: {type(cause).__name__}: {cause}"
        super().__init__(f"the MLX thread is not running ({detail})")


@attrs.frozen(kw_only=True)
class MLXThreadStatistics:
    """What the thread has done.

    Attributes:
        num_submitted: jobs accepted by :meth:`MLXThread.submit`.
        num_completed: jobs that ran and returned a result (delivered or orphaned).
        num_failed: jobs that raised (their caller got the exception).
        num_orphaned: results handed to the orphan callback (or dropped, if
            the job had none) because the caller had stopped waiting.
        num_orphan_errors: orphan callbacks that raised (logged).
        running: whether the thread is alive.
    """

    num_submitted: int
    num_completed: int
    num_failed: int
    num_orphaned: int
    num_orphan_errors: int
    running: bool


@attrs.frozen
class _Value(Generic[T]):
    value: T


@attrs.frozen
class _Error:
    error: BaseException


_Outcome = Union[_Value[Any], _Error]


class _Job:
    """A submitted function and how its caller is told.

    ``outcome`` is written by the MLX thread before it wakes the loop;
    ``abandoned`` only on the event-loop thread.
    """

    __slots__ = ("fn", "token", "done", "on_orphan", "outcome", "abandoned")

    def __init__(
        self,
        fn: Callable[[], Any],
        token: anyio.lowlevel.EventLoopToken,
        on_orphan: Optional[Callable[[Any], None]],
    ) -> None:
        self.fn = fn
        self.token = token
        self.done = anyio.Event()
        self.on_orphan = on_orphan
        self.outcome: Optional[_Outcome] = None
        self.abandoned = False


class Job(Generic[T]):
    """A job :meth:`MLXThread.queue` queued, to wait for with :meth:`MLXThread.result`."""

    __slots__ = ("_job",)

    def __init__(self, job: _Job) -> None:
        self._job = job


class _Stop:
    """The sentinel that ends the thread.

    ``done`` is set (through ``token``'s loop) once the thread reaches it; a
    stop sent by synchronous code has neither and is joined instead.
    """

    __slots__ = ("token", "done")

    def __init__(self, token: Optional[anyio.lowlevel.EventLoopToken]) -> None:
        self.token = token
        self.done = anyio.Event() if token is not None else None


def evaluate_arrays(tree: Any) -> None:
    """Evaluate every MLX array found in ``tree`` on the calling thread.

    Walks tuples, lists, dicts and ``attrs`` instances (the shapes replies
    take); anything else is left alone.

    Args:
        tree: a job's result.
    """
    import mlx.core as mx

    arrays: list[Any] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, mx.array):
            arrays.append(node)
        elif isinstance(node, (tuple, list)):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif attrs.has(type(node)):
            stack.extend(getattr(node, field.name) for field in attrs.fields(type(node)))
    if arrays:
        mx.eval(arrays)


class MLXThread:
    """A dedicated thread with its own MLX stream, fed by a FIFO queue of jobs.

    Owns: the OS thread, the stream (created on that thread, used only there),
    the job queue and counters. The queue is the only thing both threads
    touch; it is a hand-off, not a lock around state.

    Invariants:
        - every MLX graph a job builds is built and evaluated on this thread,
          under this thread's stream; a result leaves only after every array
          in it has been evaluated (:func:`evaluate_arrays`);
        - jobs run one at a time, in submission order;
        - every submitted job ends in exactly one of: its result or error
          delivered to the waiting caller, its result handed to ``on_orphan``
          (caller gone), or :class:`MLXThreadStopped` (thread dead);
        - after :meth:`aclose` returns, the thread has ended.
    """

    def __init__(
        self,
        *,
        name: str = "mlxkv-mlx",
        device: Any = None,
        log: Any = None,
    ) -> None:
        """Prepare the thread; nothing runs until :meth:`start`.

        Args:
            name: the OS thread's name.
            device: the MLX device for the stream; the default device if
                ``None``.
            log: an :class:`EventLog` for orphan-cleanup failures; one
                bound to ``component="mlx_thread"`` if ``None``.
        """
        self._queue: queue.SimpleQueue[Union[_Job, _Stop]] = queue.SimpleQueue()
        # Daemon: a thread left running by a program that never closed it
        # must not keep the interpreter from exiting.
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._device = device
        self._log = log if log is not None else EventLog(component="mlx_thread")
        # Event-loop side only.
        self._closing = False
        self._stop: Optional[_Stop] = None
        self._num_submitted = 0
        self._num_orphaned = 0
        self._num_orphan_errors = 0
        # MLX-thread side only (read elsewhere for statistics).
        self._crash: Optional[BaseException] = None
        self._num_completed = 0
        self._num_failed = 0

    # -- life cycle --------------------------------------------------------

    def start(self) -> None:
        """Start the thread.

        Raises:
            RuntimeError: it was started (or closed) before.
        """
        if self._closing:
            raise RuntimeError("MLXThread was closed")
        _register_exit_hook()
        _LIVE.add(self)
        self._thread.start()

    async def __aenter__(self) -> MLXThread:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.aclose()

    async def aclose(self) -> None:
        """Stop accepting jobs, let the queued ones finish, end and join the thread.

        Idempotent. Waits (a cancellation point) for the job running now and
        those queued before this call; shield it where the thread must be
        gone afterwards.
        """
        self._closing = True
        if not self._thread.is_alive():
            if self._thread.ident is not None:
                self._thread.join()
            return
        if self._stop is None:
            self._stop = _Stop(anyio.lowlevel.current_token())
            self._queue.put(self._stop)
        if self._stop.done is not None:
            await self._stop.done.wait()
        # The thread's last act was to wake us; it is about to return.
        self._thread.join()

    def close(self) -> None:
        """Stop the thread and wait for it, blocking the calling thread.

        Only for synchronous code with no event loop waiting on a job (say,
        after the loop has ended): the thread wakes callers through their
        event loop, so blocking that loop's thread here while a job is in
        flight would deadlock. Async code uses :meth:`aclose`.
        """
        self._closing = True
        if not self._thread.is_alive():
            return
        if self._stop is None:
            self._stop = _Stop(None)
            self._queue.put(self._stop)
        self._thread.join()

    @property
    def running(self) -> bool:
        """Whether the thread is alive (it may have crashed and only fail jobs)."""
        return self._thread.is_alive()

    def is_current(self) -> bool:
        """Whether the calling thread is this MLX thread."""
        return threading.current_thread() is self._thread

    def statistics(self) -> MLXThreadStatistics:
        """A snapshot of the counters."""
        return MLXThreadStatistics(
            num_submitted=self._num_submitted,
            num_completed=self._num_completed,
            num_failed=self._num_failed,
            num_orphaned=self._num_orphaned,
            num_orphan_errors=self._num_orphan_errors,
            running=self._thread.is_alive(),
        )

    # -- submitting --------------------------------------------------------

    async def submit(
        self, fn: Callable[[], T], *, on_orphan: Optional[Callable[[T], None]] = None
    ) -> T:
        """Run ``fn()`` on the MLX thread and return its (evaluated) result.

        A cancellation point: :meth:`queue`, then :meth:`result`.

        Args:
            fn: the job: synchronous, builds and evaluates MLX graphs freely.
            on_orphan: gives back what an unwanted result holds.

        Returns:
            ``fn()``'s return value, every MLX array in it evaluated.

        Raises:
            MLXThreadStopped: the thread is closed or has crashed, or it
                crashed while running this job.
            Exception: whatever ``fn`` raised.
        """
        return await self.result(self.queue(fn, on_orphan=on_orphan))

    def queue(self, fn: Callable[[], T], *, on_orphan: Optional[Callable[[T], None]] = None) -> Job[T]:
        """Queue ``fn()`` to run on the MLX thread; wait for it with :meth:`result`.

        Not a checkpoint: the caller may do other work (on the event loop)
        while the job runs. Every job started must be waited for: until then
        its result has no owner.

        Raises:
            MLXThreadStopped: the thread is closed or has crashed.
        """
        if self._closing or not self._thread.is_alive():
            raise MLXThreadStopped(self._crash)
        job = _Job(fn, anyio.lowlevel.current_token(), on_orphan)
        self._queue.put(job)
        self._num_submitted += 1
        return Job(job)

    async def result(self, handle: Job[T]) -> T:
        """Wait for a job :meth:`queue` queued; its (evaluated) result.

        A cancellation point. If the caller is cancelled before the result
        arrives, the job still runs to the end and its result is passed to
        ``on_orphan`` instead, on the event-loop thread (a job that raised
        has no result to give back). ``on_orphan`` must be quick, must not
        block and must not build MLX graphs; what it raises is logged.

        Raises:
            MLXThreadStopped: the thread crashed while running this job.
            Exception: whatever the job raised.
        """
        job = handle._job
        try:
            await job.done.wait()
        except BaseException:
            if job.done.is_set():
                # Settled just before the cancellation reached us: the result
                # is ours to give back.
                self._orphan(job)
            else:
                job.abandoned = True
            raise
        outcome = job.outcome
        assert outcome is not None, "a job was settled without an outcome"
        if isinstance(outcome, _Error):
            raise outcome.error
        return outcome.value

    # -- event-loop side of a finished job ---------------------------------

    def _settle(self, job: _Job) -> None:
        """Runs on the event-loop thread: wake the caller, or orphan the result."""
        if job.abandoned:
            self._orphan(job)
        else:
            job.done.set()

    def _orphan(self, job: _Job) -> None:
        outcome = job.outcome
        if not isinstance(outcome, _Value):
            return
        self._num_orphaned += 1
        if job.on_orphan is None:
            return
        try:
            job.on_orphan(outcome.value)
        except Exception as error:
            self._num_orphan_errors += 1
            self._log.error(
                "mlx_thread.orphan_cleanup_failed", error=f"{type(error).__name__}: {error}"
            )

    # -- the thread --------------------------------------------------------

    def _main(self) -> None:
        import mlx.core as mx

        stream = None
        try:
            device = self._device if self._device is not None else mx.default_device()
            stream = mx.new_stream(device)
        except BaseException as error:
            self._crash = error
        try:
            while True:
                item = self._queue.get()
                if isinstance(item, _Stop):
                    stop = item
                    break
                if self._crash is not None:
                    self._deliver(item, _Error(MLXThreadStopped(self._crash)))
                    continue
                self._deliver(item, self._run(item, stream))
        except BaseException as error:  # a wake-up that failed for another reason than the loop's end
            self._crash = error
            self._log.error("mlx_thread.crashed", error=f"{type(error).__name__}: {error}")
            stop = None
        del stream
        # Before waking whoever waits for the stop: the thread must be done
        # with MLX once aclose() returns.
        mx.clear_streams()
        _LIVE.discard(self)
        if stop is not None and stop.done is not None:
            self._wake(stop.done.set, stop.token)

    def _run(self, job: _Job, stream: Any) -> _Outcome:
        import mlx.core as mx

        try:
            with mx.stream(stream):
                value = job.fn()
                evaluate_arrays(value)
        except Exception as error:
            # The frames' locals may hold unevaluated arrays of this stream:
            # free them here rather than wherever the traceback ends up.
            traceback.clear_frames(error.__traceback__)
            self._num_failed += 1
            return _Error(error)
        except BaseException as error:
            traceback.clear_frames(error.__traceback__)
            self._crash = error
            self._num_failed += 1
            return _Error(MLXThreadStopped(error))
        self._num_completed += 1
        return _Value(value)

    def _deliver(self, job: _Job, outcome: _Outcome) -> None:
        job.outcome = outcome
        if not self._wake(self._settle, job.token, job):
            # The event loop is gone, so no one can be waiting: give the
            # result back from here.
            job.abandoned = True
            self._orphan(job)

    @staticmethod
    def _wake(fn: Callable[..., None], token: anyio.lowlevel.EventLoopToken, *args: Any) -> bool:
        """Schedule ``fn(*args)`` on the token's event-loop thread without waiting.

        Returns:
            False if that loop has finished (nobody can be waiting on it).

        Raises:
            Exception: any other failure to reach the loop (a bug).
        """
        try:
            token.backend_class.run_sync_soon(fn, args, token.native_token)
        except anyio.RunFinishedError:
            return False
        return True
