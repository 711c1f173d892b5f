"""``mlxkv serve`` as a user runs it: a fresh process, the README's examples, its exit codes.

The README's ``curl`` commands run as written against a server started with
``--port 0``, their port 8000 replaced by the one it picked (its python
example, which starts a server of its own, runs with the README's other
python blocks in ``tests/test_readme.py``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import pytest

from mlxkv.default_model import DEFAULT_MODEL, ensure_model

README = Path(__file__).resolve().parents[2] / "README.md"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.MULTILINE | re.DOTALL)


def serve_section() -> str:
    text = README.read_text()
    return text[text.index("## `mlxkv serve`") : text.index("## Troubleshooting")]


def env(model_dir: Path) -> dict[str, str]:
    return {**os.environ, "MLXKV_CACHE_DIR": str(model_dir), "HF_HUB_OFFLINE": "1"}


def start(model_dir: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    """``mlxkv serve --port 0 ARGS`` in a fresh process; it and its URL (from its one line)."""
    ensure_model(DEFAULT_MODEL, model_dir)
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxkv.cli", "serve", "--port", "0", *args],
        env=env(model_dir), stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stderr is not None
    line = process.stderr.readline()
    match = re.fullmatch(
        r"mlxkv serve: (http://127\.0\.0\.1:\d+)/v1 serves [\w.-]+ \(Ctrl-C stops it\)\n",
        line,
    )
    if match is None:
        process.kill()
        pytest.fail(f"not the ready line: {line!r}{process.stderr.read()}")
    return process, match.group(1)


def stop(process: subprocess.Popen[str], signum: int = signal.SIGINT) -> tuple[int, list[str]]:
    """Signal it; its exit status and the rest of its standard error, by line."""
    process.send_signal(signum)
    _, err = process.communicate(timeout=30)
    return process.returncode, err.splitlines()


needs_server = pytest.mark.skipif(
    any(find_spec(module) is None for module in ("starlette", "hypercorn", "prometheus_client")),
    reason="needs the server extra",
)


@needs_server
class TestServeCommand:
    """The command, its README examples and its shutdown."""

    @pytest.mark.parametrize("backend", ["asyncio", "trio"])
    def test_readme_curl_examples_then_ctrl_c(self, model_dir: Path, backend: str):
        """Each README curl command gets its answer; Ctrl-C then stops the server with
        one line, "interrupted", and exit status 130."""
        blocks = [body for language, body in _FENCE.findall(serve_section()) if language == "bash"]
        commands = [c for c in blocks[1].replace("\\\n", "").splitlines() if c.strip()]
        assert len(commands) == 3
        process, url = start(model_dir, "--backend", backend)
        try:
            outputs = []
            for command in commands:
                done = subprocess.run(
                    ["bash", "-c", command.replace("http://127.0.0.1:8000", url)],
                    capture_output=True, text=True, timeout=60,
                )  # fmt: skip
                assert done.returncode == 0, (command, done.stderr)
                outputs.append(done.stdout)
        finally:
            status, err = stop(process)
        reply = json.loads(outputs[0])
        assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] >= 1
        events = [
            line[len("data: ") :] for line in outputs[1].splitlines() if line.startswith("data: ")
        ]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["prompt_tokens"] == 5
        assert "mlxkv_prefix_cache_queries_total 2.0" in outputs[2]
        assert (status, err) == (130, ["mlxkv serve: interrupted"])

    def test_a_local_model_is_named_by_its_directory_and_keys_guard_details(self, model_dir: Path):
        """``--model DIR``: the API's id is the directory's name (its path is in no
        answer), a request may still name the path; with ``--api-key``, /health
        without the key is its state only, and ``--public-metrics`` opens /metrics;
        ``--max-choices`` bounds ``n``."""
        import httpx

        path = str(ensure_model(DEFAULT_MODEL, model_dir))
        process, url = start(model_dir, "--model", path, "--api-key", "k", "--public-metrics", "--max-choices", "2")
        try:
            keyed = {"Authorization": "Bearer k"}
            models = httpx.get(url + "/v1/models", headers=keyed, timeout=30).json()
            health = httpx.get(url + "/health", timeout=30)
            keyed_health = httpx.get(url + "/health", headers=keyed, timeout=30)
            reply = httpx.post(
                url + "/v1/completions", headers=keyed, timeout=60,
                json={"model": path, "prompt": "hi", "max_tokens": 1},
            )  # fmt: skip
            metrics = httpx.get(url + "/metrics", timeout=30)
            choices = [
                httpx.post(
                    url + "/v1/completions", headers=keyed, timeout=60, json={"prompt": "hi", "max_tokens": 1, "n": n}
                )
                for n in (2, 3)
            ]
        finally:
            status, _ = stop(process)
        assert models["data"][0]["id"] == os.path.basename(path)
        assert health.json() == {"status": "ok"}
        assert keyed_health.json()["model"] == os.path.basename(path)
        assert reply.status_code == 200 and metrics.status_code == 200
        assert [c.status_code for c in choices] == [200, 400] and len(choices[0].json()["choices"]) == 2
        assert choices[1].json()["error"]["param"] == "n" and "--max-choices" in choices[1].json()["error"]["message"]
        for text in (json.dumps(models), health.text, keyed_health.text, reply.text, metrics.text):
            assert path not in text
        assert status == 130

    def test_sigterm_drains_a_running_stream(self, model_dir: Path):
        """SIGTERM while a stream runs: the stream gets the grace period, then a last
        "shutting down" error event; the server ends with "terminated", status 143."""
        import httpx

        process, url = start(model_dir, "--graceful-timeout", "0.5")
        signalled = False
        try:
            # Greedy, this prompt runs past 1,500 tokens on the built-in model.
            body = {
                "prompt": "Count to a million:",
                "max_tokens": 30000,
                "stream": True,
                "temperature": 0,
            }
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
                lines = response.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                started = time.monotonic()
                process.send_signal(signal.SIGTERM)
                signalled = True
                rest = [line for line in lines if line.startswith("data: ")]
            elapsed = time.monotonic() - started
        finally:
            if not signalled:
                process.kill()
            _, err = process.communicate(timeout=30)
        assert json.loads(first[len("data: ") :])["choices"][0]["finish_reason"] is None
        last = json.loads(rest[-1][len("data: ") :])
        assert last["error"]["code"] == "shutting_down"
        assert 0.4 < elapsed < 10
        assert (process.returncode, err.splitlines()) == (143, ["mlxkv serve: terminated"])

def run_cli(
    model_dir: Path, *args: str, code: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``mlxkv serve ARGS`` (or python ``code``) in a fresh process, to its end."""
    ensure_model(DEFAULT_MODEL, model_dir)
    command = (
        [sys.executable, "-c", code]
        if code
        else [sys.executable, "-m", "mlxkv.cli", "serve", *args]
    )
    return subprocess.run(command, env=env(model_dir), capture_output=True, text=True, timeout=60)


class TestWithoutTheExtra:
    """The plain install: ``mlxkv serve`` says what it needs."""

    def test_without_the_server_extra(self, model_dir: Path):
        """Without Starlette/Hypercorn/prometheus-client: one line naming the extra."""
        code = (
            "import sys; sys.modules['hypercorn'] = None\n"
            "from mlxkv.cli import main; sys.exit(main(['serve']))"
        )
        done = run_cli(model_dir, code=code)
        assert done.returncode == 2
        assert done.stderr.splitlines() == [
            "mlxkv serve: needs the server extra: pip install 'mlxkv[server]' (hypercorn is not installed)"
        ]


@needs_server
class TestServeErrors:
    """Bad usage is one line on standard error and exit status 2."""

    @pytest.mark.parametrize(
        ("args", "needle"),
        [
            (("--max-concurrent", "0"), "max_concurrent"),
            (("--max-choices", "0"), "max_choices"),
            (("--port", "70000"), "--port"),
            (("--max-blocks", "0"), "max_blocks"),
            (("--decode-wait", "0"), "decode_wait"),
            (("--prefill-budget", "-1"), "prefill_budget"),
            (("--model", "/nonexistent/model"), "/nonexistent/model"),
            (("--max-body", "0"), "--max-body"),
            (("--max-body", "lots"), "--max-body"),
            (("--body-timeout", "0"), "body_timeout"),
            (("--body-timeout", "inf"), "body_timeout"),
            (("--header-timeout", "0"), "header_timeout"),
            (("--max-request-images", "0"), "max_request_images"),
            (("--max-request-pixels", "0"), "max_request_pixels"),
            (("--kv-events", "http://127.0.0.1:1"), "kv_events"),
            (("--kv-events-replay", "tcp://*:5558"), "needs --kv-events"),
            (("--chat-template-args", "{nope"), "--chat-template-args"),
            (("--chat-template-args", '{"messages": []}'), "--chat-template-args.messages"),
        ],
    )
    def test_bad_options_are_one_line(self, model_dir: Path, args: tuple[str, ...], needle: str):
        """A bad setting, or a model that does not load: one line naming it, exit 2."""
        # On a free port (a later --port wins): a busy 8000 would be the error instead.
        done = run_cli(model_dir, "--port", "0", *args)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("mlxkv serve: ") and needle in lines[0], (
            lines
        )

    def test_a_tier_url_password_is_never_printed(self, model_dir: Path):
        """A malformed Redis URL with a password: one line showing it redacted."""
        done = run_cli(model_dir, "--kv-tier", "redis://alice:s3cret-pw@cache/db1")
        assert done.returncode == 2
        (line,) = done.stderr.splitlines()
        assert "s3cret-pw" not in done.stderr + done.stdout and "redis://alice:***@cache/db1" in line

    def test_a_directory_of_other_files_is_refused_untouched(self, model_dir: Path, tmp_path: Path):
        """``--kv-tier file://DIR`` over someone else's files: one line naming the
        directory, exit 2, and the files are all still there."""
        (tmp_path / "report.tmp").write_text("quarterly figures")
        (tmp_path / ("ab" * 32)).write_text("not a block")
        done = run_cli(model_dir, "--kv-tier", f"file://{tmp_path}")
        assert done.returncode == 2
        (line,) = done.stderr.splitlines()
        assert str(tmp_path) in line and "empty or new directory" in line
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["report.tmp", "ab" * 32])

    def test_address_in_use(self, model_dir: Path):
        """A port another socket holds: one line saying so, exit 2."""
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            done = run_cli(model_dir, "--port", str(port))
        assert done.returncode == 2
        assert done.stderr.splitlines() == [
            f"mlxkv serve: cannot listen on 127.0.0.1:{port}: Address already in use"
        ]

    def test_a_kv_events_address_in_use(self, model_dir: Path):
        """A KV events port another socket holds: one line naming the option, exit 2."""
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            done = run_cli(model_dir, "--port", "0", "--kv-events", f"tcp://127.0.0.1:{port}", "--kv-events-replay", f"tcp://127.0.0.1:{port}")
        assert done.returncode == 2, done.stderr
        (line,) = done.stderr.splitlines()
        assert line.startswith("mlxkv serve: invalid kv_events=") and "cannot open its sockets" in line, line
