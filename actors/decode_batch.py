"""Requests that decode together: one model call per step for every row.

A :class:`DecodeBatch` holds the rows (sequences whose prefill is done), one
batch cache merged from their caches by the model runner (mlx-lm's
``BatchKVCache`` and friends), and the tokens the last step sampled. Its
methods run on the MLX thread, inside the compute actor's jobs.

Pipelining: :meth:`DecodeBatch.advance` feeds the tokens the previous step
sampled, builds this step's graph (logits and samples), starts evaluating it
(``mx.async_eval``) and only then reads the fed tokens' values to return
them. So the model computes step *n + 1* while the event loop hands out the
tokens of step *n*: a row's token is emitted in the job that feeds it, and
the KV of a row always holds exactly its prompt and its emitted tokens.
A row held to a JSON grammar needs the token it feeds before its draw (what
may follow depends on it): a step with such a row queues its model call,
then reads the fed tokens and masks the constrained rows' logits while the
device computes (:meth:`DecodeBatch._feed_constraints`); a step without one
never waits.

Rows join with the first token their prefill sampled (already emitted) and
leave when finished or cancelled; joining and leaving copy the batch cache
(mlx-lm's ``extend``/``filter``), once per request, not per token; the
copies are queued (``mx.async_eval``), not waited for, so a join or a leave
does not drain the device of the step in flight. A batch of
one row keeps that request's own cache (no merge, no padding mask), made
ready to decode alone by the runner (:meth:`ModelRunner.alone`: over a
shared prefix, one plain run of prefix and own tokens), so a lone request
decodes as fast as mlx-lm's ``generate_step``; the cache is made ready to
merge again (:meth:`ModelRunner.together`) and merged when a second row
joins, and extracted again when one row is left.

Failures. What is done for one row -- merging its cache in, extracting it on
the way out, sampling its next token, snapshotting its recurrent state --
fails that row alone (:class:`RowFailed`); the batch goes on without it. A
draw that raises after the row's last token (its next token is never used)
is no failure. What is done for the whole batch -- the model call, cutting
the batch cache down or extending it -- raises: every row of the batch
shared it.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable
from typing import Any, Optional

import attrs

from mlxkv.actors.model_runner import ModelRunner
from mlxkv.actors.request import stop_reason
from mlxkv.actors.json_constraint import ConstrainedRow, ConstraintBroken, masked
from mlxkv.actors.json_grammar import GrammarTooAmbiguous
from mlxkv.actors.penalties import adjust_rows
from mlxkv.actors.sampling import draw_rows
from mlxkv.actors.sequence import SequenceState
from mlxkv.actors.token_logprobs import Picks, TokenLogprob, pick
from mlxkv.cache.shared_prefix import BatchSharedPrefixCache

__all__ = ["BatchBroken", "DecodeBatch", "RowFailed", "RowToken", "without_frames"]


@attrs.frozen
class RowToken:
    """A token a row emitted in a step.

    Attributes:
        sequence: the row.
        index: the token's place in the row's ``generated``.
        token: the token fed to the model in this step.
        logprobs: its step's log-probabilities ``(vocab,)`` if the row keeps
            them (evaluated), else None.
        token_logprob: its log-probability and alternatives if the row asked
            for them (``top_logprobs``), else None.
    """

    sequence: SequenceState
    index: int
    token: int
    logprobs: Any = attrs.field(default=None, eq=False, repr=False)
    token_logprob: Optional[TokenLogprob] = None


@attrs.frozen
class RowFailed:
    """A step done for one row raised; the row is out of the batch (or leaves
    it now), the others go on.

    Attributes:
        sequence: the row.
        error: what raised.
    """

    sequence: SequenceState
    error: Exception


class BatchBroken(Exception):
    """Changing the batch cache as a whole raised: the batch is unusable.

    Attributes:
        error: what raised.
    """

    def __init__(self, error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


class DecodeBatch:
    """The rows decoding together and their merged cache.

    Owns: the rows in batch order, the batch cache (``None`` when empty),
    the lazily sampled next token of every row, and, for rows that keep
    them, the log-probabilities those tokens were drawn from (for rows that
    ask, their records: :mod:`~mlxkv.actors.token_logprobs`).

    Invariants:
        - ``len(rows)`` equals the batch size of the cache and of ``_next``;
        - row ``i``'s KV holds exactly ``rows[i].prompt + rows[i].generated``;
        - ``_next[i]`` is row ``i``'s next token, sampled but not yet fed or
          emitted, except for a row that just joined, whose first token was
          emitted by its prefill (``_fresh``).
    """

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner
        self.rows: list[SequenceState] = []
        self._cache: Optional[list[Any]] = None
        self._merged = False  # whether _cache is a batch cache (else one row's own)
        self._next: Any = None
        self._next_logprobs: list[Any] = []
        self._next_picks: Optional[Picks] = None  # by request id: rows that leave need no update
        self._fresh: set[int] = set()  # id() of rows whose next token is already emitted

    def __len__(self) -> int:
        return len(self.rows)

    def leave(
        self,
        sequences: Iterable[SequenceState],
        *,
        keep: Iterable[SequenceState] = (),
        read: Iterable[SequenceState] = (),
    ) -> tuple[dict[int, list[Any]], list[RowFailed]]:
        """Remove rows; return the caches of those in ``keep`` or ``read`` (by ``id()``).

        Such a cache is the row's own request cache (``extract``), holding
        its prompt and its emitted tokens: for a row in ``keep`` (its cache
        outlives the batch) its own copy; for one in ``read`` only, whose
        cache is read before the batch's next step (its answer's blocks
        sliced, copies of their own), views of the batch's buffers where the
        runner makes them (a shared prefix's suffixes): no copy of a row
        that is only read. A row whose cache cannot be extracted leaves all
        the same, and is among the failures; so is the one row left, out of
        the batch too, if its cache cannot be.

        Raises:
            BatchBroken: cutting the batch cache down to the other rows raised.
        """
        import mlx.core as mx

        leaving = {id(sequence) for sequence in sequences}
        copied = {id(sequence) for sequence in keep}
        wanted = copied | {id(sequence) for sequence in read}
        caches: dict[int, list[Any]] = {}
        failed: list[RowFailed] = []
        if not leaving:
            return caches, failed
        assert self._cache is not None, "rows leave an empty batch"
        stay = []
        for index, sequence in enumerate(self.rows):
            if id(sequence) not in leaving:
                stay.append(index)
                continue
            self._fresh.discard(id(sequence))
            if id(sequence) in wanted:
                try:
                    caches[id(sequence)] = self._row_cache(index, copy=id(sequence) in copied)
                except Exception as error:
                    failed.append(RowFailed(sequence, without_frames(error)))
        if len(stay) == 1:
            # The last row keeps its own cache again (no padding mask).
            try:
                alone = self._runner.alone(self.rows[stay[0]], self._row_cache(stay[0]))
                self._cache, self._merged = alone, False
            except Exception as error:
                failed.append(RowFailed(self.rows[stay[0]], without_frames(error)))
                stay = []
        if not stay:
            self.rows, self._cache, self._next, self._next_logprobs = [], None, None, []
            self._next_picks = None
            self._merged = False
            return caches, failed
        kept = mx.array(stay)
        if len(stay) > 1:
            try:
                for layer in self._cache:
                    layer.filter(kept)
                # Cut now: evaluated with the next step, the old and the new
                # batch cache would both be held through that step's
                # transients. Queued, not waited for: the old buffers go as
                # soon as the copies are made, and the host goes on building
                # the next step while the device runs the one in flight.
                mx.async_eval([layer.state for layer in self._cache])
            except Exception as error:
                raise BatchBroken(without_frames(error)) from None
        self.rows = [self.rows[i] for i in stay]
        self._next = self._next[kept]
        self._next_logprobs = [self._next_logprobs[i] for i in stay]
        return caches, failed

    def _row_cache(self, index: int, *, copy: bool = True) -> list[Any]:
        assert self._cache is not None, "an empty batch has no rows"
        return self._runner.extract(self._cache, index, copy=copy) if self._merged else self._cache

    def join(self, sequences: list[SequenceState]) -> list[RowFailed]:
        """Add rows whose prefill is done; their caches move into the batch.

        Each row's next token is the last of its ``generated`` (its first
        token, sampled and emitted by the prefill). A row whose cache cannot
        be merged (even on its own) stays out, its cache dropped, and is
        among the returned failures; the others join.

        Raises:
            BatchBroken: the batch cache could not take the rows in.
        """
        if not sequences:
            return []
        try:
            self._join(sequences)
            return []
        except BatchBroken:
            raise
        except Exception:
            pass
        # Whose cache it was (a rare path): each merged on its own is refused
        # if it raises; if the others still do not merge in, the batch's own
        # cache is at fault.
        failed, fine = [], []
        for sequence in sequences:
            try:
                self._runner.merge([sequence.cache])
            except Exception as error:
                failed.append(self._refuse(sequence, error))
                continue
            fine.append(sequence)
        if fine:
            try:
                self._join(fine)
            except BatchBroken:
                raise
            except Exception as error:
                raise BatchBroken(without_frames(error)) from None
        return failed

    def _refuse(self, sequence: SequenceState, error: Exception) -> RowFailed:
        sequence.give_up_cache()
        return RowFailed(sequence, without_frames(error))

    def _join(self, sequences: list[SequenceState]) -> None:
        """Merge ``sequences`` in; nothing changes if the merge raises, and
        only :class:`BatchBroken` leaves the batch changed."""
        import mlx.core as mx

        caches = []
        for sequence in sequences:
            assert sequence.cache is not None, f"{sequence!r} joins without a cache"
            caches.append(sequence.cache)
        tokens = mx.array([sequence.generated[-1] for sequence in sequences], dtype=mx.uint32)
        if self._cache is None and len(caches) == 1:
            alone = self._runner.alone(sequences[0], caches[0])
            self._cache, self._merged, self._next = alone, False, tokens
        elif self._cache is None:
            self._cache, self._merged, self._next = self._runner.merge(caches), True, tokens
        elif not self._merged:
            lone = self._runner.together(self.rows[0], self._cache)
            self._cache, self._merged = self._runner.merge([lone, *caches]), True
            self._next = mx.concatenate([self._next, tokens])
        else:
            merged = self._runner.merge(caches)
            try:
                for layer, new in zip(self._cache, merged):
                    layer.extend(new)
                mx.async_eval([layer.state for layer in self._cache])  # as in leave
            except Exception as error:
                raise BatchBroken(without_frames(error)) from None
            self._next = mx.concatenate([self._next, tokens])
        for sequence in sequences:
            sequence.give_up_cache()
            self._fresh.add(id(sequence))
        self.rows.extend(sequences)
        self._next_logprobs.extend([None] * len(sequences))

    def advance(self, max_steps: int = 1) -> tuple[list[RowToken], list[RowFailed], int]:
        """Run up to ``max_steps`` decode steps; stop early once a row is done.

        Each step feeds every row's next token, samples the following one and
        emits the fed ones. A row is done when it emits a stop token or
        reaches ``max_tokens``, or when a step for it alone raised.

        Returns:
            The tokens emitted, in order (by every row but those that just
            joined, whose first fed token their prefill emitted), the rows
            whose own step raised (still in the batch: make them leave; the
            tokens they emitted before are valid), and the number of steps
            (model calls) run.

        Raises:
            Exception: the model call raised (every row shared it).
        """
        emitted: list[RowToken] = []
        failed: list[RowFailed] = []
        steps = 0
        while steps < max_steps and self.rows:
            tokens, failures = self._step()
            steps += 1
            emitted.extend(tokens)
            failed.extend(failures)
            if failures or any(_done(item) for item in tokens):
                break
        return emitted, failed, steps

    def _step(self) -> tuple[list[RowToken], list[RowFailed]]:
        import mlx.core as mx

        fresh = [id(sequence) in self._fresh for sequence in self.rows]
        self._fresh.clear()
        inputs, fed_logprobs, fed_picks = self._next, self._next_logprobs, self._next_picks
        # The fed token's index: a fresh row's first token is already counted.
        positions = [
            sequence.num_tokens - 1 if fresh[index] else sequence.num_tokens
            for index, sequence in enumerate(self.rows)
        ]
        grown = [a for layer in self._cache if isinstance(layer, BatchSharedPrefixCache) for a in layer.reserve(1)]
        if grown:
            # Queued ahead of the step (the old buffers go as soon as the
            # copies are made), without waiting for the step in flight.
            mx.async_eval(grown)
        logits = self._runner.decode(inputs, self._cache, self.rows, positions)
        for index, sequence in enumerate(self.rows):
            if sequence.adjuster is not None:
                sequence.adjuster.fed(inputs[index : index + 1])  # generated now, counted from this step
        logits = adjust_rows(logits, [sequence.adjuster for sequence in self.rows])
        constraints = [sequence.constraint for sequence in self.rows]
        broken: list[RowFailed] = []
        if any(constraint is not None for constraint in constraints):
            broken = self._feed_constraints(inputs, logits, constraints)
            logits, unmasked = masked(logits, constraints)
            broken.extend(RowFailed(self.rows[row], error) for row, error in unmasked)
        if any(
            sequence.sampler is not None or sequence.keep_logits or sequence.top_logprobs is not None
            for sequence in self.rows
        ):
            logits = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        # (Greedy rows take the argmax, which log-probabilities do not move.)
        self._next, failed = self._sample(logits)
        failed.extend(broken)
        self._next_logprobs = [
            logits[i] if sequence.keep_logits else None for i, sequence in enumerate(self.rows)
        ]
        self._next_picks = pick(
            logits, self._next, [s.top_logprobs for s in self.rows], [s.request_id for s in self.rows]
        )
        picked = self._next_picks.arrays if self._next_picks is not None else []
        snapshots, unsnapped = self._snapshot_block_ends(fresh)
        failed.extend(unsnapped)
        mx.async_eval(self._next, [lp for lp in self._next_logprobs if lp is not None], snapshots, picked)
        values = inputs.tolist()
        records = fed_picks.read() if fed_picks is not None else {}
        emitted = []
        for index, sequence in enumerate(self.rows):
            if fresh[index]:
                continue
            sequence.emitted(values[index])
            emitted.append(
                RowToken(
                    sequence, len(sequence.generated) - 1, values[index], fed_logprobs[index],
                    records.get(sequence.request_id),
                )  # fmt: skip
            )
        # A row done with the token it fed never uses what was drawn after it
        # (a fresh row is never done: its prefill would have finished it).
        done = {id(item.sequence) for item in emitted if _done(item)}
        return emitted, [failure for failure in failed if id(failure.sequence) not in done]

    def _feed_constraints(
        self, inputs: Any, logits: Any, constraints: list[Optional[ConstrainedRow]]
    ) -> list[RowFailed]:
        """Move each constrained row past the token it feeds in this step, so
        that its draw is among the tokens that may follow (a row whose token
        its constraint refused leaves ``constraints`` and fails).

        The step's model call is queued first: the device computes it while
        the host reads the fed tokens (the previous step's draws, done by
        now) and finds what each row allows. That read is the one wait a
        constrained row adds to a step; a batch without one never waits."""
        import mlx.core as mx

        mx.async_eval(logits)
        fed = inputs.tolist()
        failed = []
        for index, constraint in enumerate(constraints):
            if constraint is None:
                continue
            try:
                constraint.fed(fed[index])
            except (ConstraintBroken, GrammarTooAmbiguous) as error:
                failed.append(RowFailed(self.rows[index], error))
                constraints[index] = None
        return failed

    def _sample(self, logprobs: Any) -> tuple[Any, list[RowFailed]]:
        """Each row's next token (:func:`~mlxkv.actors.sampling.draw_rows`:
        one draw for the rows that share sampling settings); the rows whose
        draw raised."""
        tokens, failed = draw_rows([sequence.sampler for sequence in self.rows], logprobs)
        return tokens, [RowFailed(self.rows[row], without_frames(error)) for row, error in failed]

    def _snapshot_block_ends(self, fresh: list[bool]) -> tuple[list[Any], list[RowFailed]]:
        """Record recurrent state of rows whose KV ends on a block boundary after this step."""
        if not self._runner.info.has_recurrent:
            return [], []
        arrays = []
        failed = []
        for index, sequence in enumerate(self.rows):
            # A fresh row feeds its first token, already in ``generated``;
            # any other row feeds a token that joins ``generated`` below.
            position = sequence.num_tokens + (0 if fresh[index] else 1)
            if position % sequence.block_size == 0:
                try:
                    state = self._runner.snapshot(self._cache, index)
                except Exception as error:
                    failed.append(RowFailed(sequence, without_frames(error)))
                    continue
                sequence.snapshot(position, state)
                arrays.extend(a for group in state if group for a in group if a is not None)
        return arrays, failed


def _done(item: RowToken) -> bool:
    """Whether the row that emitted ``item`` is finished with it (by the
    rule the scheduler ends requests by): a burst stops there, so that no
    row decodes past its end; the row leaves when a plan says so."""
    return stop_reason(item.sequence.spec, item.token, item.index) is not None


def without_frames(error: Exception) -> Exception:
    """``error`` without the frames its traceback holds (they hold MLX arrays)."""
    traceback.clear_frames(error.__traceback__)
    return error
