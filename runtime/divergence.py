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

Everything here runs the model in hand, outside any runtime (mlx-lm's own
paths: nothing under test can widen the noise), on the calling thread: the
benchmarks (``scripts/divergence.py``), ``mlxkv stress --generate`` once
its runtime has closed, and the tests' comparisons of greedy runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import attrs

__all__ = ["Divergence", "first_divergence", "float32_weights", "ulp"]

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
