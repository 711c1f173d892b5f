"""The KV pool sized in bytes, and statistics a person can read."""

from __future__ import annotations

from typing import Any

import pytest

from mlxkv import CacheRuntime, InvalidInput, RuntimeConfig
from mlxkv.default_model import TINY_HYBRID, TINY_LLAMA, ensure_model
from mlxkv.units import format_bytes, parse_bytes


@pytest.fixture
def llama(model_dir: Any) -> str:
    """The directory of the tiny full-attention Llama."""
    return str(ensure_model(TINY_LLAMA, model_dir))


class TestParseBytes:
    @pytest.mark.parametrize(
        "text, expected",
        [(4096, 4096), ("4096", 4096), ("2GiB", 2 << 30), ("2 gib", 2 << 30), ("1.5MB", 1_500_000),
         ("64k", 65536), ("3 KB", 3000), ("1T", 1 << 40)],
    )  # fmt: skip
    def test_sizes(self, text, expected):
        """Ints and sizes with decimal or binary units become byte counts."""
        assert parse_bytes(text) == expected

    @pytest.mark.parametrize("bad", [0, -5, True, "", "lots", "2 parsecs", "0.1B", 1.5, None])
    def test_bad_sizes(self, bad):
        """Anything else is InvalidInput naming the argument."""
        with pytest.raises(InvalidInput, match="kv_memory"):
            parse_bytes(bad, argument="kv_memory")

    def test_format(self):
        """Counts print in the largest binary unit that keeps them >= 1."""
        assert [format_bytes(n) for n in (512, 49152, 3 << 20, 5 << 30)] == [
            "512 B", "48.0 KiB", "3.0 MiB", "5.0 GiB",
        ]  # fmt: skip


class TestKVMemory:
    def test_needs_a_model(self):
        """A byte budget without a model to size blocks from is refused at once."""
        with pytest.raises(InvalidInput, match="kv_memory"):
            RuntimeConfig(kv_memory="1MiB")

    async def test_pool_is_sized_from_the_model(self, llama):
        """The pool holds as many blocks as the budget fits on this model, and stats say so."""
        async with CacheRuntime(model=llama, block_size=16, kv_memory="1MiB") as rt:
            info = rt.model_info
            assert info is not None and info.kv_bytes_per_token > 0
            block_bytes = info.block_bytes(16)
            stats = await rt.stats()
            assert stats.allocator.num_blocks == (1 << 20) // block_bytes
            assert stats.memory is not None
            assert stats.memory.block_bytes == block_bytes and stats.memory.budget == 1 << 20
            assert stats.memory.pool_bytes <= 1 << 20

    async def test_bytes_per_token_are_measured(self, llama):
        """KV bytes per token match the model's geometry: 2 layers x keys and values
        x 2 KV heads x head dim 16 x 4 bytes."""
        async with CacheRuntime(model=llama) as rt:
            assert rt.model_info is not None
            assert rt.model_info.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
            assert rt.model_info.state_bytes == 0

    async def test_recurrent_state_is_counted_per_block(self, model_dir):
        """On a hybrid model a block also carries a recurrent-state snapshot."""
        async with CacheRuntime(model=str(ensure_model(TINY_HYBRID, model_dir))) as rt:
            info = rt.model_info
            assert info is not None and info.state_bytes > 0
            assert info.block_bytes(16) == 16 * info.kv_bytes_per_token + info.state_bytes

    async def test_a_budget_below_one_block_is_refused(self, llama):
        """A budget that holds no block fails the start with InvalidInput, not an empty cache."""
        runtime = CacheRuntime(model=llama, block_size=64, kv_memory=1000)
        with pytest.raises(InvalidInput, match="holds no block"):
            async with runtime:
                pass
        assert runtime.closed


class TestStatistics:
    async def test_each_actor_once_and_readable(self, llama):
        """stats() lists every actor once (the compute actor too) and prints as text lines."""
        async with CacheRuntime(model=llama, block_size=16) as rt:
            await rt.tokenize("hello")
            stats = await rt.stats()
        names = [actor.name for actor in stats.actors]
        assert sorted(names) == ["allocator", "compute", "image_cache", "prefix_index"]
        text = str(stats)
        assert text == stats.format()
        for label in ("blocks", "lookups", "KV memory", "compute", "mailboxes"):
            assert any(line.startswith(label) for line in text.splitlines()), label
