"""How a request picks its next token: validated settings and per-request samplers.

:class:`Sampling` holds a request's settings, checked when it is built (a bad
value never reaches the model). :meth:`Sampling.make_sampler` gives the
function that turns one row of log-probabilities into a token; it runs on the
MLX thread, inside whatever batch the request decodes in.

Reproducibility: a seeded request's ``n``-th draw uses MLX's generator seeded
with ``(seed, n)``, and the generator is reseeded from the OS right after, so
neither the other requests in a batch nor the order in which rows are
sampled change a seeded request's tokens (as long as its logits are the same),
and no unseeded request draws from a predictable generator.

A decode step draws the rows of unseeded requests with the same settings
together, in one call of one of their samplers (:attr:`_Draw.batch_key`): a
draw a row would be a few kernels a row and step on a GPU, where a step of
a batch is its kernels. A seeded request draws alone (its generator is its
own).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Sequence
from typing import Any, Optional

import attrs

from mlxkv.cache.errors import InvalidInput

__all__ = ["GREEDY", "Sampler", "Sampling", "draw_rows"]

#: Log-probabilities of shape ``(1, vocab)`` -> sampled token ids ``(1,)``.
Sampler = Callable[[Any], Any]


def _real(low: float, high: float = math.inf, *, integer: bool = False) -> Any:
    """An attrs validator: a finite number (an int if ``integer``) in ``[low, high]``."""

    def check(_instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            kind = "an int" if integer else "a number"
            raise InvalidInput(attribute.name, value, f"must be {kind}")
        if not math.isfinite(value) or not low <= value <= high:
            bounds = f">= {low}" if high == math.inf else f"in [{low}, {high}]"
            raise InvalidInput(attribute.name, value, f"must be finite and {bounds}")

    return check


def _seed(_instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise InvalidInput(attribute.name, value, "must be an int or None")


@attrs.frozen(kw_only=True)
class Sampling:
    """How a request picks its next token (mlx-lm's ``make_sampler``).

    Attributes:
        temperature: 0 for greedy (argmax), else the softmax temperature.
        top_p: nucleus sampling; off at 0 or 1.
        top_k: keep the ``k`` most likely tokens; off at 0.
        min_p: drop tokens below ``min_p`` times the top probability; off at 0.
        seed: makes a sampling request reproducible (see the module
            docstring); ignored when greedy.

    Raises:
        InvalidInput: a value of the wrong type, not finite, or out of range.
    """

    temperature: float = attrs.field(default=0.0, validator=_real(0.0))
    top_p: float = attrs.field(default=0.0, validator=_real(0.0, 1.0))
    top_k: int = attrs.field(default=0, validator=_real(0, integer=True))
    min_p: float = attrs.field(default=0.0, validator=_real(0.0, 1.0))
    seed: Optional[int] = attrs.field(default=None, validator=_seed)

    @property
    def greedy(self) -> bool:
        """Whether the argmax is taken (no randomness at all)."""
        return self.temperature == 0.0

    def make_sampler(self) -> Optional[Sampler]:
        """This request's sampler, or None when greedy (batches take one argmax).

        Built once per request; each call is one draw, on the MLX thread. A
        ``top_k`` at or past the width of the logits keeps every token, as
        ``top_k=0`` does. A draw that raises leaves MLX's generator as it was
        before the draw (see :class:`_Draw`).
        """
        if self.greedy:
            return None
        return _Draw(self)


#: Argmax sampling, the default.
GREEDY = Sampling()


class _Draw:
    """One request's draws: mlx-lm's sampler, built for the width of the first
    logits it is given, guarded so that a failing draw cannot break the
    generator that every unseeded request draws from.

    mlx-lm's samplers are compiled with MLX's global random state as an input
    and an output: one that raises while it is traced leaves a placeholder
    where the state's key was, and every later draw in the process fails
    until something reseeds. So the key is kept (a reference: nothing is
    evaluated on the way through) and, if the draw raises, set back.

    A seeded request's ``n``-th draw uses the generator seeded with
    ``(seed, n)``, reseeded from the OS right after.
    """

    __slots__ = ("_sampling", "_base", "_draws")

    def __init__(self, sampling: Sampling) -> None:
        self._sampling = sampling
        self._base: Optional[Sampler] = None
        self._draws = 0

    @property
    def batch_key(self) -> Optional[Sampling]:
        """What rows drawn together share: the settings of an unseeded
        request (any of its rows' samplers draws for all of them, a token a
        row of ``(rows, vocab)`` log-probabilities, independently); None for
        a seeded one, which draws alone."""
        return self._sampling if self._sampling.seed is None else None

    def __call__(self, logprobs: Any) -> Any:
        import mlx.core as mx

        if self._base is None:
            self._base = self._build(logprobs.shape[-1])
        before = mx.random.state[0]
        seed = self._sampling.seed
        if seed is not None:
            mx.random.seed(_mix_seed(seed, self._draws))
            self._draws += 1
        try:
            token = self._base(logprobs)
        except BaseException:
            _restore_key(before)
            raise
        if seed is not None:
            # The draw above split its key from the seeded state eagerly;
            # leave no predictable generator behind for unseeded requests.
            mx.random.seed(secrets.randbits(64))
        return token

    def _build(self, width: int) -> Sampler:
        from mlx_lm.sample_utils import make_sampler

        s = self._sampling
        top_k = s.top_k if s.top_k < width else 0
        return make_sampler(temp=s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=top_k)


def _restore_key(key: Any) -> None:
    """Make ``key`` (a ``uint32`` pair) MLX's random state again."""
    import mlx.core as mx

    high, low = (int(word) for word in key.tolist())
    mx.random.seed((high << 32) | low)


def _mix_seed(seed: int, draw: int) -> int:
    # Any fixed mix that separates (seed, draw) pairs will do; keep it in uint64.
    return (seed * 0x9E3779B97F4A7C15 + draw * 0xBF58476D1CE4E5B9 + 1) % (1 << 64)


def draw_rows(samplers: Sequence[Optional[Sampler]], logprobs: Any) -> tuple[Any, list[tuple[int, Exception]]]:
    """The next token of each row of ``logprobs`` ``(rows, vocab)``, row ``i``
    by ``samplers[i]`` (None: greedy), as ``uint32`` ``(rows,)``, and the rows
    whose draw raised, with what it raised.

    One argmax for the greedy rows and one call for each group of
    :func:`_draw_groups`, written over the argmax in place (a batch that
    all draws together: that call alone). A call that raises fails the rows
    it was for; their argmax stands in (never to be emitted).
    """
    import mlx.core as mx

    groups = _draw_groups(samplers)
    failed: list[tuple[int, Exception]] = []
    if len(groups) == 1 and len(groups[0]) == len(samplers):
        try:
            return samplers[0](logprobs).astype(mx.uint32), []  # type: ignore[misc]
        except Exception as error:
            groups, failed = [], [(row, error) for row in groups[0]]
    tokens = mx.argmax(logprobs, axis=-1).astype(mx.uint32)
    for rows in groups:
        try:
            drawn = samplers[rows[0]](logprobs[mx.array(rows)])  # type: ignore[misc]
        except Exception as error:
            failed.extend((row, error) for row in rows)
            continue
        tokens[mx.array(rows)] = drawn.astype(mx.uint32)
    return tokens, failed


def _draw_groups(samplers: Sequence[Optional[Sampler]]) -> list[list[int]]:
    """The indices of the rows that sample (not None), in groups drawn by one
    call each: rows whose samplers share a ``batch_key``
    (:attr:`_Draw.batch_key`) together, any other row alone; in order of
    their first row."""
    groups: dict[Any, list[int]] = {}
    for index, sampler in enumerate(samplers):
        if sampler is not None:
            key = getattr(sampler, "batch_key", None)
            groups.setdefault(("alone", index) if key is None else ("shared", key), []).append(index)
    return list(groups.values())
