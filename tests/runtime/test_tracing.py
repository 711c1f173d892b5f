"""Tracing: one structlog event per handled message, configured by applications only."""

from __future__ import annotations

import io
import json

import pytest
import structlog
from structlog.testing import capture_logs

from mlxkv import CacheRuntime, InvalidInput
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

    async def test_domain_errors_are_traced(self):
        """A refused message is traced with its error type."""
        with capture_logs() as logs:
            async with CacheRuntime(block_size=BS, max_blocks=16, trace=True) as rt:
                await rt.fetch("r1", PROMPT)
                with pytest.raises(Exception):
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

    async def test_library_never_configures(self, monkeypatch, capsys):
        """A traced request, a refused message and a crash never configure structlog."""

        def forbidden(*args, **kwargs):
            raise AssertionError("mlxkv called structlog.configure()")

        monkeypatch.setattr(structlog, "configure", forbidden)
        monkeypatch.setattr(structlog, "configure_once", forbidden)

        def crash(actor, message):
            if type(message).__name__ == "Statistics":
                raise RuntimeError("crash")

        with pytest.raises(RuntimeError, match="crash"):
            async with CacheRuntime(block_size=BS, max_blocks=16, trace=True, intercept=crash) as rt:
                async with rt.request("r1", PROMPT):
                    with pytest.raises(InvalidInput):
                        await rt.store("r1", PROMPT, ["too", "many", "payloads"])
                await rt.stats()
        assert "message.handled" in capsys.readouterr().out  # structlog's own defaults
