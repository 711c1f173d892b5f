"""Concurrent generations that share a prefix compute it once (in-flight sharing).

A request whose prefix another request is computing right now waits for
those blocks as they are published, instead of computing them again; if the
computing request is cancelled or cannot store its blocks, the waiters take
over. Every result still equals a cold computation (parity as in
``test_generate``: greedy tokens equal, last-prompt logits within 1e-4).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from mlxkv import CacheRuntime, GenerationReport
from mlxkv.default_model import TINY_HYBRID, TINY_LLAMA, TINY_SLIDING_LLAMA, ensure_model

from parity import BS, assert_clean, assert_matches_cold, run

SPECS = {"llama": TINY_LLAMA, "sliding": TINY_SLIDING_LLAMA, "hybrid": TINY_HYBRID}
PREFIX = [(i * 29 + (i // 5) ** 2) % 240 + 1 for i in range(320)]  # 20 full blocks


def _suffix(i: int, n: int = 24) -> list[int]:
    return [(i * 53 + j * 17) % 240 + 1 for j in range(n)]


@pytest.fixture(params=list(SPECS))
def any_model(request: pytest.FixtureRequest, model_dir: Any) -> tuple[str, str]:
    """(name, directory) of each tiny model kind."""
    return request.param, str(ensure_model(SPECS[request.param], model_dir))


async def _together(rt: CacheRuntime, prompts: list[list[int]], **kwargs: Any) -> list[GenerationReport]:
    reports: list[Any] = [None] * len(prompts)

    async def one(i: int) -> None:
        reports[i] = (await run(rt, prompts[i], **kwargs))[1]

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return reports


class TestSharing:
    async def test_a_prefix_computed_once_for_requests_arriving_together(self, any_model):
        """N requests arriving together with a P-token common prefix prefill about
        P + N x suffix tokens, not N x P; all but the first report the prefix reused."""
        _, path = any_model
        n, suffix = 4, 24
        prompts = [PREFIX + _suffix(i, suffix) for i in range(n)]
        async with CacheRuntime(model=path, block_size=BS, prefill_chunk=64) as rt:
            reports = await _together(rt, prompts, max_tokens=4)
            stats = await rt.stats()
            assert stats.compute is not None
            # The first request computes everything; each other one its own
            # suffix (plus at most the partial block before it).
            assert stats.compute.num_prefill_tokens <= len(PREFIX) + n * (suffix + BS)
            reused = sorted(report.cached_tokens for report in reports)
            assert reused == [0] + [len(PREFIX)] * (n - 1)
            assert stats.index.num_waits >= n - 1
            for prompt, report in zip(prompts, reports):
                await assert_matches_cold(rt, prompt, (list(report.tokens), report), f"cold-{report.request_id}")
            await assert_clean(rt)

    async def test_without_sharing_every_request_computes_the_prefix(self, model_dir):
        """share_in_flight=False (today's behaviour before sharing) computes N x P."""
        path = str(ensure_model(TINY_LLAMA, model_dir))
        prompts = [PREFIX + _suffix(i) for i in range(3)]
        # A budget that admits all three in one plan: none can find another's
        # blocks finished (or reuse the live cache another one left).
        async with CacheRuntime(model=path, block_size=BS, share_in_flight=False, prefill_budget=1 << 16) as rt:
            reports = await _together(rt, prompts, max_tokens=2)
            stats = await rt.stats()
        assert [report.cached_tokens for report in reports] == [0, 0, 0]
        assert stats.compute is not None and stats.compute.num_prefill_tokens == sum(map(len, prompts))
        assert stats.index.num_waits == 0

    async def test_salts_never_share_in_flight(self, model_dir):
        """Requests with different cache salts neither wait for nor reuse each other."""
        path = str(ensure_model(TINY_LLAMA, model_dir))
        async with CacheRuntime(model=path, block_size=BS) as rt:
            reports: list[Any] = [None, None]

            async def one(i: int) -> None:
                reports[i] = (await run(rt, PREFIX + _suffix(i), max_tokens=2, cache_salt=f"tenant-{i}"))[1]

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, 0)
                tg.start_soon(one, 1)
            stats = await rt.stats()
        assert [report.cached_tokens for report in reports] == [0, 0]
        assert stats.index.num_waits == 0


class TestTakeOver:
    async def test_waiters_take_over_from_a_cancelled_computer(self, model_dir):
        """When the request computing a shared prefix is cancelled mid-prefill, the
        waiters compute the rest themselves, exactly, and nothing leaks."""
        path = str(ensure_model(TINY_LLAMA, model_dir))
        prompts = [PREFIX + _suffix(i) for i in range(3)]
        async with CacheRuntime(model=path, block_size=BS, prefill_chunk=16) as rt:
            reports: dict[int, GenerationReport] = {}

            async def waiter(i: int) -> None:
                reports[i] = (await run(rt, prompts[i], max_tokens=4))[1]

            computer = anyio.CancelScope()
            async with anyio.create_task_group() as tg:
                tg.start_soon(_run_in, computer, rt, prompts[0])
                # Let the computer publish a few chunks, then the waiters arrive.
                while (await rt.stats()).allocator.num_stored < 3:
                    await anyio.sleep(0)
                tg.start_soon(waiter, 1)
                tg.start_soon(waiter, 2)
                while (await rt.stats()).index.num_waits < 2:
                    await anyio.sleep(0)
                computer.cancel()
            stats = await rt.stats()
            assert stats.index.num_abandoned_claims > 0
            # Each waiter reused at least what the computer had published.
            assert all(report.cached_tokens >= 3 * BS for report in reports.values())
            for i, report in reports.items():
                await assert_matches_cold(rt, prompts[i], (list(report.tokens), report), f"cold-{i}")
            await assert_clean(rt)

    async def test_waiters_take_over_when_the_computer_runs_out_of_blocks(self, model_dir):
        """A computer whose blocks do not fit drops its claims; nobody waits in vain."""
        path = str(ensure_model(TINY_LLAMA, model_dir))
        prompts = [PREFIX + _suffix(i) for i in range(3)]
        async with CacheRuntime(model=path, block_size=BS, max_blocks=8, prefill_chunk=32) as rt:
            with anyio.fail_after(60):
                reports = await _together(rt, prompts, max_tokens=3)
            stats = await rt.stats()
            assert stats.generation is not None and stats.generation.num_blocks_not_stored > 0
            for prompt, report in zip(prompts, reports):
                await assert_matches_cold(rt, prompt, (list(report.tokens), report), f"cold-{report.request_id}")
            await assert_clean(rt)


class TestSlowConsumer:
    async def test_a_consumer_stalled_after_its_first_token_holds_no_waiter_back(self, model_dir):
        """The last chunk's blocks are stored by the request's own storer task,
        not between the tokens its consumer takes: a request waiting for them
        goes on while the computing request's consumer sits on its first token."""
        path = str(ensure_model(TINY_LLAMA, model_dir))
        first, second = PREFIX + _suffix(0), PREFIX + _suffix(1)
        async with CacheRuntime(model=path, block_size=BS, prefill_chunk=512) as rt:
            stalled, resume = anyio.Event(), anyio.Event()

            async def stalling_consumer() -> None:
                async with rt.generate(first, max_tokens=4) as stream:
                    async for _ in stream:
                        stalled.set()
                        await resume.wait()

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(stalling_consumer)
                    # The second request arrives while the first computes its one
                    # chunk (asking the index alone: the compute actor answers
                    # statistics only between jobs).
                    while (await rt.client.index_statistics()).num_in_flight == 0:
                        await anyio.sleep(0)
                    _, report = await run(rt, second, max_tokens=4)
                    assert stalled.is_set()
                    resume.set()
            assert report.cached_tokens == len(PREFIX)
            assert (await rt.stats()).index.num_waits == 1  # it did wait for the first one's blocks
            await assert_matches_cold(rt, second, (list(report.tokens), report), "cold")
            await assert_clean(rt)


async def _run_in(scope: anyio.CancelScope, rt: CacheRuntime, prompt: list[int]) -> None:
    with scope:
        await run(rt, prompt, max_tokens=4)
