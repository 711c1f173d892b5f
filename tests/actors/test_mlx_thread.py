"""The MLX thread: one OS thread, one stream, jobs in order, results evaluated."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import mlx.core as mx
import numpy as np
import pytest

from mlxkv.actors.mlx_thread import MLXThread, MLXThreadStopped


class Fatal(BaseException):
    """Escapes a job the way only a dying thread's exceptions do."""


class _Opaque:
    """Hides an array from the thread's result walk."""

    def __init__(self, array: Any) -> None:
        self.array = array


async def _job_started(thread: MLXThread, gate: threading.Event) -> tuple[anyio.Event, Any]:
    """A blocking job: signals (through the loop) when it runs, then waits for ``gate``."""
    started = anyio.Event()
    token = anyio.lowlevel.current_token()

    def job() -> Any:
        anyio.from_thread.run_sync(started.set, token=token)
        gate.wait(10)
        return mx.arange(3) * 2

    return started, job


class TestMLXThread:
    async def test_jobs_run_in_order_on_one_dedicated_thread(self):
        """Every job runs on the same non-event-loop thread, in submission order."""
        seen: list[tuple[int, int]] = []
        submitted: list[int] = []
        async with MLXThread() as thread:

            def job(i: int) -> int:
                seen.append((i, threading.get_ident()))
                return i

            async def call(i: int) -> None:
                # No checkpoint between these two lines: this is queue order.
                submitted.append(i)
                assert await thread.submit(lambda: job(i)) == i

            async with anyio.create_task_group() as tg:
                for i in range(20):
                    tg.start_soon(call, i)
        assert [i for i, _ in seen] == submitted
        assert sorted(submitted) == list(range(20))
        idents = {ident for _, ident in seen}
        assert len(idents) == 1
        assert idents != {threading.get_ident()}

    async def test_results_are_evaluated_and_readable_on_the_loop_thread(self):
        """A lazy array returned by a job arrives evaluated: numpy reads it here."""
        async with MLXThread() as thread:
            result = await thread.submit(lambda: {"y": (mx.ones((4, 4)) @ mx.ones((4, 4)),)})
            assert np.array(result["y"][0]).sum() == 64.0
            # The guarantee matters: a lazy array hidden from the walk belongs
            # to the MLX thread's stream and cannot be evaluated here.
            hidden = await thread.submit(lambda: _Opaque(mx.ones((2,)) * 3))
            with pytest.raises(RuntimeError, match="no Stream"):
                np.array(hidden.array)

    async def test_event_loop_runs_while_a_job_computes(self):
        """A job can wait for the event loop to act: the loop is never blocked by it.

        The job holds until a task on the loop opens a gate, so it could
        not finish if submitting or waiting blocked the loop.
        """
        gate = threading.Event()

        def job() -> Any:
            assert gate.wait(10), "the event loop never ran while the job waited"
            return mx.arange(3)

        async def open_gate() -> None:
            await anyio.lowlevel.checkpoint()
            gate.set()

        async with MLXThread() as thread, anyio.create_task_group() as tg:
            tg.start_soon(open_gate)
            result = await thread.submit(job)
        assert np.array(result).tolist() == [0, 1, 2]

    async def test_a_queued_job_runs_while_the_caller_goes_on(self):
        """``queue`` returns at once, without a checkpoint; the job runs while the
        caller does other work, and ``result`` hands its result over."""
        gate = threading.Event()

        def job() -> Any:
            assert gate.wait(10), "the caller never went on while the job waited"
            return mx.arange(2)

        async with MLXThread() as thread:
            handle = thread.queue(job)
            gate.set()  # only reachable because queue did not wait for the job
            result = await thread.result(handle)
        assert np.array(result).tolist() == [0, 1]

    async def test_job_errors_are_raised_in_the_caller(self):
        """An exception in a job reaches its caller; the thread keeps serving."""

        def boom() -> None:
            raise ValueError("bad job")

        async with MLXThread() as thread:
            with pytest.raises(ValueError, match="bad job"):
                await thread.submit(boom)
            assert int(await thread.submit(lambda: mx.array(7))) == 7
            assert thread.statistics().num_failed == 1

    async def test_cancelled_caller_hands_the_result_to_on_orphan(self):
        """A job whose caller was cancelled still finishes; on_orphan gets its result."""
        orphans: list[Any] = []
        gate = threading.Event()
        async with MLXThread() as thread:
            started, job = await _job_started(thread, gate)
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: thread.submit(job, on_orphan=orphans.append))
                    await started.wait()
                    scope.cancel()
            assert scope.cancelled_caught
            assert orphans == []
            gate.set()
            # FIFO: once a later job is answered, the orphan has been settled.
            await thread.submit(lambda: None)
            assert len(orphans) == 1
            assert np.array(orphans[0]).tolist() == [0, 2, 4]
            assert thread.statistics().num_orphaned == 1

    async def test_caller_cancelled_while_queued_still_orphans(self):
        """A job cancelled before it started runs anyway and is orphaned."""
        orphans: list[Any] = []
        gate = threading.Event()
        async with MLXThread() as thread:
            started, job = await _job_started(thread, gate)
            async with anyio.create_task_group() as tg:
                tg.start_soon(thread.submit, job)
                await started.wait()
                with anyio.move_on_after(0.01):
                    await thread.submit(lambda: mx.array([1, 2]), on_orphan=orphans.append)
                gate.set()
            await thread.submit(lambda: None)
        assert [np.array(o).tolist() for o in orphans] == [[1, 2]]

    async def test_orphan_cleanup_errors_are_counted_not_raised(self):
        """A failing on_orphan is logged and counted; the thread carries on."""
        gate = threading.Event()

        def bad_cleanup(_result: Any) -> None:
            raise RuntimeError("cleanup failed")

        async with MLXThread() as thread:
            started, job = await _job_started(thread, gate)
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: thread.submit(job, on_orphan=bad_cleanup))
                    await started.wait()
                    scope.cancel()
            gate.set()
            await thread.submit(lambda: None)
            assert thread.statistics().num_orphan_errors == 1

    async def test_crash_fails_the_running_and_every_later_caller(self):
        """A BaseException escaping a job kills the thread: its caller and all later ones fail."""
        gate = threading.Event()

        def fatal() -> None:
            gate.wait(10)
            raise Fatal()

        errors: list[BaseException] = []

        async def call(fn: Any) -> None:
            try:
                await thread.submit(fn)
            except MLXThreadStopped as error:
                errors.append(error)

        async with MLXThread() as thread:
            async with anyio.create_task_group() as tg:
                tg.start_soon(call, fatal)
                while thread.statistics().num_submitted < 1:
                    await anyio.lowlevel.checkpoint()
                for _ in range(3):
                    tg.start_soon(call, lambda: mx.array(1))
                # All four queued behind the fatal one before it is let go.
                while thread.statistics().num_submitted < 4:
                    await anyio.lowlevel.checkpoint()
                gate.set()
            assert len(errors) == 4
            assert all(isinstance(e.cause, Fatal) for e in errors)
            with pytest.raises(MLXThreadStopped):
                await thread.submit(lambda: None)
        assert not thread.running

    async def test_aclose_drains_queued_jobs_then_joins(self):
        """Closing lets queued jobs finish, ends the thread, and refuses new jobs."""
        thread = MLXThread()
        thread.start()
        results: list[int] = []

        async def call(i: int) -> None:
            results.append(int(await thread.submit(lambda: mx.array(i) + 1)))

        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(call, i)
            while thread.statistics().num_submitted < 5:
                await anyio.lowlevel.checkpoint()
            await thread.aclose()
        assert sorted(results) == [1, 2, 3, 4, 5]
        assert not thread.running
        with pytest.raises(MLXThreadStopped, match="closed"):
            await thread.submit(lambda: None)
        await thread.aclose()  # idempotent

    def test_sync_close_joins_an_idle_thread(self):
        """close() from synchronous code stops and joins a thread nobody waits on."""
        thread = MLXThread()
        thread.start()
        thread.close()
        assert not thread.running



class TestTeardown:
    async def test_the_thread_clears_its_streams_before_it_ends(self, monkeypatch):
        """The thread's last MLX act is mx.clear_streams(), on the thread itself."""
        calls: list[str] = []
        real = mx.clear_streams

        def spy() -> None:
            calls.append(threading.current_thread().name)
            real()

        monkeypatch.setattr(mx, "clear_streams", spy)
        async with MLXThread(name="teardown-probe") as thread:
            await thread.submit(lambda: mx.arange(4) + 1)
            assert calls == []
        assert calls == ["teardown-probe"]

    def test_a_finished_loop_is_not_an_error(self):
        """Waking a loop that has finished reports False: nobody can be waiting there."""

        async def grab() -> Any:
            return anyio.lowlevel.current_token()

        token = anyio.run(grab)
        assert MLXThread._wake(lambda: None, token) is False

    async def test_any_other_failed_wake_up_kills_the_thread_loudly(self, monkeypatch):
        """A wake-up that fails while the loop lives is a bug: logged as a crash, and every
        later job fails instead of hanging."""
        from structlog.testing import capture_logs

        token = anyio.lowlevel.current_token()

        def broken(*args: Any) -> None:
            raise RuntimeError("cannot reach the loop")

        monkeypatch.setattr(token.backend_class, "run_sync_soon", broken)
        thread = MLXThread()
        thread.start()
        with capture_logs() as logs:
            with anyio.move_on_after(30):  # the caller cannot be woken: it is given up
                async with anyio.create_task_group() as tg:
                    tg.start_soon(thread.submit, lambda: mx.array(1))
                    await anyio.to_thread.run_sync(thread._thread.join, 30)
                    tg.cancel_scope.cancel()
        assert not thread.running
        assert [log["event"] for log in logs] == ["mlx_thread.crashed"]
        assert "cannot reach the loop" in logs[0]["error"]
        with pytest.raises(MLXThreadStopped):
            await thread.submit(lambda: None)
