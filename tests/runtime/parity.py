"""Helpers shared by the generation tests: run a request, compare with a cold run.

Parity tolerance: greedy tokens are equal, and the logits at the last prompt
position agree within ``ATOL = 1e-4`` absolute (float32 models; a warm
prefill runs the same positions in differently sized chunks, so the sums are
not bit-identical). A "cold" run is the same prompt under a fresh
``cache_salt``, which shares no block with anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mlxkv import CacheRuntime
from mlxkv.generation import GeneratedToken, GenerationReport

ATOL = 1e-4
BS = 16


async def run(rt: CacheRuntime, prompt: Any, **kwargs: Any) -> tuple[list[int], GenerationReport]:
    """Generate to the end; the token ids and the report."""
    kwargs.setdefault("max_tokens", 8)
    tokens: list[int] = []
    async with rt.generate(prompt, **kwargs) as stream:
        async for record in stream:
            if isinstance(record, GeneratedToken):
                tokens.append(record.token)
    assert stream.report is not None and stream.report.tokens == tuple(tokens)
    return tokens, stream.report


async def assert_matches_cold(
    rt: CacheRuntime,
    prompt: Sequence[int],
    warm: tuple[list[int], GenerationReport],
    salt: str,
    **kwargs: Any,
) -> None:
    """A cold run of ``prompt`` (with ``kwargs``: images, say) gives ``warm``'s
    greedy tokens and prompt logits."""
    warm_tokens, report = warm
    # As many tokens as the warm run, and one more if it stopped at an end token.
    budget = len(warm_tokens) + (report.finish_reason == "stop")
    cold_tokens, cold = await run(rt, prompt, cache_salt=salt, max_tokens=budget, **kwargs)
    assert cold.cached_tokens == 0
    assert cold.finish_reason == report.finish_reason
    assert warm_tokens == cold_tokens
    np.testing.assert_allclose(
        np.array(report.prompt_logits), np.array(cold.prompt_logits), atol=ATOL, rtol=0
    )


async def assert_clean(rt: CacheRuntime) -> None:
    """No block referenced, no compute cache live, every invariant holds."""
    stats = await rt.stats()
    assert stats.allocator.num_referenced == 0
    assert stats.index.num_active_requests == 0
    assert stats.compute is not None and stats.compute.num_live == 0
    assert await rt.check_invariants()
