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

Rows join with the first token their prefill sampled (already emitted) and
leave when finished or cancelled; joining and leaving copy the batch cache
(mlx-lm's ``extend``/``filter``), once per request, not per token. A batch of
one row keeps that request's own cache (no merge, no padding mask): a lone
request decodes as fast as mlx-lm's ``generate_step``; the cache is merged
when a second row joins and extracted again when one row is left.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import attrs

from mlxkv.actors.model_runner import ModelRunner
from mlxkv.actors.sequence import Sequence

__all__ = ["DecodeBatch", "Emitted", "SampleFailed"]


@attrs.frozen
class Emitted:
    """A token a row emitted in a step.

    Attributes:
        sequence: the row.
        index: the token's place in the row's ``generated``.
        token: the token fed to the model in this step.
        logprobs: its step's log-probabilities ``(vocab,)`` if the row keeps
            them (evaluated), else None.
    """

    sequence: Sequence
    index: int
    token: int
    logprobs: Any = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class SampleFailed:
    """A row whose sampler raised; it leaves the batch, the others go on."""

    sequence: Sequence
    error: Exception


class DecodeBatch:
    """The rows decoding together and their merged cache.

    Owns: the rows in batch order, the batch cache (``None`` when empty),
    the lazily sampled next token of every row, and, for rows that keep
    them, the log-probabilities those tokens were drawn from.

    Invariants:
        - ``len(rows)`` equals the batch size of the cache and of ``_next``;
        - row ``i``'s KV holds exactly ``rows[i].prompt + rows[i].generated``;
        - ``_next[i]`` is row ``i``'s next token, sampled but not yet fed or
          emitted, except for a row that just joined, whose first token was
          emitted by its prefill (``_fresh``).
    """

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner
        self.rows: list[Sequence] = []
        self._cache: Optional[list[Any]] = None
        self._merged = False  # whether _cache is a batch cache (else one row's own)
        self._next: Any = None
        self._next_logprobs: list[Any] = []
        self._fresh: set[int] = set()  # id() of rows whose next token is already emitted

    def __len__(self) -> int:
        return len(self.rows)

    def leave(
        self, sequences: Iterable[Sequence], *, keep: Iterable[Sequence] = ()
    ) -> dict[int, list[Any]]:
        """Remove rows; return the caches of those in ``keep`` (by ``id()``).

        A kept cache is the row's own request cache (``extract``), holding
        its prompt and its emitted tokens.
        """
        import mlx.core as mx

        leaving = {id(sequence) for sequence in sequences}
        wanted = {id(sequence) for sequence in keep}
        caches: dict[int, list[Any]] = {}
        if not leaving:
            return caches
        assert self._cache is not None, "rows leave an empty batch"
        stay = []
        for index, sequence in enumerate(self.rows):
            if id(sequence) not in leaving:
                stay.append(index)
                continue
            self._fresh.discard(id(sequence))
            if id(sequence) in wanted:
                caches[id(sequence)] = self._row_cache(index)
        if not stay:
            self.rows, self._cache, self._next, self._next_logprobs = [], None, None, []
            self._merged = False
            return caches
        kept = mx.array(stay)
        if len(stay) == 1:
            self._cache, self._merged = self._row_cache(stay[0]), False
        else:
            for layer in self._cache:
                layer.filter(kept)
        self.rows = [self.rows[i] for i in stay]
        self._next = self._next[kept]
        self._next_logprobs = [self._next_logprobs[i] for i in stay]
        return caches

    def _row_cache(self, index: int) -> list[Any]:
        assert self._cache is not None, "an empty batch has no rows"
        return self._runner.extract(self._cache, index) if self._merged else self._cache

    def join(self, sequences: list[Sequence]) -> None:
        """Add rows whose prefill is done; their caches move into the batch.

        Each row's next token is the last of its ``generated`` (its first
        token, sampled and emitted by the prefill).
        """
        import mlx.core as mx

        if not sequences:
            return
        caches = []
        for sequence in sequences:
            assert sequence.cache is not None, f"{sequence!r} joins without a cache"
            caches.append(sequence.cache)
            sequence.cache = None
            self._fresh.add(id(sequence))
        tokens = mx.array([sequence.generated[-1] for sequence in sequences], dtype=mx.uint32)
        if self._cache is None and len(caches) == 1:
            self._cache, self._merged, self._next = caches[0], False, tokens
        elif self._cache is None:
            self._cache, self._merged, self._next = self._runner.merge(caches), True, tokens
        else:
            if not self._merged:
                caches.insert(0, self._cache)
                self._cache, self._merged = self._runner.merge(caches), True
            else:
                for layer, new in zip(self._cache, self._runner.merge(caches)):
                    layer.extend(new)
            self._next = mx.concatenate([self._next, tokens])
        self.rows.extend(sequences)
        self._next_logprobs.extend([None] * len(sequences))

    def advance(self, max_steps: int = 1) -> tuple[list[Emitted], list[SampleFailed], int]:
        """Run up to ``max_steps`` decode steps; stop early once a row is done.

        Each step feeds every row's next token, samples the following one and
        emits the fed ones. A row is done when it emits a stop token or
        reaches ``max_tokens``, or when its sampler raised.

        Returns:
            The tokens emitted, in order (by every row but those that just
            joined, whose first fed token their prefill emitted), the rows
            whose sampler raised (still in the batch: make them leave), and
            the number of steps (model calls) run.
        """
        emitted: list[Emitted] = []
        failed: list[SampleFailed] = []
        steps = 0
        while steps < max_steps and self.rows:
            tokens, failures = self._step()
            steps += 1
            emitted.extend(tokens)
            failed.extend(failures)
            if failures or any(_done(item) for item in tokens):
                break
        return emitted, failed, steps

    def _step(self) -> tuple[list[Emitted], list[SampleFailed]]:
        import mlx.core as mx

        fresh = [id(sequence) in self._fresh for sequence in self.rows]
        self._fresh.clear()
        inputs, fed_logprobs = self._next, self._next_logprobs
        # The fed token's index: a fresh row's first token is already counted.
        positions = [
            sequence.num_tokens - 1 if fresh[index] else sequence.num_tokens
            for index, sequence in enumerate(self.rows)
        ]
        logits = self._runner.decode(inputs, self._cache, self.rows, positions)
        if any(sequence.sampler is not None or sequence.keep_logits for sequence in self.rows):
            logits = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        # (Greedy rows take the argmax, which log-probabilities do not move.)
        self._next, failed = self._sample(logits)
        self._next_logprobs = [
            logits[i] if sequence.keep_logits else None for i, sequence in enumerate(self.rows)
        ]
        snapshots = self._snapshot_block_ends(fresh)
        mx.async_eval(self._next, [lp for lp in self._next_logprobs if lp is not None], snapshots)
        values = inputs.tolist()
        emitted = []
        for index, sequence in enumerate(self.rows):
            if fresh[index]:
                continue
            sequence.generated.append(values[index])
            emitted.append(
                Emitted(sequence, len(sequence.generated) - 1, values[index], fed_logprobs[index])
            )
        return emitted, failed

    def _sample(self, logprobs: Any) -> tuple[Any, list[SampleFailed]]:
        """Each row's next token: one argmax for greedy rows, each sampler for the rest."""
        import mlx.core as mx

        greedy = mx.argmax(logprobs, axis=-1).astype(mx.uint32)
        if all(sequence.sampler is None for sequence in self.rows):
            return greedy, []
        tokens = []
        failed = []
        for index, sequence in enumerate(self.rows):
            token = greedy[index]
            if sequence.sampler is not None:
                try:
                    token = sequence.sampler(logprobs[index : index + 1])[0].astype(mx.uint32)
                except Exception as error:
                    failed.append(SampleFailed(sequence, error))
            tokens.append(token)
        return mx.stack(tokens), failed

    def _snapshot_block_ends(self, fresh: list[bool]) -> list[Any]:
        """Record recurrent state of rows whose KV ends on a block boundary after this step."""
        if not self._runner.info.has_recurrent:
            return []
        arrays = []
        for index, sequence in enumerate(self.rows):
            # A fresh row feeds its first token, already in ``generated``;
            # any other row feeds a token that joins ``generated`` below.
            position = sequence.num_tokens + (0 if fresh[index] else 1)
            if position % sequence.block_size == 0:
                state = self._runner.snapshot(self._cache, index)
                sequence.snapshots[position] = state
                arrays.extend(a for group in state if group for a in group if a is not None)
        return arrays


def _done(item: Emitted) -> bool:
    """Whether the row that emitted ``item`` is finished with it."""
    sequence = item.sequence
    return item.token in sequence.stop_tokens or item.index + 1 >= sequence.max_tokens
