"""KV quantization: blocks and live caches in 8 or 4 bits, exact against
themselves, smaller, refused where MLX cannot quantize the heads.
(Its accuracy against float32 is measured by scripts/bench_kv_bits.py.)"""

from __future__ import annotations

import pytest

from mlxkv import CacheRuntime, InvalidInput, ModelLoadError, RuntimeConfig
from mlxkv.default_model import TINY_LLAMA, UNTIED_SHARP, ModelSpec, _llama, ensure_model

from parity import BS, assert_clean, assert_matches_cold, run

from device_arithmetic import needs_quantized_attention

#: Heads of 32: MLX quantizes in groups of 32, 64 or 128 (the built-in model's are 48).
HEADS_OF_32 = ModelSpec(
    name="tiny-llama-heads-32",
    model_type="llama",
    config=_llama(num_attention_heads=2, num_key_value_heads=1),
    weight_scales=UNTIED_SHARP,
)


def _tokens(n: int, salt: int) -> list[int]:
    return [(i * 37 + salt * 11 + (i // 7) ** 2) % 250 for i in range(n)]


class TestKVBits:
    @needs_quantized_attention
    @pytest.mark.parametrize("bits", [8, 4])
    async def test_quantized_blocks_serve_warm_requests_exactly(self, bits, model_dir):
        """A warm request over quantized blocks equals its own cold run under
        the same quantization; a block takes fewer bytes; requests decode one
        at a time and keep their own prefix copies (mlx-lm cannot batch them)."""
        path = str(ensure_model(HEADS_OF_32, model_dir))
        async with CacheRuntime(model=path, block_size=BS) as plain:
            full = plain.model_info.kv_bytes_per_token
        async with CacheRuntime(model=path, block_size=BS, kv_bits=bits, keep_caches=False) as rt:
            info = rt.model_info
            assert set(info.cache_layers) == {"QuantizedKVCache"}
            assert info.kv_bytes_per_token < full / 3
            assert not info.batchable and not info.shared_prefix
            prefix = _tokens(6 * BS, salt=1)
            await run(rt, prefix + _tokens(9, salt=2))
            prompt = prefix + _tokens(12, salt=3)
            warm = await run(rt, prompt)
            assert warm[1].cached_tokens == len(prefix)
            await assert_matches_cold(rt, prompt, warm, "cold")
            await assert_clean(rt)

    @needs_quantized_attention
    async def test_a_quantized_kept_cache_used_in_part_stays_exact_for_its_continuation(self, model_dir):
        """Another conversation over the same system prompt computes on a copy
        of a kept quantized cache's first tokens; the conversation's own next
        turn then takes all of that cache and equals its cold run."""
        path = str(ensure_model(HEADS_OF_32, model_dir))
        async with CacheRuntime(model=path, block_size=BS, kv_bits=8) as rt:
            system = _tokens(3 * BS + 7, salt=1)
            first_prompt = system + _tokens(20, salt=2)
            answer, _ = await run(rt, first_prompt, max_tokens=12)
            neighbour = system + _tokens(20, salt=3)
            near = await run(rt, neighbour, max_tokens=12)
            assert near[1].cached_tokens == len(system)  # past its 3 blocks: from the kept cache
            second = first_prompt + answer + _tokens(10, salt=4)
            warm = await run(rt, second, max_tokens=8)
            assert warm[1].cached_tokens == len(first_prompt) + len(answer)
            await assert_matches_cold(rt, second, warm, "cold")
            await assert_matches_cold(rt, neighbour, near, "cold-near")
            await assert_clean(rt)

    async def test_heads_mlx_cannot_quantize_are_refused(self, model_dir):
        """Heads of 16 (no group size divides them): the runtime does not start,
        and says why."""
        with pytest.raises(ModelLoadError, match="kv_bits"):
            async with CacheRuntime(model=str(ensure_model(TINY_LLAMA, model_dir)), kv_bits=8):
                pass

    @pytest.mark.parametrize("bits", [3, 16, True, "8"])
    def test_only_4_or_8_bits(self, bits):
        """Any other value is refused before anything starts."""
        with pytest.raises(InvalidInput, match="kv_bits"):
            RuntimeConfig(kv_bits=bits)
