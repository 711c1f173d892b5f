"""Two greedy runs of one model compared as the device's arithmetic allows.

Two exact ways of computing a model round differently (a prompt in another
number of chunks, a row in a batch, another attention kernel; on a GPU
float32 products with TF32-like inputs), and greedy decoding turns a last
bit into another token wherever the two best logits are that close. So
runs are equal, or part first where their two choices are at a tie within
float noise, measured with the model in hand by :mod:`mlxkv.divergence`:
its noise comes from mlx-lm's own exact paths (one call, and the prompt
cached then the rest), so nothing under test can widen it; a wrong cache
moves logits by far more (``tests/runtime/test_teeth.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from mlxkv.divergence import first_divergence

__all__ = ["CLEAR_GAP", "assert_same_greedy", "least_gap", "reference_load", "reference_model"]

#: A greedy run whose two best choices are at least this far apart at every
#: step (in log-probabilities) gives the same tokens on every exact path of
#: any device: twenty times what TF32-like products (a GPU's float32) moved
#: the built-in model's last logits by, 4.7e-4 (``tests/tf32.py``). Where a
#: test cannot see tokens (a served answer's text), its prompts are chosen
#: clear of ties by this (:func:`least_gap`) and compared exactly.
CLEAR_GAP = 1e-2


@functools.lru_cache(maxsize=4)
def reference_load(path: str) -> tuple[Any, Any]:
    """The model at ``path`` and its tokenizer, loaded once a process with mlx-lm (not through the runtime)."""
    from mlx_lm import load

    return load(path)


def reference_model(path: str) -> Any:
    """The model of :func:`reference_load`."""
    return reference_load(path)[0]


def least_gap(model: Any, prompt: Sequence[int], steps: int) -> float:
    """The least gap between the two best log-probabilities over ``model``'s
    greedy run of ``steps`` tokens after ``prompt`` (mlx-lm's
    ``generate_step``, one cold call)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    gaps = []
    for (_, logprobs), _ in zip(generate_step(mx.array(list(prompt)), model), range(steps)):
        second, best = mx.sort(logprobs)[-2:].tolist()
        gaps.append(best - second)
    return min(gaps)


def assert_same_greedy(
    model: Any,
    prompt: Sequence[int],
    reference: Sequence[int],
    other: Sequence[int],
    *,
    stop_tokens: Sequence[int] = (),
) -> int:
    """``other``'s greedy tokens after ``prompt`` are ``reference``'s, or
    leave them first at a tie (a run shorter than the other stopped there,
    where ``stop_tokens`` are given; without them it must be equal as far as
    it goes).

    Returns:
        How many tokens the two share from the start (all of ``reference``'s
        if equal): what a caller may compare further (log-probabilities, say).
    """
    if list(reference) == list(other):
        return len(reference)
    found = first_divergence(model, list(prompt), list(reference), list(other), stop_tokens=list(stop_tokens))
    assert found is not None and found.tie, (found, list(reference), list(other))
    return found.position
