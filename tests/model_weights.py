"""A model's weights, changed in place: what it computes and what it holds, before and after."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache


def prefill_and_decode_logits(model: Any, prompt: list[int], steps: int) -> list[Any]:
    """Logits of a prefill of ``prompt`` and of ``steps`` greedy decode steps after it."""
    cache = make_prompt_cache(model)
    out = [model(mx.array([prompt]), cache=cache)]
    for _ in range(steps):
        token = mx.argmax(out[-1][:, -1:], axis=-1)
        out.append(model(token, cache=cache))
    mx.eval(out)
    return out


def parameter_bytes(model: Any) -> int:
    """The bytes of ``model``'s parameters."""
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))
