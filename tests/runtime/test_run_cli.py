"""``mlxkv run``: the main job, end to end on the built-in model, and its progress display."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from mlxkv.cli import main
from mlxkv.default_model import DEFAULT_MODEL, ensure_model
from mlxkv.progress import Progress
from mlxkv.workload import WorkloadReport

SMALL = [
    "--requests", "6", "--system-prompts", "2", "--turns", "2", "--concurrency", "2",
    "--max-tokens", "4", "--prompt-tokens", "80", "--user-tokens", "12",
    "--block-size", "16", "--max-blocks", "64", "--decode-wait", "2",
]  # fmt: skip


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
        # The built-in model's two layers run their decode steps compiled (a check off the CPU may drop them).
        row = r".+, shared-prefix attention \w+; decode compiled in [02] of 2 layers(, .+)?"
        assert re.fullmatch(row, report["compute"]), report["compute"]
        assert "6/6 requests" in done.stderr  # the progress lines (stderr is not a TTY)
        last = done.stderr.strip().splitlines()[-1]
        assert last.endswith(f"{report['wall_seconds']:.1f} s")  # the same clock as the report
        events = [json.loads(line) for line in trace_file.read_text().splitlines()]
        names = {event["event"] for event in events}
        assert {"message.handled", "generation.finished"} <= names
        actors = {event.get("actor") for event in events if event["event"] == "message.handled"}
        assert {"allocator", "prefix_index", "compute"} <= actors

    def test_the_compute_row_says_what_the_runner_chose(self):
        """The device and shared-prefix attention, the layers compiled for
        decode (of all, none included), and the fused and transposed
        layers where there are any."""
        from mlxkv.actors.model_info import ModelInfo

        info = ModelInfo(
            vocab_size=None, eos_token_ids=frozenset(), cache_layers=("KVCache",) * 4, has_recurrent=False,
            prefix_attention="kernel", compiled_layers=4, fused_projections=8, device="gpu (CUDA)",
        )  # fmt: skip
        assert info.summary() == (
            "gpu (CUDA), shared-prefix attention kernel; decode compiled in 4 of 4 layers, 8 projection sets fused"
        )
        plain = attrs.evolve(
            info, prefix_attention=None, compiled_layers=0, fused_projections=0, transposed_layers=3, device="cpu"
        )
        assert plain.summary() == (
            "cpu, shared-prefix attention -; decode compiled in 0 of 4 layers, 3 linear layers transposed"
        )

    @pytest.mark.parametrize(
        ("option", "value", "blamed"),
        [("--requests", "0", "requests"), ("--decode-wait", "0", "decode_wait"), ("--prefill-budget", "0", "prefill_budget")],
    )
    def test_bad_settings_exit_2(self, capsys: pytest.CaptureFixture[str], option: str, value: str, blamed: str):
        """An out-of-range setting is a usage error, reported on stderr."""
        assert main(["run", option, value, "--model", "unused"]) == 2
        assert blamed in capsys.readouterr().err


class TestWorkloadRuntime:
    def test_the_commands_options_reach_its_runtime(self):
        """What ``mlxkv run`` and ``mlxkv serve`` are told about the pool, tiers,
        scheduling and runner is what their runtime is configured with, and an
        option not given leaves the configuration's default."""
        import argparse

        from mlxkv.runtime_config import RuntimeConfig
        from mlxkv.runtime_options import add_runtime_options, runtime_config

        parser = argparse.ArgumentParser()
        add_runtime_options(parser)
        parser.add_argument("--trace")
        args = parser.parse_args(
            ["--block-size", "16", "--max-blocks", "64", "--kv-bits", "8", "--kv-tier", "file:///tmp/x",
             "--kv-tier", "file:///tmp/y", "--prefill-chunk", "32", "--prefill-budget", "1024",
             "--decode-wait", "3", "--transpose-weights", "off", "--max-request-images", "2",
             "--kept-cache-memory", "1GiB", "--prefill-streams", "3", "--trace", "events.jsonl"]
        )  # fmt: skip
        config = runtime_config(args, model="unused")
        assert config == RuntimeConfig(
            model="unused", block_size=16, max_blocks=64, kv_bits=8, kv_tiers=("file:///tmp/x", "file:///tmp/y"),
            prefill_chunk=32, prefill_budget=1024, decode_wait=3, transpose_weights=False,
            max_request_images=2, kept_cache_memory=1 << 30, prefill_streams=3, trace=True,
        )  # fmt: skip
        assert runtime_config(parser.parse_args([]), model="unused") == RuntimeConfig(model="unused")

    def test_the_workload_holds_its_runtime(self):
        """A workload is refused without a model to run on, or with anything
        but a runtime configuration."""
        from mlxkv.cache.errors import InvalidInput
        from mlxkv.runtime_config import RuntimeConfig
        from mlxkv.workload import WorkloadConfig

        with pytest.raises(InvalidInput, match="must name a model"):
            WorkloadConfig(runtime=RuntimeConfig())
        with pytest.raises(InvalidInput, match="must be a RuntimeConfig"):
            WorkloadConfig(runtime={"model": "unused"})  # type: ignore[arg-type]


class TestWorkloadFits:
    """A workload whose longest request outgrows the model's context is refused
    once the model is loaded, before any request, blaming the setting to lower."""

    @pytest.mark.parametrize(
        ("settings", "blamed", "says"),
        [
            ({"prompt_tokens": 40_000}, "prompt_tokens", "a request holds 40000 system prompt tokens"),
            ({"user_tokens": 33_000}, "user_tokens", "a request holds 512 system prompt tokens + 2 x (33000 user"),
            ({"max_tokens": 32_300}, "max_tokens", "beyond the model's context of 32768 tokens"),
            ({"turns": 800}, "turns", "the last turn holds 512 system prompt tokens + 800 x (48 user + 32 answer"),
        ],
    )
    async def test_refused_naming_the_setting(self, model_dir: Path, settings, blamed, says):
        """The first turn alone too long: its largest part is blamed; else the turns."""
        from mlxkv.cache.errors import InvalidInput
        from mlxkv.workload import WorkloadConfig, run_workload

        from mlxkv.runtime_config import RuntimeConfig

        config = WorkloadConfig(runtime=RuntimeConfig(model=str(ensure_model(DEFAULT_MODEL, model_dir))), **settings)
        with pytest.raises(InvalidInput, match=re.escape(says)) as info:
            await run_workload(config)
        assert info.value.argument == blamed


class TestPrintTable:
    """The report's two columns."""

    @pytest.mark.parametrize("terminal", [False, True])
    def test_aligned_and_never_padded_at_the_end(self, terminal: bool):
        """Names are aligned, values follow two spaces later, a long value is not
        wrapped, and no line ends in a space, on a terminal or not."""
        from mlxkv.progress import print_table

        class Stream(io.StringIO):
            def isatty(self) -> bool:
                return terminal

        out = Stream()
        long = "x" * 200
        print_table([("model", long), ("requests", "3 (1 cold, 2 warm)"), ("a", "b")], out)
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in out.getvalue().splitlines()]
        assert lines == [f"model     {long}", "requests  3 (1 cold, 2 warm)", "a         b"]
        assert ("\x1b[1m" in out.getvalue()) is terminal  # bold names on a terminal only


class TestProgress:
    """The progress display."""

    def test_periodic_lines_without_a_terminal(self):
        """Not a TTY: plain lines at most every few seconds, the last one at completion."""
        out = io.StringIO()
        progress = Progress(3, out, every=3600)
        for done, elapsed in ((1, 0.5), (2, 1.0), (3, 1.2)):
            progress.update(done, f"{done} ok", elapsed)
        progress.finish(3, "done", 1.25)
        progress.update(3, "after close", 2.0)
        assert out.getvalue().splitlines() == [
            "mlxkv run: 1/3 1 ok, 0.5 s",
            "mlxkv run: 3/3 done, 1.2 s",
        ]

    def test_a_rich_bar_on_a_terminal(self):
        """A terminal gets rich's bar, with the count and the status."""

        class Terminal(io.StringIO):
            def isatty(self) -> bool:
                return True

        out = Terminal()
        progress = Progress(2, out)
        progress.update(1, "half", 0.1)
        progress.finish(2, "all", 0.2)
        text = out.getvalue()
        assert "2/2" in text and "all, 0.2 s" in text and "━" in text


class TestVersion:
    def test_version_matches_the_package(self, capsys: pytest.CaptureFixture[str]):
        """``mlxkv --version`` prints the version pyproject.toml declares."""
        import mlxkv

        tomllib = pytest.importorskip("tomllib")  # Python 3.11+

        declared = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
        assert mlxkv.__version__ == declared["project"]["version"]
        with pytest.raises(SystemExit) as done:
            main(["--version"])
        assert done.value.code == 0
        assert capsys.readouterr().out.strip() == f"mlxkv {mlxkv.__version__}"

    def test_backend_has_help(self, capsys: pytest.CaptureFixture[str]):
        """Every subcommand's --backend option says what it does."""
        for command in ("run", "stress"):
            with pytest.raises(SystemExit):
                main([command, "--help"])
            assert "event loop" in capsys.readouterr().out
