"""Helpers shared by the generation tests: run a request, compare with a cold run.

Parity tolerance: the logits at the last prompt position agree within
``ATOL`` absolute (the device's: 1e-4 on the CPU for float32 models -- a warm
prefill runs the same positions in differently sized chunks, so the sums are
not bit-identical -- and a GPU's for its TF32-like products:
``device_arithmetic``), and greedy tokens are equal, or part first where the
two choices are at a tie within float noise: measured with the model loaded
here, outside the runtime, by ``mlxkv.divergence`` (its noise from
mlx-lm's own exact paths, so a broken cache cannot widen it). A "cold" run
is the same prompt under a fresh ``cache_salt``, which shares no block with
anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mlxkv import CacheRuntime
from mlxkv.generation import GeneratedToken, GenerationReport

from device_arithmetic import LOGITS_ATOL
from greedy import assert_same_greedy, reference_model

ATOL = LOGITS_ATOL
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
    np.testing.assert_allclose(
        np.array(report.prompt_logits), np.array(cold.prompt_logits), atol=ATOL, rtol=0
    )
    if warm_tokens == cold_tokens:
        assert cold.finish_reason == report.finish_reason
    else:
        assert_parted_at_a_tie(rt, report.prompt_ids, warm_tokens, cold_tokens, images=bool(kwargs.get("images")))


def assert_parted_at_a_tie(
    rt: CacheRuntime, prompt_ids: Sequence[int], reference: Sequence[int], other: Sequence[int], *, images: bool
) -> None:
    """``other``'s greedy tokens leave ``reference``'s (both after
    ``prompt_ids``, stop tokens left out) first at a tie within float noise,
    measured with ``rt``'s model loaded here (a text model's; a request with
    images must match exactly)."""
    info = rt.model_info
    assert info is not None and not images and not info.takes_images, (reference, other)
    assert reference != other, "the runs do not part"
    model = reference_model(str(rt.config.model))
    assert_same_greedy(model, prompt_ids, reference, other, stop_tokens=sorted(info.eos_token_ids))


async def holds_nothing(rt: CacheRuntime) -> bool:
    """No block referenced, no request table open, no compute cache live."""
    stats = await rt.stats()
    return (
        stats.allocator.num_referenced == 0
        and stats.index.num_active_requests == 0
        and stats.compute is not None
        and stats.compute.num_live == 0
    )


async def assert_clean(rt: CacheRuntime) -> None:
    """No block referenced, no compute cache live, every invariant holds."""
    stats = await rt.stats()
    assert stats.allocator.num_referenced == 0
    assert stats.index.num_active_requests == 0
    assert stats.compute is not None and stats.compute.num_live == 0
    assert await rt.check_invariants()


def break_prefix_rebuild(monkeypatch: Any, block_size: int) -> None:
    """Deliberately serve the wrong KV for block 0 of every prefix rebuilt from
    blocks, whichever way it is rebuilt: copied into the request's own cache
    (``kv_state.reconstruct``) or held once in a shared prefix group
    (``PrefixGroup.build``), with block 1's KV in its place."""
    import mlx.core as mx

    from mlxkv.cache import kv_state, shared_prefix

    reconstruct = kv_state.reconstruct

    def broken_reconstruct(*args: Any, **kwargs: Any) -> list[Any]:
        cache = reconstruct(*args, **kwargs)
        for layer in cache:
            keys = getattr(layer, "keys", None)
            if isinstance(keys, mx.array) and layer.offset >= 2 * block_size:
                layer.keys[..., :block_size, :] = keys[..., block_size : 2 * block_size, :]
                layer.values[..., :block_size, :] = layer.values[..., block_size : 2 * block_size, :]
        return cache

    build = shared_prefix.PrefixGroup.build.__func__  # type: ignore[attr-defined]

    def broken_build(cls: Any, payloads: Any) -> Any:
        wrong = [payloads[1], *payloads[1:]] if len(payloads) > 1 else list(payloads)
        group = build(cls, wrong)
        group.payloads = tuple(payloads)  # still found as the right blocks
        return group

    monkeypatch.setattr(kv_state, "reconstruct", broken_reconstruct)
    monkeypatch.setattr(shared_prefix.PrefixGroup, "build", classmethod(broken_build))
