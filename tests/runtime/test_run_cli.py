"""``mlxkv run``: the main job, end to end on the built-in model, and its progress display."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxkv.cli import main
from mlxkv.default_model import DEFAULT_MODEL, ensure_model
from mlxkv.generation import GenerationReport
from mlxkv.workload import Progress, WorkloadReport

SMALL = [
    "--requests", "6", "--system-prompts", "2", "--turns", "2", "--concurrency", "2",
    "--max-tokens", "4", "--prompt-tokens", "80", "--user-tokens", "12",
    "--block-size", "16", "--max-blocks", "64",
]  # fmt: skip


def _report(prompt_tokens: int, cached_tokens: int) -> GenerationReport:
    return GenerationReport(
        request_id="r",
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        generated_tokens=1,
        finish_reason="length",
        tokens=(1,),
        text="x",
        time_to_first_token=0.01,
        decode_tokens_per_second=0.0,
        total_time=0.01,
        stored_blocks=0,
        stored_bytes=0,
    )


class TestRunCommand:
    """``mlxkv run`` in a fresh process, as a user runs it."""

    def test_small_workload_reports_reuse_and_traces(self, tmp_path: Path, model_dir: Path):
        """Exit 0, a JSON report with every key and some reuse, and a JSON-lines trace."""
        ensure_model(DEFAULT_MODEL, model_dir)  # written once per session, found via the env
        report_file, trace_file = tmp_path / "report.json", tmp_path / "trace.jsonl"
        done = subprocess.run(
            [sys.executable, "-m", "mlxkv.cli", "run", *SMALL,
             "--json", str(report_file), "--trace", str(trace_file)],
            env={**os.environ, "MLXKV_CACHE_DIR": str(model_dir)},
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        report = json.loads(report_file.read_text())
        assert set(report) == {f.name for f in WorkloadReport.__attrs_attrs__}
        assert report["requests"] == 6
        assert report["reused_tokens"] > 0 and report["warm_requests"] > 0
        assert report["blocks_stored"] > 0 and report["peak_kv_bytes"] > 0
        assert "tokens reused" in done.stdout and "TTFT warm" in done.stdout
        assert "6/6 requests" in done.stderr  # the progress lines (stderr is not a TTY)
        events = [json.loads(line) for line in trace_file.read_text().splitlines()]
        names = {event["event"] for event in events}
        assert {"message.handled", "generation.finished"} <= names
        actors = {event.get("actor") for event in events if event["event"] == "message.handled"}
        assert {"allocator", "prefix_index", "compute"} <= actors

    def test_bad_settings_exit_2(self, capsys: pytest.CaptureFixture[str]):
        """An out-of-range setting is a usage error, reported on stderr."""
        assert main(["run", "--requests", "0", "--model", "unused"]) == 2
        assert "requests" in capsys.readouterr().err


class TestProgress:
    """The progress display."""

    def test_periodic_lines_without_a_terminal(self):
        """Not a TTY: plain lines, the last one at completion."""
        out = io.StringIO()
        progress = Progress(3, out, every=3600)
        for cached in (0, 50, 100):
            progress.advance(_report(100, cached))
        progress.close()
        lines = out.getvalue().splitlines()
        assert lines == [
            lines[0],
            lines[-1],
        ] and lines[-1].startswith("mlxkv run: 3/3 requests, 50% prompt tokens reused")

    def test_redrawn_bar_on_a_terminal(self):
        """A TTY gets one line redrawn with a carriage return and ended at close."""

        class Terminal(io.StringIO):
            def isatty(self) -> bool:
                return True

        out = Terminal()
        progress = Progress(2, out)
        progress.advance(_report(10, 0))
        progress.advance(_report(10, 10))
        progress.close()
        text = out.getvalue()
        assert text.count("\r") == 2 and text.endswith("\n")
        assert "[" + "#" * 30 + "] 2/2 requests" in text
