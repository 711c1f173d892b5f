"""The benchmarks' check of their methods' greedy tokens against a
reference's: where each run parts, and whether at a tie within float noise
(:mod:`mlxkv.divergence`, which measures it), summed up a line a method.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from mlxkv.divergence import Divergence, first_divergence, float32_weights

__all__ = ["TokenComparison", "compare_tokens", "report"]


def _possessive(name: str) -> str:
    return f"{name}'" if name.endswith("s") else f"{name}'s"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def report(
    method: str, reference_name: str, rows: int, differing: int, found: Sequence[Divergence]
) -> tuple[str, bool]:
    """One line on ``method``'s runs against ``reference_name``'s (``differing``
    of ``rows`` rows differ; ``found``: the divergences measured of them),
    and whether any is not a tie (a line to warn with)."""
    theirs = _possessive(reference_name)
    if not differing:
        return f"{method}: tokens equal to {theirs} ({rows} rows)", False
    if not found:
        return f"{method}: tokens differ from {theirs} in {differing} of {rows} rows (not measured)", True
    measured = "" if len(found) == differing else f"; {len(found)} measured"
    worst = max(found, key=lambda d: d.gap / d.margin)
    figures = f"largest gap {worst.gap:.3g}, noise there {worst.noise:.3g}, top logit's ulp {worst.top_ulp:.3g}"
    if all(d.tie for d in found):
        return (
            f"{method}: tokens differ from {theirs} in {differing} of {rows} rows{measured}, "
            f"each first at a tie within float noise ({figures})",
            False,
        )
    apart = [d for d in found if not d.tie]
    where = ", ".join(f"row {d.row} at token {d.position}" for d in apart[:4])
    return (
        f"{method}: tokens differ from {theirs} in {differing} of {rows} rows{measured}, "
        f"{len(apart)} apart by more than float noise ({where}; {figures})",
        True,
    )


class TokenComparison:
    """The greedy tokens of a benchmark's methods against its reference's,
    collected while it measures and measured after it (:meth:`measure`), so
    that the extra model calls touch neither its times nor its peaks.

    A method's first round whose tokens differ is kept per setting, and at
    most ``most`` of its differing rows are measured.
    """

    def __init__(self, model: Any, reference_name: str, *, stop_tokens: Sequence[int] = (), most: int = 8) -> None:
        self.model = model
        self.reference_name = reference_name
        self.stop_tokens = list(stop_tokens)
        self.most = most
        self._kept: dict[tuple[str, str], tuple[list[list[int]], list[list[int]], list[list[int]]]] = {}
        self._compared = 0

    def add(
        self,
        setting: str,
        method: str,
        prompts: Sequence[Sequence[int]],
        reference: Sequence[Sequence[int]],
        other: Sequence[Sequence[int]],
    ) -> None:
        """One round of ``method`` at ``setting``: each row's prompt, the
        reference's tokens and the method's."""
        key = (setting, method)
        self._compared += 1
        if key not in self._kept and list(map(list, reference)) != list(map(list, other)):
            self._kept[key] = ([list(p) for p in prompts], [list(r) for r in reference], [list(o) for o in other])

    def measure(self) -> list[tuple[str, bool]]:
        """A line a method and setting whose tokens differed in some round
        (:func:`report`), and whether it warns; one line that says so where
        none differed."""
        if not self._kept:
            theirs = _possessive(self.reference_name)
            return [(f"greedy tokens: every method's equal to {theirs} ({_count(self._compared, 'run')})", False)]
        lines = []
        wide = float32_weights(self.model)  # once for every divergence measured
        for (setting, method), (prompts, reference, other) in self._kept.items():
            differing = [row for row, (theirs, mine) in enumerate(zip(reference, other)) if theirs != mine]
            measured = (
                first_divergence(
                    self.model, prompts[row], reference[row], other[row],
                    row=row, stop_tokens=self.stop_tokens, wide_weights=wide,
                )
                for row in differing[: self.most]
            )  # fmt: skip
            found = [d for d in measured if d is not None]
            line, warns = report(f"{method} ({setting})", self.reference_name, len(prompts), len(differing), found)
            lines.append((line, warns))
        return lines


def compare_tokens(tokens_seen: TokenComparison) -> list[str]:
    """:meth:`TokenComparison.measure`'s lines; each that warns is also
    printed as a warning on standard error."""
    lines = []
    for line, warns in tokens_seen.measure():
        lines.append(line)
        if warns:
            print(f"warning: {line}", file=sys.stderr)
    return lines
