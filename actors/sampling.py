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
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from typing import Any, Optional

import attrs

from mlxkv.cache.errors import InvalidInput

__all__ = ["GREEDY", "Sampler", "Sampling"]

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

        Built once per request; each call is one draw. Runs on the MLX thread.
        """
        if self.greedy:
            return None
        from mlx_lm.sample_utils import make_sampler

        base = make_sampler(
            temp=self.temperature, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k
        )
        if self.seed is None:
            return base
        return _SeededSampler(base, self.seed)


#: Argmax sampling, the default.
GREEDY = Sampling()


class _SeededSampler:
    """A sampler whose ``n``-th call draws from the generator seeded with ``(seed, n)``."""

    __slots__ = ("_base", "_seed", "_draws")

    def __init__(self, base: Sampler, seed: int) -> None:
        self._base = base
        self._seed = seed
        self._draws = 0

    def __call__(self, logprobs: Any) -> Any:
        import mlx.core as mx

        mx.random.seed(_mix_seed(self._seed, self._draws))
        self._draws += 1
        try:
            return self._base(logprobs)
        finally:
            # The draw above split its key from the seeded state eagerly;
            # leave no predictable generator behind for unseeded requests.
            mx.random.seed(secrets.randbits(64))


def _mix_seed(seed: int, draw: int) -> int:
    # Any fixed mix that separates (seed, draw) pairs will do; keep it in uint64.
    return (seed * 0x9E3779B97F4A7C15 + draw * 0xBF58476D1CE4E5B9 + 1) % (1 << 64)
