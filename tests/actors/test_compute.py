"""The compute actor on real tiny mlx-lm models: parity, fairness, cancellation, faults."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Optional

import anyio
import anyio.from_thread
import anyio.lowlevel
import mlx.core as mx
import numpy as np
import pytest
from structlog.testing import capture_logs

from mlxkv.actors.actor import ActorFailed
from mlxkv.actors.compute import (
    ComputeActor,
    ComputeFailed,
    ComputeHandle,
    Sampling,
    Step,
    plan_chunks,
)
from mlxkv.actors.mlx_thread import MLXThreadStopped
from mlxkv.cache import kv_state
from mlxkv.cache.errors import DuplicateRequest, InvalidInput, UnknownRequest

ATOL = 1e-4
BLOCK = 32
MODELS = ["tiny_llama", "sliding_llama", "hybrid_model"]
POISON = 255  # prompts stay below 250; a model wrapper fails on this token


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 37 + salt * 11 + (i // 7) ** 2) % 250 for i in range(n)]


def _logprobs(logits: Any) -> np.ndarray:
    return np.array(logits - mx.logsumexp(logits, keepdims=True))


class Wrapped:
    """A real model whose calls first run ``before(inputs)`` on the MLX thread.

    The first call passes straight through: it is the actor's start-up probe
    (one token, to measure the model's KV bytes per token).
    """

    def __init__(self, model: Any, before: Callable[[Any], None]) -> None:
        self._model = model
        self._before = before
        self._probed = False

    def __call__(self, inputs: Any, cache: Any = None, **kwargs: Any) -> Any:
        if self._probed:
            self._before(inputs)
        self._probed = True
        return self._model(inputs, cache=cache, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class Gate:
    """Holds the first model call until released; says (via the loop) when it is held."""

    def __init__(self) -> None:
        self.held = anyio.Event()
        self.release = threading.Event()
        self._token = anyio.lowlevel.current_token()
        self._armed = True

    def __call__(self, _inputs: Any) -> None:
        if self._armed:
            self._armed = False
            anyio.from_thread.run_sync(self.held.set, token=self._token)
            self.release.wait(10)


class Fatal(BaseException):
    """Escapes a model call the way a dying MLX runtime would."""


def _poisoned(inputs: Any) -> None:
    if POISON in inputs.tolist()[0]:
        raise RuntimeError("injected model failure")


@asynccontextmanager
async def _serving(running: Any, actor: ComputeActor) -> AsyncIterator[ComputeHandle]:
    async with running(actor) as ref:
        yield ComputeHandle(ref)


async def _generate(handle: ComputeHandle, request_id: str, first: Step, steps: int) -> list[Step]:
    out = [first]
    for _ in range(steps):
        out.append(await handle.decode_step(request_id, out[-1].token))
    return out


def _assert_same(warm: list[Step], cold: list[Step]) -> None:
    assert [s.token for s in warm] == [s.token for s in cold]
    for w, c in zip(warm, cold):
        np.testing.assert_allclose(np.array(w.logits), np.array(c.logits), atol=ATOL, rtol=0)


class TestPlanChunks:
    def test_chunks_end_on_absolute_multiples_and_the_last_token_rides_last(self):
        """Chunk ends are multiples of the chunk size; the final job ends at the total."""
        assert plan_chunks(0, 200, 64) == [64, 128, 192, 200]
        assert plan_chunks(100, 300, 64) == [128, 192, 256, 300]
        assert plan_chunks(0, 1, 64) == [1]
        assert plan_chunks(10, 65, 64) == [65]  # the last token joins the only chunk
        assert plan_chunks(10, 66, 64) == [64, 66]

    def test_a_snapshot_position_splits_a_chunk(self):
        """A requested snapshot position always ends a job."""
        assert plan_chunks(0, 200, 256, snapshot_at=192) == [192, 200]
        assert plan_chunks(0, 200, 64, snapshot_at=96) == [64, 96, 128, 192, 200]


class TestParity:
    @pytest.mark.parametrize("model_name", MODELS)
    @pytest.mark.parametrize("source", ["full_request", "prefix_request"])
    async def test_warm_request_equals_cold(self, request, running, model_name, source):
        """Prefill from detached blocks + suffix gives the cold logits and greedy tokens."""
        model, tokenizer = request.getfixturevalue(model_name)
        prompt = _prompt(200)
        num_blocks = len(prompt) // BLOCK  # 6 full blocks: 192 cached tokens
        async with _serving(running, ComputeActor(model, tokenizer, prefill_chunk=64)) as compute:
            cold_first = await compute.prefill("cold", prompt, block_size=BLOCK)
            cold = await _generate(compute, "cold", cold_first, 6)
            if source == "full_request":
                # Detached after decoding: for the hybrid the recurrent state
                # comes from the snapshot the prefill took at token 192.
                payloads = await compute.detach_blocks("cold", BLOCK, 0, num_blocks)
            else:
                await compute.prefill("prefix", prompt[: num_blocks * BLOCK])
                payloads = await compute.detach_blocks("prefix", BLOCK, 0, num_blocks)
                await compute.drop("prefix")
            assert kv_state.num_reconstructable_blocks(payloads) == num_blocks
            warm_first = await compute.prefill(
                "warm", prompt[num_blocks * BLOCK :], prefix=payloads
            )
            assert warm_first.num_cached == num_blocks * BLOCK
            assert warm_first.num_tokens == len(prompt)
            warm = await _generate(compute, "warm", warm_first, 6)
            _assert_same(warm, cold)
            stats = await compute.statistics()
            assert stats.num_cached_tokens == num_blocks * BLOCK

    @pytest.mark.parametrize("model_name", MODELS)
    async def test_decoding_equals_mlx_lm_generate(self, request, running, model_name):
        """N greedy steps through the actor equal mlx-lm's generate_step, logprobs included."""
        from mlx_lm.generate import generate_step

        model, tokenizer = request.getfixturevalue(model_name)
        prompt = _prompt(150, salt=3)
        reference = [
            (int(token), np.array(logprobs))
            for token, logprobs in generate_step(mx.array(prompt), model, max_tokens=8)
        ]
        async with _serving(running, ComputeActor(model, tokenizer)) as compute:
            steps = await _generate(compute, "r", await compute.prefill("r", prompt), 7)
        assert [s.token for s in steps] == [t for t, _ in reference]
        for step, (_, logprobs) in zip(steps, reference):
            np.testing.assert_allclose(_logprobs(step.logits), logprobs, atol=ATOL, rtol=0)

    async def test_hybrid_needs_the_prefill_snapshot(self, running, hybrid_model):
        """Without block_size a hybrid's detached chain has no recurrent snapshot to end on."""
        model, tokenizer = hybrid_model
        prompt = _prompt(200)
        async with _serving(running, ComputeActor(model, tokenizer)) as compute:
            assert (await compute.describe()).has_recurrent
            await compute.prefill("plain", prompt)
            plain = await compute.detach_blocks("plain", BLOCK, 0, 6)
            await compute.prefill("snap", prompt, block_size=BLOCK)
            snap = await compute.detach_blocks("snap", BLOCK, 0, 6)
        assert kv_state.num_reconstructable_blocks(plain) == 0
        assert kv_state.num_reconstructable_blocks(snap) == 6

    async def test_detached_blocks_are_owned_copies(self, running, tiny_llama):
        """Later decoding and dropping the request leave detached payloads unchanged."""
        model, tokenizer = tiny_llama
        async with _serving(running, ComputeActor(model, tokenizer)) as compute:
            first = await compute.prefill("r", _prompt(100))
            payloads = await compute.detach_blocks("r", BLOCK, 1, 3)
            before = [np.array(a) for p in payloads for group in p.arrays for a in group]
            await _generate(compute, "r", first, 5)
            await compute.drop("r")
            assert (await compute.statistics()).num_live == 0
        assert [p.start for p in payloads] == [32, 64]
        after = [np.array(a) for p in payloads for group in p.arrays for a in group]
        for a, b in zip(before, after):
            np.testing.assert_array_equal(a, b)

    async def test_seeded_sampling_is_reproducible_under_interleaving(self, running, tiny_llama):
        """Two requests with one seed draw the same tokens even when their steps interleave."""
        model, tokenizer = tiny_llama
        prompt = _prompt(60)
        sampling = Sampling(temperature=1.5, top_k=50, seed=7)
        async with _serving(running, ComputeActor(model, tokenizer)) as compute:
            a = [await compute.prefill("a", prompt, sampling=sampling)]
            b = [await compute.prefill("b", prompt, sampling=sampling)]
            c = [await compute.prefill("c", prompt, sampling=Sampling(temperature=1.5, seed=8))]
            for _ in range(12):
                for rid, steps in (("a", a), ("b", b), ("c", c)):
                    steps.append(await compute.decode_step(rid, steps[-1].token))
        tokens = [[s.token for s in steps] for steps in (a, b, c)]
        assert tokens[0] == tokens[1]
        assert tokens[0] != tokens[2]


class TestConcurrency:
    async def test_event_loop_progresses_during_a_long_prefill(self, running, tiny_llama):
        """Another task keeps running while the model prefills on the MLX thread."""
        model, tokenizer = tiny_llama
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await anyio.sleep(0.002)
                ticks += 1

        async with _serving(running, ComputeActor(model, tokenizer)) as compute:
            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker)
                await compute.prefill("long", _prompt(600))
                tg.cancel_scope.cancel()
        assert ticks >= 5

    async def test_concurrent_decodes_interleave_round_robin(self, running, tiny_llama):
        """Two generating requests alternate one decode step each."""
        model, tokenizer = tiny_llama
        order: list[Optional[str]] = []

        def record(_name: str, message: Any) -> None:
            if type(message).__name__ == "DecodeStep":
                order.append(message.request_id)

        actor = ComputeActor(model, tokenizer, intercept=record)
        async with _serving(running, actor) as compute:

            async def generate(rid: str, salt: int) -> None:
                await _generate(compute, rid, await compute.prefill(rid, _prompt(80, salt)), 12)

            async with anyio.create_task_group() as tg:
                tg.start_soon(generate, "a", 1)
                tg.start_soon(generate, "b", 2)
        assert sorted(order) == ["a"] * 12 + ["b"] * 12
        repeats = sum(1 for x, y in zip(order, order[1:]) if x == y)
        assert repeats <= 2, order

    async def test_a_long_prefill_does_not_starve_decodes(self, running, tiny_llama):
        """Decode steps of one request run between the chunks of another's prefill."""
        model, tokenizer = tiny_llama
        actor = ComputeActor(model, tokenizer, prefill_chunk=32)
        steps_during_prefill = 0
        prefilling = False
        async with _serving(running, actor) as compute:
            first = await compute.prefill("decoder", _prompt(40))

            async def decoder() -> None:
                nonlocal steps_during_prefill
                token = first.token
                for _ in range(40):
                    token = (await compute.decode_step("decoder", token)).token
                    steps_during_prefill += prefilling

            async def long_prefill() -> None:
                nonlocal prefilling
                prefilling = True
                await compute.prefill("long", _prompt(320, salt=5))  # 10 chunks
                prefilling = False

            async with anyio.create_task_group() as tg:
                tg.start_soon(decoder)
                tg.start_soon(long_prefill)
            stats = await compute.statistics()
        assert stats.num_prefill_chunks >= 11
        assert steps_during_prefill >= 5


class TestCancellation:
    async def test_cancelled_prefill_leaves_no_cache(self, running, tiny_llama):
        """A caller cancelled during its prefill's model call leaves no live cache behind."""
        model, tokenizer = tiny_llama
        gate = Gate()
        actor = ComputeActor(Wrapped(model, gate), tokenizer)
        async with _serving(running, actor) as compute:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(compute.prefill, "gone", _prompt(20))
                    await gate.held.wait()
                    scope.cancel()
            gate.release.set()
            stats = await compute.statistics()
            assert stats.num_live == 0
            assert actor.statistics().num_undone == 1
            with pytest.raises(UnknownRequest):
                await compute.decode_step("gone", 1)
            # The id is free again.
            await compute.prefill("gone", _prompt(20))

    async def test_abandoned_long_prefill_stops_between_chunks(self, running, tiny_llama):
        """A multi-chunk prefill whose caller left is dropped before its next chunk."""
        model, tokenizer = tiny_llama
        gate = Gate()
        actor = ComputeActor(Wrapped(model, gate), tokenizer, prefill_chunk=32)
        async with _serving(running, actor) as compute:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(compute.prefill, "gone", _prompt(320))
                    await gate.held.wait()
                    scope.cancel()
            gate.release.set()
            with anyio.fail_after(5):
                while (stats := await compute.statistics()).num_live:
                    await anyio.sleep(0.01)
        assert stats.num_abandoned == 1
        assert stats.num_prefill_chunks < 10

    async def test_cancelled_actor_orphans_the_running_job(self, tiny_llama):
        """Cancelling the actor mid-job orphans the job's result, drops caches, stops the thread."""
        model, tokenizer = tiny_llama
        gate = Gate()
        actor = ComputeActor(Wrapped(model, gate), tokenizer)
        ref = actor.ref()
        actor.close()
        outcome: list[BaseException] = []

        async def client() -> None:
            try:
                await ComputeHandle(ref).prefill("r", _prompt(20))
            except ActorFailed as error:
                outcome.append(error)

        async with anyio.create_task_group() as tg:
            await tg.start(actor.run)
            async with anyio.create_task_group() as clients:
                clients.start_soon(client)
                await gate.held.wait()
                tg.cancel_scope.cancel()
                gate.release.set()
        ref.close()
        stats = actor.compute_statistics()
        assert stats.thread.num_orphaned == 1
        assert stats.num_live == 0
        assert not stats.thread.running
        assert outcome == [] or isinstance(outcome[0], ActorFailed)


class TestFaults:
    async def test_failing_prefill_fails_only_that_request(self, running, tiny_llama):
        """A model error in a prefill reaches its caller; nothing is left; others go on."""
        model, tokenizer = tiny_llama
        actor = ComputeActor(Wrapped(model, _poisoned), tokenizer, prefill_chunk=32)
        async with _serving(running, actor) as compute:
            first = await compute.prefill("good", _prompt(40))
            with pytest.raises(ComputeFailed, match="injected") as info:
                await compute.prefill("bad", _prompt(100) + [POISON] + _prompt(10))
            assert isinstance(info.value.cause, RuntimeError)
            assert info.value.request_id == "bad"
            await _generate(compute, "good", first, 3)
            stats = await compute.statistics()
            assert stats.num_live == 1
            assert stats.num_model_errors == 1

    async def test_failed_decode_poisons_the_request_until_dropped(self, running, tiny_llama):
        """After a failed decode step the request answers ComputeFailed until it is dropped."""
        model, tokenizer = tiny_llama
        actor = ComputeActor(Wrapped(model, _poisoned), tokenizer)
        async with _serving(running, actor) as compute:
            await compute.prefill("r", _prompt(30))
            with pytest.raises(ComputeFailed):
                await compute.decode_step("r", POISON)
            with pytest.raises(ComputeFailed):
                await compute.decode_step("r", 1)
            with pytest.raises(ComputeFailed):
                await compute.detach_blocks("r", BLOCK, 0, 1)
            await compute.drop("r")
            assert (await compute.statistics()).num_live == 0
            await compute.prefill("r", _prompt(30))

    async def test_dead_mlx_thread_crashes_the_actor_loudly(self, tiny_llama):
        """If the MLX thread dies, the pending caller gets ActorFailed and the actor raises."""
        model, tokenizer = tiny_llama

        def fatal(_inputs: Any) -> None:
            raise Fatal()

        actor = ComputeActor(Wrapped(model, fatal), tokenizer)
        ref = actor.ref()
        actor.close()
        crashes: list[BaseException] = []
        failures: list[BaseException] = []

        async def host(*, task_status: Any) -> None:
            try:
                await actor.run(task_status=task_status)
            except MLXThreadStopped as error:
                crashes.append(error)

        async with anyio.create_task_group() as tg:
            await tg.start(host)
            try:
                await ComputeHandle(ref).prefill("r", _prompt(10))
            except ActorFailed as error:
                failures.append(error)
            ref.close()
        assert len(crashes) == 1 and isinstance(crashes[0].cause, Fatal)
        assert len(failures) == 1 and failures[0].cause is crashes[0]
        assert not actor.compute_statistics().thread.running


class TestMessages:
    async def test_bad_requests_are_domain_errors(self, running, tiny_llama):
        """Duplicate, unknown, empty, out-of-range and not-yet-full requests are refused."""
        model, tokenizer = tiny_llama
        async with _serving(running, ComputeActor(model, tokenizer)) as compute:
            await compute.prefill("r", _prompt(40))
            with pytest.raises(DuplicateRequest):
                await compute.prefill("r", _prompt(5))
            with pytest.raises(UnknownRequest):
                await compute.decode_step("nope", 1)
            with pytest.raises(InvalidInput):
                await compute.prefill("empty", [])
            with pytest.raises(InvalidInput):
                await compute.prefill("big", [1, 100_000])
            with pytest.raises(InvalidInput, match="not full"):
                await compute.detach_blocks("r", BLOCK, 0, 2)
            assert (await compute.statistics()).num_live == 1

    async def test_foreign_payloads_are_not_reconstructable(
        self, running, tiny_llama, hybrid_model
    ):
        """Payloads of another model's cache layout are refused, not half-used."""
        async with _serving(running, ComputeActor(*hybrid_model)) as compute:
            await compute.prefill("h", _prompt(64))
            payloads = await compute.detach_blocks("h", BLOCK, 0, 2)
        async with _serving(running, ComputeActor(*tiny_llama)) as compute:
            with pytest.raises(kv_state.NotReconstructable):
                await compute.prefill("r", [1, 2], prefix=payloads)
            assert (await compute.statistics()).num_live == 0

    async def test_text_round_trip_and_model_info(self, running, tiny_llama):
        """The tokenizer helpers round-trip text; Describe reports the model."""
        model, tokenizer = tiny_llama
        async with _serving(running, ComputeActor(model, tokenizer)) as compute:
            tokens = await compute.encode("hello, world", add_special_tokens=False)
            assert await compute.decode_text(tokens) == "hello, world"
            info = await compute.describe()
        assert info.vocab_size == 259
        assert info.cache_layers == ("KVCache", "KVCache")
        assert not info.has_recurrent
        assert info.eos_token_ids

    async def test_one_trace_event_per_message(self, running, tiny_llama):
        """Each handled message emits message.handled with its request id."""
        model, tokenizer = tiny_llama
        with capture_logs() as logs:
            actor = ComputeActor(model, tokenizer, trace=True, prefill_chunk=32)
            async with _serving(running, actor) as compute:
                first = await compute.prefill("t", _prompt(100))
                await compute.decode_step("t", first.token)
                await compute.drop("t")
        handled = [(e["message"], e["request_id"]) for e in logs if e["event"] == "message.handled"]
        assert handled == [("Prefill", "t"), ("DecodeStep", "t"), ("Drop", "t")]
