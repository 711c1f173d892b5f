"""A decode batch over a real tiny Llama and its runner: a lone row over a shared
prefix decodes over one plain run of its prefix and own tokens (holding no
group), and is over the prefix's group again, holding only its own tokens,
once a second row joins; greedy tokens equal cold runs throughout."""

from __future__ import annotations

import gc
from typing import Any

import mlx.core as mx
import pytest

from mlxkv.actors.decode_batch import DecodeBatch
from mlxkv.actors.model_runner import TextRunner, cache_tokens
from mlxkv.actors.request import RequestSpec
from mlxkv.actors.sampling import Sampling
from mlxkv.actors.sequence import SequenceState
from mlxkv.cache.shared_prefix import BatchSharedPrefixCache, SharedPrefixCache

from graph_ops import primitives, working
from greedy import assert_same_greedy
from model_blocks import block_payloads

BS = 16
PREFIX = [(i * 37 + 5) % 250 for i in range(4 * BS)]


def own(n: int, salt: int) -> list[int]:
    return [(i * 11 + salt * 29) % 250 for i in range(n)]


@pytest.fixture
def runner(tiny_llama):
    model, tokenizer = tiny_llama
    return TextRunner(model, tokenizer)


def started(
    runner, request_id: str, prompt: list[int], prefix: tuple = (), sampling: Sampling = Sampling()
) -> SequenceState:
    """A request whose prefill is done: its first token the argmax (whatever its ``sampling``)."""
    spec = RequestSpec(
        request_id=request_id, prompt=prompt, prefix=prefix, max_tokens=64,
        block_size=BS, stop_tokens=frozenset(), sampling=sampling,
    )  # fmt: skip
    sequence = SequenceState(spec)
    runner.start(sequence)
    logits = runner.prefill(sequence, len(prompt))
    sequence.emitted(int(mx.argmax(logits).item()))
    return sequence


def decode(batch: DecodeBatch, steps: int) -> None:
    for _ in range(steps):
        _, failed, _ = batch.advance(1)
        assert not failed


def cold_tokens(runner, prompt: list[int], count: int) -> list[int]:
    batch = DecodeBatch(runner)
    sequence = started(runner, "cold", prompt)
    batch.join([sequence])
    decode(batch, count)
    return sequence.generated[:count]


def assert_like_cold(runner, model, prompt: list[int], generated: list[int]) -> None:
    """``generated`` are the greedy tokens of ``prompt`` decoded alone, or leave
    them first at a tie within float noise (``tests/greedy.py``)."""
    assert_same_greedy(model, prompt, cold_tokens(runner, prompt, len(generated)), generated)


class TestLoneRow:
    def test_a_lone_row_decodes_over_a_plain_run_and_shares_again_when_joined(self, runner, tiny_llama):
        model, _ = tiny_llama
        assert runner.info.shared_prefix
        payloads = block_payloads(model, PREFIX, BS)
        first = PREFIX + own(9, salt=1)
        second = PREFIX + own(5, salt=2)

        batch = DecodeBatch(runner)
        a = started(runner, "a", first, payloads)
        assert isinstance(a.cache[0], SharedPrefixCache) and a.cache[0].num_prefix == len(PREFIX)
        batch.join([a])
        lone = batch._cache[0]
        assert isinstance(lone, SharedPrefixCache) and lone.group is None and lone.num_prefix == 0
        assert lone.suffix.offset == len(first)  # prefix and own tokens, in one run
        gc.collect()
        assert len(runner._groups) == 0, "the lone row still holds its prefix's group"
        decode(batch, 3)

        b = started(runner, "b", second, payloads)
        batch.join([b])
        joined = batch._cache[0]
        assert isinstance(joined, BatchSharedPrefixCache)
        assert [rows for rows, *_ in joined.segments()] == [[0, 1]], "both rows over one group"
        assert [n for _, n in joined.rows] == [len(PREFIX), len(PREFIX)]
        # The suffixes hold the rows' own tokens only: 9 + 3 decoded for a (5 for b, left-padded).
        assert joined.suffix._idx == 12
        decode(batch, 6)

        batch.leave([b])
        assert batch._cache[0].group is None  # alone again: one plain run
        decode(batch, 3)
        assert len(a.generated) == 12 and len(b.generated) == 6
        assert_like_cold(runner, model, first, a.generated)
        assert_like_cold(runner, model, second, b.generated)

    def test_a_row_without_a_prefix_is_left_as_it_is(self, runner):
        batch = DecodeBatch(runner)
        a = started(runner, "a", own(20, salt=3))
        cache = a.cache
        batch.join([a])
        assert batch._cache is cache


class TestNoWaits:
    def test_decode_steps_over_a_shared_prefix_never_wait_for_the_device(self, runner, tiny_llama, monkeypatch):
        """Three rows over one group decode 40 steps (their suffixes grow twice
        on the way): no step calls ``mx.eval`` (a growth is queued with
        ``async_eval``, not waited for), and the tokens are the cold runs'."""
        model, _ = tiny_llama
        payloads = block_payloads(model, PREFIX, BS)
        prompts = [PREFIX + own(n, salt=n) for n in (3, 7, 12)]
        batch = DecodeBatch(runner)
        rows = [started(runner, f"r{i}", prompt, payloads) for i, prompt in enumerate(prompts)]
        batch.join(rows)
        assert isinstance(batch._cache[0], BatchSharedPrefixCache)
        waits: list[int] = []
        real = mx.eval

        def counting(*arrays):
            waits.append(1)
            return real(*arrays)

        monkeypatch.setattr(mx, "eval", counting)
        decode(batch, 40)
        monkeypatch.setattr(mx, "eval", real)
        assert waits == []
        for row, prompt in zip(rows, prompts):
            assert_like_cold(runner, model, prompt, row.generated[:40])


    def test_rows_joining_and_leaving_a_running_batch_never_wait_for_the_device(self, runner, tiny_llama, monkeypatch):
        """A merged batch over a shared prefix takes rows in and lets rows go
        between steps, the batch cache cut or extended each time: neither
        calls ``mx.eval`` (the copies are queued with ``async_eval``, which
        is given the new cache), and every row's tokens are its cold run's."""
        model, _ = tiny_llama
        payloads = block_payloads(model, PREFIX, BS)
        prompts = [PREFIX + own(n, salt=n) for n in (3, 7, 12, 5)]
        rows = [started(runner, f"r{i}", prompt, payloads) for i, prompt in enumerate(prompts)]
        batch = DecodeBatch(runner)
        batch.join(rows[:2])
        decode(batch, 3)
        waits: list[int] = []
        queued: list[int] = []
        real_eval, real_async = mx.eval, mx.async_eval

        def counting(*arrays):
            waits.append(1)
            return real_eval(*arrays)

        def queueing(*arrays):
            queued.append(1)
            return real_async(*arrays)

        monkeypatch.setattr(mx, "eval", counting)
        monkeypatch.setattr(mx, "async_eval", queueing)
        batch.join(rows[2:])  # extends the merged cache
        assert len(queued) == 1
        decode(batch, 4)
        queued.clear()
        caches, failed = batch.leave([rows[1]], keep=[rows[1]])  # cuts it down to three rows
        assert not failed and len(queued) == 1
        decode(batch, 5)
        monkeypatch.setattr(mx, "eval", real_eval)
        monkeypatch.setattr(mx, "async_eval", real_async)
        assert waits == []
        assert_like_cold(runner, model, prompts[1], rows[1].generated)
        for row, prompt in zip([rows[0], *rows[2:]], [prompts[0], *prompts[2:]]):
            assert_like_cold(runner, model, prompt, row.generated)


class TestLeaving:
    def test_a_row_only_read_leaves_as_views_and_a_kept_row_as_its_own_copy(self, runner, tiny_llama):
        """Rows leaving a merged batch over a shared prefix: one whose cache is
        kept comes out as its own copy (it must not pin the batch's buffers),
        one whose cache is only read (its answer's blocks sliced) as views of
        the batch's buffers, nothing of its own to run; both hold their
        prompt's and answer's tokens, and the rows that stay decode their
        cold runs' tokens."""
        model, _ = tiny_llama
        payloads = block_payloads(model, PREFIX, BS)
        prompts = [PREFIX + own(n, salt=n) for n in (3, 7, 12)]
        rows = [started(runner, f"r{i}", prompt, payloads) for i, prompt in enumerate(prompts)]
        batch = DecodeBatch(runner)
        batch.join(rows)
        decode(batch, 4)
        mx.eval([layer.state for layer in batch._cache])
        caches, failed = batch.leave(rows[:2], keep=[rows[0]], read=[rows[1]])
        assert not failed and set(caches) == {id(rows[0]), id(rows[1])}
        kept, read = caches[id(rows[0])], caches[id(rows[1])]
        for layer in read:
            assert working(primitives(layer.suffix.keys, layer.suffix.values)) == 0
        for layer in kept:
            assert primitives(layer.suffix.keys, layer.suffix.values).count("Contiguous") == 2
        for row, cache in ((rows[0], kept), (rows[1], read)):
            assert cache_tokens(cache) == len(row.prompt) + len(row.generated)
        decode(batch, 3)
        assert_like_cold(runner, model, prompts[2], rows[2].generated)


class TestStepInvariantShapes:
    def test_a_stacked_decode_steps_fused_call_keeps_its_shapes_until_the_buffer_grows(self, tiny_llama, monkeypatch):
        """Three rows over a shared prefix decode 40 steps with the stacked
        way: every step's fused call has the shapes of the step before unless
        the suffix buffer grew in between (MLX's CUDA backend builds a cuDNN
        graph per new shape), and the greedy tokens equal cold runs."""
        from mlxkv.actors import attention_hook
        from mlxkv.actors.compute_config import RunnerConfig
        from mlxkv.actors.prefix_attention import PrefixAttention

        model, tokenizer = tiny_llama
        stacked = TextRunner(model, tokenizer, RunnerConfig(prefix_attention=PrefixAttention.STACKED))
        payloads = block_payloads(model, PREFIX, BS)
        prompts = [PREFIX + own(n, salt=n) for n in (3, 9, 5)]
        batch = DecodeBatch(stacked)
        rows = [started(stacked, f"r{i}", p, payloads) for i, p in enumerate(prompts)]
        batch.join(rows)
        shapes: list[tuple[Any, ...]] = []
        real = mx.fast.scaled_dot_product_attention

        def spy(q, k, v, *, scale, mask=None):
            shapes.append((q.shape, k.shape, None if mask is None else mask.shape))
            return real(q, k, v, scale=scale, mask=mask)

        per_step, capacity = [], []
        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
        try:
            for _ in range(40):
                shapes.clear()
                decode(batch, 1)
                layer = batch._cache[0]
                assert isinstance(layer, BatchSharedPrefixCache)
                per_step.append(set(shapes))
                capacity.append(layer.suffix.keys.shape[2])
        finally:
            monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", real)
            attention_hook.use(PrefixAttention.for_device())
        assert all(len(s) == 1 for s in per_step)  # every layer alike
        for before, after, grown in zip(per_step, per_step[1:], (a != b for a, b in zip(capacity, capacity[1:]))):
            assert (before != after) == grown
        assert len(set(capacity)) >= 3  # it did grow, more than once
        cold_runner = TextRunner(model, tokenizer)
        for row, prompt in zip(rows, prompts):
            assert_like_cold(cold_runner, model, prompt, row.generated[:20])


class TestDraws:
    """A step draws the rows of unseeded requests with the same settings in one
    call; a seeded request, and other settings, in calls of their own; each
    row gets its own token."""

    NARROW = Sampling(temperature=2.0, top_k=1)  # its draws are the argmax

    def _batch(self, runner, samplings: list[Sampling]) -> tuple[DecodeBatch, list[SequenceState]]:
        batch = DecodeBatch(runner)
        rows = [started(runner, f"r{i}", own(12 + 3 * i, salt=i), sampling=s) for i, s in enumerate(samplings)]
        batch.join(rows)
        return batch, rows

    @pytest.fixture
    def draws(self, sampler_draws: list[int]) -> list[int]:
        return sampler_draws

    def test_rows_of_one_setting_draw_together(self, runner, draws):
        hot = Sampling(temperature=1.0)
        seeded = Sampling(temperature=1.0, seed=5)
        batch, _ = self._batch(runner, [hot, Sampling(), hot, self.NARROW, seeded, hot])
        decode(batch, 1)
        assert sorted(draws) == [1, 1, 3]  # the three hot rows, the narrow one, the seeded one
        draws.clear()
        alike, _ = self._batch(runner, [hot] * 4)
        decode(alike, 1)
        assert draws == [4]

    def test_each_row_gets_its_own_token(self, runner, draws):
        """Rows that draw the argmax (``top_k=1``), together, alone and seeded,
        between greedy rows: every row's tokens are its greedy ones."""
        other = Sampling(temperature=3.0, top_k=1)
        seeded = Sampling(temperature=2.0, top_k=1, seed=2)
        samplings = [Sampling(), self.NARROW, Sampling(), self.NARROW, seeded, other]
        batch, rows = self._batch(runner, samplings)
        greedy, plain = self._batch(runner, [Sampling()] * len(samplings))
        decode(batch, 5)
        decode(greedy, 5)
        assert sorted(draws[:3]) == [1, 1, 2]  # a step: the two narrow rows together, the seeded, the other
        assert [row.generated for row in rows] == [row.generated for row in plain]
        assert len({tuple(row.generated) for row in plain}) == len(plain), "the rows' tokens differ"
        narrow, _ = self._batch(runner, [self.NARROW] * 3)
        decode(narrow, 3)
        assert draws[-1] == 3  # a batch that all draws together: one draw, no argmax to write over
        assert all(len(row.generated) == 3 for row in narrow.rows)
        assert [row.generated for row in narrow.rows] == [row.generated[:3] for row in plain[:3]]

    def test_a_steps_draws_do_not_grow_with_the_rows_that_share_them(self, runner, monkeypatch):
        """The operations a step puts in MLX's graph are the same for 2 and 6
        rows of one unseeded setting (a GPU launches a kernel an operation:
        a draw a row was ~24 a row), and grow with seeded rows, which draw
        alone."""
        from graph_ops import arrays_in, primitives

        def step_ops(samplings: list[Sampling]) -> int:
            batch, _ = self._batch(runner, samplings)
            decode(batch, 1)
            graphs: list[int] = []
            honest = mx.async_eval

            def queued(*trees: Any) -> None:
                graphs.append(len(primitives(*arrays_in(trees))))
                honest(*trees)

            monkeypatch.setattr(mx, "async_eval", queued)
            decode(batch, 1)
            monkeypatch.undo()
            return max(graphs)

        hot = Sampling(temperature=1.0, top_p=0.9)
        assert step_ops([hot] * 2) == step_ops([hot] * 6)
        seeded = [Sampling(temperature=1.0, top_p=0.9, seed=s) for s in range(6)]
        assert step_ops(seeded) > step_ops([hot] * 6) + 4 * 5
