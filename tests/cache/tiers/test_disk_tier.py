"""The disk tier on a real directory: whole files, verified reads, an LRU byte budget, shared use."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import anyio
import mlx.core as mx
import pytest
from tier_blocks import assert_same_payload, chain_of, kv_blocks, namespace_of

from mlxkv.cache.tiers import DiskTier, decode_payload, encode_block, storage_key
from mlxkv.cache.tiers import disk_tier as disk_tier_module

LOGGER = "mlxkv.cache.tiers.disk_tier"


@pytest.fixture
def blocks():
    return kv_blocks(6)


@pytest.fixture
def namespace(blocks):
    return namespace_of(blocks[0])


@pytest.fixture
def keys(namespace):
    return [storage_key(namespace, h) for h in chain_of(6)]


@pytest.fixture
def values(blocks, keys, namespace):
    return [encode_block(b, key=k, namespace=namespace) for b, k in zip(blocks, keys)]


def _files(directory: Path) -> list[Path]:
    return sorted(path for path in directory.iterdir() if not path.name.startswith("."))


def _disk_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir())


def _warnings(caplog, logger=LOGGER):
    return [r for r in caplog.records if r.name == logger and r.levelno == logging.WARNING]


class TestDiskTier:
    async def test_put_then_get_round_trips(self, tmp_path, namespace, blocks, keys, values):
        """A stored block comes back verified and decodes to the same KV; the file
        is named by its key, and no temporary file is left behind."""
        async with DiskTier(tmp_path / "kv", namespace) as tier:
            assert await tier.put(keys[0], values[0])
            value = await tier.get(keys[0])
            assert_same_payload(decode_payload(value), blocks[0])
            assert [p.name for p in (tmp_path / "kv").iterdir()] == [keys[0].hex()]
            stats = tier.statistics()
        assert (stats.num_written, stats.num_loaded, stats.num_bytes) == (1, 1, len(values[0]))
        assert stats.name == f"file://{tmp_path / 'kv'}"

    async def test_a_missing_block_is_a_miss(self, tmp_path, namespace, keys, values):
        """Unknown keys are misses in probes and gets, counted."""
        async with DiskTier(tmp_path, namespace) as tier:
            await tier.put(keys[0], values[0])
            assert await tier.contains_many(keys[:2]) == [True, False]
            assert [v is not None for v in await tier.get_many(keys[:2])] == [True, False]
            assert tier.statistics().num_missed == 2

    async def test_file_io_runs_in_worker_threads(self, tmp_path, namespace, keys, values, monkeypatch):
        """Reading and writing files happens off the event loop's thread."""
        loop_thread = threading.get_ident()
        seen = []
        for name in ("_read_many", "_write_file", "_exist_many", "_scan"):
            real = getattr(disk_tier_module, name)

            def spy(*args, _real=real, **kwargs):
                seen.append(threading.get_ident())
                return _real(*args, **kwargs)

            monkeypatch.setattr(disk_tier_module, name, spy)
        async with DiskTier(tmp_path, namespace) as tier:
            await tier.put(keys[0], values[0])
            await tier.contains_many(keys[:1])
            await tier.get(keys[0])
        assert len(seen) == 4 and loop_thread not in seen

    async def test_corrupt_files_are_counted_misses_and_deleted(self, tmp_path, namespace, keys, values, caplog):
        """Flipped bytes, a truncated file and another block's bytes are misses:
        counted corrupt, deleted, logged once, reported as removals."""
        caplog.set_level(logging.DEBUG, logger=LOGGER)
        async with DiskTier(tmp_path, namespace) as tier:
            for key, value in zip(keys[:3], values[:3]):
                await tier.put(key, value)
            flipped = bytearray(values[0])
            flipped[len(flipped) // 2] ^= 0xFF
            (tmp_path / keys[0].hex()).write_bytes(bytes(flipped))
            (tmp_path / keys[1].hex()).write_bytes(values[1][:-10])
            (tmp_path / keys[2].hex()).write_bytes(values[3])  # a valid value of another key
            assert await tier.get_many(keys[:3]) == [None, None, None]
            assert _files(tmp_path) == []
            assert tier.statistics().num_corrupt == 3
            assert [r.reason for r in tier.take_removals()] == ["corrupt"] * 3
            tier.check_invariants()
        assert len(_warnings(caplog)) == 1

    async def test_another_namespace_is_never_a_hit(self, tmp_path, blocks, keys, values):
        """A tier of another model, block size or dtype over the same directory
        finds nothing, even a file renamed to its own key."""
        others = [
            namespace_of(blocks[0], model="sha256:model-b"),
            namespace_of(kv_blocks(1, block_size=8)[0]),
            namespace_of(kv_blocks(1, dtype=mx.float32)[0]),
        ]
        async with DiskTier(tmp_path, namespace_of(blocks[0])) as tier:
            await tier.put(keys[0], values[0])
        for other in others:
            other_key = storage_key(other, chain_of(1)[0])
            async with DiskTier(tmp_path, other) as tier:
                assert await tier.get(other_key) is None
                os.link(tmp_path / keys[0].hex(), tmp_path / other_key.hex())
                assert await tier.get(other_key) is None
                assert tier.statistics().num_corrupt == 1

    async def test_budget_evicts_least_recently_used_and_holds(self, tmp_path, namespace, keys, values):
        """With room for three blocks, writes evict the least recently used
        (a hit makes a block recent), and the directory never exceeds the budget."""
        budget = 3 * len(values[0]) + len(values[0]) // 2
        async with DiskTier(tmp_path, namespace, max_bytes=budget) as tier:
            for key, value in zip(keys[:3], values[:3]):
                await tier.put(key, value)
            assert await tier.get(keys[0]) is not None  # 0 is now more recent than 1 and 2
            for key, value in zip(keys[3:], values[3:]):
                assert await tier.put(key, value)
                assert _disk_bytes(tmp_path) <= budget
            assert {p.name for p in _files(tmp_path)} == {k.hex() for k in keys[3:]}
            await tier.put(keys[0], values[0])
            assert await tier.contains_many(keys) == [True, False, False, False, True, True]
            removals = tier.take_removals()
            assert [r.key for r in removals] == [keys[1], keys[2], keys[0], keys[3]]
            assert {r.reason for r in removals} == {"evicted"}
            assert tier.statistics().num_evicted == 4
            tier.check_invariants()

    async def test_a_value_over_the_budget_is_dropped(self, tmp_path, namespace, keys, values):
        """A value bigger than the whole budget is dropped, not written."""
        async with DiskTier(tmp_path, namespace, max_bytes=len(values[0]) - 1) as tier:
            assert not await tier.put(keys[0], values[0])
            assert tier.statistics().num_dropped == 1 and _files(tmp_path) == []

    async def test_other_writers_are_counted_after_a_rescan(self, tmp_path, namespace, keys, values):
        """Files another process wrote are hits at once, and count against the
        budget from the next rescan, which evicts the least recently used."""
        budget = 4 * max(map(len, values))
        async with DiskTier(tmp_path, namespace, max_bytes=budget) as ours, DiskTier(
            tmp_path, namespace, max_bytes=10 * budget
        ) as theirs:
            for key, value in zip(keys[:3], values[:3]):
                await ours.put(key, value)
            for key, value in zip(keys[3:], values[3:]):
                await theirs.put(key, value)
            # File times are coarse (a few ms): spell out the order of writing.
            for i, key in enumerate(keys):
                os.utime(tmp_path / key.hex(), ns=(10**18 + i * 10**9,) * 2)
            assert await ours.get(keys[5]) is not None
            await ours.rescan()
            assert ours.statistics().num_bytes <= budget
            assert _disk_bytes(tmp_path) <= budget
            # The oldest files (ours, written first) went; the one we just read stayed.
            assert await theirs.contains_many(keys) == [False, False, True, True, True, True]

    async def test_a_file_deleted_meanwhile_is_a_miss(self, tmp_path, namespace, keys, values):
        """A file another process deletes between probe and read is a miss, not an error."""
        async with DiskTier(tmp_path, namespace) as tier:
            await tier.put(keys[0], values[0])
            assert await tier.contains_many([keys[0]]) == [True]
            (tmp_path / keys[0].hex()).unlink()
            assert await tier.get(keys[0]) is None
            assert tier.statistics().num_missed == 1
            tier.check_invariants()

    async def test_temporary_files_are_never_read_and_stale_ones_are_removed(
        self, tmp_path, namespace, keys
    ):
        """A half-written temporary file is not a value; one left for over an hour
        by a dead process is removed at the next scan."""
        fresh = tmp_path / f".{keys[0].hex()}.abc.tmp"
        stale = tmp_path / f".{keys[1].hex()}.def.tmp"
        fresh.write_bytes(b"half a value")
        stale.write_bytes(b"half a value")
        os.utime(stale, (0, 0))
        async with DiskTier(tmp_path, namespace) as tier:
            assert await tier.get(keys[0]) is None
            assert tier.statistics().num_bytes == 0
        assert fresh.exists() and not stale.exists()

    async def test_an_unwritable_directory_drops_writes_with_one_warning(
        self, tmp_path, namespace, keys, values, caplog
    ):
        """Writes into a directory that became a file are dropped, logged once,
        and never raise."""
        directory = tmp_path / "kv"
        async with DiskTier(directory, namespace) as tier:
            directory.rmdir()
            directory.write_bytes(b"not a directory")
            for key, value in zip(keys[:3], values[:3]):
                assert not await tier.put(key, value)
            stats = tier.statistics()
            assert stats.num_dropped == 3 and not stats.available
            assert await tier.get(keys[0]) is None
        assert len(_warnings(caplog)) == 1

    async def test_a_removed_directory_is_made_again(self, tmp_path, namespace, keys, values):
        """A directory removed under the tier is created again by the next write."""
        directory = tmp_path / "kv"
        async with DiskTier(directory, namespace) as tier:
            directory.rmdir()
            assert await tier.put(keys[0], values[0])
            assert await tier.get(keys[0]) is not None


_WRITER = textwrap.dedent(
    """
    import sys, anyio
    sys.path.insert(0, {tests!r})
    from tier_blocks import chain_of, kv_blocks, namespace_of
    from mlxkv.cache.tiers import DiskTier, encode_block, storage_key

    async def main():
        blocks = kv_blocks(6)
        namespace = namespace_of(blocks[0])
        async with DiskTier({directory!r}, namespace) as tier:
            for block, chain_hash in zip(blocks, chain_of(6)):
                key = storage_key(namespace, chain_hash)
                assert await tier.put(key, encode_block(block, key=key, namespace=namespace))

    anyio.run(main)
    """
)


class TestSharedDirectory:
    def test_another_process_writes_this_one_reads(self, tmp_path, blocks, namespace, keys):
        """Blocks written by another process are read here, verified and equal."""
        script = _WRITER.format(tests=str(Path(__file__).parent), directory=str(tmp_path))
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr

        async def read():
            async with DiskTier(tmp_path, namespace) as tier:
                assert tier.statistics().num_bytes == _disk_bytes(tmp_path)
                return await tier.get_many(keys)

        for value, block in zip(anyio.run(read), blocks):
            assert_same_payload(decode_payload(value), block)
