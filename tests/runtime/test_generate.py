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
import numpy as np
import pytest

from mlxkv import CacheRuntime, DuplicateRequest, InvalidInput, ModelLoadError, RuntimeClosed
from mlxkv.default_model import TINY_HYBRID, TINY_LLAMA, TINY_SLIDING_LLAMA, ensure_model
from mlxkv.generation import GeneratedToken, GenerationReport, Status

from parity import ATOL, BS, assert_clean, assert_matches_cold, holds_nothing, run

from device_arithmetic import EXACT_FLOAT32
from greedy import assert_same_greedy

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
    """Requests served from cached blocks give the cold greedy tokens and logits.

    These runtimes do not keep the last cache, so every warm prefix is rebuilt
    from blocks; :meth:`test_multi_turn_from_the_last_cache` covers the kept one.
    """

    async def test_shared_system_prompt(self, any_model):
        """Request B reuses the system-prompt blocks request A stored, on every model
        kind: a hybrid model's prefill snapshots its recurrent state at every block end."""
        _, path = any_model
        async with CacheRuntime(model=path, block_size=BS, keep_caches=False) as rt:
            await run(rt, SYSTEM + _tokens(30, salt=1))
            prompt_b = SYSTEM + _tokens(25, salt=2)
            warm = await run(rt, prompt_b)
            assert warm[1].cached_tokens == len(SYSTEM) // BS * BS
            await assert_matches_cold(rt, prompt_b, warm, "cold")
            await assert_clean(rt)

    async def test_multi_turn_conversation(self, any_model):
        """Turn n+1 (prompt n + answer n + new text) reuses turn n's prompt and answer."""
        _, path = any_model
        async with CacheRuntime(model=path, block_size=BS, keep_caches=False) as rt:
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
        async with CacheRuntime(model=path, block_size=BS, keep_caches=False) as rt:
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
    async def test_partly_evicted_prefix(self, any_model, how):
        """With the tail of a prefix evicted, the rest is reused and the result is
        cold-exact, on every model kind (a hybrid's blocks each carry their snapshot)."""
        _, path = any_model
        prompt = SYSTEM + _tokens(60, salt=4)  # 160 tokens: 9 full blocks before the last
        async with CacheRuntime(model=path, block_size=BS, keep_caches=False, max_blocks=14) as rt:
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

    async def test_multi_turn_from_the_last_cache(self, llama):
        """With the last cache kept (the default), each turn takes the previous
        one's cache instead of rebuilding it, and still equals a cold run."""
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            prompt = SYSTEM + _tokens(20, salt=1)
            for turn in range(3):
                answer, report = await run(rt, prompt, max_tokens=12)
                if turn:
                    assert report.cached_tokens > 0
                    await assert_matches_cold(rt, prompt, (answer, report), f"cold-{turn}")
                prompt = prompt + answer + _tokens(15, salt=turn + 5)
            stats = await rt.stats()
            await assert_clean(rt)
        assert stats.compute is not None and stats.compute.num_kept_cache_reuses == 2
        assert stats.compute.num_last_cache_reuses == 2  # its old name

    async def test_cold_generation_equals_mlx_lm(self, llama):
        """A cold greedy generation gives mlx-lm's own generate_step tokens."""
        from mlx_lm import load
        from mlx_lm.generate import generate_step

        model, _ = load(llama)
        prompt = _tokens(90, salt=6)
        expected = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=8)]
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            tokens, report = await run(rt, prompt, max_tokens=8)
        # The same tokens, as far as the runtime went; or parted at a tie (tests/greedy.py).
        if tokens == expected[: len(tokens)]:
            assert report.finish_reason == ("length" if len(tokens) == 8 else "stop")
        else:
            assert_same_greedy(model, prompt, expected[: len(tokens)], tokens)


class TestGenerate:
    """The stream, its report, text prompts and concurrent generations."""

    async def test_prompt_log_probabilities_compute_the_whole_prompt(self, llama):
        """``prompt_logprobs=2``: a record for every prompt token but the first,
        the model's own over the whole prompt, though its prefix is cached
        (reused by none of it: computed whole); known from the first token
        on; the answer as without."""
        from mlx_lm import load

        model, _ = load(llama)
        prompt = SYSTEM + _tokens(20, salt=7)
        logits = model(mx.array(prompt)[None])[0].astype(mx.float32)
        reference = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            plain, _ = await run(rt, prompt, max_tokens=6)
            async with rt.generate(prompt, max_tokens=6, prompt_logprobs=2) as stream:
                tokens = []
                async for record in stream:
                    if isinstance(record, GeneratedToken):
                        tokens.append(record.token)
                        assert len(stream.prompt_logprobs) == len(prompt) - 1
            report = stream.report
            await assert_clean(rt)
        assert report is not None and report.cached_tokens == 0 and tokens == plain
        assert report.prompt_logprobs == stream.prompt_logprobs
        assert [r.token for r in report.prompt_logprobs] == prompt[1:]
        np.testing.assert_allclose(
            [r.logprob for r in report.prompt_logprobs],
            [reference[i, t] for i, t in enumerate(prompt[1:])],
            atol=ATOL, rtol=0,
        )  # fmt: skip
        assert all(len(r.top) == 2 for r in report.prompt_logprobs)

    async def test_penalties_see_the_whole_prompt_warm_or_cold(self, llama):
        """A repetition penalty covers the prompt's tokens whether its prefix
        was computed or taken from the cache: warm and cold give the same
        tokens, which the penalty changed."""
        async with CacheRuntime(model=llama, block_size=BS, keep_caches=False) as rt:
            await run(rt, SYSTEM + _tokens(9, salt=8))  # the system prompt's blocks, cached
            prompt = SYSTEM + _tokens(20, salt=7)
            plain, _ = await run(rt, prompt, max_tokens=12, cache_salt="plain")
            warm, report = await run(rt, prompt, max_tokens=12, repetition_penalty=2.0)
            cold, cold_report = await run(rt, prompt, max_tokens=12, repetition_penalty=2.0, cache_salt="cold")
            assert report.cached_tokens > 0 and cold_report.cached_tokens == 0
            assert warm != plain
            # Elsewhere the two paths round otherwise, and a penalty's near-tie
            # (no model-only margin measures it) may part them after the first.
            assert warm == cold if EXACT_FLOAT32 else warm[0] == cold[0]
            await assert_clean(rt)

    async def test_log_probabilities_are_mlx_lms_warm_and_cold(self, llama):
        """With ``logprobs=k`` each token comes with its log-probability and
        the ``k`` most likely tokens under mlx-lm's own ``generate_step``
        (within the parity tolerance), over a cold prompt and over one whose
        prefix came from the cache; without, none."""
        from mlx_lm import load
        from mlx_lm.generate import generate_step

        model, _ = load(llama)
        prompt = SYSTEM + _tokens(20, salt=7)
        reference = [(int(t), np.array(lp)) for t, lp in generate_step(mx.array(prompt), model, max_tokens=6)]
        async with CacheRuntime(model=llama, block_size=BS, keep_caches=False) as rt:
            await run(rt, SYSTEM + _tokens(9, salt=8))  # the system prompt's blocks, cached
            for logprobs, salt in ((4, "cold"), (4, None), (0, None), (None, None)):
                records = []
                async with rt.generate(prompt, max_tokens=6, logprobs=logprobs, cache_salt=salt) as stream:
                    async for record in stream:
                        if isinstance(record, GeneratedToken):
                            records.append(record)
                        else:
                            assert (record.cached_tokens == 0) == (salt == "cold")
                if logprobs is None:
                    assert all(record.logprob is None for record in records)
                    continue
                tokens = [record.token for record in records]
                shared = assert_same_greedy(model, prompt, [t for t, _ in reference], tokens)
                for record, (_, theirs) in list(zip(records, reference))[: shared + 1]:
                    picked = record.logprob
                    assert picked is not None and picked.token == record.token
                    assert picked.logprob == pytest.approx(float(theirs[record.token]), abs=ATOL)
                    assert len(picked.top) == logprobs
                    best = np.sort(theirs)[::-1][:logprobs]
                    np.testing.assert_allclose([value for _, value in picked.top], best, atol=ATOL, rtol=0)
            await assert_clean(rt)

    async def test_a_generation_stops_at_the_models_end_of_sequence_token(self, llama):
        """A prompt whose greedy continuation (mlx-lm's ``generate_step``,
        which does not stop) reaches the model's end-of-sequence token ends
        there: the tokens before it, finish reason ``stop``."""
        from mlx_lm import load
        from mlx_lm.generate import generate_step

        model, tokenizer = load(llama)
        eos = set(tokenizer.eos_token_ids)
        for salt in range(200):  # the first prompt whose continuation says eos a few tokens in
            prompt = _tokens(40, salt=salt)
            expected = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=24)]
            ends = [i for i, token in enumerate(expected) if token in eos]
            if ends and ends[0] > 0:
                break
        else:
            pytest.fail("no prompt's greedy continuation reaches the end-of-sequence token")
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            tokens, report = await run(rt, prompt, max_tokens=24)
        # The tokens before the end; or parted at a tie (tests/greedy.py), the end included.
        if tokens == expected[: ends[0]]:
            assert report.finish_reason == "stop"
        else:
            assert_same_greedy(model, prompt, expected[: ends[0]], tokens, stop_tokens=sorted(eos))

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
            # The last cache holds the first run: all but the last prompt token is reused.
            assert second[1].cached_tokens == len(ids) - 1
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

    async def test_cached_tokens_known_from_the_first_token(self, llama):
        """``Generation.cached_tokens`` is None before the first token and the
        report's count from it on, also for a generation closed before its report."""
        async with CacheRuntime(model=llama, block_size=BS, keep_caches=False) as rt:
            await run(rt, SYSTEM + _tokens(20, salt=1), max_tokens=2)
            stream = rt.generate(SYSTEM + _tokens(20, salt=2), max_tokens=8)
            assert stream.cached_tokens is None
            async with stream:
                await stream.__anext__()
                early = stream.cached_tokens
            assert stream.report is None
            assert early == len(SYSTEM) // BS * BS
            _, report = await run(rt, SYSTEM + _tokens(20, salt=3), max_tokens=2)
            assert report.cached_tokens == early
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

    async def test_the_report_comes_after_the_release(self, llama):
        """When the report is handed out the generation is FINISHED and holds nothing,
        before the iterator is asked for more."""
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            stream = rt.generate(SYSTEM, max_tokens=3)
            assert stream.status is Status.NEW
            statuses = []
            async with stream:
                async for record in stream:
                    statuses.append(stream.status)
                    if isinstance(record, GenerationReport):
                        assert stream.status is Status.FINISHED and stream.report is record
                        await assert_clean(rt)
            assert statuses[:-1] == [Status.COMPUTING] * 3 and statuses[-1] is Status.FINISHED
            stats = await rt.stats()
        assert stats.generation is not None
        assert (stats.generation.num_started, stats.generation.num_finished, stats.generation.num_stopped) == (1, 1, 0)

    async def test_a_generation_closed_early_is_stopped_once(self, llama):
        """Closing the iterator early leaves it STOPPED and counted once, however
        often it is closed."""
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            stream = rt.generate(SYSTEM, max_tokens=20)
            await stream.__anext__()
            assert stream.status is Status.COMPUTING
            await stream.aclose()
            await stream.aclose()
            assert stream.status is Status.STOPPED and stream.report is None
            await assert_clean(rt)
            stats = await rt.stats()
        assert stats.generation is not None
        assert (stats.generation.num_started, stats.generation.num_stopped) == (1, 1)

    # trio finalizes the dropped generator at once too, and warns that it was not closed.
    @pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
    async def test_a_generation_dropped_unclosed_releases_at_once(self, llama):
        """A generation dropped mid-stream without aclose is finalized when its last
        reference goes (no reference cycle waits for the collector) and holds nothing."""
        import gc
        import weakref

        async with CacheRuntime(model=llama, block_size=BS) as rt:
            gc.disable()
            try:
                stream = rt.generate(SYSTEM, max_tokens=20)
                await stream.__anext__()
                dropped = weakref.ref(stream)
                del stream
                assert dropped() is None
                # The release runs in the background: nothing may be held once it ran
                # (the prompt's blocks may not be stored yet when the stream is dropped).
                with anyio.fail_after(10):
                    while not await holds_nothing(rt):
                        await anyio.sleep(0.01)
            finally:
                gc.enable()
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
            (np.array([[1, 2], [3, 4]]), {}),
            (np.array([1.0, 2.0]), {}),
            (np.array([True, False]), {}),
            (mx.array([[1, 2]]), {}),
            (mx.array([1.0, 2.0]), {}),
            ({1, 2, 3}, {}),
            ("hi", {"logprobs": -1}),
            ("hi", {"logprobs": 21}),
            ("hi", {"logprobs": True}),
            ("hi", {"presence_penalty": 2.5}),
            ("hi", {"repetition_penalty": 0}),
            ("hi", {"logit_bias": {10_000: 1.0}}),
            ("hi", {"logit_bias": {"1": 1.0}}),
            ("hi", {"prompt_logprobs": 21}),
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

    async def test_the_context_blames_what_overflows_it(self, llama):
        """A prompt that alone fills the context is the prompt's fault (named with
        its length); one that leaves too little room is ``max_tokens``'s (named
        with the room left)."""
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            with pytest.raises(InvalidInput, match="its 32768 tokens leave no room") as info:
                rt.generate([1] * 32_768, max_tokens=1)
            assert info.value.argument == "prompt"
            with pytest.raises(InvalidInput, match="leave room for 32765 new ones") as info:
                rt.generate([1, 2, 3], max_tokens=32_766)
            assert info.value.argument == "max_tokens" and info.value.value == 32_766
            await assert_clean(rt)

    async def test_a_text_too_long_for_the_tokenizer_warns_nothing(self, llama, capfd):
        """A text past the tokenizer's model_max_length is refused as the prompt's
        fault, and transformers prints no warning of its own about it."""
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            with pytest.raises(InvalidInput, match="its 40000 tokens leave no room") as info:
                await run(rt, "x" * 40_000, max_tokens=1)
            assert info.value.argument == "prompt"
            assert len(await rt.tokenize("y" * 40_000)) == 40_000
            await assert_clean(rt)
        assert "Token indices" not in capfd.readouterr().err

    async def test_a_text_prompt_longer_than_the_context(self, llama):
        """A text prompt that, tokenized, leaves no room for max_tokens is refused
        before anything is cached."""
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            with pytest.raises(InvalidInput, match="context of 32768"):
                await run(rt, "hello there", max_tokens=32_760)
            await assert_clean(rt)
            assert (await rt.stats()).index.num_lookups == 0


class TestTokenIdArrays:
    """A 1-D integer array (NumPy or MLX) is a token-id prompt like a list."""

    @pytest.mark.parametrize(
        "convert",
        [
            lambda ids: np.array(ids, dtype=np.int64),
            lambda ids: np.array(ids, dtype=np.uint32),
            lambda ids: mx.array(ids),
            lambda ids: mx.array(ids, dtype=mx.uint32),
        ],
        ids=["numpy-int64", "numpy-uint32", "mlx-int32", "mlx-uint32"],
    )
    async def test_arrays_generate_as_lists_do(self, llama, convert):
        """The same tokens and the same reuse as the list prompt, and the next
        turn (report ids and answer fed back as an array) reuses both."""
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            prompt = SYSTEM + _tokens(20, salt=3)
            listed = await run(rt, prompt, cache_salt="list")
            arrayed = await run(rt, convert(prompt), cache_salt="array")
            assert arrayed[0] == listed[0] and arrayed[1].prompt_ids == tuple(prompt)
            turn2 = list(arrayed[1].prompt_ids) + arrayed[0] + list(await rt.tokenize(" more"))
            again = await run(rt, convert(turn2), cache_salt="array")
            assert again[1].cached_tokens >= len(prompt) // BS * BS
            await assert_clean(rt)

    async def test_fetch_and_store_take_arrays(self):
        """The low-level calls take the same arrays, as the same tokens."""
        tokens = np.arange(1, 2 * BS + 3, dtype=np.int64)
        async with CacheRuntime(block_size=BS, max_blocks=8) as rt:
            hit = await rt.fetch("r1", tokens)
            assert hit.remaining == tuple(range(1, 2 * BS + 3))
            stored = await rt.store("r1", mx.array(tokens), [mx.zeros((1,)), mx.zeros((1,))])
            assert stored.num_blocks == 2
            await rt.release("r1")
            again = await rt.fetch("r2", list(tokens))
            assert again.num_cached_tokens == 2 * BS
            await rt.release("r2")
            with pytest.raises(InvalidInput, match="not 2-D"):
                await rt.fetch("r3", tokens.reshape(1, -1))
            with pytest.raises(InvalidInput, match="not float32"):
                await rt.fetch("r3", tokens.astype(np.float32))


class TestSlidingWindow:
    async def test_past_the_window(self, model_dir):
        """A prompt longer than the sliding window (512) is reused up to the window, where
        the rotating cache wraps and blocks can no longer be cut exactly (a documented
        miss), and the rest is computed: cold-exact."""
        path = str(ensure_model(TINY_SLIDING_LLAMA, model_dir))
        prompt = _tokens(600, salt=8)
        async with CacheRuntime(model=path, block_size=BS) as rt:
            first = await run(rt, prompt, max_tokens=6)
            warm = await run(rt, prompt, max_tokens=6)
            stats = await rt.stats()
            assert first[1].stored_blocks == 512 // BS
            assert warm[1].cached_tokens == 512
            assert stats.compute is not None and stats.compute.num_unpublishable >= 1
            await assert_matches_cold(rt, prompt, warm, "cold")
            await assert_clean(rt)


class TestFailuresAreHeard:
    async def test_blocks_that_do_not_fit_are_counted_and_warned(self, llama):
        """A pool too small for a prompt's blocks: generation goes on, the blocks not
        stored are counted and a warning says so."""
        from structlog.testing import capture_logs

        with capture_logs() as logs:
            async with CacheRuntime(model=llama, block_size=BS, max_blocks=4) as rt:
                tokens, report = await run(rt, SYSTEM + _tokens(40), max_tokens=4)
                stats = await rt.stats()
        assert len(tokens) == 4
        assert stats.generation is not None and stats.generation.num_blocks_not_stored > 0
        assert stats.generation.num_prompts_over_pool == 1
        events = {log["event"] for log in logs if log["log_level"] == "warning"}
        assert {"generation.not_stored", "generation.prompt_exceeds_pool"} <= events

    async def test_a_pool_smaller_than_a_chunk_keeps_its_leading_blocks(self, llama):
        """A 256-token chunk publishes 16 blocks into a pool of 7: the leading 7
        are stored (the rest counted), and the same prompt then reuses them,
        exactly."""
        prompt = _tokens(300, salt=7)
        async with CacheRuntime(model=llama, block_size=BS, max_blocks=7, keep_caches=False) as rt:
            first = await run(rt, prompt, max_tokens=4)
            warm = await run(rt, prompt, max_tokens=4)
            stats = await rt.stats()
            await assert_matches_cold(rt, prompt, warm, "cold")
            await assert_clean(rt)
        assert first[1].stored_blocks == 7
        assert warm[1].cached_tokens == 7 * BS
        # Each request's prompt and answer blocks beyond the 7.
        assert stats.generation is not None
        assert stats.generation.num_blocks_not_stored == 2 * ((300 + 4) // BS - 7)

    async def test_a_chunk_that_does_not_fit_is_one_store(self, llama):
        """The storer keeps the leading blocks that fit with a single store of the
        chunk (the pool's leading store), not a second all-or-nothing one."""
        from mlxkv.actors.actor import Message
        from mlxkv.actors.allocator import StoreBlocks

        stores: list[StoreBlocks] = []

        def intercept(actor: str, message: Message) -> None:
            if isinstance(message, StoreBlocks):
                stores.append(message)

        prompt = _tokens(300, salt=9)
        async with CacheRuntime(
            model=llama, block_size=BS, max_blocks=7, keep_caches=False, intercept=intercept
        ) as rt:
            _, report = await run(rt, prompt, max_tokens=2)
            await assert_clean(rt)
        assert report.stored_blocks == 7
        assert len(stores) == 1 and stores[0].leading and len(stores[0].hashes) > 7

    async def test_a_store_that_fails_unexpectedly_fails_the_generation(self, llama):
        """The storer's failure (not a full pool) reaches the generation that owns
        it, after the tokens it computed; nothing leaks and the runtime serves on."""
        from mlxkv.actors.actor import Message

        def intercept(actor: str, message: Message) -> None:
            if type(message).__name__ == "Extend" and message.request_id == "doomed":
                raise InvalidInput("tokens", "injected", "fails on purpose")

        async with CacheRuntime(model=llama, block_size=BS, intercept=intercept) as rt:
            tokens: list[int] = []
            with pytest.raises(InvalidInput, match="fails on purpose"):
                async with rt.generate(SYSTEM, max_tokens=5, request_id="doomed") as stream:
                    async for record in stream:
                        if isinstance(record, GeneratedToken):
                            tokens.append(record.token)
            assert len(tokens) == 5
            await assert_clean(rt)
            await run(rt, SYSTEM, max_tokens=2)
            await assert_clean(rt)

    async def test_a_prefix_that_cannot_be_rebuilt_falls_back_cold(self, llama, model_dir):
        """Cached blocks of another model's layout under the prompt's hashes: the prompt
        is computed whole, exactly, counted and warned about."""
        from structlog.testing import capture_logs

        prompt = SYSTEM + _tokens(30, salt=2)
        async with CacheRuntime(model=str(ensure_model(TINY_HYBRID, model_dir)), block_size=BS) as hybrid:
            await run(hybrid, prompt, max_tokens=1)
            foreign = await hybrid.fetch("grab", prompt[:-1])
            await hybrid.release("grab")
        assert foreign.grants
        with capture_logs() as logs:
            async with CacheRuntime(model=llama, block_size=BS) as rt:
                await rt.fetch("plant", prompt[:-1])
                cut = len(foreign.payloads) * BS
                await rt.store("plant", prompt[:cut], list(foreign.payloads))
                await rt.release("plant")
                warm = await run(rt, prompt)
                stats = await rt.stats()
                await assert_matches_cold(rt, prompt, warm, "cold")
        assert warm[1].cached_tokens == 0
        assert stats.generation is not None and stats.generation.num_cold_fallbacks == 1
        assert "prefill.cold_fallback" in {log["event"] for log in logs if log["log_level"] == "warning"}


class TestComputeFailed:
    async def test_a_failing_model_call_fails_its_request(self, llama, monkeypatch):
        """A model call that raises surfaces as ComputeFailed from generate; another
        request is untouched and nothing leaks."""
        from mlxkv import ComputeFailed
        from mlxkv.actors.model_runner import TextRunner

        original = TextRunner._run

        def failing(self: Any, sequence: Any, cache: Any, start: int, stop: int) -> Any:
            if 255 in sequence.prompt:  # prompts here stay below 250
                raise RuntimeError("injected model failure")
            return original(self, sequence, cache, start, stop)

        monkeypatch.setattr(TextRunner, "_run", failing)
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            with pytest.raises(ComputeFailed, match="injected model failure") as info:
                await run(rt, SYSTEM + [255])
            assert isinstance(info.value.cause, RuntimeError)
            tokens, _ = await run(rt, SYSTEM)
            stats = await rt.stats()
            assert len(tokens) == 8 and stats.compute is not None and stats.compute.num_model_errors == 1
            await assert_clean(rt)


class TestSampling:
    async def test_a_seeded_request_is_reproducible(self, llama):
        """The same seed gives the same tokens; another seed other tokens."""
        prompt = _tokens(80, salt=3)
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            a = await run(rt, prompt, max_tokens=24, temperature=2.0, seed=11)
            b = await run(rt, prompt, max_tokens=24, temperature=2.0, seed=11)
            c = await run(rt, prompt, max_tokens=24, temperature=2.0, seed=12)
        assert a[0] == b[0]
        assert a[0] != c[0]

    @pytest.mark.parametrize(
        "narrowing", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}], ids=["top_k", "top_p", "min_p"]
    )
    async def test_each_filter_narrows_sampling(self, llama, narrowing):
        """At a high temperature, top_k=1, a tiny top_p or min_p=1 leave only the most
        likely token: the greedy answer; without them the answer differs."""
        prompt = _tokens(80, salt=4)
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            greedy = await run(rt, prompt, max_tokens=24)
            narrowed = await run(rt, prompt, max_tokens=24, temperature=2.0, seed=3, **narrowing)
            free = await run(rt, prompt, max_tokens=24, temperature=2.0, seed=3)
        assert narrowed[0] == greedy[0]
        assert free[0] != greedy[0]

    @pytest.mark.parametrize("top_k", [259, 260, 10**9])
    async def test_top_k_past_the_vocabulary_keeps_every_token(self, llama, top_k):
        """A top_k at or past the logits' width filters nothing: the same tokens as no top_k."""
        prompt = _tokens(80, salt=5)
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            wide = await run(rt, prompt, max_tokens=12, temperature=1.5, seed=9, top_k=top_k)
            free = await run(rt, prompt, max_tokens=12, temperature=1.5, seed=9)
            await assert_clean(rt)
        assert wide[0] == free[0]


class TestConfiguration:
    async def test_model_info_through_the_runtime(self, llama):
        """model_info describes the loaded model; it is None without one."""
        async with CacheRuntime(model=llama) as rt:
            info = rt.model_info
        assert info is not None and info.vocab_size == 259 and info.eos_token_ids
        assert info.cache_layers == ("KVCache", "KVCache") and info.batchable
        async with CacheRuntime() as bare:
            assert bare.model_info is None

    async def test_image_cache_bounds(self):
        """image_cache_entries and memory_budget bound the image cache."""
        import mlx.core as mx

        features = [mx.ones((16, 64)) for _ in range(3)]  # 4 KiB each
        async with CacheRuntime(image_cache_entries=2) as rt:
            for i, value in enumerate(features):
                await rt.store_images([f"image-{i}"], value, num_image_tokens=16)
            by_count = (await rt.stats()).images
        async with CacheRuntime(memory_budget=5000) as rt:
            for i, value in enumerate(features):
                await rt.store_images([f"image-{i}"], value, num_image_tokens=16)
            by_bytes = (await rt.stats()).images
        assert (by_count.num_entries, by_count.num_evictions) == (2, 1)
        assert by_bytes.num_entries == 1 and by_bytes.num_bytes <= 5000


    @pytest.mark.parametrize("model_name", ["llama", "hybrid"])
    async def test_transposed_weights_generate_the_same(self, model_name, model_dir):
        """A runtime that holds the weights transposed (the CPU default) and
        one that keeps the model's layout generate the same tokens: from the
        same prompt logits bit for bit one request at a time (over a shared
        prefix), and within float noise for two in flight (which of them
        prefill together moves with timing)."""
        spec = {"llama": TINY_LLAMA, "hybrid": TINY_HYBRID}[model_name]
        path = str(ensure_model(spec, model_dir))
        system = _tokens(3 * BS + 5, salt=9)
        prompts = [system + _tokens(7 + i, salt=i) for i in range(4)]
        answers = {}
        for transpose in (False, True):
            async with CacheRuntime(model=path, block_size=BS, transpose_weights=transpose) as rt:
                assert rt.model_info is not None and (rt.model_info.transposed_layers > 0) is transpose
                results: list[Any] = [None] * len(prompts)

                async def one(i: int) -> None:
                    results[i] = await run(rt, prompts[i], max_tokens=6)

                await one(0)  # the prefix is cached, then the others share it
                await one(1)
                async with anyio.create_task_group() as tg:
                    for i in (2, 3):
                        tg.start_soon(one, i)
                assert all(report.cached_tokens >= 3 * BS for _, report in results[1:])
                answers[transpose] = [(tokens, np.array(report.prompt_logits)) for tokens, report in results]
                await assert_clean(rt)
        for i, ((tokens, logits), (want_tokens, want_logits)) in enumerate(zip(answers[True], answers[False])):
            if not EXACT_FLOAT32:  # another product kernel: only within float noise
                np.testing.assert_allclose(logits, want_logits, atol=ATOL, rtol=0)
                continue
            assert tokens == want_tokens
            if i < 2:
                assert np.array_equal(logits, want_logits)
            else:
                np.testing.assert_allclose(logits, want_logits, atol=ATOL, rtol=0)
