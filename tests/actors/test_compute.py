"""The compute actor on real tiny mlx-lm models: parity, batching, fairness, cancellation, faults.

Parity tolerance: greedy tokens are equal, and log-probabilities agree within
``ATOL = 1e-4`` absolute (float32 models). Batched decoding merges the
requests' caches with mlx-lm's batch caches; on these models that is
bit-identical to decoding alone, but a warm prefill runs the same positions
in differently sized chunks, so sums may round differently. A greedy token
is compared only where the top two log-probabilities of the reference are
further apart than the tolerance (else either token is right); none of the
prompts here comes that close.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Optional

import anyio
import anyio.from_thread
import anyio.lowlevel
import attrs
import mlx.core as mx
import numpy as np
import pytest
from structlog.testing import capture_logs

from mlxkv.actors.actor import ActorFailed
from mlxkv.actors.compute import (
    ComputeActor,
    ComputeFailed,
    ComputeHandle,
    Event,
    Failed,
    Finished,
    Prefilled,
    Published,
    RequestSpec,
    RunnerConfig,
    SchedulingConfig,
    Token,
    events_needed,
)
from mlxkv.actors.mlx_thread import MLXThreadStopped
from mlxkv.actors.penalties import Penalties
from mlxkv.actors.sampling import Sampling
from mlxkv.cache import kv_state
from mlxkv.cache.errors import InvalidInput

from device_arithmetic import LOGITS_ATOL, ON_CPU
from greedy import assert_same_greedy

ATOL = LOGITS_ATOL
BLOCK = 32
MODELS = ["tiny_llama", "sliding_llama", "hybrid_model"]
POISON = 255  # prompts stay below 250; a model wrapper fails on this token


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 37 + salt * 11 + (i // 7) ** 2) % 250 for i in range(n)]


class Wrapped:
    """A real model whose calls first run ``before(inputs, cache)`` on the MLX thread.

    The first call passes straight through: it is the runner's start-up probe
    (one token, to measure the model's KV bytes per token).
    """

    def __init__(self, model: Any, before: Callable[[Any, Any], None], make_cache: Any = None) -> None:
        self._model = model
        self._before = before
        self._probed = False
        if make_cache is not None:
            self.make_cache = make_cache

    def __call__(self, inputs: Any, cache: Any = None, **kwargs: Any) -> Any:
        if self._probed:
            self._before(inputs, cache)
        self._probed = True
        return self._model(inputs, cache=cache, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class Gate:
    """Holds the first model call it sees until released; says (via the loop) when held."""

    def __init__(self) -> None:
        self.held = anyio.Event()
        self.release = threading.Event()
        self._token = anyio.lowlevel.current_token()
        self._armed = True

    def __call__(self, _inputs: Any, _cache: Any) -> None:
        if self._armed:
            self._armed = False
            anyio.from_thread.run_sync(self.held.set, token=self._token)
            self.release.wait(10)


class Fatal(BaseException):
    """Escapes a model call the way a dying MLX runtime would."""


def _poisoned(inputs: Any, _cache: Any) -> None:
    if POISON in np.array(inputs).ravel().tolist():
        raise RuntimeError("injected model failure")


@attrs.frozen
class Run:
    """Everything one request's event stream carried."""

    events: list[Any]

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events if isinstance(e, Token) for t in e.tokens]

    @property
    def logprobs(self) -> list[np.ndarray]:
        return [np.array(lp) for e in self.events if isinstance(e, Token) for lp in e.logprobs]

    @property
    def prefilled(self) -> Prefilled:
        return next(e for e in self.events if isinstance(e, Prefilled))

    @property
    def published(self) -> list[kv_state.BlockPayload]:
        blocks: list[kv_state.BlockPayload] = []
        for event in self.events:
            if isinstance(event, Published):
                assert event.start == len(blocks), "blocks are published in order, without gaps"
                blocks.extend(event.payloads)
        return blocks

    @property
    def final(self) -> Any:
        return self.events[-1]


def _actor(model_and_tokenizer: tuple[Any, Any], **options: Any) -> ComputeActor:
    """An actor over the model; ``options`` are the scheduling's, the runner's
    and the actor's, each by name."""
    parts: dict[str, dict[str, Any]] = {"scheduling": {}, "runner_config": {}, "actor": {}}
    for name, value in options.items():
        if name in attrs.fields_dict(SchedulingConfig):
            parts["scheduling"][name] = value
        elif name in attrs.fields_dict(RunnerConfig):
            parts["runner_config"][name] = value
        else:
            parts["actor"][name] = value
    return ComputeActor.with_model(
        *model_and_tokenizer,
        scheduling=SchedulingConfig(**parts["scheduling"]),
        runner_config=RunnerConfig(**parts["runner_config"]),
        **parts["actor"],
    )


async def _start(compute: ComputeHandle, request_id: str, prompt: list[int], *, events: Any, **spec: Any) -> None:
    """Start ``RequestSpec(request_id=..., prompt=..., **spec)``; its events go to ``events``."""
    await compute.start(RequestSpec(request_id=request_id, prompt=prompt, **spec), events=events)


@asynccontextmanager
async def _serving(running: Any, actor: ComputeActor) -> AsyncIterator[ComputeHandle]:
    async with running(actor) as ref:
        yield ComputeHandle(ref)


async def _run(
    compute: ComputeHandle,
    request_id: str,
    prompt: list[int],
    *,
    max_tokens: int = 8,
    started: Optional[anyio.Event] = None,
    **kwargs: Any,
) -> Run:
    """Start a request and collect its events until the actor closes the stream."""
    kwargs.setdefault("block_size", BLOCK)
    kwargs.setdefault("keep_logits", True)
    events_in, events = anyio.create_memory_object_stream[Event](
        events_needed(len(prompt), max_tokens, kwargs["block_size"])
    )
    await _start(compute, request_id, prompt, events=events_in, max_tokens=max_tokens, **kwargs)
    received = []
    async with events:
        async for event in events:
            received.append(event)
            if started is not None and isinstance(event, Token):
                started.set()
    return Run(received)


def _assert_same(run: Run, reference: Run, *, prefix: bool = False) -> None:
    """Equal greedy tokens and log-probabilities within ATOL, step by step --
    up to where the tokens part, if they do: there too the log-probabilities
    must agree within ATOL, which puts the two choices within 2 ATOL of each
    other in either run (a tie the device's arithmetic may order either
    way: ``device_arithmetic``), and nothing after it is comparable.
    ``prefix``: ``run`` ended early (cancelled, failed): ``reference`` is
    compared as far as ``run`` went."""
    parted = next((i for i, (a, b) in enumerate(zip(run.tokens, reference.tokens)) if a != b), None)
    if parted is None:
        assert run.tokens == (reference.tokens[: len(run.tokens)] if prefix else reference.tokens)
        compared = len(run.tokens)
    else:
        compared = parted + 1
        assert min(len(run.logprobs), len(reference.logprobs)) >= compared, "a parting needs its log-probabilities"
    for mine, theirs in zip(run.logprobs[:compared], reference.logprobs[:compared]):
        np.testing.assert_allclose(mine, theirs, atol=ATOL, rtol=0)


class TestAssertSame:
    """The comparison of two runs the tests below make."""

    @staticmethod
    def _run(tokens: list[int], logprobs: list[list[float]]) -> Run:
        return Run([Token(tokens=tuple(tokens), logprobs=tuple(np.array(lp) for lp in logprobs))])

    def test_runs_that_part_where_their_log_probabilities_agree_pass(self):
        """Parting at a tie: the log-probabilities there agree within ATOL;
        what follows the parting is not compared."""
        tie = [-1.0, -1.0 - ATOL / 2, -5.0]
        mine = self._run([0, 1, 2], [tie, [-1.0 - ATOL / 2, -1.0, -5.0], [-1.0, -2.0, -3.0]])  # chose 1
        theirs = self._run([0, 0, 0], [tie, [-1.0, -1.0 - ATOL / 2, -5.0], [-3.0, -2.0, -1.0]])  # chose 0
        _assert_same(mine, theirs)

    def test_anything_else_fails(self):
        """Log-probabilities apart at the parting, a parting without them, or
        equal tokens of different counts fail."""
        lp = [-1.0, -1.0, -5.0]
        mine = self._run([0, 1], [lp, lp])
        with pytest.raises(AssertionError, match="Not equal to tolerance"):
            _assert_same(mine, self._run([0, 0], [lp, [-1.0, -1.5, -5.0]]))
        with pytest.raises(AssertionError, match="needs its log-probabilities"):
            _assert_same(mine, Run([Token(tokens=(0, 0), logprobs=(np.array(lp),))]))
        with pytest.raises(AssertionError):
            _assert_same(mine, self._run([0, 1, 2], [lp, lp, lp]))
        _assert_same(mine, self._run([0, 1, 2], [lp, lp, lp]), prefix=True)  # mine ended early
        with pytest.raises(AssertionError):
            _assert_same(self._run([0, 1, 2], [lp, lp, lp]), mine, prefix=True)  # ran past the reference


class TestGeneration:
    @pytest.mark.parametrize("model_name", MODELS)
    async def test_decoding_equals_mlx_lm_generate(self, request, running, model_name):
        """Greedy tokens and log-probabilities through the actor equal mlx-lm's generate_step."""
        from mlx_lm.generate import generate_step

        model, tokenizer = request.getfixturevalue(model_name)
        prompt = _prompt(150, salt=3)
        reference = [
            (int(token), np.array(logprobs))
            for token, logprobs in generate_step(mx.array(prompt), model, max_tokens=8)
        ]
        async with _serving(running, _actor((model, tokenizer))) as compute:
            run = await _run(compute, "r", prompt, max_tokens=8, stop_tokens=frozenset())
        # The same tokens, or parted at a tie (tests/greedy.py): log-probabilities
        # compared over the context both saw.
        shared = assert_same_greedy(model, prompt, [t for t, _ in reference], run.tokens)
        for mine, (_, theirs) in list(zip(run.logprobs, reference))[: shared + 1]:
            np.testing.assert_allclose(mine, theirs, atol=ATOL, rtol=0)

    async def test_events_arrive_in_order_and_cover_the_request(self, running, tiny_llama):
        """Blocks per chunk, the prefilled mark, the first token, the last chunk's
        blocks (none here) and the prompt-published mark, each token, the
        answer's blocks, then Finished."""
        prompt = _prompt(150)
        actor = _actor(tiny_llama, prefill_chunk=64)
        async with _serving(running, actor) as compute:
            run = await _run(compute, "r", prompt, max_tokens=20, stop_tokens=frozenset())
            stats = await compute.statistics()
        kinds = [type(e).__name__ for e in run.events]
        tokens = kinds.count("Token")
        assert kinds == [
            "Published", "Published", "Prefilled", "Token", "PromptPublished",
            *["Token"] * (tokens - 1), "Published", "Finished",
        ]
        assert len(run.tokens) == 20 and tokens < 20  # decode bursts send several at once
        assert run.final == Finished(reason="length", num_stored=160)
        # The prompt's 4 full blocks as the chunks ending at 64 and 128+ were
        # computed, then the answer's: prompt + 20 tokens = 170 -> 5 blocks.
        assert [len(e.payloads) for e in run.events if isinstance(e, Published)] == [2, 2, 1]
        assert [p.start for p in run.published] == [0, 32, 64, 96, 128]
        # Each batch of blocks names its tokens: the prompt's, then the answer's.
        published = [e for e in run.events if isinstance(e, Published)]
        assert [list(e.tokens) for e in published] == [
            prompt[:64], prompt[64:128], (prompt + run.tokens)[128:160]
        ]
        assert run.prefilled.num_cached == 0 and not run.prefilled.cold_fallback
        assert stats.num_prefill_tokens == 150 and stats.num_published_blocks == 5
        assert stats.num_live == 0

    async def test_the_last_chunk_publishes_after_the_first_token(self, running, tiny_llama):
        """A one-chunk prompt: its first token is out before its blocks are sliced."""
        prompt = _prompt(100)
        async with _serving(running, _actor(tiny_llama)) as compute:
            run = await _run(compute, "r", prompt, max_tokens=3, stop_tokens=frozenset())
        kinds = [type(e).__name__ for e in run.events]
        assert kinds[:4] == ["Prefilled", "Token", "Published", "PromptPublished"]
        published = run.events[2]
        assert published.start == 0 and len(published.payloads) == 3
        assert list(published.tokens) == prompt[:96]

    @pytest.mark.parametrize("model_name", MODELS)
    async def test_warm_request_equals_cold(self, request, running, model_name):
        """A request rebuilt from another's published blocks decodes like the cold one."""
        model_and_tokenizer = request.getfixturevalue(model_name)
        prompt = _prompt(200)
        actor = _actor(model_and_tokenizer, prefill_chunk=64, keep_caches=False)
        async with _serving(running, actor) as compute:
            cold = await _run(compute, "cold", prompt, stop_tokens=frozenset())
            blocks = cold.published[: (len(prompt) - 1) // BLOCK]
            assert kv_state.num_reconstructable_blocks(blocks) == len(blocks) == 6
            warm = await _run(compute, "warm", prompt, prefix=blocks, stop_tokens=frozenset())
            stats = await compute.statistics()
        assert warm.prefilled.num_cached == 6 * BLOCK
        _assert_same(warm, cold)
        assert stats.num_cached_tokens == 6 * BLOCK and stats.num_kept_cache_reuses == 0

    async def test_every_hybrid_block_carries_its_snapshot(self, running, hybrid_model):
        """A hybrid's published blocks (prompt and answer) can each end a reused prefix."""
        async with _serving(running, _actor(hybrid_model)) as compute:
            info = await compute.describe()
            run = await _run(compute, "h", _prompt(140), max_tokens=30, stop_tokens=frozenset())
        assert info.has_recurrent and info.state_bytes > 0
        blocks = run.published
        assert len(blocks) == (140 + 30) // BLOCK
        assert all(block.has_snapshots for block in blocks)
        assert kv_state.num_reconstructable_blocks(blocks) == len(blocks)

    async def test_published_blocks_are_owned_copies(self, running, tiny_llama):
        """Later decoding leaves published payloads unchanged."""
        async with _serving(running, _actor(tiny_llama)) as compute:
            first = await _run(compute, "a", _prompt(100), max_tokens=2)
            before = [np.array(a) for p in first.published for group in p.arrays for a in group]
            await _run(compute, "b", _prompt(100), prefix=first.published[:3], max_tokens=20)
        after = [np.array(a) for p in first.published for group in p.arrays for a in group]
        for a, b in zip(before, after):
            np.testing.assert_array_equal(a, b)

    async def test_held_blocks_are_not_published_again(self, running, tiny_llama):
        """Blocks the request already holds are skipped; publishing resumes after them."""
        prompt = _prompt(3 * BLOCK)
        async with _serving(running, _actor(tiny_llama)) as compute:
            first = await _run(compute, "a", prompt, max_tokens=2, stop_tokens=frozenset())
            # The prompt's last block is held but not restored: its last token is recomputed.
            again = await _run(compute, "b", prompt, prefix=first.published[:2], max_tokens=BLOCK, stop_tokens=frozenset())
            held = await _run(
                compute, "c", prompt, prefix=first.published[:2], held_blocks=3, max_tokens=BLOCK, stop_tokens=frozenset()
            )
        assert [e.start for e in again.events if isinstance(e, Published)] == [2, 3]
        assert [e.start for e in held.events if isinstance(e, Published)] == [3]
        _assert_same(held, again)
        _assert_same(first, again, prefix=True)

    async def test_a_stop_token_ends_the_request_unsent(self, running, tiny_llama):
        """A stop token finishes with reason 'stop' and is not emitted."""
        async with _serving(running, _actor(tiny_llama)) as compute:
            free = await _run(compute, "free", _prompt(60), max_tokens=12, stop_tokens=frozenset())
            stop = free.tokens[5]
            run = await _run(compute, "stop", _prompt(60), max_tokens=12, stop_tokens=frozenset({stop}))
        assert run.tokens == free.tokens[: free.tokens.index(stop)]
        assert isinstance(run.final, Finished) and run.final.reason == "stop"

    async def test_foreign_payloads_fall_back_to_cold(self, running, tiny_llama, hybrid_model):
        """Payloads of another model's layout are not half-used: the prompt is computed whole."""
        async with _serving(running, _actor(hybrid_model)) as compute:
            foreign = (await _run(compute, "h", _prompt(100), max_tokens=1)).published
        # Without the last cache, which holds these tokens and would be used instead.
        async with _serving(running, _actor(tiny_llama, keep_caches=False)) as compute:
            cold = await _run(compute, "cold", _prompt(100))
            with capture_logs() as logs:
                run = await _run(compute, "r", _prompt(100), prefix=foreign[:2])
            stats = await compute.statistics()
        assert run.prefilled.cold_fallback and run.prefilled.num_cached == 0
        _assert_same(run, cold)
        assert stats.num_cold_fallbacks == 1
        assert [log["event"] for log in logs] == ["prefill.cold_fallback"]


class TestLastCache:
    """The caches of the requests that finished last, cut back for the next one
    that brings its prefix (instead of rebuilding that prefix from blocks)."""

    async def test_the_next_turn_takes_the_last_cache_and_equals_a_rebuild(self, running, tiny_llama):
        """Turn 2 (turn 1's prompt, answer and more) reuses turn 1's cache; results equal a rebuild."""
        first_prompt = _prompt(100)
        runs: dict[bool, tuple[Run, Any]] = {}
        for keep in (True, False):
            async with _serving(running, _actor(tiny_llama, keep_caches=keep)) as compute:
                first = await _run(compute, "t1", first_prompt, max_tokens=40, stop_tokens=frozenset())
                second_prompt = first_prompt + first.tokens + _prompt(30, salt=5)
                # Turn 1's 140 tokens in the KV: blocks 0..3 (128 tokens) are the prefix.
                second = await _run(
                    compute, "t2", second_prompt, prefix=first.published[:4], max_tokens=12, stop_tokens=frozenset()
                )
                runs[keep] = (second, await compute.statistics())
        (reused, stats), (rebuilt, cold_stats) = runs[True], runs[False]
        assert stats.num_kept_cache_reuses == 1 and cold_stats.num_kept_cache_reuses == 0
        # The last cache holds all of turn 1 (prompt and answer); the blocks only 128 tokens.
        assert (reused.prefilled.num_cached, rebuilt.prefilled.num_cached) == (140, 4 * BLOCK)
        _assert_same(reused, rebuilt)
        starts = [[e.start for e in run.events if isinstance(e, Published)] for run in (reused, rebuilt)]
        assert starts[0] == starts[1] == [4]  # 182 tokens in all: block 4 is the last full one

    async def test_another_namespace_takes_only_its_prefix(self, running, tiny_llama):
        """Across namespaces (cache salts) only the prefix the request brings blocks for is used."""
        prompt = _prompt(4 * BLOCK + 10)
        async with _serving(running, _actor(tiny_llama)) as compute:
            first = await _run(compute, "a", prompt, max_tokens=4, namespace=("tenant-a", None))
            other = await _run(
                compute, "b", prompt, prefix=first.published[:2], max_tokens=4, namespace=("tenant-b", None)
            )
            same = await _run(compute, "c", prompt, max_tokens=4, namespace=("tenant-b", None))
            stats = await compute.statistics()
        # "b" may use no more of "a"'s cache than its blocks give: it rebuilds them.
        assert other.prefilled.num_cached == 2 * BLOCK
        # "c" brings no blocks, but "b" (its namespace) left the whole prompt but its last token.
        assert same.prefilled.num_cached == len(prompt) - 1
        assert stats.num_kept_cache_reuses == 1
        _assert_same(other, first)
        _assert_same(same, first)

    async def test_blocks_taken_from_the_last_cache_are_published(self, running, tiny_llama):
        """Blocks the request neither brought nor holds, got from the last cache, are
        handed out like computed ones (so the pool gets them)."""
        prompt = _prompt(3 * BLOCK + 10)
        async with _serving(running, _actor(tiny_llama)) as compute:
            first = await _run(compute, "a", prompt, max_tokens=2)
            again = await _run(compute, "b", prompt, max_tokens=2)
        assert again.prefilled.num_cached == len(prompt) - 1
        assert [p.start for p in again.published] == [p.start for p in first.published] == [0, 32, 64]
        for mine, theirs in zip(again.published, first.published):
            for a, b in zip(mine.arrays, theirs.arrays):
                for x, y in zip(a, b):
                    np.testing.assert_allclose(np.array(x), np.array(y), atol=ATOL, rtol=0)

    async def test_an_answer_ended_by_a_stop_token_continues_exactly(self, running, tiny_llama):
        """The stop token was fed but is not part of the answer: the next turn,
        prompt + answer + more, reuses prompt and answer only, and equals a rebuild."""
        prompt = _prompt(70)
        async with _serving(running, _actor(tiny_llama)) as compute:
            free = await _run(compute, "free", prompt, max_tokens=12, stop_tokens=frozenset())
        stop = free.tokens[6]
        answer = free.tokens[: free.tokens.index(stop)]
        turn2 = prompt + answer + _prompt(20, salt=4)
        results = {}
        for keep in (True, False):
            async with _serving(running, _actor(tiny_llama, keep_caches=keep)) as compute:
                first = await _run(compute, "t1", prompt, max_tokens=12, stop_tokens=frozenset({stop}))
                assert first.tokens == answer and first.final.reason == "stop"
                results[keep] = await _run(compute, "t2", turn2, prefix=first.published[:2], max_tokens=6)
        assert results[True].prefilled.num_cached == len(prompt) + len(answer)
        _assert_same(results[True], results[False])

    async def test_a_request_that_ends_at_its_first_token_is_kept_too(self, running, tiny_llama):
        """max_tokens=1 finishes in the prefill; the same prompt again reuses that cache."""
        prompt = _prompt(3 * BLOCK + 5)
        async with _serving(running, _actor(tiny_llama)) as compute:
            first = await _run(compute, "a", prompt, max_tokens=1)
            again = await _run(compute, "b", prompt, prefix=first.published, max_tokens=1)
            stats = await compute.statistics()
        assert stats.num_kept_cache_reuses == 1
        _assert_same(again, first)

    async def test_each_request_takes_the_kept_cache_that_shares_most_of_it(self, running, tiny_llama):
        """Several finished requests' caches are kept: each later request takes
        the one that shares most of its tokens (not only the last one), and a
        request with other tokens rebuilds."""
        prompt, other = _prompt(4 * BLOCK + 3), _prompt(4 * BLOCK + 3, salt=9)
        async with _serving(running, _actor(tiny_llama)) as compute:
            first = await _run(compute, "a", prompt, max_tokens=2)
            other_first = await _run(compute, "o", other, max_tokens=2)
            # "o" finished last; "a"'s cache is kept too.
            again = await _run(compute, "b", prompt, prefix=first.published[:2], max_tokens=2)
            other_again = await _run(compute, "c", other, prefix=other_first.published[:2], max_tokens=2)
            assert (await compute.statistics()).num_kept_cache_reuses == 2
            stranger = await _run(compute, "s", _prompt(4 * BLOCK + 3, salt=5), max_tokens=2)
            stats = await compute.statistics()
        assert stats.num_kept_cache_reuses == 2 and stranger.prefilled.num_cached == 0
        assert again.prefilled.num_cached == other_again.prefilled.num_cached == len(prompt) - 1
        _assert_same(again, first)
        _assert_same(other_again, other_first)

    @pytest.mark.parametrize("shared_prefix", [True, False])
    @pytest.mark.parametrize("blocks", [3, 0], ids=["with-blocks", "no-blocks"])
    async def test_a_request_that_uses_part_of_a_kept_cache_leaves_it_to_its_continuation(
        self, running, tiny_llama, shared_prefix, blocks
    ):
        """A request sharing only a kept cache's first tokens (another
        conversation over the same system prompt) computes on arrays of its
        own: the kept cache stays, and its own next turn then takes all of it
        and equals a rebuild -- whether the request brings blocks (then over a
        shared prefix it copies its own tokens anyway) or not (then it writes
        after the kept cache's tokens). (With one cache kept and handed over,
        the first request took it and turn 2 recomputed what no block holds.)"""
        system = _prompt(3 * BLOCK + 7)
        first_prompt = system + _prompt(20, salt=1)
        results = {}
        for keep in (True, False):
            actor = _actor(tiny_llama, keep_caches=keep, shared_prefix=shared_prefix)
            async with _serving(running, actor) as compute:
                first = await _run(compute, "t1", first_prompt, max_tokens=12, stop_tokens=frozenset())
                neighbour = await _run(
                    compute, "n1", system + _prompt(20, salt=2), prefix=first.published[:blocks], max_tokens=12
                )
                second_prompt = first_prompt + first.tokens + _prompt(10, salt=3)
                second = await _run(compute, "t2", second_prompt, prefix=first.published[:4], max_tokens=8)
                results[keep] = (neighbour, second, await compute.statistics())
        (neighbour, second, stats), (cold_neighbour, cold_second, _) = results[True], results[False]
        assert stats.num_kept_cache_reuses == 2
        assert neighbour.prefilled.num_cached == len(system)
        assert second.prefilled.num_cached == len(first_prompt) + 12  # turn 1's prompt and answer
        _assert_same(neighbour, cold_neighbour)
        _assert_same(second, cold_second)

    @pytest.mark.parametrize("bound", ["count", "bytes"])
    async def test_the_kept_caches_are_bounded(self, running, tiny_llama, monkeypatch, bound):
        """At most MAX_KEPT_CACHES, of at most ``kept_cache_memory`` bytes
        together, are kept, the most recent (and always the last one): beyond,
        the oldest go."""
        from mlxkv.actors import kept_caches

        options = {}
        if bound == "count":
            monkeypatch.setattr(kept_caches, "MAX_KEPT_CACHES", 2)
        else:
            options["kept_cache_memory"] = 1
        prompts = [_prompt(3 * BLOCK + 3, salt=k) for k in range(3)]
        async with _serving(running, _actor(tiny_llama, **options)) as compute:
            firsts = [await _run(compute, f"p{k}", p, max_tokens=2) for k, p in enumerate(prompts)]
            # Newest first, so that taking one does not make room for an older one.
            agains = [
                await _run(compute, f"q{k}", prompts[k], prefix=firsts[k].published[:1], max_tokens=2)
                for k in (2, 1, 0)
            ]
        took = [run.prefilled.num_cached == len(prompts[k]) - 1 for run, k in zip(agains, (2, 1, 0))]
        assert took == ([True, True, False] if bound == "count" else [True, False, False])

    @pytest.mark.parametrize("model_name", ["sliding_llama", "hybrid_model"])
    async def test_caches_that_cannot_be_cut_back_are_not_kept(self, request, running, model_name):
        """Sliding-window and recurrent layers cannot be cut back exactly: always rebuilt."""
        model_and_tokenizer = request.getfixturevalue(model_name)
        prompt = _prompt(4 * BLOCK + 3)
        async with _serving(running, _actor(model_and_tokenizer)) as compute:
            first = await _run(compute, "a", prompt, max_tokens=2)
            again = await _run(compute, "b", prompt, prefix=first.published[:3], max_tokens=2)
            stats = await compute.statistics()
        assert stats.num_kept_cache_reuses == 0 and stats.num_cached_tokens == 3 * BLOCK
        _assert_same(again, first)

    def test_keep_caches_must_be_a_bool(self, tiny_llama):
        with pytest.raises(InvalidInput, match="keep_caches"):
            _actor(tiny_llama, keep_caches=1)


class TestBatching:
    @pytest.mark.parametrize("model_name", MODELS)
    async def test_concurrent_requests_share_model_calls_exactly(self, request, running, model_name):
        """Requests decoding together take one model call per step and give their solo results."""
        model_and_tokenizer = request.getfixturevalue(model_name)
        prompts = [_prompt(n, salt=n) for n in (37, 120, 260, 64)]
        async with _serving(running, _actor(model_and_tokenizer)) as compute:
            alone = [await _run(compute, f"a{i}", p, max_tokens=16, stop_tokens=frozenset()) for i, p in enumerate(prompts)]
            solo_steps = (await compute.statistics()).num_decode_steps
            together: list[Optional[Run]] = [None] * len(prompts)

            async def one(i: int) -> None:
                together[i] = await _run(compute, f"t{i}", prompts[i], max_tokens=16, stop_tokens=frozenset())

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            stats = await compute.statistics()
        for mine, theirs in zip(together, alone):
            assert mine is not None
            _assert_same(mine, theirs)
        batched_steps = stats.num_decode_steps - solo_steps
        assert batched_steps < solo_steps  # 4 x 15 steps alone; far fewer together
        assert stats.batched and stats.mean_batch_size > 1

    @pytest.mark.parametrize("streams", [1, 3])
    @pytest.mark.parametrize("model_name", ["tiny_llama", "sliding_llama", "hybrid_model"])
    async def test_requests_arriving_together_prefill_in_one_call(self, request, running, model_name, streams):
        """Requests arriving together, each over its own cached prefix and with
        its own length, prefill in one model call (plain and sliding-window
        KV; a hybrid's recurrent layers one request at a time) and give their
        solo results; so do they spread over three prefill streams (99
        tokens: three calls of at least 32 side by side, one of two rows)."""
        model_and_tokenizer = request.getfixturevalue(model_name)
        shared = _prompt(160, salt=1)
        actor = _actor(model_and_tokenizer, keep_caches=False, prefill_streams=streams)
        async with _serving(running, actor) as compute:
            info = await compute.describe()
            assert info.prefill_streams == (1 if model_name == "hybrid_model" else streams)
            blocks = (await _run(compute, "seed", shared, max_tokens=1, stop_tokens=frozenset())).published
            # Prefixes of 0, 2, 3 and 4 blocks, own tails of different lengths.
            cases = [(k, shared[: k * BLOCK] + _prompt(9 + 7 * k, salt=10 + k)) for k in (0, 2, 3, 4)]
            alone = [
                await _run(compute, f"a{k}", p, prefix=blocks[:k], max_tokens=6, stop_tokens=frozenset())
                for k, p in cases
            ]
            before = await compute.statistics()
            together: dict[int, Run] = {}

            async def one(k: int, prompt: list[int]) -> None:
                together[k] = await _run(compute, f"t{k}", prompt, prefix=blocks[:k], max_tokens=6, stop_tokens=frozenset())

            async with anyio.create_task_group() as tg:
                for k, prompt in cases:
                    tg.start_soon(one, k, prompt)
            stats = await compute.statistics()
        for (k, _), theirs in zip(cases, alone):
            _assert_same(together[k], theirs)
            assert together[k].prefilled.num_cached == k * BLOCK
        calls = stats.num_prefill_calls - before.num_prefill_calls
        chunks = stats.num_prefill_chunks - before.num_prefill_chunks
        if model_name == "hybrid_model":
            assert calls == chunks  # one request per call
        else:
            assert chunks == 4 and calls == 1

    async def test_requests_join_and_leave_without_disturbing_others(self, running, tiny_llama):
        """A request that arrives mid-decode and one that ends early leave the rest exact."""
        specs = [("long", _prompt(90, 1), 40), ("short", _prompt(50, 2), 5), ("late", _prompt(70, 3), 20)]
        async with _serving(running, _actor(tiny_llama)) as compute:
            alone = {name: await _run(compute, f"alone-{name}", p, max_tokens=n, stop_tokens=frozenset()) for name, p, n in specs}
            results: dict[str, Run] = {}
            long_started = anyio.Event()

            async def one(name: str, prompt: list[int], max_tokens: int, started: Optional[anyio.Event] = None) -> None:
                results[name] = await _run(compute, name, prompt, max_tokens=max_tokens, started=started, stop_tokens=frozenset())

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, *specs[0], long_started)
                tg.start_soon(one, *specs[1])
                await long_started.wait()
                tg.start_soon(one, *specs[2])
        for name, _, _ in specs:
            _assert_same(results[name], alone[name])

    @pytest.mark.skipif(
        not ON_CPU, reason="on a GPU a row's logits move with the batch's size, so its seeded draws may too"
    )
    async def test_seeded_sampling_ignores_the_batch(self, running, tiny_llama):
        """A seeded request draws the same tokens alone and beside others; another seed differs."""
        sampling = Sampling(temperature=1.5, top_k=50, seed=7)
        prompt = _prompt(60)
        async with _serving(running, _actor(tiny_llama)) as compute:
            alone = await _run(compute, "alone", prompt, sampling=sampling, max_tokens=16, stop_tokens=frozenset())
            runs: dict[str, Run] = {}

            async def one(name: str, prompt: list[int], sampling: Sampling) -> None:
                runs[name] = await _run(compute, name, prompt, sampling=sampling, max_tokens=16, stop_tokens=frozenset())

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "seeded", prompt, sampling)
                tg.start_soon(one, "greedy", _prompt(80, 1), Sampling())
                tg.start_soon(one, "other", prompt, Sampling(temperature=1.5, top_k=50, seed=8))
        assert runs["seeded"].tokens == alone.tokens
        assert runs["other"].tokens != alone.tokens

    async def test_a_layout_mlx_lm_cannot_batch_decodes_one_at_a_time(self, running, tiny_llama):
        """A cache class without a batch form (mlx-lm's ConcatenateKVCache) decodes each
        request alone, visibly; its KV cannot be cut into blocks either."""
        from mlx_lm.models.cache import ConcatenateKVCache

        model, tokenizer = tiny_llama
        plain = Wrapped(model, lambda *_: None, make_cache=lambda: [ConcatenateKVCache() for _ in model.layers])
        prompts = [_prompt(60, 1), _prompt(90, 2), _prompt(40, 3)]
        async with _serving(running, ComputeActor.with_model(plain, tokenizer)) as compute:
            info = await compute.describe()
            alone = [await _run(compute, f"a{i}", p, stop_tokens=frozenset()) for i, p in enumerate(prompts)]
            together: dict[int, Run] = {}

            async def one(i: int) -> None:
                together[i] = await _run(compute, f"t{i}", prompts[i], stop_tokens=frozenset())

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            stats = await compute.statistics()
        assert info.cache_layers == ("ConcatenateKVCache", "ConcatenateKVCache") and not info.batchable
        for i in range(len(prompts)):
            _assert_same(together[i], alone[i])
            assert together[i].published == []
        assert not stats.batched and stats.mean_batch_size == 1.0
        assert stats.num_unpublishable == 2 * len(prompts)

    async def test_a_long_prefill_does_not_starve_decoding(self, running, tiny_llama):
        """Decode steps of one request run between the chunks of another's prefill."""
        actor = _actor(tiny_llama, prefill_chunk=32)
        tokens_during_prefill = 0
        prefilling = anyio.Event()
        async with _serving(running, actor) as compute:
            decoder_started = anyio.Event()

            async def decoder() -> None:
                nonlocal tokens_during_prefill
                events_in, events = anyio.create_memory_object_stream[Event](200)
                await _start(compute, "decoder", _prompt(40), events=events_in, max_tokens=150, block_size=BLOCK, stop_tokens=frozenset())
                async with events:
                    async for event in events:
                        if isinstance(event, Token):
                            decoder_started.set()
                            tokens_during_prefill += prefilling.is_set() and not done.is_set()

            done = anyio.Event()

            async def long_prefill() -> None:
                await decoder_started.wait()
                prefilling.set()
                await _run(compute, "long", _prompt(640, salt=5), max_tokens=1)  # 20 chunks
                done.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(decoder)
                tg.start_soon(long_prefill)
            stats = await compute.statistics()
        assert stats.num_prefill_chunks >= 20
        assert tokens_during_prefill >= 15  # about one per chunk


class TestTokenLogprobs:
    async def test_each_token_comes_with_its_record_where_asked(self, running, tiny_llama):
        """Requests decoding side by side, greedy and sampled, asking for 0 to
        5 alternatives or nothing: each token of one that asks comes with its
        record -- the token itself, its log-probability and the most likely
        tokens of the very distribution it was drawn from (the kept
        log-probabilities) -- the first one (from the prefill) and the
        decoded ones alike; one that does not ask gets none."""
        cases = {
            "greedy5": (_prompt(70, 1), Sampling(), 5),
            "sampled3": (_prompt(90, 2), Sampling(temperature=1.2, seed=4), 3),
            "zero": (_prompt(50, 3), Sampling(temperature=0.7), 0),
            "none": (_prompt(60, 4), Sampling(), None),
            "one_token": (_prompt(40, 5), Sampling(), 2),
        }
        runs: dict[str, Run] = {}
        async with _serving(running, _actor(tiny_llama)) as compute:

            async def one(name: str) -> None:
                prompt, sampling, width = cases[name]
                max_tokens = 1 if name == "one_token" else 12
                runs[name] = await _run(
                    compute, name, prompt, sampling=sampling, top_logprobs=width, max_tokens=max_tokens,
                    stop_tokens=frozenset(),
                )  # fmt: skip

            async with anyio.create_task_group() as tg:
                for name in cases:
                    tg.start_soon(one, name)
        for name, (_, _, width) in cases.items():
            run = runs[name]
            records = [r for e in run.events if isinstance(e, Token) for r in e.token_logprobs]
            if width is None:
                assert records == []
                continue
            assert [r.token for r in records] == run.tokens
            for record, full in zip(records, run.logprobs):
                assert record.logprob == pytest.approx(float(full[record.token]), abs=1e-6)
                assert len(record.top) == width
                best = np.sort(full)[::-1][:width]
                np.testing.assert_allclose([value for _, value in record.top], best, atol=1e-6, rtol=0)
                assert all(abs(float(full[t]) - value) <= 1e-6 for t, value in record.top)
            if width and name.startswith("greedy"):
                assert all(record.top[0][0] == record.token for record in records)


class TestPromptLogprobs:
    async def test_the_prompts_records_are_the_models_over_the_whole_prompt(self, running, tiny_llama):
        """A request asking for its prompt's log-probabilities, prefilled in
        chunks beside requests that do not (one over a cached prefix): its
        ``Prefilled`` event holds a record for every prompt token but the
        first, each the log-softmax of the model's one call over the whole
        prompt at the position before it, with the alternatives asked for;
        its answer is the same as without."""
        model, _ = tiny_llama
        prompt = _prompt(150, salt=9)
        logits = model(mx.array(prompt)[None])[0].astype(mx.float32)
        reference = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        async with _serving(running, _actor(tiny_llama, prefill_chunk=32)) as compute:
            seed = await _run(compute, "seed", prompt, max_tokens=1, stop_tokens=frozenset())
            plain = await _run(
                compute, "plain", prompt, prefix=seed.published[:2], max_tokens=6, stop_tokens=frozenset()
            )
            runs: dict[str, Run] = {}

            async def one(name: str, **spec: Any) -> None:
                runs[name] = await _run(compute, name, prompt, max_tokens=6, stop_tokens=frozenset(), **spec)

            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(one, "asks", prompt_logprobs=3))
                tg.start_soon(functools.partial(one, "warm", prefix=seed.published[:3]))
                tg.start_soon(functools.partial(one, "other", prompt_logprobs=0))
        records = runs["asks"].prefilled.prompt_logprobs
        assert [r.token for r in records] == prompt[1:]
        for position, record in enumerate(records):
            row = reference[position]
            assert record.logprob == pytest.approx(float(row[prompt[position + 1]]), abs=ATOL)
            assert len(record.top) == 3
            np.testing.assert_allclose([v for _, v in record.top], np.sort(row)[::-1][:3], atol=ATOL, rtol=0)
        assert all(r.top == () for r in runs["other"].prefilled.prompt_logprobs)
        assert len(runs["other"].prefilled.prompt_logprobs) == len(prompt) - 1
        assert runs["warm"].prefilled.prompt_logprobs == () and runs["warm"].prefilled.num_cached > 0
        assert runs["asks"].prefilled.num_cached == 0
        for name in ("asks", "warm", "other"):
            _assert_same(runs[name], plain)


class _ReferencePenalties:
    """The penalties as an mlx-lm logits processor, in NumPy (for
    ``generate_step``, whose processors see the last prompt token and the
    tokens generated after it)."""

    def __init__(self, penalties: Penalties, prompt: list[int]) -> None:
        self.penalties, self.prompt = penalties, prompt
        self._first: Optional[int] = None

    def __call__(self, tokens: Any, logits: Any) -> Any:
        if self._first is None:
            self._first = tokens.size
        generated = tokens.tolist()[self._first :]
        p = self.penalties
        row = np.array(logits[0].astype(mx.float32))
        for token, bias in p.logit_bias:
            row[token] += bias
        seen = sorted(set(self.prompt) | set(generated))
        row[seen] = np.where(row[seen] > 0, row[seen] / p.repetition_penalty, row[seen] * p.repetition_penalty)
        counts = np.bincount(np.array(generated, dtype=np.int64), minlength=row.size).astype(np.float32)
        row = row - p.presence_penalty * (counts > 0) - p.frequency_penalty * counts
        return mx.array(row)[None].astype(logits.dtype)


class TestPenalties:
    CASES = {
        "presence": Penalties(presence_penalty=1.5),
        "frequency": Penalties(frequency_penalty=0.9),
        "repetition": Penalties(repetition_penalty=1.8),
        "bias": Penalties(logit_bias={7: 4.0, 11: -100.0}),
        "all": Penalties(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={3: 2.0}),
        "none": Penalties(),
    }

    async def test_each_row_is_mlx_lms_with_the_same_processor(self, running, tiny_llama):
        """Requests decoding side by side, each with its own penalties (or
        none): each one's tokens and log-probabilities are mlx-lm's
        ``generate_step`` with the same rule as a logits processor (written
        here in NumPy); and the penalties change what greedy decoding picks."""
        from mlx_lm.generate import generate_step

        model, _ = tiny_llama
        prompts = {name: _prompt(40 + 9 * i, salt=20 + i) for i, name in enumerate(self.CASES)}
        references = {}
        for name, penalties in self.CASES.items():
            processor = _ReferencePenalties(penalties, prompts[name])
            steps = generate_step(mx.array(prompts[name]), model, max_tokens=16, logits_processors=[processor])
            references[name] = Run([Token(tokens=(int(t),), logprobs=(np.array(lp),)) for t, lp in steps])
        runs: dict[str, Run] = {}
        async with _serving(running, _actor(tiny_llama)) as compute:
            plain = await _run(compute, "plain", prompts["repetition"], max_tokens=16, stop_tokens=frozenset())

            async def one(name: str) -> None:
                runs[name] = await _run(
                    compute, name, prompts[name], penalties=self.CASES[name], max_tokens=16, stop_tokens=frozenset()
                )

            async with anyio.create_task_group() as tg:
                for name in self.CASES:
                    tg.start_soon(one, name)
        for name in self.CASES:
            _assert_same(runs[name], references[name])
        assert runs["repetition"].tokens != plain.tokens
        assert 7 in runs["bias"].tokens and 11 not in runs["bias"].tokens


class TestCancellation:
    async def test_cancelling_one_row_leaves_the_others_exact(self, running, tiny_llama):
        """A request cancelled mid-decode leaves the batch; the others go on unchanged."""
        prompts = {"a": _prompt(50, 1), "b": _prompt(70, 2), "c": _prompt(60, 3)}
        async with _serving(running, _actor(tiny_llama)) as compute:
            alone = {name: await _run(compute, f"alone-{name}", p, max_tokens=30, stop_tokens=frozenset()) for name, p in prompts.items()}
            results: dict[str, Run] = {}
            b_started = anyio.Event()

            async def one(name: str) -> None:
                started = b_started if name == "b" else None
                results[name] = await _run(compute, name, prompts[name], max_tokens=30, started=started, stop_tokens=frozenset())

            async with anyio.create_task_group() as tg:
                for name in prompts:
                    tg.start_soon(one, name)
                await b_started.wait()
                await compute.cancel("b")
            stats = await compute.statistics()
        _assert_same(results["a"], alone["a"])
        _assert_same(results["c"], alone["c"])
        assert not isinstance(results["b"].final, Finished) and len(results["b"].tokens) < 30
        _assert_same(results["b"], alone["b"], prefix=True)
        assert stats.num_cancelled == 1 and stats.num_live == 0 and stats.num_decoding == 0

    async def test_a_closed_event_stream_cancels_the_request(self, running, tiny_llama):
        """A consumer that stops listening stops its request at the next round."""
        async with _serving(running, _actor(tiny_llama)) as compute:
            events_in, events = anyio.create_memory_object_stream[Event](500)
            await _start(compute, "gone", _prompt(50), events=events_in, max_tokens=400, block_size=BLOCK, stop_tokens=frozenset())
            async with events:
                async for event in events:
                    if isinstance(event, Token):
                        break
            with anyio.fail_after(10):
                while (stats := await compute.statistics()).num_live:
                    await anyio.sleep(0)
        assert stats.num_cancelled == 1
        assert stats.num_decode_steps < 100

    async def test_cancel_during_a_long_prefill_stops_it(self, running, tiny_llama):
        """A request cancelled between prefill chunks computes no more of them."""
        model, tokenizer = tiny_llama
        gate = Gate()
        actor = _actor((Wrapped(model, gate), tokenizer), prefill_chunk=32)
        async with _serving(running, actor) as compute:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_run, compute, "gone", _prompt(320))
                await gate.held.wait()
                await compute.cancel("gone")
                gate.release.set()
            stats = await compute.statistics()
        assert stats.num_cancelled == 1 and stats.num_live == 0
        assert stats.num_prefill_chunks <= 2

    async def test_a_cancelled_actor_closes_every_stream_and_stops(self, tiny_llama):
        """Cancelling the actor mid-job ends every request's stream and joins the thread."""
        model, tokenizer = tiny_llama
        gate = Gate()
        actor = ComputeActor.with_model(Wrapped(model, gate), tokenizer)
        ref = actor.ref()
        actor.close()
        runs: list[Run] = []

        async def client() -> None:
            runs.append(await _run(ComputeHandle(ref), "r", _prompt(20)))

        async with anyio.create_task_group() as clients:
            async with anyio.create_task_group() as tg:
                await tg.start(actor.run)
                clients.start_soon(client)
                await gate.held.wait()
                tg.cancel_scope.cancel()
                gate.release.set()
            ref.close()
        assert len(runs) == 1 and runs[0].events == []  # closed without a word
        stats = actor.compute_statistics()
        assert stats.num_live == 0 and not stats.thread.running


class TestFaults:
    async def test_a_failing_prefill_fails_only_that_request(self, running, tiny_llama):
        """A model error in a prefill reaches its request alone; the others finish."""
        model, tokenizer = tiny_llama
        actor = _actor((Wrapped(model, _poisoned), tokenizer), prefill_chunk=32)
        async with _serving(running, actor) as compute:
            runs: dict[str, Run] = {}

            async def one(name: str, prompt: list[int]) -> None:
                runs[name] = await _run(compute, name, prompt, max_tokens=10, stop_tokens=frozenset())

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "good", _prompt(40))
                tg.start_soon(one, "bad", _prompt(100) + [POISON] + _prompt(10))
            stats = await compute.statistics()
        assert len(runs["good"].tokens) == 10
        failure = runs["bad"].final
        assert isinstance(failure, Failed) and isinstance(failure.error, ComputeFailed)
        assert failure.error.request_id == "bad" and "injected" in str(failure.error)
        assert stats.num_model_errors == 1 and stats.num_live == 0

    @pytest.mark.parametrize("streams", [1, 2])
    @pytest.mark.parametrize("where", ["merge", "extract"])
    async def test_a_fault_in_a_batched_prefill_stays_with_its_request(
        self, where, streams, running, tiny_llama, monkeypatch
    ):
        """Four requests queued while the model is busy prefill in one call (or
        one per prefill stream); if merging or taking out one's cache raises
        there, it fails alone and the others, run again one by one, give their
        solo results -- also those whose call, on another stream, was built
        before the fault (no cache of theirs was replaced)."""
        from mlxkv.actors import model_runner

        model, tokenizer = tiny_llama
        lengths = {"a": 40, "b": 55, "c": 70, "victim": 150}
        prompts = {name: _prompt(n, salt=n) for name, n in lengths.items()}
        async with _serving(running, _actor(tiny_llama)) as compute:
            alone = {n: await _run(compute, f"alone-{n}", p, stop_tokens=frozenset()) for n, p in prompts.items() if n != "victim"}
        honest = getattr(model_runner.CacheRunner, where)

        def victims(cache: Any) -> list[int]:
            offset = cache[0].offset
            return [int(o) for o in np.array(offset).reshape(-1)] if isinstance(offset, mx.array) else [offset]

        sizes: list[int] = []  # the rows each failing call saw
        if where == "merge":
            def failing(self: Any, caches: Any) -> Any:
                if any(v >= 149 for c in caches for v in victims(c)):
                    sizes.append(len(caches))
                    raise RuntimeError("injected merge failure")
                return honest(self, caches)
        else:
            def failing(self: Any, cache: Any, row: int, **options: Any) -> Any:
                if victims(cache)[row] >= 149:
                    sizes.append(len(victims(cache)))
                    raise RuntimeError("injected extract failure")
                return honest(self, cache, row, **options)

        gate = Gate()
        actor = _actor((Wrapped(model, gate), tokenizer), prefill_streams=streams)
        async with _serving(running, actor) as compute:
            runs: dict[str, Run] = {}

            async def one(name: str, prompt: list[int]) -> None:
                runs[name] = await _run(compute, name, prompt, stop_tokens=frozenset())

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "blocker", _prompt(30))
                await gate.held.wait()  # the blocker's prefill holds the model
                for name, prompt in prompts.items():
                    tg.start_soon(one, name, prompt)
                await anyio.sleep(0.05)  # every request is queued behind it
                monkeypatch.setattr(model_runner.CacheRunner, where, failing)
                gate.release.set()
            stats = await compute.statistics()
        final = runs["victim"].final
        assert isinstance(final, Failed) and "injected" in str(final.error)
        for name, theirs in alone.items():
            _assert_same(runs[name], theirs)
        # It failed first where the victim's whole prompt was in and others
        # with it. One stream: taking caches out of the prefill's one batch
        # (its last tokens ran on it), or merging into the decode batch with
        # the blocker (5 rows). Two streams: taking them out of the victim's
        # own call (149 tokens against 39 + 54 + 69), or merging the four
        # for their last tokens.
        expected = {("extract", 1): 4, ("extract", 2): 1, ("merge", 1): 5, ("merge", 2): 4}
        assert sizes[0] == expected[where, streams]
        assert stats.num_live == 0

    async def test_a_failing_decode_step_fails_its_rows_only(self, running, tiny_llama):
        """A decode call that raises fails the requests in that call; a request still
        prefilling is untouched and finishes exactly."""
        model, tokenizer = tiny_llama
        armed = threading.Event()

        def fail_a_batched_step(inputs: Any, _cache: Any) -> None:
            # Armed while "good" is still prefilling its first of 38 chunks: the
            # next one-token call is "bad"'s decode step.
            if armed.is_set() and inputs.shape[1] == 1:
                armed.clear()
                raise RuntimeError("injected decode failure")

        long_prompt = _prompt(600, 9)
        async with _serving(running, _actor(tiny_llama, prefill_chunk=16)) as compute:
            probe = await _run(compute, "probe", _prompt(30), max_tokens=900, stop_tokens=frozenset())
            solo = await _run(compute, "solo", long_prompt, max_tokens=6, stop_tokens=frozenset())
        actor = _actor((Wrapped(model, fail_a_batched_step), tokenizer), prefill_chunk=16)
        async with _serving(running, actor) as compute:
            runs: dict[str, Run] = {}
            two_tokens = anyio.Event()
            armed_once: list[bool] = []

            async def bad() -> None:
                events_in, events = anyio.create_memory_object_stream[Event](1000)
                await _start(compute, "bad", _prompt(30), events=events_in, max_tokens=900, block_size=BLOCK, stop_tokens=frozenset())
                received = []
                async with events:
                    async for event in events:
                        received.append(event)
                        if isinstance(event, Token) and sum(len(e.tokens) for e in received if isinstance(e, Token)) >= 2 and not armed_once:
                            armed_once.append(True)
                            armed.set()
                            two_tokens.set()
                runs["bad"] = Run(received)

            async def good() -> None:
                await two_tokens.wait()
                runs["good"] = await _run(compute, "good", long_prompt, max_tokens=6, stop_tokens=frozenset())

            async with anyio.create_task_group() as tg:
                tg.start_soon(bad)
                tg.start_soon(good)
            stats = await compute.statistics()
        final = runs["bad"].final
        assert isinstance(final, Failed) and isinstance(final.error, ComputeFailed)
        assert "injected decode failure" in str(final.error)
        _assert_same(runs["bad"], probe, prefix=True)
        _assert_same(runs["good"], solo)
        assert stats.num_model_errors == 1 and stats.num_live == 0

    async def test_a_failing_sampler_fails_only_its_row(self, running, tiny_llama, monkeypatch):
        """A row whose sampler raises leaves the batch; the other rows are exact."""
        prompts = {"ok": _prompt(50, 1), "broken": _prompt(60, 2)}
        async with _serving(running, _actor(tiny_llama)) as compute:
            alone = await _run(compute, "alone", prompts["ok"], max_tokens=12, stop_tokens=frozenset())

            class Broken(Sampling):
                def make_sampler(self) -> Any:
                    draws = [0]

                    def sample(logprobs: Any) -> Any:
                        draws[0] += 1
                        if draws[0] > 3:
                            raise RuntimeError("sampler broke")
                        return mx.argmax(logprobs, axis=-1)

                    return sample

            runs: dict[str, Run] = {}

            async def one(name: str, sampling: Sampling) -> None:
                runs[name] = await _run(compute, name, prompts[name], sampling=sampling, max_tokens=12, stop_tokens=frozenset())

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "ok", Sampling())
                tg.start_soon(one, "broken", Broken(temperature=1.0))
        _assert_same(runs["ok"], alone)
        final = runs["broken"].final
        assert isinstance(final, Failed) and "sampler broke" in str(final.error)

    async def test_a_dead_mlx_thread_crashes_the_actor_loudly(self, tiny_llama):
        """If the MLX thread dies, the actor raises, a waiting caller gets ActorFailed and
        every request's stream is closed."""
        model, tokenizer = tiny_llama

        def fatal(_inputs: Any, _cache: Any) -> None:
            raise Fatal()

        actor = ComputeActor.with_model(Wrapped(model, fatal), tokenizer)
        ref = actor.ref()
        actor.close()
        crashes: list[BaseException] = []
        runs: list[Run] = []

        async def host(*, task_status: Any) -> None:
            try:
                await actor.run(task_status=task_status)
            except MLXThreadStopped as error:
                crashes.append(error)

        async with anyio.create_task_group() as tg:
            await tg.start(host)
            runs.append(await _run(ComputeHandle(ref), "r", _prompt(10)))
            with pytest.raises(ActorFailed) as failure:
                await ComputeHandle(ref).describe()
            ref.close()
        assert len(crashes) == 1 and isinstance(crashes[0].cause, Fatal)
        assert failure.value.cause is crashes[0]
        assert runs[0].events == []
        assert not actor.compute_statistics().thread.running


class TestMessages:
    @pytest.mark.parametrize(
        ("fields", "blamed"),
        [
            ({"prompt": []}, "prompt"),
            ({"prompt": [1, -1]}, "prompt"),
            ({"max_tokens": 0}, "max_tokens"),
            ({"block_size": 0}, "block_size"),
            ({"held_blocks": -1}, "held_blocks"),
            ({"prefix": ["not a payload"]}, "prefix"),
            ({"sampling": "greedy"}, "sampling"),
            ({"request_id": ""}, "request_id"),
        ],
    )
    def test_a_malformed_request_is_refused_as_it_is_made(self, fields, blamed):
        """A request is checked once, as it is made: the actor takes it checked."""
        request = {"request_id": "r", "prompt": _prompt(10), "max_tokens": 4, "block_size": BLOCK, **fields}
        with pytest.raises(InvalidInput) as refused:
            RequestSpec(**request)
        assert refused.value.argument == blamed

    @pytest.mark.parametrize(
        "fields", [{"prompt": [1, 100_000]}, {"prefix": [type("Payload", (), {"end": 4})()]}]
    )
    async def test_a_request_this_model_cannot_run_is_a_failed_event(self, running, tiny_llama, fields):
        """What only the actor can check (the model's vocabulary, its payloads)
        answers Failed(InvalidInput) on the request's stream; nothing stays live."""
        request = {"prompt": _prompt(10), "max_tokens": 4, "block_size": BLOCK, **fields}
        async with _serving(running, _actor(tiny_llama)) as compute:
            events_in, events = anyio.create_memory_object_stream[Event](10)
            prompt = request.pop("prompt")
            await _start(compute, "r", prompt, events=events_in, **request)
            async with events:
                received = [event async for event in events]
            stats = await compute.statistics()
        assert len(received) == 1 and isinstance(received[0], Failed)
        assert isinstance(received[0].error, InvalidInput)
        assert stats.num_live == 0

    async def test_text_round_trip_and_model_info(self, running, tiny_llama):
        """The model's preparer round-trips text and refuses images; Describe reports the model."""
        async with _serving(running, _actor(tiny_llama)) as compute:
            preparer = await compute.preparer()
            tokens = preparer.prepare("hello, world").tokens
            assert preparer.decode(tokens) == "hello, world"
            assert preparer.prepare(tokens).tokens == tokens
            with pytest.raises(InvalidInput, match="does not take images"):
                preparer.prepare("hello", ["picture"])
            info = await compute.describe()
        assert info.vocab_size == 259 and info.eos_token_ids
        assert info.cache_layers == ("KVCache", "KVCache")
        assert info.batchable and not info.has_recurrent and not info.takes_images
        assert info.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4

    async def test_one_trace_event_per_message(self, running, tiny_llama):
        """Each handled message emits message.handled with its request id and size."""
        with capture_logs() as logs:
            actor = _actor(tiny_llama, trace=True)
            async with _serving(running, actor) as compute:
                await _run(compute, "t", _prompt(100), max_tokens=3)
                await compute.statistics()
        handled = [log for log in logs if log["event"] == "message.handled"]
        assert [log["message"] for log in handled] == ["Generate"]  # statistics are polled
        assert handled[0]["request_id"] == "t" and handled[0]["prompt_tokens"] == 100
