"""The compute path's executor: runs the scheduler's plans on the MLX thread.

:class:`Executor` owns every MLX object of the compute path: the model
runner (and, through it, the kept caches), each live request's
:class:`~mlxkv.actors.sequence.SequenceState` (its own cache while it
prefills), and the decode batches (the caches of the requests decoding).
:meth:`Executor.run` takes a :class:`~mlxkv.actors.plan.Plan`, does it
in order -- publish, leave, join, prefill, decode steps -- and returns an
immutable :class:`~mlxkv.actors.plan.Result`. It writes no scheduler
state; everything it learns travels in the result.

Reads last. Every piece of a plan queues its work (``mx.async_eval``) and
nothing is read back before the plan's decode step, if it has one, is
queued behind it. So a plan that publishes blocks, lets rows go (their
answers sliced, their caches kept) or joins rows before it steps does not
wait for the step in flight before it queues the next one, and what it
reads -- the blocks and kept caches, evaluated by the MLX thread with the
result -- waits for itself, not for its own step, which the device computes
while the host hands the result over and makes the next plan. (A step
reads the tokens of the step before it, queued by the plan before.) A
prefill's first tokens are read last as well; the scheduler's plans
prefill or decode, so a prefill plan's read waits for its chunks, and the
device then waits for the next plan, as it does after mlx-lm's prefill.
What is read at once still: a plain batch cache's padding when rows are
taken out of it (mlx-lm's ``extract``), a request's start (its cache
rebuilt from payloads) and its images' encoding.

Failures. A step done for one request that raises (slicing, extracting,
merging or keeping its cache, starting it, sampling its token,
snapshotting its state) lets go of that request alone: it is among the
result's failures and the executor holds nothing of it any more. A model
call or a change of a batch cache as a whole that raises lets go of every
request it served. Either way the other requests go on exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import attrs

from mlxkv.actors.decode_batch import BatchBroken, DecodeBatch, RowFailed, without_frames
from mlxkv.actors.model_runner import ModelRunner, cache_tokens
from mlxkv.actors.request import blocks_out_at_start, next_chunk_end
from mlxkv.actors.json_constraint import masked
from mlxkv.actors.penalties import adjust_rows
from mlxkv.actors.sampling import draw_rows
from mlxkv.actors.plan import (
    Blocks,
    Chunk,
    ChunkDone,
    Emitted,
    Leave,
    Plan,
    RequestFailure,
    Result,
    Slice,
)
from mlxkv.actors.sequence import SequenceState
from mlxkv.actors.token_logprobs import Picks, pick
from mlxkv.cache import kv_state

__all__ = ["Executor"]


class Executor:
    """Runs plans; owns the runner, the live requests' MLX state and the decode batches.

    Every method runs on the MLX thread.

    Invariants:
        - a request is in ``_live`` from its first chunk until it leaves or
          fails; while there it holds its own cache or a row of exactly one
          decode batch, never both;
        - a decode batch is never empty between plans.
    """

    def __init__(self, runner: ModelRunner, *, prefill_chunk: int) -> None:
        """Args:
            runner: the model runner (made on this MLX thread).
            prefill_chunk: tokens per prefill chunk (the scheduling's): where a
                request's first chunk ends once the runner has started it.
        """
        self._runner = runner
        self._chunk = prefill_chunk
        self._live: dict[str, SequenceState] = {}
        self._batches: list[DecodeBatch] = []

    def run(self, plan: Plan) -> Result:
        """Do ``plan``; what happened. Nothing is read back before its
        decode step is queued (the module docstring)."""
        run = _ResultBuilder()
        run.stage = "publish"
        for piece in plan.publish:
            self._publish(piece, run)
        run.stage = "leave"
        self._leave(plan.leave, run)
        run.stage = "join"
        self._join(plan.join, run)
        run.stage = "prefill"
        firsts = self._prefill(plan.prefill, run)
        run.stage = "decode"
        if plan.steps:
            self._decode(plan.steps, run)
        run.stage = "prefill"
        for first in firsts:
            self._read_first_token(first, run)
        self._batches = [batch for batch in self._batches if len(batch)]
        return run.result()

    # -- the pieces of a plan ---------------------------------------------------

    def _publish(self, piece: Slice, run: _ResultBuilder) -> None:
        sequence = self._live.get(piece.request_id)
        if sequence is None:
            return  # failed earlier in this plan
        assert sequence.cache is not None, f"{sequence!r} publishes from a batch"
        try:
            run.published.append(self._slice(sequence, sequence.cache, piece.start, piece.stop))
        except Exception as error:
            self._let_go(sequence, error, run)

    def _slice(self, sequence: SequenceState, cache: list[Any], start: int, stop: int) -> Blocks:
        try:
            payloads = self._runner.slice_blocks(sequence, cache, start, stop)
        except kv_state.NotReconstructable:
            return Blocks(sequence.request_id, start, (), exact=False)
        return Blocks(sequence.request_id, start, payloads)

    def _leave(self, leaves: tuple[Leave, ...], run: _ResultBuilder) -> None:
        """Take ended requests out: from their batch (one cut per batch), or
        their own cache; publish their answer and keep their cache if asked."""
        departing: dict[str, tuple[SequenceState, Leave]] = {}
        for leave in leaves:
            sequence = self._live.pop(leave.request_id, None)
            if sequence is not None:
                departing[leave.request_id] = (sequence, leave)
        caches: dict[int, list[Any]] = {}
        for batch in list(self._batches):
            mine = [sequence for sequence, _ in departing.values() if sequence in batch.rows]
            if not mine:
                continue
            kept = [s for s in mine if departing[s.request_id][1].keep]
            read = [s for s in mine if departing[s.request_id][1].answer]
            try:
                extracted, failed = batch.leave(mine, keep=kept, read=read)
            except BatchBroken as error:
                run.num_model_errors += 1
                self._break(batch, error.error, run)
                continue
            caches.update(extracted)
            for failure in failed:
                departing.pop(failure.sequence.request_id, None)
                self._record(failure.sequence, failure.error, run)
        for sequence, leave in departing.values():
            own = sequence.give_up_cache()
            cache = caches.get(id(sequence), own)
            if cache is None:
                continue
            try:
                if leave.answer is not None:
                    start, stop = leave.answer
                    stop = min(stop, cache_tokens(cache) // sequence.block_size)
                    if stop > start:
                        run.published.append(self._slice(sequence, cache, start, stop))
                if leave.keep:
                    self._runner.keep(sequence, cache, leave.num_tokens)
            except Exception as error:
                self._record(sequence, error, run)

    def _join(self, request_ids: tuple[str, ...], run: _ResultBuilder) -> None:
        rows = [self._live[r] for r in request_ids if r in self._live]
        if not rows:
            return
        groups: list[tuple[DecodeBatch, list[SequenceState]]] = []
        if self._runner.info.batchable:
            if not self._batches:
                self._batches.append(DecodeBatch(self._runner))
            groups.append((self._batches[0], rows))
        else:
            for sequence in rows:
                self._batches.append(DecodeBatch(self._runner))
                groups.append((self._batches[-1], [sequence]))
        for batch, joining in groups:
            try:
                failed = batch.join(joining)
            except BatchBroken as error:
                run.num_model_errors += 1
                for sequence in joining:
                    self._let_go(sequence, error.error, run, shared=True)
                self._break(batch, error.error, run)
                continue
            for failure in failed:
                self._let_go(failure.sequence, failure.error, run)

    def _decode(self, steps: int, run: _ResultBuilder) -> None:
        for batch in list(self._batches):
            if not len(batch):
                continue
            try:
                tokens, failed, ran = batch.advance(steps)
            except Exception as error:
                run.num_model_errors += 1
                self._break(batch, without_frames(error), run)
                continue
            run.steps.extend([len(batch)] * ran)
            run.emitted.extend(
                Emitted(item.sequence.request_id, item.index, item.token, item.logprobs, item.token_logprob)
                for item in tokens
            )
            if failed:
                self._remove_rows(batch, failed, run)

    def _prefill(self, chunks: tuple[Chunk, ...], run: _ResultBuilder) -> list[_FirstToken]:
        """Start the new requests, then run every chunk: in one model call
        where the model batches prefill, else each in its own. The first
        tokens of the prompts done, queued, to read (:meth:`_read_first_token`)."""
        runner = self._runner
        firsts: list[_FirstToken] = []
        rows: list[tuple[SequenceState, int]] = []
        encodings: dict[str, Any] = {}
        by_id = {chunk.request_id: chunk for chunk in chunks}
        for chunk in chunks:
            if chunk.spec is None:
                sequence = self._live[chunk.request_id]
            else:
                sequence = SequenceState(chunk.spec)
                try:
                    runner.start(sequence)
                    encodings[sequence.request_id] = runner.take_encoding(sequence)
                except Exception as error:
                    self._record(sequence, error, run)
                    continue
                self._live[sequence.request_id] = sequence
            boundary = sequence.block_size if runner.info.has_recurrent else None
            rows.append((sequence, next_chunk_end(sequence.num_computed, len(sequence.prompt), self._chunk, boundary)))
        # A row whose every position's logits are asked for prefills alone.
        alone = [row for row in rows if row[0].spec.prompt_logprobs is not None]
        together = [row for row in rows if row[0].spec.prompt_logprobs is None]
        if runner.info.batch_prefill and len(together) > 1:
            groups = [together] + [[row] for row in alone]
        else:
            groups = [[row] for row in together + alone]
        while groups:
            group = groups.pop(0)
            try:
                logits = runner.prefill_batch(group)
            except Exception as error:
                if len(group) > 1:
                    # Whose step it was: each alone (a rare path; what ran
                    # together changed no request it did not finish).
                    groups[:0] = [[row] for row in group]
                    continue
                self._let_go(group[0][0], error, run)
                continue
            run.prefill_calls.append(len(group))
            done: list[tuple[SequenceState, Any, Any]] = []
            for (sequence, _), last in zip(group, logits):
                chunk = by_id[sequence.request_id]
                if last is None and chunk.published >= 0:
                    self._publish_chunk(sequence, chunk, run)
                if sequence.request_id not in self._live:
                    continue
                encoding = encodings.get(sequence.request_id, _NOT_STARTED)
                if last is None:
                    run.chunks.append(_chunk_done(sequence, encoding))
                    continue
                done.append((sequence, encoding, last))
            if done:
                firsts.extend(self._first_tokens(done, run))
        return firsts

    def _first_tokens(self, done: list[tuple[SequenceState, Any, Any]], run: _ResultBuilder) -> list[_FirstToken]:
        """The first tokens of the prompts a model call finished, ``(sequence,
        encoding, last position's logits)`` each: drawn together
        (:func:`~mlxkv.actors.sampling.draw_rows`, from one log-softmax of
        them all) and queued at once (``mx.async_eval``), not read. A row
        whose draw raised is let go."""
        import mlx.core as mx

        try:
            logits = adjust_rows(mx.stack([last for *_, last in done]), [s.adjuster for s, *_ in done])
            logits, unmasked = masked(logits, [s.constraint for s, *_ in done])
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            tokens, failed = draw_rows([sequence.sampler for sequence, *_ in done], logprobs)
            failed = unmasked + failed
        except Exception as error:
            tokens, logprobs, failed = None, None, [(row, error) for row in range(len(done))]
        errors = dict(failed)
        drawn = [(row, tokens[row], logprobs[row]) for row in range(len(done)) if row not in errors]
        sequences = [sequence for sequence, *_ in done]
        picks = None if not drawn else pick(
            logprobs, tokens, [s.top_logprobs for s in sequences], [s.request_id for s in sequences]
        )
        # Each row's own views too: what the result carries is queued before the step.
        queued = [(token, row_logprobs, done[row][2]) for row, token, row_logprobs in drawn]
        mx.async_eval(queued, picks.arrays if picks else [])
        for row, error in errors.items():
            self._let_go(done[row][0], error, run)
        return [_FirstToken(*done[row], token, row_logprobs, picks) for row, token, row_logprobs in drawn]

    def _publish_chunk(self, sequence: SequenceState, chunk: Chunk, run: _ResultBuilder) -> None:
        """Slice the full blocks a (not last) chunk completed, at once."""
        start = chunk.published if chunk.spec is None else blocks_out_at_start(chunk.spec, sequence.num_cached)
        stop = sequence.num_computed // sequence.block_size
        if stop <= start:
            return
        assert sequence.cache is not None, f"{sequence!r} prefills in its own cache"
        try:
            run.published.append(self._slice(sequence, sequence.cache, start, stop))
        except Exception as error:
            self._let_go(sequence, error, run)

    def _read_first_token(self, first: _FirstToken, run: _ResultBuilder) -> None:
        """A prompt's last chunk is done: its first token, read."""
        sequence = first.sequence
        try:
            token = int(first.token.item())
        except Exception as error:
            self._let_go(sequence, error, run)
            return
        try:
            token_logprob = None if first.picks is None else first.picks.read().get(sequence.request_id)
            taken = sequence.take_prompt_picks()
            prompt_logprobs = tuple(record for picks in taken for record in picks.read().values())
        except Exception as error:
            self._let_go(sequence, error, run)
            return
        sequence.emitted(token)
        run.chunks.append(
            _chunk_done(
                sequence, first.encoding, first_token=token, logits=first.logits, logprobs=first.logprobs,
                token_logprob=token_logprob, prompt_logprobs=prompt_logprobs,
            )  # fmt: skip
        )

    # -- letting go -----------------------------------------------------------------

    def _let_go(self, sequence: SequenceState, error: Exception, run: _ResultBuilder, *, shared: bool = False) -> None:
        """``sequence`` failed: hold nothing of it, say so."""
        if self._live.pop(sequence.request_id, None) is not None:
            sequence.give_up_cache()
        self._record(sequence, error, run, shared=shared)

    def _record(self, sequence: SequenceState, error: Exception, run: _ResultBuilder, *, shared: bool = False) -> None:
        """A failure of ``sequence``; one of its own computations raised
        (counted), or one it shared with others (counted once, by the caller)."""
        run.failures.append(RequestFailure(sequence.request_id, without_frames(error), run.stage))
        run.num_model_errors += not shared

    def _remove_rows(self, batch: DecodeBatch, failed: Iterable[RowFailed], run: _ResultBuilder) -> None:
        """Rows whose own step raised leave their batch; each fails alone."""
        failed = list(failed)
        try:
            _, unextracted = batch.leave([f.sequence for f in failed])
        except BatchBroken as error:
            run.num_model_errors += 1
            self._break(batch, error.error, run)
            unextracted = []
        for failure in [*failed, *unextracted]:
            self._let_go(failure.sequence, failure.error, run)

    def _break(self, batch: DecodeBatch, error: Exception, run: _ResultBuilder) -> None:
        """Every row of ``batch`` fails with ``error`` (counted by the
        caller, once); the batch is dropped."""
        for sequence in batch.rows:
            self._let_go(sequence, error, run, shared=True)
        if batch in self._batches:
            self._batches.remove(batch)


#: Stands for "not its first chunk" where a first chunk's image encoding goes.
_NOT_STARTED = object()


@attrs.frozen(eq=False)
class _FirstToken:
    """A prompt's first token, sampled from the last chunk's ``logits`` and
    queued, not read yet; ``encoding`` is its start's image encoding (or
    :data:`_NOT_STARTED`); ``picks``: the log-probability records of the
    rows drawn with it that asked for them (shared), or None."""

    sequence: SequenceState
    encoding: Any
    logits: Any
    token: Any
    logprobs: Any
    picks: Optional[Picks]


def _chunk_done(sequence: SequenceState, encoding: Any, **first: Any) -> ChunkDone:
    """The record of a chunk ``sequence`` ran (a last one's: with ``first``,
    its first token and what it was drawn from)."""
    started = encoding is not _NOT_STARTED
    ran = None if not started or encoding is None else encoding.ran
    return ChunkDone(
        sequence.request_id,
        sequence.num_computed,
        started=started,
        num_cached=sequence.num_cached,
        cold_fallback=sequence.cold_fallback,
        reused_kept_cache=sequence.reused_kept_cache,
        num_shared=sequence.num_shared,
        encoder_ran=ran,
        features=None if ran is None else encoding.features,
        **first,
    )


class _ResultBuilder:
    """What one plan did so far (a builder of :class:`Result`)."""

    def __init__(self) -> None:
        self.published: list[Blocks] = []
        self.chunks: list[ChunkDone] = []
        self.emitted: list[Emitted] = []
        self.steps: list[int] = []
        self.failures: list[RequestFailure] = []
        self.num_model_errors = 0
        self.prefill_calls: list[int] = []
        #: the piece of the plan being done (what a failure is tagged with)
        self.stage = "publish"

    def result(self) -> Result:
        return Result(
            published=tuple(self.published),
            chunks=tuple(self.chunks),
            emitted=tuple(self.emitted),
            steps=tuple(self.steps),
            failures=tuple(self.failures),
            num_model_errors=self.num_model_errors,
            prefill_calls=tuple(self.prefill_calls),
        )
