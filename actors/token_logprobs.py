"""A generated token's log-probability and its most likely alternatives, picked on the device.

A request that asks for them (``RequestSpec.top_logprobs``: ``k`` from 0 to
:data:`MAX_TOP_LOGPROBS`) gets, with each token, a :class:`TokenLogprob`: the
token's log-probability under the model's distribution at that step (the
log-softmax of its logits, before temperature or any truncation: what
mlx-lm's ``generate_step`` yields), and the ``k`` most likely tokens there
with theirs.

:func:`pick` does it for the rows of one step that ask, in a few operations
over the batch (a gather and a partial sort), queued with the step: only
``2 + 2k`` numbers a row reach the host, in one transfer, never a row of
the vocabulary.
:meth:`Picks.read` reads them, once, after the step was evaluated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import attrs

__all__ = ["MAX_TOP_LOGPROBS", "Picks", "TokenLogprob", "pick", "pick_positions"]

#: The most alternatives a token may come with (OpenAI's bound for chat).
MAX_TOP_LOGPROBS = 20


@attrs.frozen
class TokenLogprob:
    """A generated token's log-probability, and the most likely tokens at its step.

    Attributes:
        token: the token id.
        logprob: its log-probability (<= 0).
        top: ``(token id, log-probability)`` of the most likely tokens, most
            likely first (ties: lower id first; of tokens tied at the last
            place, any), as many as asked for (fewer only for a vocabulary
            that small).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Picks:
    """What :func:`pick` queued for one step's rows, read once.

    Owns: the queued array (the caller evaluates it with its step) and,
    once read, the records.

    Invariants:
        - row ``i`` of the array is the row keyed ``keys[i]``, which asked
          for ``widths[i]`` alternatives: its token, the token's
          log-probability, then ``width`` token ids and their
          log-probabilities (ids as float32: exact below 2**24);
        - :meth:`read` reads the array once (one transfer), whoever asks.
    """

    def __init__(self, keys: Sequence[Any], widths: Sequence[int], packed: Any) -> None:
        self._keys = tuple(keys)
        self._widths = tuple(widths)
        self._packed = packed
        self._read: Optional[dict[Any, TokenLogprob]] = None

    @property
    def arrays(self) -> list[Any]:
        """The queued array, for the caller's ``mx.async_eval``."""
        return [self._packed]

    def read(self) -> dict[Any, TokenLogprob]:
        """Each asking row's record, by its key."""
        if self._read is None:
            rows = self._packed.tolist()
            width = (len(rows[0]) - 2) // 2 if rows else 0
            records = {}
            for row, key, asked in zip(rows, self._keys, self._widths):
                ranked = sorted(zip(row[2 + width :], row[2 : 2 + width]), key=lambda pair: (-pair[0], pair[1]))
                alternatives = tuple((int(token), value) for value, token in ranked[:asked])
                records[key] = TokenLogprob(int(row[0]), row[1], alternatives)
            self._read = records
        return self._read


def pick(logprobs: Any, tokens: Any, widths: Sequence[Optional[int]], keys: Sequence[Any]) -> Optional[Picks]:
    """Queue the records of the rows of a step that ask for them.

    Args:
        logprobs: the step's log-probabilities ``(rows, vocab)``.
        tokens: the tokens drawn from them ``(rows,)``.
        widths: per row, how many alternatives it asks for, or None (none
            asked: no record).
        keys: per row, what its record is read back under.

    Returns:
        The picks, lazy (evaluate :attr:`Picks.arrays` with the step), or
        None where no row asks.
    """
    import mlx.core as mx

    asking = [(row, width) for row, width in enumerate(widths) if width is not None]
    if not asking:
        return None
    if len(asking) < len(widths):
        index = mx.array([row for row, _ in asking])
        logprobs, tokens = logprobs[index], tokens[index]
    logprobs = logprobs.astype(mx.float32)
    tokens = tokens.astype(mx.int32)
    chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    width = min(max(asked for _, asked in asking), logprobs.shape[-1])
    columns = [tokens.astype(mx.float32)[:, None], chosen[:, None]]
    if width:
        top = mx.argpartition(-logprobs, kth=width - 1, axis=-1)[:, :width]
        columns += [top.astype(mx.float32), mx.take_along_axis(logprobs, top, axis=-1)]
    widths_read = [min(asked, width) for _, asked in asking]
    return Picks([keys[row] for row, _ in asking], widths_read, mx.concatenate(columns, axis=1))


def pick_positions(logits: Any, tokens: Sequence[int], width: int, first: int) -> Picks:
    """Queue the records of a prompt's ``tokens``, token ``i`` from the
    logits ``logits[i]`` ``(len(tokens), vocab)`` of the position before it,
    each with ``width`` alternatives, keyed by their positions from ``first``."""
    import mlx.core as mx

    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    count = len(tokens)
    picks = pick(logprobs, mx.array(tokens), [width] * count, range(first, first + count))
    assert picks is not None, "every position asks"
    return picks
