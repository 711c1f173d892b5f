"""The executor alone, over a fake runner, as the scheduler is tested with
hand-built results: plans built by hand, results read back.

A mock here stands for a model, and only there: the fake runner's "KV" is
each row's token list, its logits a one-hot of the last token plus one, so
what the executor does with requests (start, chunk ends, batching, decode
steps, publishing, keeping, letting go) is visible without a model. The
sequences, decode batches and MLX arrays it drives are the real ones; the
runner's contract is :class:`~mlxkv.actors.model_runner.ModelRunner`, which
the real runners are tested against elsewhere.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs
import mlx.core as mx
import pytest

from mlxkv.actors.executor import Executor
from mlxkv.actors.model_info import ModelInfo
from mlxkv.actors.plan import Blocks, Chunk, Leave, Plan, Slice
from mlxkv.actors.request import RequestSpec
from mlxkv.actors.sequence import SequenceState

VOCAB = 64
BS = 4
CHUNK = 8


class FakeLayer:
    """A batch of rows' token lists, with the batch-cache calls a decode batch makes."""

    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows

    @property
    def offset(self) -> int:
        return len(self.rows[0])

    @property
    def state(self) -> Any:
        return mx.array([len(row) for row in self.rows])

    def filter(self, kept: Any) -> None:
        self.rows = [self.rows[i] for i in kept.tolist()]

    def extend(self, other: FakeLayer) -> None:
        self.rows = self.rows + other.rows


@attrs.frozen
class FakePayload:
    tokens: tuple[int, ...]
    end: int


def _next(token: int) -> int:
    return (token + 1) % VOCAB


def _logits(tokens: list[int]) -> Any:
    return mx.stack([mx.eye(VOCAB)[_next(t)] for t in tokens])


class FakeRunner:
    """A :class:`ModelRunner` whose KV is token lists; it fails where told to."""

    def __init__(self, *, batch_prefill: bool = True) -> None:
        self.info = ModelInfo(
            vocab_size=VOCAB,
            eos_token_ids=frozenset(),
            cache_layers=("FakeLayer",),
            has_recurrent=False,
            batch_prefill=batch_prefill,
        )
        self.fail_start: set[str] = set()
        self.fail_prefill: set[str] = set()
        self.fail_decode: set[str] = set()
        self.prefill_calls: list[list[str]] = []
        self.kept: list[tuple[str, tuple[int, ...]]] = []
        self.extracted: list[tuple[int, bool]] = []  # (the row in its batch, copied)

    def start(self, sequence: SequenceState) -> None:
        if sequence.request_id in self.fail_start:
            raise ValueError("cannot start")
        cached = sequence.spec.num_prefix_tokens
        sequence.start([FakeLayer([list(sequence.prompt[:cached])])], cached)

    def take_encoding(self, sequence: SequenceState) -> None:
        return None

    def prefill_batch(self, rows: list[tuple[SequenceState, int]]) -> list[Optional[Any]]:
        ids = [sequence.request_id for sequence, _ in rows]
        if self.fail_prefill & set(ids):
            raise RuntimeError("the model call raised")
        self.prefill_calls.append(ids)
        out = []
        for sequence, end in rows:
            sequence.cache[0].rows[0].extend(sequence.prompt[sequence.num_computed : end])
            sequence.computed(end)
            out.append(_logits([sequence.prompt[-1]])[0] if end == len(sequence.prompt) else None)
        return out

    def decode(self, inputs: Any, cache: list[Any], rows: list[SequenceState], positions: list[int]) -> Any:
        if self.fail_decode & {row.request_id for row in rows}:
            raise RuntimeError("the decode step raised")
        tokens = inputs.tolist()
        for row, token in zip(cache[0].rows, tokens):
            row.append(token)
        return _logits(tokens)

    def merge(self, caches: list[list[Any]]) -> list[Any]:
        return [FakeLayer([list(row) for cache in caches for row in cache[0].rows])]

    def extract(self, cache: list[Any], row: int, *, copy: bool = True) -> list[Any]:
        self.extracted.append((row, copy))
        return [FakeLayer([list(cache[0].rows[row])])]

    def alone(self, sequence: SequenceState, cache: list[Any]) -> list[Any]:
        return cache

    def together(self, sequence: SequenceState, cache: list[Any]) -> list[Any]:
        return cache

    def snapshot(self, cache: list[Any], row: int) -> tuple[()]:
        raise AssertionError("no recurrent layers")

    def slice_blocks(self, sequence: SequenceState, cache: list[Any], start: int, stop: int) -> tuple[FakePayload, ...]:
        row = cache[0].rows[0]
        return tuple(FakePayload(tuple(row[b * BS : (b + 1) * BS]), (b + 1) * BS) for b in range(start, stop))

    def keep(self, sequence: SequenceState, cache: list[Any], num_tokens: int) -> None:
        self.kept.append((sequence.request_id, tuple(cache[0].rows[0][:num_tokens])))


def _spec(request_id: str, length: int, *, max_tokens: int = 8, prefix: tuple = ()) -> RequestSpec:
    prompt = [(7 * i + len(request_id)) % VOCAB for i in range(length)]
    return RequestSpec(
        request_id=request_id, prompt=prompt, prefix=prefix, max_tokens=max_tokens, block_size=BS,
        stop_tokens=frozenset(),
    )  # fmt: skip


def _first(spec: RequestSpec, end: int = CHUNK) -> Chunk:
    return Chunk(spec.request_id, end, spec, 0)


class TestOneRequest:
    def test_from_its_first_chunk_to_leaving(self):
        """Chunks end where the plan says (the first where the prefix lets it),
        each publishes the blocks it completed, the last samples the first
        token; joined, each step feeds a token; leaving publishes the answer's
        blocks and keeps the cache; after that the executor holds nothing of it."""
        runner = FakeRunner()
        executor = Executor(runner, prefill_chunk=CHUNK)
        prefix = (FakePayload((), BS),)  # its first block is cached
        spec = _spec("a", 20, prefix=prefix)
        first = executor.run(Plan(prefill=(Chunk("a", CHUNK, spec, 0),)))
        (done,) = first.chunks
        assert (done.computed, done.started, done.num_cached, done.first_token) == (CHUNK, True, BS, None)
        assert first.published == (Blocks("a", 1, ()),)  # its one computed block (the first came with it)
        assert [p.tokens for p in first.published[0].payloads] == [tuple(spec.prompt[BS:CHUNK])]
        second = executor.run(Plan(prefill=(Chunk("a", 16, None, 2),)))
        assert second.chunks[0].computed == 16 and second.published[0].start == 2
        last = executor.run(Plan(prefill=(Chunk("a", 20, None, 4),)))
        assert last.chunks[0].first_token == _next(spec.prompt[-1]) and not last.published
        assert last.prefill_calls == (1,)

        answer = [last.chunks[0].first_token]
        for _ in range(3):
            answer.append(_next(answer[-1]))
        decoded = executor.run(Plan(publish=(Slice("a", 4, 5),), join=("a",), steps=4))
        assert decoded.published[0].start == 4
        # The first step feeds the prefill's token (emitted already), the others theirs.
        assert [(e.request_id, e.index, e.token) for e in decoded.emitted] == [("a", k, answer[k]) for k in (1, 2, 3)]
        assert decoded.steps == (1, 1, 1, 1)

        left = executor.run(Plan(leave=(Leave("a", (5, 6), True, 24),)))
        assert [p.tokens for p in left.published[0].payloads] == [tuple(answer)]  # block 5: tokens 20-23
        assert runner.kept == [("a", (*spec.prompt, *answer))]
        assert not executor.run(Plan(join=("a",), steps=2)).emitted  # it holds nothing of "a"

    def test_chunks_end_where_the_executor_cuts_them(self):
        """Where a chunk ends is the executor's to decide, from what the KV
        holds (absolute multiples of the chunk), whatever the scheduler
        budgeted: a first chunk's start is known only once the runner started it."""
        executor = Executor(FakeRunner(), prefill_chunk=CHUNK)
        spec = _spec("a", 30, prefix=(FakePayload((), 12),))
        (done,) = executor.run(Plan(prefill=(_first(spec, end=CHUNK),))).chunks
        assert done.computed == 16  # from 12 cached, not the budgeted 8
        (done,) = executor.run(Plan(prefill=(Chunk("a", 99, None, 4),))).chunks
        assert done.computed == 24


class TestLeaving:
    def test_only_a_kept_row_is_copied_out_of_its_batch(self):
        """Two rows leave a batch: the one whose cache is kept is extracted as a
        copy of its own, the one whose answer is only sliced as a view (read
        before the batch's next step); both answers are published."""
        runner = FakeRunner()
        executor = Executor(runner, prefill_chunk=CHUNK)
        specs = {"a": _spec("a", 8), "b": _spec("b", 8)}
        executor.run(Plan(prefill=tuple(_first(spec) for spec in specs.values())))
        executor.run(Plan(join=tuple(specs), steps=8))
        left = executor.run(Plan(leave=(Leave("a", (0, 1), True, 16), Leave("b", (0, 1), False, 16))))
        assert sorted(runner.extracted) == [(0, True), (1, False)]  # rows in the order they joined
        assert sorted(blocks.request_id for blocks in left.published) == ["a", "b"]
        assert [name for name, _ in runner.kept] == ["a"]


class TestFailures:
    def test_a_request_that_cannot_start_fails_alone(self):
        runner = FakeRunner()
        runner.fail_start.add("bad")
        executor = Executor(runner, prefill_chunk=CHUNK)
        result = executor.run(Plan(prefill=(_first(_spec("bad", 12)), _first(_spec("good", 12)))))
        assert [(f.request_id, f.stage) for f in result.failures] == [("bad", "prefill")]
        assert [c.request_id for c in result.chunks] == ["good"]
        assert result.num_model_errors == 1

    def test_a_batched_prefill_that_raises_runs_each_row_alone(self):
        """Whose prefill it was: each row runs alone, and only its own fails."""
        runner = FakeRunner()
        runner.fail_prefill.add("bad")
        executor = Executor(runner, prefill_chunk=CHUNK)
        result = executor.run(Plan(prefill=(_first(_spec("good", 6)), _first(_spec("bad", 6)))))
        assert runner.prefill_calls == [["good"]]
        assert [(f.request_id, f.stage) for f in result.failures] == [("bad", "prefill")]
        assert result.chunks[0].request_id == "good" and result.chunks[0].first_token is not None
        assert result.prefill_calls == (1,)

    def test_first_tokens_are_drawn_together_and_a_raising_draw_fails_its_row(self, sampler_draws):
        """A model call's first tokens: the rows of one unseeded setting in one
        draw, a greedy row by the argmax, a sampler that raises failing its
        row alone (``top_k=1``: the drawn rows' tokens are the argmax)."""
        from mlxkv.actors.sampling import Sampling

        class Broken(Sampling):
            def make_sampler(self) -> Any:
                def sample(logprobs: Any) -> Any:
                    raise RuntimeError("sampler broke")

                return sample

        narrow = Sampling(temperature=1.0, top_k=1)
        specs = [
            attrs.evolve(_spec("a", 6), sampling=narrow),
            attrs.evolve(_spec("bad", 7), sampling=Broken(temperature=1.0)),
            _spec("g", 8),
            attrs.evolve(_spec("bb", 9), sampling=narrow),
        ]
        executor = Executor(FakeRunner(), prefill_chunk=CHUNK)
        result = executor.run(Plan(prefill=tuple(_first(spec) for spec in specs)))
        assert sampler_draws == [2]
        assert [(f.request_id, f.stage) for f in result.failures] == [("bad", "prefill")]
        assert {c.request_id: c.first_token for c in result.chunks} == {
            spec.request_id: _next(spec.prompt[-1]) for spec in specs if spec.request_id != "bad"
        }

    @pytest.mark.parametrize("batch_prefill", [True, False])
    def test_prefill_batches_only_where_the_model_does(self, batch_prefill):
        runner = FakeRunner(batch_prefill=batch_prefill)
        executor = Executor(runner, prefill_chunk=CHUNK)
        executor.run(Plan(prefill=(_first(_spec("a", 6)), _first(_spec("b", 6)))))
        assert runner.prefill_calls == ([["a", "b"]] if batch_prefill else [["a"], ["b"]])

    def test_a_decode_step_that_raises_fails_its_whole_batch_once(self):
        """Every row shared the model call: each fails, the error counted once,
        and the executor holds nothing of them; a request after them decodes."""
        runner = FakeRunner()
        executor = Executor(runner, prefill_chunk=CHUNK)
        executor.run(Plan(prefill=(_first(_spec("a", 6)), _first(_spec("b", 6)))))
        runner.fail_decode.add("a")
        result = executor.run(Plan(join=("a", "b"), steps=2))
        assert sorted(f.request_id for f in result.failures) == ["a", "b"]
        assert result.num_model_errors == 1 and not result.emitted
        runner.fail_decode.clear()
        executor.run(Plan(prefill=(_first(_spec("c", 6)),)))
        after = executor.run(Plan(join=("c",), steps=2))
        assert [e.request_id for e in after.emitted] == ["c"] and not after.failures


class TestTheDeviceNeverWaitsForTheHost:
    """Over the real runner (the tiny Llama, its rows over a shared prefix), not
    the fake: what a plan queues and when it reads it back is MLX's."""

    def test_a_plan_reads_nothing_back_before_its_step_is_queued(self, tiny_llama, monkeypatch):
        """A plan that publishes, lets a row go (its answer sliced, its cache
        kept), joins a row, prefills a prompt to its end and steps the batch:
        nothing is evaluated before the step is queued, the first token is
        read after it, and every array the result carries was queued before
        the step, so reading it waits for it alone, not for the step (the
        device computes the step while the host reads and plans). The first
        token is a cold run's."""
        from graph_ops import arrays_in, primitives
        from mlx_lm.models.cache import make_prompt_cache

        import mlxkv.actors.executor as executor_module
        from mlxkv.actors.compute_config import RunnerConfig
        from mlxkv.actors.mlx_thread import evaluate_arrays
        from mlxkv.actors.model_runner import TextRunner
        from mlxkv.cache import kv_state

        model, tokenizer = tiny_llama
        shared = [(i * 37 + 5) % 250 for i in range(64)]
        cold = make_prompt_cache(model)
        model(mx.array(shared)[None], cache=cold)
        payloads = tuple(kv_state.slice_blocks(cold, 16, range(4), num_tokens=64))

        def spec(request_id: str, own: int) -> RequestSpec:
            prompt = shared + [(i * 31 + own) % 250 for i in range(own)]
            return RequestSpec(
                request_id=request_id, prompt=prompt, prefix=payloads, max_tokens=16, block_size=16,
                stop_tokens=frozenset(), top_logprobs=3 if request_id == "d" else None,
            )  # fmt: skip

        runner = TextRunner(model, tokenizer, RunnerConfig(prefill_streams=1))
        executor = Executor(runner, prefill_chunk=64)
        a, b, c, d = spec("a", 20), spec("b", 9), spec("c", 16), spec("d", 12)
        executor.run(Plan(prefill=(Chunk("a", 84, a), Chunk("b", 73, b))))
        executor.run(Plan(join=("a", "b"), steps=2))
        executor.run(Plan(prefill=(Chunk("c", 80, c),)))

        log: list[str] = []
        queued: set[int] = set()
        honest_eval, honest_async_eval, honest_decode, honest_first = (
            mx.eval, mx.async_eval, runner.decode, executor_module._FirstToken,
        )  # fmt: skip

        def blocking(*trees: Any) -> None:
            if primitives(*[a for tree in trees for a in arrays_in(tree)]):
                log.append("eval")
            honest_eval(*trees)

        def queueing(*trees: Any) -> None:
            if "decode" not in log:
                queued.update(id(a) for tree in trees for a in arrays_in(tree))
            honest_async_eval(*trees)

        def decode(*args: Any) -> Any:
            log.append("decode")
            return honest_decode(*args)

        class Read:
            def __init__(self, token: Any) -> None:
                self.token = token

            def item(self) -> int:
                log.append("read")
                return self.token.item()

        def first_token(sequence: Any, encoding: Any, logits: Any, token: Any, logprobs: Any, picks: Any) -> Any:
            if picks is not None:
                assert {id(a) for a in picks.arrays} <= queued, "the picks are queued with the first token"
            return honest_first(sequence, encoding, logits, Read(token), logprobs, picks)  # read through the probe

        monkeypatch.setattr(mx, "eval", blocking)
        monkeypatch.setattr(mx, "async_eval", queueing)
        monkeypatch.setattr(runner, "decode", decode)
        monkeypatch.setattr(executor_module, "_FirstToken", first_token)
        result = executor.run(
            Plan(
                publish=(Slice("c", 4, 5),),
                leave=(Leave("a", (4, 5), True, 86),),
                join=("c",),
                prefill=(Chunk("d", 76, d),),
                steps=1,
            )
        )
        carried = [id(a) for a in arrays_in([p.arrays for blocks in result.published for p in blocks.payloads])]
        carried += [id(a) for chunk in result.chunks for a in (chunk.logits, chunk.logprobs)]
        evaluate_arrays(result)  # what the MLX thread does with a job's result
        monkeypatch.undo()

        assert log == ["decode", "read"]
        assert [(b.request_id, b.start, len(b.payloads)) for b in result.published] == [("c", 4, 1), ("a", 4, 1)]
        assert len(carried) > 2 and set(carried) <= queued
        (done,) = result.chunks
        expected = model(mx.array(d.prompt)[None])[0, -1]
        assert done.first_token == int(mx.argmax(expected).item())
        assert done.token_logprob is not None and done.token_logprob.token == done.first_token
        assert [e.request_id for e in result.emitted] == ["b"] and result.steps == (2,)
