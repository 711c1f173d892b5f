"""A model's weights, changed in place: what it computes and what it holds, before and after."""

from __future__ import annotations

from pathlib import Path
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


def with_twin_tokens(source: Path, path: Path, prompt: list[int]) -> tuple[int, int]:
    """A copy of the model at ``source`` written to ``path`` in which a token
    (the twin) has the output weights of the model's greedy first choice
    after ``prompt``: the model cannot tell the two apart there (a tie of gap
    0). Returns ``(first choice, twin)``."""
    import shutil

    from mlx_lm import load

    shutil.copytree(source, path)
    model = load(str(path))[0]
    first = int(mx.argmax(model(mx.array([prompt]))[0, -1]).item())
    twin = (first + 1) % model.args.vocab_size
    weights = mx.load(str(path / "model.safetensors"))
    head = weights["lm_head.weight"]
    weights["lm_head.weight"] = mx.concatenate([head[:twin], head[first : first + 1], head[twin + 1 :]])
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return first, twin
