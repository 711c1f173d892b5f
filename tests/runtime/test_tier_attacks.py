"""The tiers under the runtime against a hostile writer and an unlucky operator:
files planted under a block's name, a forged value, a directory that is not
the tier's, a password in a tier URL.

Every test runs real runtimes on the tiny Llama, a real directory and, for
Redis, a real ``redis-server``. "A run without tiers" is the same prompt in a
runtime that has none: what the tiers serve must never change a token.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import anyio
import pytest

from mlxkv import CacheRuntime
from mlxkv.default_model import TINY_LLAMA, ensure_model

from parity import BS, assert_clean, run

pytestmark = pytest.mark.anyio

#: Six full blocks and a partial one.
PROMPT_TOKENS = 6 * BS + 5


@pytest.fixture
def llama(model_dir: Any) -> str:
    """The directory of the tiny full-attention Llama."""
    return str(ensure_model(TINY_LLAMA, model_dir))


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(PROMPT_TOKENS)]


def _runtime(model: str, *tiers: str) -> CacheRuntime:
    return CacheRuntime(model=model, block_size=BS, kv_tiers=list(tiers))


async def _tokens_without_tiers(model: str, prompt: list[int]) -> list[int]:
    async with _runtime(model) as rt:
        tokens, _ = await run(rt, prompt)
    return tokens


async def _store(model: str, prompt: list[int], directory: Path) -> None:
    """Run ``prompt`` once over a disk tier in ``directory`` and write its blocks there."""
    async with _runtime(model, f"file://{directory}") as rt:
        await run(rt, prompt)
        await rt.flush_tiers()


def _header(value: bytes) -> tuple[dict[str, Any], int]:
    """A stored value's header (see ``block_format``) and its length."""
    (size,) = struct.unpack_from("<I", value, 8)
    return json.loads(value[12 : 12 + size]), size


def _block_file(directory: Path, start: int) -> Path:
    """The file holding the block that starts at token ``start``."""
    for path in directory.iterdir():
        if len(path.name) == 64 and _header(path.read_bytes())[0]["start"] == start:
            return path
    raise AssertionError(f"no block at {start} in {directory}")


def _hold(fifo: Path) -> int:
    """A descriptor of ``fifo`` itself that neither reads nor writes it (Linux:
    ``O_PATH``), so it can be released after its name was written over."""
    return os.open(fifo, getattr(os, "O_PATH", os.O_RDONLY | os.O_NONBLOCK))


def _release_readers(held: int) -> None:
    """Open the held FIFO for writing and close it, so that a reader blocked
    opening it (code that does block) goes on and a failing test cannot hang
    at exit."""
    where = f"/proc/self/fd/{held}"
    try:
        if os.path.exists(where):
            os.close(os.open(where, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader waiting
        pass
    finally:
        os.close(held)


class TestPlantedFiles:
    """What is planted under a block's name costs a counted miss, never a hang or wrong KV."""

    @pytest.mark.parametrize("plant", ["fifo", "sparse-300-mb"])
    async def test_a_planted_file_costs_a_counted_miss(self, llama, tmp_path, plant):
        """A FIFO or a 300 MB sparse file under block 2's name: generation and the
        runtime's close finish promptly, the hit stops before block 2, the tier
        counts it corrupt (loaded: the two blocks used), and the tokens equal a
        run without tiers."""
        directory, prompt = tmp_path / "kv", _prompt(1)
        await _store(llama, prompt, directory)
        path = _block_file(directory, 2 * BS)
        path.unlink()
        held = None
        if plant == "fifo":
            os.mkfifo(path)
            held = _hold(path)
        else:
            path.touch()
            os.truncate(path, 300 * 2**20)
        try:
            with anyio.fail_after(60):
                async with _runtime(llama, f"file://{directory}") as rt:
                    tokens, report = await run(rt, prompt)
                    stats = (await rt.stats()).tiers
                    await assert_clean(rt)
        finally:
            if held is not None:
                _release_readers(held)
        assert report.cached_tokens == 2 * BS
        (disk,) = stats.tiers
        assert (disk.num_loaded, disk.num_corrupt, stats.num_timeouts) == (2, 1, 0)
        assert stats.num_blocks_found == 2
        assert tokens == await _tokens_without_tiers(llama, prompt)


class TestForgedValues:
    """A value that verifies but names another position is corrupt, and the
    counters say what was reused."""

    async def test_a_forged_start_counts_what_was_reused(self, llama, tmp_path):
        """Block 1's value with its ``start`` changed to another block's and its
        checksum recomputed: block 0 alone is reused, ``loaded`` says 1 and
        ``corrupt`` 1, and the tokens equal a run without tiers."""
        directory, prompt = tmp_path / "kv", _prompt(2)
        await _store(llama, prompt, directory)
        path = _block_file(directory, BS)
        value = path.read_bytes()
        header, size = _header(value)
        header["start"] = 3 * BS
        encoded = json.dumps(header, separators=(",", ":")).encode()
        body = value[:8] + struct.pack("<I", len(encoded)) + encoded + value[12 + size : -4]
        path.write_bytes(body + struct.pack("<I", zlib.crc32(body)))
        async with _runtime(llama, f"file://{directory}") as rt:
            tokens, report = await run(rt, prompt)
            stats = (await rt.stats()).tiers
            await assert_clean(rt)
        assert report.cached_tokens == BS
        (disk,) = stats.tiers
        assert (disk.num_loaded, disk.num_corrupt, stats.num_blocks_found) == (1, 1, 1)
        assert tokens == await _tokens_without_tiers(llama, prompt)


class TestOperator:
    """What an operator points ``mlxkv run`` at, and what it prints back."""

    def test_a_directory_of_other_files_is_refused_untouched(self, llama, tmp_path):
        """``mlxkv run --kv-tier file://DIR`` over a directory of someone else's
        files exits 2 with one line naming the directory, and deletes nothing."""
        directory = tmp_path / "reports"
        directory.mkdir()
        (directory / "report.tmp").write_text("quarterly figures")
        (directory / ("ab" * 32)).write_text("not a block")
        two_hours_ago = os.path.getmtime(directory) - 2 * 3600
        for path in directory.iterdir():
            os.utime(path, (two_hours_ago, two_hours_ago))
        done = subprocess.run(
            [
                sys.executable, "-m", "mlxkv.cli", "run", "--model", llama, "--requests", "2",
                "--max-tokens", "2", "--prompt-tokens", "64", "--block-size", str(BS),
                "--kv-tier", f"file://{directory}", "--quiet",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert str(directory) in line and "empty or new directory" in line
        assert sorted(p.name for p in directory.iterdir()) == sorted(["report.tmp", "ab" * 32])

    def test_mlxkv_run_never_prints_a_tier_password(self, llama, redis_server):
        """``mlxkv run --json -`` with a Redis URL that carries a password (of a
        real ACL user the run connects as) writes blocks through it, and neither
        the JSON report nor anything else printed holds the password."""
        secret = "s3cret-pw"
        assert redis_server.command("ACL", "SETUSER", "alice", "on", f">{secret}", "allkeys", "allcommands") == "+OK"
        port = redis_server.port
        url = f"redis://alice:{secret}@127.0.0.1:{port}/0?timeout=5"
        done = subprocess.run(
            [
                sys.executable, "-m", "mlxkv.cli", "run", "--model", llama, "--requests", "4",
                "--max-tokens", "2", "--prompt-tokens", "64", "--block-size", str(BS),
                "--kv-tier", url, "--json", "-",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert secret not in done.stdout and secret not in done.stderr
        report = json.loads(done.stdout)
        assert report["kv_tiers"] == [f"redis://alice:***@127.0.0.1:{port}/0?timeout=5"]
        (tier,) = report["tiers"]
        assert tier["name"] == f"redis://127.0.0.1:{port}/0"
        assert tier["num_written"] > 0 and report["tier_blocks_written"] > 0

    def test_a_bad_tier_url_is_refused_without_its_password(self, llama):
        """A malformed Redis URL is refused in one line that shows it with its
        password redacted."""
        done = subprocess.run(
            [
                sys.executable, "-m", "mlxkv.cli", "run", "--model", llama, "--quiet",
                "--kv-tier", "redis://alice:s3cret-pw@cache/db1",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
        assert done.returncode == 2
        (line,) = done.stderr.strip().splitlines()
        assert "s3cret-pw" not in line and "redis://alice:***@cache/db1" in line

    def test_a_runtime_config_never_shows_a_tier_password(self):
        """``RuntimeConfig``'s repr, and its error for tiers without a model, show
        a Redis URL with its password redacted (the URL itself keeps it)."""
        from mlxkv import InvalidInput, RuntimeConfig

        url = "redis://alice:s3cret-pw@cache:6379/0"
        config = RuntimeConfig(model="some/model", kv_tiers=[url])
        assert config.kv_tiers == (url,)
        assert "s3cret-pw" not in repr(config) and "redis://alice:***@cache:6379/0" in repr(config)
        with pytest.raises(InvalidInput) as refused:
            RuntimeConfig(kv_tiers=[url])
        assert "s3cret-pw" not in str(refused.value) and "alice:***" in str(refused.value)
