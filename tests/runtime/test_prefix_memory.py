"""Requests that begin with the same cached blocks read one shared copy of that
prefix, exactly: greedy tokens and logits equal cold runs, with and without
sharing, alone and batched, over several prefixes at once. Models it cannot
serve exactly (a sliding window, recurrent layers, a vision-language model)
say so and keep copies. Memory itself is measured in scripts/bench_memory.py.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from mlxkv import CacheRuntime
from mlxkv.actors import decode_kernel
from mlxkv.actors.prefix_attention import PrefixAttention
from mlxkv.default_model import TINY_HYBRID, TINY_LLAMA, TINY_SLIDING_LLAMA, ensure_model

from parity import BS, assert_clean, assert_matches_cold, run


def _tokens(n: int, salt: int) -> list[int]:
    return [(i * 37 + salt * 11 + (i // 7) ** 2) % 250 for i in range(n)]


PREFIXES = [_tokens(8 * BS, salt=100 + k) for k in range(2)]


async def _together(rt: CacheRuntime, prompts: list[list[int]]) -> list[Any]:
    out: list[Any] = [None] * len(prompts)

    async def one(i: int) -> None:
        out[i] = await run(rt, prompts[i], max_tokens=10)

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return out


class TestSharedPrefix:
    @pytest.mark.parametrize("way", [None, "cascade", "gathered", "stacked", "mixed", "kernel"])
    async def test_concurrent_requests_over_two_prefixes_are_exact(self, model_dir, way, monkeypatch):
        """Six requests over two cached prefixes (three each), with tails of
        different lengths, decode together over one copy of each prefix and
        give their cold tokens and logits, whichever way attention reads the
        prefixes (None: the device's), and that way is the one that ran
        (``kernel`` off MLX's CUDA backend: ``mixed``, and said so)."""
        from mlxkv.actors import banded_attention, cascade_attention, prefix_attention, stacked_attention

        ran: list[str] = []
        functions = {name: f"{name}_attention" for name in ("cascade", "gathered", "stacked", "mixed", "kernel")}
        for name, function in {**functions, "by head": "_decode_by_head", "banded": "banded_attention"}.items():
            # Wherever a way is bound: one way calls another from its own module.
            for module in (prefix_attention, cascade_attention, banded_attention, stacked_attention):
                real = getattr(module, function, None)
                if callable(real):
                    spy = lambda *a, _n=name, _f=real, **k: ran.append(_n) or _f(*a, **k)  # noqa: E731
                    monkeypatch.setattr(module, function, spy)
        path = str(ensure_model(TINY_LLAMA, model_dir))
        async with CacheRuntime(model=path, block_size=BS, keep_caches=False, prefix_attention=way) as rt:
            assert rt.model_info.shared_prefix
            served = "mixed" if way == "kernel" and not decode_kernel.usable() else way
            assert rt.model_info.prefix_attention == (served or PrefixAttention.for_device().value)
            for prefix in PREFIXES:
                await run(rt, prefix + [7], max_tokens=1)  # caches the prefix's blocks
            prompts = [PREFIXES[i % 2] + _tokens(5 + 3 * i, salt=i) for i in range(6)]
            warm = await _together(rt, prompts)
            stats = await rt.stats()
            for i, prompt in enumerate(prompts):
                assert warm[i][1].cached_tokens == len(PREFIXES[0])
                await assert_matches_cold(rt, prompt, warm[i], f"cold-{i}")
            await assert_clean(rt)
        assert stats.compute is not None
        assert stats.compute.num_shared_prefix_tokens == 6 * len(PREFIXES[0])
        assert stats.compute.mean_batch_size > 1
        chosen = served or PrefixAttention.for_device().value
        if chosen == "kernel":
            # Decode steps by the kernel, the rest as mixed.
            assert "kernel" in ran and "by head" not in ran
        elif chosen == "mixed":
            # Decode steps by head (a lone row's by the cascade), prefill chunks in bands.
            assert {"mixed", "by head", "banded"} <= set(ran) <= {"mixed", "by head", "banded", "cascade"}
        else:  # gathered: bands of a row
            assert chosen in ran and set(ran) <= {chosen, "banded"}

    async def test_a_wave_over_one_prefix_prefills_rows_together_over_one_copy(self, model_dir, monkeypatch):
        """Four requests with short tails over one cached prefix, served by
        the GPU's way (``mixed``): their prefill lays the rows end to end over
        one copy of the prefix (a band of more than one row), and each gives
        its cold tokens and logits."""
        import mlxkv.actors.prefix_attention as module

        bands: list[int] = []
        real = module.banded_attention
        monkeypatch.setattr(module, "banded_attention", lambda *a: bands.append(a[-1]) or real(*a))
        path = str(ensure_model(TINY_LLAMA, model_dir))
        async with CacheRuntime(model=path, block_size=BS, keep_caches=False, prefix_attention="mixed") as rt:
            await run(rt, PREFIXES[0] + [7], max_tokens=1)
            prompts = [PREFIXES[0] + _tokens(3 + i % 2, salt=i) for i in range(4)]
            warm = await _together(rt, prompts)
            for i, prompt in enumerate(prompts):
                assert warm[i][1].cached_tokens == len(PREFIXES[0])
                await assert_matches_cold(rt, prompt, warm[i], f"cold-{i}")
            await assert_clean(rt)
        assert max(bands) > 1

    async def test_the_same_tokens_with_and_without_sharing(self, model_dir):
        """Held once or copied per request, a warm request gives the same tokens."""
        path = str(ensure_model(TINY_LLAMA, model_dir))
        prompts = [PREFIXES[0] + _tokens(9 + i, salt=i) for i in range(4)]
        results = {}
        for shared in (True, False):
            async with CacheRuntime(model=path, block_size=BS, shared_prefix=shared) as rt:
                await run(rt, PREFIXES[0] + [7], max_tokens=1)
                results[shared] = [tokens for tokens, _ in await _together(rt, prompts)]
                stats = await rt.stats()
            assert stats.compute is not None and (stats.compute.num_shared_prefix_tokens > 0) == shared
        assert results[True] == results[False]

    async def test_a_conversation_continues_over_its_shared_prefix(self, model_dir):
        """Turn 2 of a conversation over a shared system prompt, from the kept
        cache or from blocks, equals its cold run; its answer blocks are stored."""
        path = str(ensure_model(TINY_LLAMA, model_dir))
        async with CacheRuntime(model=path, block_size=BS) as rt:
            await run(rt, PREFIXES[1] + [7], max_tokens=1)
            first = PREFIXES[1] + _tokens(20, salt=3)
            answer, report = await run(rt, first, max_tokens=12)
            second = list(report.prompt_ids) + answer + _tokens(9, salt=4)
            warm = await run(rt, second, max_tokens=8)
            assert warm[1].cached_tokens > len(first)
            await assert_matches_cold(rt, second, warm, "cold")
            await assert_clean(rt)


class TestModelsThatKeepCopies:
    @pytest.mark.parametrize("spec", [TINY_SLIDING_LLAMA, TINY_HYBRID], ids=["sliding", "hybrid"])
    async def test_say_so_and_stay_exact(self, spec, model_dir):
        """A sliding window or recurrent layers: no shared prefix, visibly; the
        warm requests are exact all the same."""
        path = str(ensure_model(spec, model_dir))
        async with CacheRuntime(model=path, block_size=BS, keep_caches=False) as rt:
            assert not rt.model_info.shared_prefix
            await run(rt, PREFIXES[0] + [7], max_tokens=1)
            prompts = [PREFIXES[0] + _tokens(6 + i, salt=i) for i in range(3)]
            warm = await _together(rt, prompts)
            for i, prompt in enumerate(prompts):
                await assert_matches_cold(rt, prompt, warm[i], f"cold-{i}")
            stats = await rt.stats()
        assert stats.compute is not None and stats.compute.num_shared_prefix_tokens == 0

    async def test_a_vision_language_model_keeps_copies(self, vlm_path):
        """The vision-language runner does not share prefixes, and says so."""
        async with CacheRuntime(model=str(vlm_path), block_size=BS) as rt:
            assert not rt.model_info.shared_prefix
