"""The ``mlxkv`` command line as a user meets it, in fresh processes: bad input is
one line and exit 2, warnings are summarized, Ctrl-C is a clean stop, and
``mlxkv bench`` says what it takes and what it skipped."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mlxkv.cli import main

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import ExceptionGroup
from mlxkv.default_model import DEFAULT_MODEL, ensure_model

SMALL = [
    "--requests", "6", "--system-prompts", "2", "--turns", "2", "--concurrency", "2",
    "--max-tokens", "4", "--prompt-tokens", "80", "--user-tokens", "12",
    "--block-size", "16",
]  # fmt: skip


@pytest.fixture
def env(model_dir: Path, tmp_path: Path) -> dict[str, str]:
    """The environment of a user's shell: the built-in model written, the hub closed
    (and no hub cache to fall back on)."""
    ensure_model(DEFAULT_MODEL, model_dir)
    return {
        **os.environ,
        "MLXKV_CACHE_DIR": str(model_dir),
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
    }


def mlxkv(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``mlxkv ARGS`` in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "mlxkv.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class TestBadInput:
    """Any bad option or input: one line on stderr, nothing on stdout, exit 2."""

    @pytest.mark.parametrize(
        ("args", "says"),
        [
            ((), "the following arguments are required: command"),
            (("run", "--requests", "abc"), "argument --requests: invalid int value: 'abc'"),
            (("run", "--bogus"), "unrecognized arguments: --bogus"),
            (("serve", "--transpose-weights", "yes"), "argument --transpose-weights: 'yes': choose from auto, on, off"),
            (("run", "--requests", "0"), "invalid requests=0: must be an int >= 1"),
            (("run", "--logprobs", "21"), "invalid logprobs=21: must be None or an int in [0, 20]"),
            (("run", "--kv-memory", "lots"), "invalid kv_memory='lots'"),
            (("run", "--model", "/no/such/dir"), "no such directory"),
            (("run", "--trace", "/no/such/dir/trace.jsonl"), "cannot write /no/such/dir/trace.jsonl"),
            (("run", "--json", "/no/such/dir/r.json"), "cannot write /no/such/dir/r.json"),
            (("run", "--prompt-tokens", "40000"), "invalid prompt_tokens=40000: a request holds 40000"),
            (("run", "--prompt-tokens", "32700"), "invalid prompt_tokens=32700"),
            (("stress", "--clients", "0"), "invalid clients=0"),
            (("stress", "--cancel-rate", "2"), "invalid cancel_rate=2.0"),
            (("bench", "--cached", "10"), "argument --cached: must be a positive multiple of 64"),
            (("bench", "--bogus"), "unrecognized arguments: --bogus"),
            (("bench", "--model", "/no/such/dir"), "no such directory"),
            (("stress", "--generate", "--model", "/no/such/dir"), "no such directory"),
        ],
        ids=lambda value: " ".join(value) if isinstance(value, tuple) else None,
    )
    def test_one_line_and_exit_2(self, args: tuple[str, ...], says: str, env: dict[str, str]):
        """The line names the option and what is wrong with it; no traceback, no
        library warning (a 40000-token prompt leaks no tokenizer warning)."""
        done = mlxkv(*args, env=env)
        assert done.returncode == 2, done.stderr
        assert done.stdout == ""
        assert len(done.stderr.splitlines()) == 1, done.stderr
        assert says in done.stderr
        assert done.stderr.startswith("mlxkv")

    @pytest.mark.parametrize("command", ["run", "bench"])
    def test_an_unreachable_hub_id_is_one_line(self, command: str, env: dict[str, str]):
        """A Hugging Face id that cannot be fetched (the hub closed) names the id
        in one line, not the hub's paragraph of advice."""
        done = mlxkv(command, "--model", "someone/nonexistent", env=env)
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.splitlines()) == 1, done.stderr
        assert done.stderr.startswith(f"mlxkv {command}: cannot load the model 'someone/nonexistent': ")


class TestWarnings:
    """Per-request warnings are counted and summarized, their details traced."""

    def test_a_pool_too_small_is_one_summary_line(self, env: dict[str, str], tmp_path: Path):
        """A pool of 2 blocks: one summary warning (how many requests, how many blocks,
        why, what to do), none per request; the JSON report counts the same."""
        report = tmp_path / "report.json"
        done = mlxkv("run", *SMALL, "--max-blocks", "2", "--quiet", "--json", str(report), env=env)
        assert done.returncode == 0, done.stderr
        figures = json.loads(report.read_text())
        assert figures["requests_not_stored"] > 1
        lines = done.stderr.splitlines()
        assert lines == [
            f"mlxkv run: warning: {figures['requests_not_stored']} of 6 requests could not cache"
            f" {figures['blocks_not_stored']} computed blocks: the KV pool (2 blocks) had too few"
            " free blocks, the rest held by requests in flight; raise --kv-memory or --max-blocks"
            " (details per request: --trace FILE)",
            f"mlxkv run: warning: {figures['prompts_over_pool']} prompts had more full blocks than"
            " the KV pool holds (2): none can be cached whole; raise --kv-memory or --max-blocks"
            " (details per request: --trace FILE)",
        ]

    def test_the_trace_has_each_request_and_stderr_the_summary(self, env: dict[str, str], tmp_path: Path):
        """With --trace the library's per-request events are in the file (one per
        request that could not store), and stderr still has only the summary."""
        trace = tmp_path / "trace.jsonl"
        done = mlxkv("run", *SMALL, "--max-blocks", "2", "--quiet", "--trace", str(trace), env=env)
        assert done.returncode == 0, done.stderr
        events = [json.loads(line) for line in trace.read_text().splitlines()]
        not_stored = [e for e in events if e["event"] == "generation.not_stored"]
        assert len(not_stored) > 1 and all(e["level"] == "warning" for e in not_stored)
        assert "asked for" in not_stored[0]["error"]
        summary = done.stderr.splitlines()
        assert len(summary) == 2 and all(line.startswith("mlxkv run: warning: ") for line in summary)
        assert summary[0].startswith(f"mlxkv run: warning: {len(not_stored)} of 6 requests")
        assert "in the trace file" in summary[0]

    def test_a_run_that_fits_warns_of_nothing(self, env: dict[str, str]):
        """Enough room: stderr holds only the progress lines."""
        done = mlxkv("run", *SMALL, env=env)
        assert done.returncode == 0, done.stderr
        assert all(line.startswith("mlxkv run: ") and "/6 requests" in line for line in done.stderr.splitlines())


def _granted_and_released(trace: Path) -> tuple[set[str], set[str], int, int]:
    """From a trace: requests begun, requests ended (closed, or their start undone),
    block references granted and released."""
    handled = [e for e in map(json.loads, trace.read_text().splitlines()) if e["event"] == "message.handled"]
    begun = {e["request_id"] for e in handled if e["message"] == "Begin" and not e["error"]}
    ended = {e["request_id"] for e in handled if e["message"] in ("Close", "Discard")}
    allocator = [e for e in handled if e["actor"] == "allocator" and not e["error"]]
    granted = sum(e["granted"] for e in allocator if e["message"] in ("Acquire", "StoreBlocks"))
    released = sum(e["released"] for e in allocator if e["message"] == "Release")
    return begun, ended, granted, released


class TestInterrupt:
    """Ctrl-C on ``mlxkv run``: the requests in flight stop and release, one line, exit 130."""

    @pytest.mark.parametrize("backend", ["asyncio", "trio"])
    def test_sigint_stops_cleanly(self, backend: str, env: dict[str, str], tmp_path: Path):
        """SIGINT once requests are running: exit 130, stdout empty, stderr the progress
        line and "interrupted", no traceback and no ResourceWarning (unclosed
        streams), and the trace shows every request ended and every block
        reference it was granted released."""
        trace = tmp_path / "trace.jsonl"
        process = subprocess.Popen(
            [sys.executable, "-W", "always::ResourceWarning", "-m", "mlxkv.cli", "run",
             "--requests", "400", "--backend", backend, "--trace", str(trace)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert process.stderr is not None
        first = process.stderr.readline()  # the first request finished: more are in flight
        process.send_signal(signal.SIGINT)
        out, rest = process.communicate(timeout=60)
        assert process.returncode == 130, first + rest
        assert out == ""
        assert first.startswith("mlxkv run: 1/400 requests")
        assert re.fullmatch(r"mlxkv run: interrupted \(\d+ of 400 requests done\)\n", rest), rest
        begun, ended, granted, released = _granted_and_released(trace)
        assert begun and begun <= ended
        assert granted == released > 0

    def test_interrupting_before_the_runtime_starts(self, monkeypatch, capsys):
        """Ctrl-C while the model is being prepared: the same one line and 130."""

        def interrupted(*args: object) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr("mlxkv.default_model.ensure_model", interrupted)
        assert main(["run"]) == 130
        assert capsys.readouterr().err == "mlxkv run: interrupted\n"


class TestBench:
    """``mlxkv bench`` lists the options the README names and reports what it skipped."""

    def test_help_lists_the_options(self, capsys: pytest.CaptureFixture[str]):
        """``--cached N --new M``, the repeats, the model, the JSON file and the
        reference environment are all in the help."""
        with pytest.raises(SystemExit):
            main(["bench", "--help"])
        text = capsys.readouterr().out
        for option in ("--cached N", "--new M", "--repeats", "--warmup", "--model", "--json", "--vllm-python"):
            assert option in text

    def test_a_skipped_vllm_mlx_is_said_so(self, env: dict[str, str], tmp_path: Path):
        """Without the reference environment the parity line says vllm-mlx was skipped
        and gives it no figure; the JSON has no vllm-mlx difference either."""
        result = tmp_path / "bench.json"
        done = mlxkv(
            "bench", "--cached", "64", "--new", "8", "--repeats", "1", "--warmup", "0",
            "--vllm-python", str(tmp_path / "missing"), "--json", str(result), env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        parity = [line for line in done.stdout.splitlines() if line.startswith("parity")]
        assert len(parity) == 1 and parity[0].endswith("; vllm-mlx skipped)")
        assert "vllm-mlx 0" not in parity[0] and "'vllm-mlx': 0.0" not in done.stdout
        assert "vllm-mlx" not in json.loads(result.read_text())["max_logit_diff_vs_cold"]


class TestTaskGroupErrors:
    """A bad request inside the workload's task groups is still one typed error."""

    def test_the_cache_error_is_found_in_nested_groups(self):
        """Nested groups of CacheErrors give their first; anything else keeps the group."""
        from mlxkv.cache.errors import InvalidInput
        from mlxkv.cli import _cache_error

        error = InvalidInput("prompt", (1, 2), "is refused")
        assert _cache_error(ExceptionGroup("outer", [ExceptionGroup("inner", [error])])) is error
        assert _cache_error(ExceptionGroup("mixed", [error, RuntimeError("bug")])) is None
        assert _cache_error(ExceptionGroup("bug", [RuntimeError("bug")])) is None
