"""Where two greedy runs of one model part, and whether it is at a tie.

Two exact ways of computing the same model -- a prompt prefilled in one call
or over a cached prefix, a row decoded alone or in a batch, another attention
kernel -- round differently, and greedy decoding turns a difference in the
last bit into another token wherever the two best logits are that close. A
random-weights model in bfloat16 has many such places (its logits are flat:
the best two often print equal), and a GPU's kernels round otherwise than a
CPU's, so "the tokens differ" alone says nothing. What tells a tie from a
broken cache is the margin at the first token the runs do not share:

- the context both runs saw is the prompt and the tokens before it; the
  model's logits after it are computed in one call, and ``noise`` is the
  largest difference over the vocabulary between them and the same logits
  computed otherwise: as the prompt cached then the rest (another exact
  path) and, for a model in half precision, with its weights in float32
  (what its rounding moved them by): one run's error, as far as it shows;
- ``gap`` is how far apart the two runs' tokens are in the one-call logits;
- a tie: ``gap`` is within four times the noise (at least half a unit in
  the last place of the top logit in the logits' dtype): two runs, each off
  by up to the noise in every logit, can order two logits either way where
  their true gap is within twice the noise, and the gap measured here is
  off by up to twice the noise itself.

A wrong prefix or a misplaced row moves a trained model's logits by whole
units, far past that; a random model's logits are so flat that it may not,
so a tie there clears a run less than it would on real weights.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any, Optional

import attrs

__all__ = ["Divergence", "TokenComparison", "compare_tokens", "first_divergence", "float32_weights", "report", "ulp"]

#: Mantissa bits (without the implicit one) of the logits' dtypes.
_MANTISSA = {"float32": 23, "bfloat16": 7, "float16": 10}


def ulp(value: float, dtype_name: str) -> float:
    """One unit in the last place of ``value`` in the float type ``dtype_name``."""
    if value == 0:
        return 2.0 ** -_MANTISSA[dtype_name]
    return 2.0 ** (math.floor(math.log2(abs(value))) - _MANTISSA[dtype_name])


@attrs.frozen
class Divergence:
    """The first place where a run's tokens leave the reference's.

    Attributes:
        row: which of the compared runs.
        position: how many generated tokens the two share before it.
        reference_token, other_token: what each chose there (None for a
            run that stopped there: it chose a stop token).
        gap: ``|logit(reference_token) - logit(other_token)|`` in the
            one-call logits (for a stop, against the best stop token).
        noise: the largest difference between the one-call logits there
            and the cached or float32 ones, over the vocabulary.
        top_ulp: one unit in the last place of the top logit, in the
            logits' dtype.
    """

    row: int
    position: int
    reference_token: Optional[int]
    other_token: Optional[int]
    gap: float
    noise: float
    top_ulp: float

    @property
    def margin(self) -> float:
        """The widest gap a tie has: four times the noise, at least half a
        unit in the last place of the top logit (the module's reasoning)."""
        return 4 * max(self.noise, self.top_ulp / 2)

    @property
    def tie(self) -> bool:
        """Whether the two choices are within float noise of each other."""
        return self.gap <= self.margin


def first_divergence(
    model: Any,
    prompt: Sequence[int],
    reference: Sequence[int],
    other: Sequence[int],
    *,
    row: int = 0,
    stop_tokens: Sequence[int] = (),
    wide_weights: Any = None,
) -> Optional[Divergence]:
    """Where ``other`` first leaves ``reference`` (two greedy runs of ``model``
    after ``prompt``, stop tokens left out), measured as the module says;
    None where neither leaves the other (equal, or one a prefix of the other
    because it was given fewer tokens). ``wide_weights``: the model's
    weights in float32 (:func:`float32_weights`), where the caller measures
    several divergences; made here otherwise."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    shared = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), None)
    if shared is None:
        shared = min(len(reference), len(other))
        if len(reference) == len(other) or not stop_tokens:
            return None  # equal, or cut by a token count, not by a choice
    context = [*prompt, *reference[:shared]]
    whole = model(mx.array(context)[None])[0, -1]
    dtype_name = str(whole.dtype).rsplit(".", 1)[-1]
    logits = whole.astype(mx.float32)
    others = [_in_float32(model, context, wide_weights)] if dtype_name != "float32" else []
    split = len(prompt) if shared else len(prompt) // 2
    if split:
        cache = make_prompt_cache(model)
        model(mx.array(context[:split])[None], cache=cache)
        others.append(model(mx.array(context[split:])[None], cache=cache)[0, -1])
    noise = max((mx.abs(logits - o.astype(mx.float32)).max().item() for o in others), default=0.0)
    mine = other[shared] if shared < len(other) else None
    theirs = reference[shared] if shared < len(reference) else None
    chosen = [t for t in (theirs, mine) if t is not None]
    best_stop = max(logits[t].item() for t in stop_tokens) if stop_tokens else math.nan
    values = [logits[t].item() for t in chosen] + ([best_stop] if len(chosen) == 1 else [])
    return Divergence(
        row=row,
        position=shared,
        reference_token=theirs,
        other_token=mine,
        gap=abs(values[0] - values[1]),
        noise=noise,
        top_ulp=ulp(logits.max().item(), dtype_name),
    )


def float32_weights(model: Any) -> Any:
    """``model``'s parameters with the half-precision ones in float32."""
    import mlx.core as mx
    from mlx.utils import tree_map

    wide = tree_map(lambda w: w.astype(mx.float32) if w.dtype in (mx.bfloat16, mx.float16) else w, model.parameters())
    mx.eval(wide)
    return wide


def _in_float32(model: Any, context: Sequence[int], wide: Any = None) -> Any:
    """``model``'s last logits after ``context`` with ``wide`` (default:
    :func:`float32_weights`) for its weights, its own put back after."""
    import mlx.core as mx

    weights = model.parameters()
    model.update(wide if wide is not None else float32_weights(model))
    try:
        logits = model(mx.array(context)[None])[0, -1].astype(mx.float32)
        mx.eval(logits)
    finally:
        model.update(weights)
    return logits


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
