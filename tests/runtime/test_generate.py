"""CacheRuntime.generate on real tiny mlx-lm models: parity with cold runs, cleanup, errors.

Parity tolerance: greedy tokens are equal, and the logits at the last prompt
position agree within ``ATOL = 1e-4`` absolute (float32 models; a warm
prefill runs the same positions in differently sized chunks, so the sums are
not bit-identical). A "cold" run is the same prompt under a fresh
``cache_salt``, which shares no block with anything.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import mlx.core as mx
import pytest

from mlxkv import CacheRuntime, DuplicateRequest, InvalidInput, ModelLoadError, RuntimeClosed
from mlxkv.default_model import TINY_HYBRID, TINY_LLAMA, TINY_SLIDING_LLAMA, ensure_model
from mlxkv.generation import GeneratedToken

from parity import BS, assert_clean, assert_matches_cold, run

SPECS = {"llama": TINY_LLAMA, "sliding": TINY_SLIDING_LLAMA, "hybrid": TINY_HYBRID}


def _tokens(n: int, salt: int = 0) -> list[int]:
    return [(i * 37 + salt * 11 + (i // 7) ** 2) % 250 for i in range(n)]


SYSTEM = _tokens(100)


@pytest.fixture(params=["llama", "sliding", "hybrid"])
def any_model(request: pytest.FixtureRequest, model_dir: Any) -> tuple[str, str]:
    """(name, directory) of each tiny model kind."""
    return request.param, str(ensure_model(SPECS[request.param], model_dir))


@pytest.fixture
def llama(model_dir: Any) -> str:
    """The directory of the tiny full-attention Llama."""
    return str(ensure_model(TINY_LLAMA, model_dir))


class TestParity:
    """Requests served from cached blocks give the cold greedy tokens and logits."""

    async def test_shared_system_prompt(self, any_model):
        """Request B reuses the system-prompt blocks request A stored, on every model
        kind: a hybrid model's prefill snapshots its recurrent state at every block end."""
        _, path = any_model
        async with CacheRuntime(model=path, block_size=BS) as rt:
            await run(rt, SYSTEM + _tokens(30, salt=1))
            prompt_b = SYSTEM + _tokens(25, salt=2)
            warm = await run(rt, prompt_b)
            assert warm[1].cached_tokens == len(SYSTEM) // BS * BS
            await assert_matches_cold(rt, prompt_b, warm, "cold")
            await assert_clean(rt)

    async def test_multi_turn_conversation(self, any_model):
        """Turn n+1 (prompt n + answer n + new text) reuses turn n's prompt and answer."""
        _, path = any_model
        async with CacheRuntime(model=path, block_size=BS) as rt:
            prompt = SYSTEM + _tokens(20, salt=1)
            previous_cache = 0
            for turn in range(3):
                answer, report = await run(rt, prompt, max_tokens=12)
                if turn:
                    await assert_matches_cold(rt, prompt, (answer, report), f"cold-{turn}")
                    # The answer's blocks were stored too (a hybrid's with
                    # the recurrent state snapshotted at their ends while
                    # decoding): the previous prompt and answer, in full blocks.
                    assert report.cached_tokens == previous_cache // BS * BS
                previous_cache = len(prompt) + len(answer)
                prompt = prompt + answer + _tokens(15, salt=turn + 5)
            await assert_clean(rt)

    async def test_forked_request(self, any_model):
        """A generation served by blocks that only a forked request keeps alive."""
        _, path = any_model
        async with CacheRuntime(model=path, block_size=BS) as rt:
            prompt = SYSTEM + _tokens(40, salt=3)
            await run(rt, prompt)
            await rt.fetch("holder", prompt[:-1])
            fork = await rt.fork("holder", "child")
            await rt.release("holder")
            await rt.evict(10_000)  # every block nobody holds is gone
            warm = await run(rt, prompt)
            assert warm[1].cached_tokens == fork.num_cached_tokens > 0
            await rt.release("child")
            await assert_matches_cold(rt, prompt, warm, "cold")
            await assert_clean(rt)

    @pytest.mark.parametrize("how", ["evict", "small_pool"])
    async def test_partly_evicted_prefix(self, llama, how):
        """With the tail of a prefix evicted, the rest is reused and the result is cold-exact."""
        prompt = SYSTEM + _tokens(60, salt=4)  # 160 tokens: 9 full blocks before the last
        async with CacheRuntime(model=llama, block_size=BS, max_blocks=14) as rt:
            await run(rt, prompt, max_tokens=4)  # stores 10 blocks (prompt and answer)
            if how == "evict":
                assert await rt.evict(4) == 4
            else:
                await run(rt, _tokens(100, salt=9), max_tokens=4)  # needs 6 blocks: evicts 3
            warm = await run(rt, prompt, max_tokens=4)
            assert 0 < warm[1].cached_tokens < (len(prompt) - 1) // BS * BS
            await assert_matches_cold(rt, prompt, warm, "cold")
            stats = await rt.stats()
            assert stats.allocator.num_evictions >= 3
            await assert_clean(rt)

    async def test_cold_generation_equals_mlx_lm(self, llama):
        """A cold greedy generation gives mlx-lm's own generate_step tokens."""
        from mlx_lm import load
        from mlx_lm.generate import generate_step

        model, _ = load(llama)
        prompt = _tokens(90, salt=6)
        expected = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=8)]
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            tokens, report = await run(rt, prompt, max_tokens=8)
        assert tokens == expected[: len(tokens)]
        assert report.finish_reason == ("length" if len(tokens) == 8 else "stop")


class TestGenerate:
    """The stream, its report, text prompts and concurrent generations."""

    async def test_text_prompt_streams_text_and_reports(self, llama):
        """A text prompt is tokenized; pieces add up to the text; the report adds up."""
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            prompt = "You are a helpful assistant. " * 4 + "Hi!"
            ids = await rt.tokenize(prompt)
            pieces = []
            async with rt.generate(prompt, max_tokens=6) as stream:
                async for record in stream:
                    if isinstance(record, GeneratedToken):
                        pieces.append(record.text)
            report = stream.report
            assert report is not None
            assert report.prompt_tokens == len(ids)
            assert "".join(pieces) == report.text
            assert report.generated_tokens == len(report.tokens) <= 6
            assert 0 < report.time_to_first_token <= report.total_time
            # The prompt and every generated token are in the stored blocks.
            assert report.stored_blocks == (len(ids) + report.generated_tokens) // BS
            second = await run(rt, prompt, max_tokens=6)
            assert second[1].cached_tokens == (len(ids) - 1) // BS * BS
            assert second[1].stored_blocks == 0

    async def test_concurrent_generations_interleave_and_match(self, llama):
        """Concurrent generations take turns and give their sequential results."""
        prompts = [SYSTEM + _tokens(20, salt=s) for s in range(3)]
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            alone = [(await run(rt, p, max_tokens=10, cache_salt="alone"))[0] for p in prompts]
            order: list[int] = []
            together: list[list[int]] = [[], [], []]

            async def consume(i: int) -> None:
                async with rt.generate(prompts[i], max_tokens=10) as stream:
                    async for record in stream:
                        if isinstance(record, GeneratedToken):
                            order.append(i)
                            together[i].append(record.token)

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(consume, i)
            assert together == alone
            # No request finishes before every other one has its first token.
            finished = [max(k for k, i in enumerate(order) if i == r) for r in range(3)]
            started = [order.index(r) for r in range(3)]
            assert min(finished) > max(started)
            await assert_clean(rt)

    async def test_duplicate_request_id(self, llama):
        """A second generation under an active request id fails; the first is unharmed."""
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            async with rt.generate(SYSTEM, max_tokens=4, request_id="r") as first:
                await first.__anext__()
                with pytest.raises(DuplicateRequest):
                    await run(rt, SYSTEM, request_id="r")
                async for _ in first:
                    pass
            assert first.report is not None
            await assert_clean(rt)


class TestCleanup:
    """Every way out of a generation releases its blocks and its compute cache."""

    async def test_cancellation_mid_generation(self, llama):
        """Cancelling while decoding leaves no referenced block and no live cache."""
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            seen = 0
            with anyio.CancelScope() as scope:
                async with rt.generate(SYSTEM, max_tokens=50) as stream:
                    async for _ in stream:
                        seen += 1
                        if seen == 3:
                            scope.cancel()
            assert scope.cancelled_caught and seen == 3
            await assert_clean(rt)

    async def test_cancellation_at_every_await(self, llama):
        """Cancelled after k scheduler turns, for k = 0, 2, 4, ..., nothing leaks."""
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            outcomes = set()
            for k in range(0, 240, 2):
                done = False

                async def generate() -> None:
                    nonlocal done
                    await run(rt, SYSTEM[: 20 + k % 40], max_tokens=2)
                    done = True

                async with anyio.create_task_group() as tg:
                    tg.start_soon(generate)
                    for _ in range(k):
                        await anyio.lowlevel.checkpoint()
                    tg.cancel_scope.cancel()
                await assert_clean(rt)
                outcomes.add(done)
                if done:
                    break
            assert False in outcomes  # some cuts landed inside the generation
            await run(rt, SYSTEM, max_tokens=2)  # and the runtime still serves
            await assert_clean(rt)

    async def test_leaving_the_loop_early(self, llama):
        """Breaking out of the stream releases the request at once."""
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            async with rt.generate(SYSTEM, max_tokens=50) as stream:
                async for _ in stream:
                    break
            await assert_clean(rt)

    async def test_runtime_closed_before_and_after(self, llama):
        """generate on a runtime that is not running raises RuntimeClosed."""
        rt = CacheRuntime(model=llama, block_size=BS)
        with pytest.raises(RuntimeClosed):
            rt.generate(SYSTEM, max_tokens=2)
        async with rt:
            stream = rt.generate(SYSTEM, max_tokens=50)
            await stream.__anext__()
        with pytest.raises(RuntimeClosed):
            rt.generate(SYSTEM, max_tokens=2)
        with pytest.raises(RuntimeClosed):
            await stream.__anext__()  # parked while the runtime closed
        await stream.aclose()


class TestBadInput:
    """Bad arguments raise InvalidInput before anything is sent."""

    @pytest.mark.parametrize(
        "prompt, kwargs",
        [
            ("", {}),
            ([], {}),
            ([1, 2, 10_000], {}),
            ([1, 2, -1], {}),
            ([1, 2, "x"], {}),
            (b"bytes", {}),
            ("hi", {"max_tokens": 0}),
            ("hi", {"max_tokens": True}),
            ("hi", {"temperature": -1.0}),
            ("hi", {"temperature": float("nan")}),
            ("hi", {"temperature": float("inf")}),
            ("hi", {"temperature": "0.5"}),
            ("hi", {"top_p": 2.0}),
            ("hi", {"top_p": float("nan")}),
            ("hi", {"min_p": float("nan")}),
            ("hi", {"top_k": 2.5}),
            ("hi", {"top_k": True}),
            ("hi", {"seed": 1.5}),
            ("hi", {"request_id": ""}),
            ([True, False], {}),
            ([1, 2, 3], {"max_tokens": 32_766}),  # 3 + 32766 > the model's 32768
        ],
    )
    async def test_rejected(self, llama, prompt, kwargs):
        """Each bad argument is refused and the runtime stays clean."""
        kwargs.setdefault("max_tokens", 2)
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            with pytest.raises(InvalidInput):
                rt.generate(prompt, **kwargs)
            await assert_clean(rt)

    async def test_no_model(self):
        """A runtime without a model refuses generate and tokenize."""
        async with CacheRuntime(block_size=BS) as rt:
            with pytest.raises(InvalidInput):
                rt.generate("hi", max_tokens=2)
            with pytest.raises(InvalidInput):
                await rt.tokenize("hi")

    async def test_bad_model_path_fails_the_start(self, tmp_path):
        """A model directory that does not load fails ``async with`` with ModelLoadError."""
        with pytest.raises(ModelLoadError):
            async with CacheRuntime(model=str(tmp_path / "missing"), block_size=BS):
                pass

    async def test_a_text_prompt_longer_than_the_context(self, llama):
        """A text prompt that, tokenized, leaves no room for max_tokens is refused
        before anything is cached."""
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            with pytest.raises(InvalidInput, match="context of 32768"):
                await run(rt, "hello there", max_tokens=32_760)
            await assert_clean(rt)
            assert (await rt.stats()).index.num_lookups == 0
