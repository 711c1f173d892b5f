"""What a request adds to its logits before a token is drawn: penalties and a bias.

:class:`Penalties` are a request's settings, checked when made (OpenAI's
``presence_penalty``, ``frequency_penalty`` and ``logit_bias``; vLLM's
``repetition_penalty``). At each step, before the log-softmax that sampling,
greedy decoding and log-probabilities all read, a row's logits ``l`` become::

    l + bias                                   (logit_bias)
    l / r where l > 0 else l * r, for tokens in the prompt or generated so far
                                               (repetition_penalty r; 1: off)
    l - presence * (count > 0) - frequency * count
                                               (count: times generated so far)

-- the order vLLM applies them in. :class:`LogitsAdjuster` holds one request's
state on the device (its counts, the tokens seen, its bias as a vector), and
counts each token as it is fed, lazily (``.at[...].add`` of the fed token's
array: the host never reads a token for it). Only the rows that ask pay:
:func:`adjust_rows` leaves the others' logits as they are.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import attrs

from mlxkv.cache.errors import InvalidInput

__all__ = ["NO_PENALTIES", "LogitsAdjuster", "Penalties", "adjust_rows"]

#: OpenAI's bounds: the penalties' and a bias's.
MAX_PENALTY, MAX_BIAS = 2.0, 100.0


def _within(low: float, high: float, *, open_low: bool = False) -> Any:
    def check(_instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidInput(attribute.name, value, "must be a finite number")
        if (value <= low if open_low else value < low) or value > high:
            raise InvalidInput(attribute.name, value, f"must be in {'(' if open_low else '['}{low:g}, {high:g}]")

    return check


def _bias(value: Any) -> tuple[tuple[int, float], ...]:
    """A ``{token id: bias}`` mapping (or pairs) as sorted pairs, checked."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [(token, bias) for token, bias in items]
    except (TypeError, ValueError):
        raise InvalidInput("logit_bias", value, "must map token ids to numbers") from None
    for token, bias in pairs:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidInput("logit_bias", value, f"has a key that is not a token id: {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise InvalidInput("logit_bias", value, f"has a bias that is not a finite number: {bias!r}")
        if abs(bias) > MAX_BIAS:
            raise InvalidInput("logit_bias", value, f"has a bias outside [-{MAX_BIAS:g}, {MAX_BIAS:g}]: {bias!r}")
    if len({token for token, _ in pairs}) != len(pairs):
        raise InvalidInput("logit_bias", value, "names a token twice")
    return tuple(sorted((token, float(bias)) for token, bias in pairs))


@attrs.frozen(kw_only=True)
class Penalties:
    """What a request adds to its logits (see the module docstring).

    Attributes:
        presence_penalty: subtracted from each token generated so far, once
            (``[-2, 2]``; 0: off).
        frequency_penalty: subtracted from each token generated so far, per time
            (``[-2, 2]``; 0: off).
        repetition_penalty: divides the positive logits of the tokens in the prompt
            or generated so far, multiplies the negative ones (``> 0``, at
            most 2; 1: off).
        logit_bias: ``(token id, bias)`` pairs, each bias in ``[-100, 100]``
            (given as a mapping or pairs; kept sorted).

    Raises:
        InvalidInput: a value of the wrong type, not finite, or out of range.
    """

    presence_penalty: float = attrs.field(default=0.0, validator=_within(-MAX_PENALTY, MAX_PENALTY))
    frequency_penalty: float = attrs.field(default=0.0, validator=_within(-MAX_PENALTY, MAX_PENALTY))
    repetition_penalty: float = attrs.field(default=1.0, validator=_within(0.0, MAX_PENALTY, open_low=True))
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_bias)

    @property
    def active(self) -> bool:
        """Whether they change any logit."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )

    def check_vocabulary(self, vocab_size: Optional[int]) -> None:
        """Refuse a biased token past a vocabulary of ``vocab_size`` (None: unknown)."""
        if vocab_size is not None and self.logit_bias and self.logit_bias[-1][0] >= vocab_size:
            last = self.logit_bias[-1][0]
            raise InvalidInput(
                "logit_bias", dict(self.logit_bias), f"names token {last}, past the vocabulary of {vocab_size}"
            )


#: Nothing added: the default.
NO_PENALTIES = Penalties()


class LogitsAdjuster:
    """One request's :class:`Penalties` as they stand at its next step.

    Owns (MLX thread only): the counts of its generated tokens, the tokens
    it has seen (prompt and generated) and its bias, as vectors the width
    of its logits, made at the first step (the width is the model's).

    Invariants: after :meth:`fed` of each generated token, the counts are
    those tokens' counts and ``seen`` marks them and the prompt's.
    """

    def __init__(self, penalties: Penalties, prompt: Sequence[int]) -> None:
        self.penalties = penalties
        self._prompt = tuple(prompt)
        self._fed: list[Any] = []  # tokens fed before the vectors were made
        self._counts: Any = None
        self._seen: Any = None
        self._bias: Any = None

    def fed(self, token: Any) -> None:
        """Count ``token`` (an array of one token id, lazily) as generated."""
        if self._counts is None:
            self._fed.append(token)
            return
        self._counts = self._counts.at[token].add(1.0)
        if self.penalties.repetition_penalty != 1.0:
            self._seen = self._seen.at[token].add(1.0)

    def adjust(self, logits: Any) -> Any:
        """``logits`` ``(vocab,)`` of this request's next step, adjusted."""
        import mlx.core as mx

        if self._counts is None:
            self._start(logits.shape[-1], logits.dtype)
        p = self.penalties
        if self._bias is not None:
            logits = logits + self._bias
        if p.repetition_penalty != 1.0:
            penalised = mx.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = mx.where(self._seen > 0, penalised, logits)
        if p.presence_penalty:
            logits = logits - p.presence_penalty * (self._counts > 0)
        if p.frequency_penalty:
            logits = logits - p.frequency_penalty * self._counts
        return logits

    def _start(self, width: int, dtype: Any) -> None:
        import mlx.core as mx

        self._counts = mx.zeros((width,), dtype=mx.float32)
        if self.penalties.repetition_penalty != 1.0:
            self._seen = mx.zeros((width,), dtype=mx.float32).at[mx.array(self._prompt)].add(1.0)
        if self.penalties.logit_bias:
            tokens, biases = zip(*self.penalties.logit_bias)
            self._bias = mx.zeros((width,), dtype=mx.float32).at[mx.array(tokens)].add(mx.array(biases))
        fed, self._fed = self._fed, []
        for token in fed:
            self.fed(token)


def adjust_rows(logits: Any, adjusters: Sequence[Optional[LogitsAdjuster]]) -> Any:
    """``logits`` ``(rows, vocab)`` with each row that has an adjuster adjusted
    (the others as they are; the same array where none has)."""
    import mlx.core as mx

    rows = [row for row, adjuster in enumerate(adjusters) if adjuster is not None]
    if not rows:
        return logits
    adjusted = mx.stack([adjusters[row].adjust(logits[row]) for row in rows])  # type: ignore[union-attr]
    adjusted = adjusted.astype(logits.dtype)
    if len(rows) == len(adjusters):
        return adjusted
    out = mx.array(logits)
    out[mx.array(rows)] = adjusted
    return out
