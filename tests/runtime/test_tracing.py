"""Tracing: one structlog event per handled message, configured by applications only."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import structlog
from structlog.testing import capture_logs

from mlxkv import CacheRuntime, DuplicateRequest, InvalidInput
from mlxkv.tracing import configure

BS = 4
PROMPT = list(range(1, 2 * BS + 2))


@pytest.fixture
def restore_structlog():
    """Put structlog's configuration back after a test that configures it."""
    yield
    structlog.reset_defaults()


def trail(logs: list[dict], request_id: str) -> list[tuple[str, str]]:
    return [
        (log["actor"], log["message"])
        for log in logs
        if log["event"] == "message.handled" and log["request_id"] == request_id
    ]


class TestTrace:
    async def test_events_of_one_request(self):
        """A miss, a store, a hit and two releases trace exactly their messages."""
        with capture_logs() as logs:
            async with CacheRuntime(block_size=BS, max_blocks=16, trace=True) as rt:
                async with rt.request("r1", PROMPT) as req:
                    await req.store(PROMPT, ["kv0", "kv1"])
                    async with rt.request("r2", PROMPT):
                        pass
        assert trail(logs, "r1") == [
            ("prefix_index", "Begin"),
            ("prefix_index", "Extend"),
            ("allocator", "StoreBlocks"),
            ("prefix_index", "Record"),
            ("prefix_index", "Close"),
            ("allocator", "Release"),
        ]
        assert trail(logs, "r2") == [
            ("prefix_index", "Begin"),
            ("allocator", "Acquire"),
            ("prefix_index", "Record"),
            ("prefix_index", "Close"),
            ("allocator", "Release"),
        ]
        handled = [log for log in logs if log["event"] == "message.handled"]
        assert all(log["log_level"] == "info" for log in handled)
        assert all(log["queued_ms"] >= 0 and log["handling_ms"] >= 0 for log in handled)
        assert all(log["error"] is None and log["undone"] is False for log in handled)

    async def test_events_say_what_each_message_did(self):
        """Grants, stores, records and releases carry their counts in the event."""
        with capture_logs() as logs:
            async with CacheRuntime(block_size=BS, max_blocks=16, trace=True) as rt:
                async with rt.request("r1", PROMPT) as req:
                    await req.store(PROMPT, ["kv0", "kv1"])
                async with rt.request("r2", PROMPT):
                    pass
        events = {(log["request_id"], log["message"]): log for log in logs if log["event"] == "message.handled"}
        assert events["r1", "Begin"]["blocks"] == 2 and events["r1", "Begin"]["hinted"] == 0
        assert events["r1", "StoreBlocks"]["granted"] == 2 and events["r1", "StoreBlocks"]["reused"] == 0
        assert events["r1", "Record"]["held"] == 2
        assert events["r1", "Close"]["released"] == 2 and events["r1", "Release"]["released"] == 2
        assert events["r2", "Acquire"]["asked"] == 2 and events["r2", "Acquire"]["granted"] == 2

    async def test_polls_are_left_out_unless_asked(self):
        """Statistics and invariant checks are traced only with trace_polls."""
        for polls in (False, True):
            with capture_logs() as logs:
                async with CacheRuntime(block_size=BS, trace=True, trace_polls=polls) as rt:
                    await rt.stats()
                    await rt.check_invariants()
            traced = {log["message"] for log in logs if log["event"] == "message.handled"}
            assert ({"Statistics", "CheckInvariants"} <= traced) is polls
            assert traced or not polls

    async def test_a_generation_is_traced_under_its_request(self, model_dir):
        """Every message a generation sends carries its request id."""
        from mlxkv.default_model import TINY_LLAMA, ensure_model

        with capture_logs() as logs:
            async with CacheRuntime(model=str(ensure_model(TINY_LLAMA, model_dir)), trace=True) as rt:
                async with rt.generate("hello", max_tokens=2, request_id="g1") as stream:
                    async for _ in stream:
                        pass
        handled = [log for log in logs if log["event"] == "message.handled"]
        mine = {log["message"] for log in handled if log["request_id"] == "g1"}
        assert {"Begin", "Generate", "Close"} <= mine
        assert all(log["request_id"] is not None for log in handled)

    async def test_domain_errors_are_traced(self):
        """A refused message is traced with its error type."""
        with capture_logs() as logs:
            async with CacheRuntime(block_size=BS, max_blocks=16, trace=True) as rt:
                await rt.fetch("r1", PROMPT)
                with pytest.raises(DuplicateRequest):
                    await rt.fetch("r1", PROMPT)
                await rt.release("r1")
        begins = [log for log in logs if log.get("message") == "Begin"]
        assert [log["error"] for log in begins] == [None, "DuplicateRequest"]

    async def test_nothing_below_warnings_by_default(self):
        """Without trace, a whole request logs nothing."""
        with capture_logs() as logs:
            async with CacheRuntime(block_size=BS, max_blocks=16) as rt:
                async with rt.request("r1", PROMPT) as req:
                    await req.store(PROMPT, ["kv0", "kv1"])
        assert logs == []


class TestConfigure:
    async def test_json_lines(self, restore_structlog):
        """configure(json=True) renders every trace event as one JSON object per line."""
        out = io.StringIO()
        configure(json=True, file=out)
        async with CacheRuntime(block_size=BS, max_blocks=16, trace=True) as rt:
            await rt.fetch("r1", PROMPT)
            await rt.release("r1")
        events = [json.loads(line) for line in out.getvalue().splitlines()]
        assert [e["message"] for e in events] == ["Begin", "Close"]
        assert {"timestamp", "level", "actor", "queued_ms", "handling_ms"} <= set(events[0])

    def test_level_filters(self, restore_structlog):
        """Events below the configured level are dropped; console output is plain text."""
        out = io.StringIO()
        configure(level="warning", file=out)
        log = structlog.get_logger("mlxkv")
        log.info("hidden")
        log.warning("shown", key=1)
        text = out.getvalue()
        assert "hidden" not in text and "shown" in text and "key=1" in text

    def test_bad_level(self):
        """An unknown level is InvalidInput and configures nothing."""
        with pytest.raises(InvalidInput, match="level"):
            configure(level="loud")

    async def test_library_never_configures(self, monkeypatch, capsys, caplog, restore_structlog):
        """A traced request, a refused message and a crash never configure structlog,
        and with nothing configured they print nothing: the events reach the
        standard logger ``mlxkv`` instead."""
        structlog.reset_defaults()

        def forbidden(*args, **kwargs):
            raise AssertionError("mlxkv called structlog.configure()")

        monkeypatch.setattr(structlog, "configure", forbidden)
        monkeypatch.setattr(structlog, "configure_once", forbidden)

        def crash(actor, message):
            if type(message).__name__ == "Statistics":
                raise RuntimeError("crash")

        caplog.set_level("INFO", logger="mlxkv")
        with pytest.raises(RuntimeError, match="crash"):
            async with CacheRuntime(block_size=BS, max_blocks=16, trace=True, intercept=crash) as rt:
                async with rt.request("r1", PROMPT):
                    with pytest.raises(InvalidInput):
                        await rt.store("r1", PROMPT, ["too", "many", "payloads"])
                await rt.stats()
        assert capsys.readouterr() == ("", "")
        events = [record.mlxkv["event"] for record in caplog.records if record.name == "mlxkv"]
        assert "message.handled" in events and "actor.crashed" in events
        crashed = next(r for r in caplog.records if r.mlxkv["event"] == "actor.crashed")
        assert crashed.levelname == "ERROR" and crashed.mlxkv["actor"] == "allocator"


class TestQuietByDefault:
    def test_an_unconfigured_process_prints_nothing(self, tmp_path):
        """A program that configures no logging sees a crash only as its exception: nothing on stdout or stderr."""
        script = tmp_path / "app.py"
        script.write_text(
            "import anyio\n"
            "from mlxkv import CacheRuntime\n"
            "def crash(actor, message):\n"
            "    if type(message).__name__ == 'Statistics':\n"
            "        raise RuntimeError('crash')\n"
            "async def main():\n"
            "    try:\n"
            "        async with CacheRuntime(block_size=4, max_blocks=16, trace=True, intercept=crash) as rt:\n"
            "            await rt.fetch('r1', [1, 2, 3, 4, 5])\n"
            "            await rt.stats()\n"
            "    except RuntimeError:\n"
            "        pass\n"
            "anyio.run(main)\n"
        )
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "" and done.stderr == ""
