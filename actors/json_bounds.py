"""What a JSON number may be: ``minimum``/``maximum`` (each may be
exclusive) and ``multipleOf``, read a prefix at a time.

A :class:`NumberBounds` answers, for the text of a number written so far
(in decimal, no exponent), whether some value it can still grow into is
within bounds (:meth:`NumberBounds.reach`), and whether a whole number is
(:meth:`NumberBounds.holds`). Compared exactly, as fractions: a float bound
as the decimal it is written as.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Optional

__all__ = ["BoundsNotSupported", "NumberBounds"]


class BoundsNotSupported(ValueError):
    """Bounds no number meets, or a ``multipleOf`` not above 0."""


def _exact(value) -> Optional[Fraction]:
    """A JSON number as an exact fraction (a float as the decimal it is written as)."""
    if value is None:
        return None
    return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)


class NumberBounds:
    """``minimum``/``maximum`` (each may be exclusive) and ``multipleOf`` on a
    number written in decimal (no exponent: a bounded number's text is its
    digits), compared exactly. Compared by identity.

    Attributes:
        integer: only integers (no fraction either).
        multiple: the value numbers are multiples of, or None.
        refused: the number's parts its text may not have (``"exp"``, and
            ``"dot"`` for an integer), as :mod:`~mlxkv.actors.json_grammar`
            names them.
    """

    __slots__ = ("low", "low_open", "high", "high_open", "integer", "refused", "multiple")

    def __init__(
        self, low=None, low_open=False, high=None, high_open=False, *, integer: bool = False, multiple=None
    ) -> None:
        self.low, self.high, self.multiple = (_exact(value) for value in (low, high, multiple))
        self.low_open, self.high_open = low_open, high_open
        self.integer = integer
        if self.multiple is not None and self.multiple <= 0:
            raise BoundsNotSupported("multipleOf must be above 0")
        self.refused = frozenset({"dot", "exp"} if integer else {"exp"})
        if integer:  # bounds on integers are integers, closed
            if self.low is not None:
                self.low, self.low_open = Fraction(math.floor(self.low) + 1 if low_open else math.ceil(self.low)), False
            if self.high is not None:
                self.high, self.high_open = (
                    Fraction(math.ceil(self.high) - 1 if high_open else math.floor(self.high)), False,
                )  # fmt: skip
        if self._empty(self.low, self.low_open, self.high, self.high_open):
            raise BoundsNotSupported("no number lies between the minimum and the maximum (a multiple, if asked)")

    def holds(self, text: bytes) -> bool:
        """Whether the number written ``text`` (whole) is within bounds."""
        value = Fraction(text.decode())
        return not self._empty(*self._clipped(value, False, value, False))

    def reach(self, text: bytes) -> str:
        """Where the numbers a prefix ``text`` can grow into lie: ``"none"``
        within bounds, ``"some"``, or ``"all"`` (then the bounds no longer
        matter: any way on is within them)."""
        negative = text.startswith(b"-")
        digits = text[1:] if negative else text
        if b"." in digits:
            whole, _, fraction = digits.partition(b".")
            start = Fraction((whole + b"." + fraction).decode()) if fraction else Fraction(int(whole))
            spans = [(start, start + Fraction(1, 10 ** len(fraction)))]
            grows = False
        elif digits in (b"", b"0"):
            spans = [(Fraction(0), None if not digits else Fraction(1))]
            grows = False
        else:  # digits still to come: each count of them a span further out
            leading = int(digits)
            spans = [(Fraction(leading), Fraction(leading + 1))]
            grows = True
        verdict = self._reach_spans(spans[0], negative)
        if not grows or verdict == "some":
            return verdict
        # More digits: spans [D 10^k, (D+1) 10^k), k = 1, 2, ... farther from zero.
        leading = spans[0][0]
        outer = self.low if negative else self.high
        if outer is None:
            return "all" if verdict == "all" else "some"
        scale = 10
        while leading * scale <= abs(outer):
            if self._reach_spans((leading * scale, (leading + 1) * scale), negative) != "none":
                return "some"
            scale *= 10
        return "none" if verdict == "none" else "some"

    def _reach_spans(self, span, negative: bool) -> str:
        """A magnitude span ``[start, end)`` (end None: unbounded), of values
        of the sign given, against the bounds."""
        start, end = span
        if negative:  # values (-end, -start]
            low, low_open, high, high_open = (None if end is None else -end), True, -start, False
        else:
            low, low_open, high, high_open = start, False, end, True
        if self.integer:
            if low is not None:
                low, low_open = Fraction(math.floor(low) + 1 if low_open else math.ceil(low)), False
            if high is not None:
                high, high_open = Fraction(math.ceil(high) - 1 if high_open else math.floor(high)), False
            if self._empty(low, low_open, high, high_open):
                return "none"
        clipped = self._clipped(low, low_open, high, high_open)
        if self._empty(*clipped):
            return "none"
        # A multiple is told only from the whole text: its bounds are never left behind.
        inside = clipped == (low, low_open, high, high_open) and self.multiple is None
        return "all" if inside else "some"

    def _clipped(self, low, low_open, high, high_open):
        """An interval cut to the bounds."""
        if self.low is not None and (low is None or self.low > low or (self.low == low and self.low_open)):
            low, low_open = self.low, self.low_open
        if self.high is not None and (high is None or self.high < high or (self.high == high and self.high_open)):
            high, high_open = self.high, self.high_open
        return low, low_open, high, high_open

    def _empty(self, low, low_open, high, high_open) -> bool:
        """Whether no number the bounds take (an integer, a multiple, where
        asked) lies in the interval (an end None: unbounded)."""
        step = self.multiple
        if self.integer:
            step = Fraction(1) if step is None else Fraction(step.numerator)  # integers that are multiples of p/q: of p
        if step is None:
            if low is None or high is None:
                return False
            return low > high or (low == high and (low_open or high_open))
        if low is None or high is None:
            return False  # multiples run on without end either way
        first = math.ceil(low / step) * step
        if low_open and first == low:
            first += step
        return first > high or (first == high and high_open)

