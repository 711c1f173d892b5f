"""KV tiers under the runtime: what outlives a runtime, what is shared, what
never serves wrong KV.

Every test runs real runtimes on the tiny Llama (its model directory is what
the namespace fingerprints), a real directory and, for Redis, a real
``redis-server`` (the root conftest's ``redis_server``). "Exact" means the
greedy tokens and prompt logits of a cold run of the same prompt
(:func:`parity.assert_matches_cold`: a fresh salt shares no block, in the
pool or in a tier). "Nothing leaked" is :func:`parity.assert_clean`.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from mlxkv import CacheRuntime
from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.tiers import BlockStored
from mlxkv.default_model import TINY_LLAMA, TINY_SLIDING_LLAMA, ensure_model

from parity import BS, assert_clean, assert_matches_cold, run
from test_kv_bits import HEADS_OF_32

from device_arithmetic import needs_quantized_attention

pytestmark = pytest.mark.anyio

#: Six full blocks and a partial one: every full block is stored and offered.
PROMPT_TOKENS = 6 * BS + 5


@pytest.fixture
def llama(model_dir: Any) -> str:
    """The directory of the tiny full-attention Llama."""
    return str(ensure_model(TINY_LLAMA, model_dir))


def _prompt(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(length)]


def _disk(directory: Path, **options: Any) -> str:
    query = "&".join(f"{name}={value}" for name, value in options.items())
    return f"file://{directory}" + (f"?{query}" if query else "")


def _redis(server: Any) -> str:
    """The server's URL with a generous call timeout: on a loaded machine a
    test that expects hits must not see a slow call as the server failing
    (the frozen-server test keeps the default)."""
    return f"{server.url}?timeout=5"


def _runtime(model: str, *tiers: str, **options: Any) -> CacheRuntime:
    options.setdefault("block_size", BS)
    return CacheRuntime(model=model, kv_tiers=list(tiers), **options)


async def _store(model: str, prompt: list[int], *tiers: str, **options: Any) -> list[int]:
    """Run ``prompt`` in a runtime of its own and wait until its blocks are
    written to ``tiers``; its tokens."""
    async with _runtime(model, *tiers, **options) as rt:
        tokens, _ = await run(rt, prompt)
        await rt.flush_tiers()
        await assert_clean(rt)
    return tokens


def _full_blocks(prompt: list[int]) -> int:
    return len(prompt) // BS


class TestRestart:
    """A runtime started over a tier continues prompts an earlier one computed."""

    async def test_a_fresh_runtime_continues_from_disk_exactly(self, llama, tmp_path):
        prompt = _prompt(1)
        first = await _store(llama, prompt, _disk(tmp_path))
        async with _runtime(llama, _disk(tmp_path)) as rt:
            warm = await run(rt, prompt)
            assert warm[0] == first
            assert warm[1].cached_tokens == _full_blocks(prompt) * BS
            tiers = (await rt.stats()).tiers
            assert tiers is not None and tiers.num_blocks_found == _full_blocks(prompt)
            await assert_matches_cold(rt, prompt, warm, salt="cold")
            await assert_clean(rt)

    async def test_a_longer_prompt_continues_from_disk_and_computes_the_rest(self, llama, tmp_path):
        prefix = _prompt(2, 4 * BS)
        await _store(llama, prefix, _disk(tmp_path))
        prompt = prefix + _prompt(3, 3 * BS + 2)
        async with _runtime(llama, _disk(tmp_path)) as rt:
            warm = await run(rt, prompt)
            assert warm[1].cached_tokens == 4 * BS
            await assert_matches_cold(rt, prompt, warm, salt="cold")
            await assert_clean(rt)

    async def test_a_prefix_the_pool_evicted_comes_back_from_disk(self, llama, tmp_path):
        first, second = _prompt(4), _prompt(5)
        # No kept caches: first's own would give its tokens without any block.
        async with _runtime(llama, _disk(tmp_path), max_blocks=8, keep_caches=False) as rt:
            await run(rt, first)
            await run(rt, second)  # evicts first's blocks from the pool
            await rt.flush_tiers()
            found = (await rt.stats()).tiers.num_blocks_found
            warm = await run(rt, first)
            assert warm[1].cached_tokens == _full_blocks(first) * BS
            assert (await rt.stats()).tiers.num_blocks_found > found
            await assert_matches_cold(rt, first, warm, salt="cold")
            await assert_clean(rt)

    async def test_what_does_not_fit_the_pool_is_computed(self, llama, tmp_path):
        prompt = _prompt(6, 12 * BS + 3)
        await _store(llama, prompt, _disk(tmp_path))
        async with _runtime(llama, _disk(tmp_path), max_blocks=5) as rt:
            warm = await run(rt, prompt)
            assert 0 < warm[1].cached_tokens < _full_blocks(prompt) * BS
            await assert_matches_cold(rt, prompt, warm, salt="cold")
            await assert_clean(rt)

    async def test_concurrent_requests_for_one_prefix_load_it_once(self, llama, tmp_path):
        prefix = _prompt(7, 5 * BS)
        await _store(llama, prefix, _disk(tmp_path))
        prompts = [prefix + _prompt(10 + i, BS + i) for i in range(4)]
        results: dict[int, Any] = {}
        async with _runtime(llama, _disk(tmp_path)) as rt:

            async def one(i: int) -> None:
                results[i] = await run(rt, prompts[i])

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            stats = await rt.stats()
            # One request loads the prefix; the others wait for it or hit the pool.
            assert stats.tiers.num_blocks_found == 5
            for i, prompt in enumerate(prompts):
                assert results[i][1].cached_tokens >= 5 * BS
                await assert_matches_cold(rt, prompt, results[i], salt=f"cold{i}")
            await assert_clean(rt)


class TestNamespaces:
    """A block serves only the model, layout, block size and salt it was computed for."""

    async def test_another_model_is_never_a_hit(self, llama, model_dir, tmp_path):
        prompt = _prompt(20)
        await _store(llama, prompt, _disk(tmp_path))
        other = str(ensure_model(TINY_SLIDING_LLAMA, model_dir))
        async with _runtime(other, _disk(tmp_path)) as rt:
            tokens, report = await run(rt, prompt)
            assert report.cached_tokens == 0
            assert (await rt.stats()).tiers.num_blocks_found == 0
            await assert_clean(rt)

    async def test_another_block_size_is_never_a_hit(self, llama, tmp_path):
        prompt = _prompt(21, 8 * BS)
        await _store(llama, prompt, _disk(tmp_path))
        async with _runtime(llama, _disk(tmp_path), block_size=2 * BS) as rt:
            _, report = await run(rt, prompt)
            assert report.cached_tokens == 0
            assert (await rt.stats()).tiers.num_blocks_found == 0

    @needs_quantized_attention
    async def test_quantized_blocks_serve_only_their_quantization(self, model_dir, tmp_path):
        """8-bit blocks round-trip through the disk exactly (a warm request over
        them equals its cold run under the same quantization), and neither
        float nor 4-bit runtimes take them."""
        model = str(ensure_model(HEADS_OF_32, model_dir))
        prompt = _prompt(23)
        await _store(model, prompt, _disk(tmp_path), kv_bits=8)
        for bits in (None, 4):
            async with _runtime(model, _disk(tmp_path), kv_bits=bits) as rt:
                _, report = await run(rt, prompt)
                assert report.cached_tokens == 0
        async with _runtime(model, _disk(tmp_path), kv_bits=8, keep_caches=False) as rt:
            warm = await run(rt, prompt)
            assert warm[1].cached_tokens == _full_blocks(prompt) * BS
            await assert_matches_cold(rt, prompt, warm, salt="cold")
            await assert_clean(rt)

    async def test_a_salted_block_serves_only_its_salt(self, llama, tmp_path):
        prompt = _prompt(22)
        async with _runtime(llama, _disk(tmp_path)) as rt:
            await run(rt, prompt, cache_salt="tenant-a")
            await rt.flush_tiers()
        async with _runtime(llama, _disk(tmp_path)) as rt:
            _, other = await run(rt, prompt, cache_salt="tenant-b")
            _, unsalted = await run(rt, prompt)
            _, same = await run(rt, prompt, cache_salt="tenant-a")
            assert other.cached_tokens == 0 and unsalted.cached_tokens == 0
            assert same.cached_tokens == _full_blocks(prompt) * BS

    async def test_no_prompt_token_is_stored_in_plain_text(self, llama, tmp_path):
        """No run of the prompt's token ids appears in any stored file, in any
        encoding a careless format would use (8-, 16-, 32- or 64-bit integers,
        JSON or text); the check itself finds such a run where there is one."""
        import json

        import numpy as np

        prompt = _prompt(24)
        run_of = prompt[BS : BS + 8]  # inside a stored block, not at its edge
        needles = [np.array(run_of, dtype=dtype).tobytes() for dtype in ("u1", "<u2", "<i4", "<i8")]
        needles += [json.dumps(run_of)[1:-1].encode(), json.dumps(run_of, separators=(",", ":"))[1:-1].encode()]

        def holds_tokens(data: bytes) -> bool:
            return any(needle in data for needle in needles)

        assert all(holds_tokens(b"header" + needle + b"trailer") for needle in needles)
        await _store(llama, prompt, _disk(tmp_path))
        files = [path for path in tmp_path.rglob("*") if path.is_file()]
        assert len(files) >= _full_blocks(prompt)
        for path in files:
            assert not holds_tokens(path.read_bytes()), path.name


class TestCorruption:
    """A value that does not verify is a counted miss, deleted, never wrong KV."""

    async def test_corrupt_files_are_misses_and_deleted(self, llama, tmp_path):
        prompt = _prompt(30)
        await _store(llama, prompt, _disk(tmp_path))
        values = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith(".")]
        values = [p for p in values if p.stat().st_size > 1024]
        assert len(values) == _full_blocks(prompt)
        for path in values:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        async with _runtime(llama, _disk(tmp_path)) as rt:
            warm = await run(rt, prompt)
            assert warm[1].cached_tokens == 0
            (disk,) = (await rt.stats()).tiers.tiers
            assert disk.num_corrupt >= 1
            await assert_matches_cold(rt, prompt, warm, salt="cold")
            await rt.flush_tiers()
            await assert_clean(rt)
        # Recomputed and written again: the next runtime hits.
        async with _runtime(llama, _disk(tmp_path)) as rt:
            _, report = await run(rt, prompt)
            assert report.cached_tokens == _full_blocks(prompt) * BS

    async def test_a_torn_value_ends_the_chain_there(self, llama, tmp_path):
        prompt = _prompt(31)
        await _store(llama, prompt, _disk(tmp_path))
        values = sorted(
            (p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > 1024),
            key=lambda p: p.stat().st_mtime_ns,
        )
        # Truncate one value (a torn write): whichever block it is, the hit stops before it.
        victim = values[len(values) // 2]
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        async with _runtime(llama, _disk(tmp_path)) as rt:
            warm = await run(rt, prompt)
            assert warm[1].cached_tokens < _full_blocks(prompt) * BS
            await assert_matches_cold(rt, prompt, warm, salt="cold")
            await assert_clean(rt)

    async def test_corrupt_redis_values_are_misses_and_deleted(self, llama, redis_server):
        prompt = _prompt(32)
        await _store(llama, prompt, _redis(redis_server))
        keys = redis_server.command("KEYS", "*")
        assert len(keys) == _full_blocks(prompt)
        for key in keys:
            value = bytearray(redis_server.command("GET", key))
            value[-1] ^= 0xFF
            redis_server.command("SET", key, bytes(value))
        async with _runtime(llama, _redis(redis_server)) as rt:
            warm = await run(rt, prompt)
            assert warm[1].cached_tokens == 0
            (tier,) = (await rt.stats()).tiers.tiers
            assert tier.num_corrupt >= 1
            await assert_matches_cold(rt, prompt, warm, salt="cold")
            await assert_clean(rt)


class TestRedis:
    """Runtimes share one Redis; a server that fails costs misses, never a request."""

    async def test_two_runtimes_share_one_server(self, llama, redis_server):
        prompt = _prompt(40)
        async with _runtime(llama, _redis(redis_server)) as first, _runtime(llama, _redis(redis_server)) as second:
            cold = await run(first, prompt)
            await first.flush_tiers()
            warm = await run(second, prompt)
            assert warm[1].cached_tokens == _full_blocks(prompt) * BS
            assert warm[0] == cold[0]
            await assert_matches_cold(second, prompt, warm, salt="cold")
            await assert_clean(first)
            await assert_clean(second)

    async def test_a_killed_server_makes_misses_then_reconnects(self, llama, redis_server):
        first, second = _prompt(41), _prompt(42)
        async with _runtime(llama, _redis(redis_server)) as rt:
            await run(rt, first)
            await rt.flush_tiers()
            redis_server.kill()
            warm = await run(rt, second)  # lookups and writes fail: misses
            await rt.flush_tiers()
            (tier,) = (await rt.stats()).tiers.tiers
            assert not tier.available
            await assert_matches_cold(rt, second, warm, salt="cold")
            redis_server.start()  # empty: no persistence
            # The tier probes the server again after its back-off (0.5 s, doubling).
            with anyio.fail_after(20):
                seed = 100
                while not (await rt.stats()).tiers.tiers[0].available:
                    seed += 1
                    await run(rt, _prompt(seed, BS + 1))
                    await anyio.sleep(0.1)
            third = _prompt(43)
            await run(rt, third)
            await rt.flush_tiers()
            await assert_clean(rt)
        async with _runtime(llama, _redis(redis_server)) as rt:
            _, report = await run(rt, third)
            assert report.cached_tokens == _full_blocks(third) * BS

    async def test_a_frozen_server_costs_timeouts_not_requests(self, llama, redis_server):
        prompt = _prompt(44)
        await _store(llama, prompt, _redis(redis_server))
        async with _runtime(llama, redis_server.url) as rt:
            redis_server.pause()
            try:
                warm = await run(rt, prompt)
            finally:
                redis_server.resume()
            (tier,) = (await rt.stats()).tiers.tiers
            assert not tier.available  # its own timeout fired; the request did not wait on it
            assert warm[1].cached_tokens == 0
            await assert_matches_cold(rt, prompt, warm, salt="cold")
            await assert_clean(rt)

    async def test_disk_then_redis_the_first_tier_that_holds_a_block_serves_it(
        self, llama, tmp_path, redis_server
    ):
        prompt = _prompt(45)
        # Not tmp_path itself: the server keeps its directory there, and a
        # disk tier takes only a directory of its own.
        directory = tmp_path / "kv"
        await _store(llama, prompt, _disk(directory), _redis(redis_server))
        assert len(redis_server.command("KEYS", "*")) == _full_blocks(prompt)
        async with _runtime(llama, _disk(directory), _redis(redis_server)) as rt:
            warm = await run(rt, prompt)
            disk, redis = (await rt.stats()).tiers.tiers
            assert warm[1].cached_tokens == _full_blocks(prompt) * BS
            assert disk.num_loaded == _full_blocks(prompt) and redis.num_loaded == 0
        # Without the disk, Redis alone serves it.
        async with _runtime(llama, _redis(redis_server)) as rt:
            _, report = await run(rt, prompt)
            assert report.cached_tokens == _full_blocks(prompt) * BS


class TestDiskBudget:
    async def test_a_full_budget_evicts_and_stays_exact(self, llama, tmp_path):
        prompts = [_prompt(50 + i) for i in range(3)]
        await _store(llama, prompts[0], _disk(tmp_path))
        value_bytes = max(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
        budget = 4 * value_bytes
        url = _disk(tmp_path, max_bytes=budget)
        async with _runtime(llama, url) as rt:
            results = [await run(rt, prompt) for prompt in prompts[1:]]
            await rt.flush_tiers()
            (disk,) = (await rt.stats()).tiers.tiers
            assert disk.num_evicted > 0
            assert disk.num_bytes is not None and disk.num_bytes <= budget
            for prompt, result in zip(prompts[1:], results):
                await assert_matches_cold(rt, prompt, result, salt=f"cold{len(prompt)}")
            await assert_clean(rt)
        held = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > 1024)
        assert held <= budget


class TestEvents:
    async def test_stored_blocks_are_announced_in_chain_order(self, llama, tmp_path):
        """The pool and the tier each announce every full block of the
        prompt once, chained, with its tokens; the tier's with its key."""
        prompt = _prompt(60)
        async with _runtime(llama, _disk(tmp_path)) as rt:
            with rt.kv_events() as events:
                await run(rt, prompt)
                await rt.flush_tiers()
                stored = []
                while True:
                    try:
                        event = events.receive_nowait()
                    except Exception:
                        break
                    stored.append(event)
        assert all(isinstance(event, BlockStored) for event in stored)
        blocks = [tuple(prompt[i : i + BS]) for i in range(0, _full_blocks(prompt) * BS, BS)]
        for tier in ("pool", rt.config.kv_tiers[0]):
            mine = [event for event in stored if event.tier == tier]
            assert [event.token_ids for event in mine] == blocks, tier
            assert mine[0].parent_hash is None
            for parent, child in zip(mine, mine[1:]):
                assert child.parent_hash == parent.block_hash
            assert all((event.key is None) == (tier == "pool") for event in mine)


class TestConfiguration:
    def test_tiers_need_a_model(self):
        with pytest.raises(InvalidInput, match="kv_tiers"):
            CacheRuntime(kv_tiers=["file:///tmp/x"])

    @pytest.mark.parametrize("url", ["ftp://host/x", "file://relative/dir", "file:///x?max_bytes=-1", 3])
    def test_a_url_that_names_no_tier(self, llama, url):
        with pytest.raises(InvalidInput):
            CacheRuntime(model=llama, kv_tiers=[url])

    async def test_no_tiers_to_flush(self, llama):
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            await rt.flush_tiers()  # nothing to wait for
            assert (await rt.stats()).tiers is None

    def test_the_cli_refuses_a_bad_tier_in_one_line(self, llama):
        result = subprocess.run(
            [sys.executable, "-m", "mlxkv.cli", "run", "--model", llama, "--kv-tier", "ftp://x/y", "--quiet"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2
        assert len(result.stderr.strip().splitlines()) == 1 and "ftp://x/y" in result.stderr

    def test_mlxkv_run_twice_over_a_disk_tier_has_no_cold_request(self, llama, tmp_path):
        import json

        reports = []
        for i in range(2):
            out = tmp_path / f"run{i}.json"
            subprocess.run(
                [
                    sys.executable, "-m", "mlxkv.cli", "run", "--model", llama,
                    "--requests", "8", "--max-tokens", "4", "--prompt-tokens", "128",
                    "--block-size", str(BS), "--kv-tier", _disk(tmp_path / "kv"),
                    "--quiet", "--json", str(out),
                ],
                check=True,
                capture_output=True,
                timeout=300,
            )
            reports.append(json.loads(out.read_text()))
        assert reports[0]["cold_requests"] > 0 and reports[0]["tier_blocks_written"] > 0
        assert reports[1]["cold_requests"] == 0 and reports[1]["tier_blocks_loaded"] > 0
        (tier,) = reports[1]["tiers"]
        assert tier["num_loaded"] == reports[1]["tier_blocks_loaded"] and tier["num_corrupt"] == 0
