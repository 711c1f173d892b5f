"""Blocks of real KV: a model run over tokens, its cache cut into block payloads."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxkv.cache import kv_state


def block_payloads(model: Any, tokens: list[int], block: int) -> tuple[Any, ...]:
    """The payloads of ``tokens``' full blocks of ``block`` tokens, as ``model`` computes them."""
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return tuple(kv_state.slice_blocks(cache, block, range(len(tokens) // block), num_tokens=len(tokens)))
