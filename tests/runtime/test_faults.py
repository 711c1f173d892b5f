"""A fault stays with its request: one request's failing step fails it alone.

Each test injects an error into one step the compute actor does for one
request while other requests decode beside it -- slicing its answer's
blocks, keeping its cache, merging its cache into the decode batch, taking
it out again, sampling -- and checks that the request gets
:class:`~mlxkv.ComputeFailed` with the injected error as its cause, that the
bystanders finish with the tokens they give alone (on a model whose greedy
tokens depend on the KV, see ``test_teeth.py``), that nothing leaks, and that
the runtime serves on. The faults are injected by wrapping the runner's own
methods (a real model underneath): a real part cannot be made to fail here.
"""

from __future__ import annotations

from typing import Any

import anyio
import mlx.core as mx
import pytest

from mlxkv import CacheRuntime, ComputeFailed, RuntimeClosed
from mlxkv.actors import model_runner, scheduler
from mlxkv.actors.sampling import Sampling
from mlxkv.default_model import TINY_LLAMA, ensure_model
from mlxkv.generation import GeneratedToken

from parity import BS, assert_clean, run

#: The victim's prompt is longer than any bystander's KV ever gets, so an
#: injected fault can tell its cache by its length.
VICTIM = 211
BYSTANDERS = {"a": 60, "b": 75, "c": 90}
MAX_TOKENS = 16


def _prompt(length: int, seed: int) -> list[int]:
    return [(i * 31 + seed * 17 + (i // 5) ** 2) % 250 for i in range(length)]


class Injected(RuntimeError):
    """The error a test injects."""


@pytest.fixture
def llama(model_dir: Any) -> str:
    return str(ensure_model(TINY_LLAMA, model_dir))


def _victim_cache(cache: list[Any], row: int | None = None) -> bool:
    """Whether ``cache`` (or its batch row ``row``) is the victim's."""
    offset = cache[0].offset
    if isinstance(offset, mx.array):
        offset = offset.reshape(-1)[0 if row is None else row]
        offset = int(offset.item())
    return offset >= VICTIM


def _inject(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = model_runner.CacheRunner
    if where == "answer_blocks":
        slice_blocks = runner.slice_blocks

        def failing_slice(self: Any, sequence: Any, cache: Any, start: int, stop: int) -> Any:
            if sequence.request_id == "victim" and stop * sequence.block_size > len(sequence.prompt):
                raise Injected("slicing the answer's blocks")
            return slice_blocks(self, sequence, cache, start, stop)

        monkeypatch.setattr(runner, "slice_blocks", failing_slice)
    elif where == "keep":
        keep = runner.keep

        def failing_keep(self: Any, sequence: Any, cache: Any, num_tokens: int) -> None:
            if sequence.request_id == "victim":
                raise Injected("keeping the cache")
            keep(self, sequence, cache, num_tokens)

        monkeypatch.setattr(runner, "keep", failing_keep)
    elif where == "merge":
        merge = runner.merge

        def failing_merge(self: Any, caches: Any) -> Any:
            if any(_victim_cache(cache) for cache in caches):
                raise Injected("merging into the batch")
            return merge(self, caches)

        monkeypatch.setattr(runner, "merge", failing_merge)
    elif where == "extract":
        extract = runner.extract

        def failing_extract(self: Any, cache: Any, row: int, **how: Any) -> Any:
            if _victim_cache(cache, row):
                raise Injected("taking it out of the batch")
            return extract(self, cache, row, **how)

        monkeypatch.setattr(runner, "extract", failing_extract)
    else:
        raise AssertionError(where)


async def _alone(rt: CacheRuntime) -> dict[str, list[int]]:
    return {
        name: (await run(rt, _prompt(n, k), max_tokens=MAX_TOKENS, cache_salt="alone"))[0]
        for k, (name, n) in enumerate(BYSTANDERS.items())
    }


async def _together(rt: CacheRuntime, **victim: Any) -> tuple[dict[str, list[int]], BaseException | None]:
    """The bystanders, and once they decode, the victim; every result (the
    victim prefilling together with them: ``tests/actors/test_compute.py``)."""
    out: dict[str, list[int]] = {}
    failure: list[BaseException] = []
    decoding = anyio.Event()

    async def bystander(k: int, name: str, n: int) -> None:
        tokens = []
        async with rt.generate(_prompt(n, k), max_tokens=MAX_TOKENS, cache_salt="together") as stream:
            async for record in stream:
                if isinstance(record, GeneratedToken):
                    tokens.append(record.token)
                    decoding.set()
        out[name] = tokens

    async def victim_request() -> None:
        await decoding.wait()
        try:
            await run(rt, _prompt(VICTIM, 9), max_tokens=MAX_TOKENS, request_id="victim", **victim)
        except ComputeFailed as error:
            failure.append(error)

    async with anyio.create_task_group() as tg:
        for k, (name, n) in enumerate(BYSTANDERS.items()):
            tg.start_soon(bystander, k, name, n)
        tg.start_soon(victim_request)
    return out, failure[0] if failure else None


class TestAFaultStaysWithItsRequest:
    @pytest.mark.parametrize("where", ["answer_blocks", "keep", "merge", "extract"])
    async def test_the_others_finish_exactly(self, where, llama, monkeypatch):
        """One request's failing step fails it with ComputeFailed (the cause
        attached); the requests decoding beside it finish exactly, nothing
        leaks, and the runtime serves on."""
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            alone = await _alone(rt)
            _inject(where, monkeypatch)
            together, failure = await _together(rt)
            monkeypatch.undo()
            assert together == alone
            assert isinstance(failure, ComputeFailed) and failure.request_id == "victim"
            assert isinstance(failure.cause, Injected)
            stats = await rt.stats()
            assert stats.compute is not None and stats.compute.num_model_errors == 1
            await assert_clean(rt)
            assert not rt.closed
            assert (await run(rt, _prompt(40, 5), max_tokens=3))[0]
            await assert_clean(rt)


def _sampler_failing_at(draw: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sampler made from now on raises from its ``draw``-th draw on
    (draw 1 is the first token, sampled at the end of the prefill)."""
    make_sampler = Sampling.make_sampler

    def failing(self: Sampling) -> Any:
        sample = make_sampler(self)
        assert sample is not None, "a sampled request has a sampler"
        draws = [0]

        def counted(logprobs: Any) -> Any:
            draws[0] += 1
            if draws[0] >= draw:
                raise Injected(f"draw {draws[0]}")
            return sample(logprobs)

        return counted

    monkeypatch.setattr(Sampling, "make_sampler", failing)


class TestTheSampler:
    async def test_a_raising_unused_draw_fails_nothing(self, llama, monkeypatch):
        """A sampler that raises on the draw after the request's last token
        (never used) leaves the request its tokens and a normal end."""
        prompt = _prompt(50, 3)
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            expected, _ = await run(rt, prompt, max_tokens=5, temperature=1.0, seed=7)
            _sampler_failing_at(6, monkeypatch)
            tokens, report = await run(rt, prompt, max_tokens=5, temperature=1.0, seed=7)
            await assert_clean(rt)
        assert tokens == expected and report.finish_reason == "length"

    async def test_a_needed_draw_that_raises_keeps_the_tokens_before_it(self, llama, monkeypatch):
        """A sampler that raises on a draw the request needs fails it, after every
        token drawn before (a decode burst emits them together)."""
        prompt = _prompt(50, 3)
        async with CacheRuntime(model=llama, block_size=BS) as rt:
            expected, _ = await run(rt, prompt, max_tokens=8, temperature=1.0, seed=7)
            _sampler_failing_at(4, monkeypatch)
            tokens: list[int] = []
            with pytest.raises(ComputeFailed) as failure:
                async with rt.generate(prompt, max_tokens=8, temperature=1.0, seed=7) as stream:
                    async for record in stream:
                        if isinstance(record, GeneratedToken):
                            tokens.append(record.token)
            await assert_clean(rt)
        assert isinstance(failure.value.cause, Injected)
        assert tokens == expected[:3]


class TestACrashSaysWhy:
    async def test_in_flight_generations_get_the_compute_crash(self, llama, monkeypatch):
        """A compute-actor crash (a bug in the actor, not a request's fault)
        reaches every generation in flight as RuntimeClosed('failed') with the
        crash as its cause, as another actor's crash does; ``async with``
        raises the crash."""

        class Bug(Exception):
            pass

        update = scheduler.Scheduler.update

        def crashing(self: Any, plan: Any, result: Any) -> Any:
            decoding = [s for s in self.requests() if s.status is scheduler.RequestStatus.DECODING]
            if len(decoding) == 3:  # all three decode
                raise Bug("a bug in the compute actor")
            return update(self, plan, result)

        monkeypatch.setattr(scheduler.Scheduler, "update", crashing)
        errors: list[BaseException] = []
        with pytest.raises(Bug):
            async with CacheRuntime(model=llama, block_size=BS) as rt:

                async def one(k: int) -> None:
                    try:
                        await run(rt, _prompt(40 + k, k), max_tokens=MAX_TOKENS)
                    except RuntimeClosed as error:
                        errors.append(error)

                async with anyio.create_task_group() as tg:
                    for k in range(3):
                        tg.start_soon(one, k)
        # The crash also cancels the body of ``async with``: a generation may
        # be cancelled before it hears of the crash, but none hears otherwise.
        assert errors
        for error in errors:
            assert error.reason == "failed" and isinstance(error.cause, Bug), error
