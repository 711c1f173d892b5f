"""The disk tier on a real directory: whole files, verified reads, an LRU byte budget, shared use."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import anyio
import mlx.core as mx
import pytest
from tier_blocks import assert_same_payload, chain_of, kv_blocks, namespace_of, peak_rss_script

from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.tiers import DiskTier, decode_payload, encode_block, max_value_size, storage_key
from mlxkv.cache.tiers import disk_tier as disk_tier_module
from mlxkv.cache.tiers.disk_tier import MARKER

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
    """Bytes of the block files (the marker is not a block)."""
    return sum(path.stat().st_size for path in _files(directory))


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
            assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == [MARKER, keys[0].hex()]
            assert tier.statistics().num_loaded == 0  # read, not yet used
            tier.count_loaded(1)
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
        async with DiskTier(tmp_path, namespace):
            pass  # the directory is the tier's now
        fresh = tmp_path / f".mlxkv-{keys[0].hex()}.{'0' * 16}.tmp"
        stale = tmp_path / f".mlxkv-{keys[1].hex()}.{'1' * 16}.tmp"
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
            shutil.rmtree(directory)
            directory.write_bytes(b"not a directory")
            for key, value in zip(keys[:3], values[:3]):
                assert not await tier.put(key, value)
            stats = tier.statistics()
            assert stats.num_dropped == 3 and not stats.available
            assert await tier.get(keys[0]) is None
        assert len(_warnings(caplog)) == 1

    async def test_a_removed_directory_is_made_again(self, tmp_path, namespace, keys, values):
        """A directory removed under the tier is created again, marked, by the next write."""
        directory = tmp_path / "kv"
        async with DiskTier(directory, namespace) as tier:
            shutil.rmtree(directory)
            assert await tier.put(keys[0], values[0])
            assert await tier.get(keys[0]) is not None
        assert (directory / MARKER).is_file()


def _bytes_read() -> int:
    """Bytes this process has read through read(2) and its kin, so far."""
    with open("/proc/self/io") as io:
        return int(next(line for line in io if line.startswith("rchar:")).split()[1])


def _release_readers(fifo: Path) -> None:
    """Open ``fifo`` for writing and close it: a reader blocked opening it
    (code that does block) goes on, so a failing test cannot hang at exit."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader waiting
        pass


@pytest.fixture
def marked(tmp_path, namespace):
    """A directory a disk tier has made its own (it holds the marker)."""
    directory = tmp_path / "kv"

    async def mark():
        async with DiskTier(directory, namespace):
            pass

    anyio.run(mark)
    return directory


class TestUntrustedFiles:
    """Whatever is planted under a block's name is opened without blocking or
    following a link, checked, and read no further than a value can be."""

    async def test_a_fifo_never_blocks_a_read(self, marked, namespace, keys):
        """A FIFO under a block's name is counted corrupt at once (no writer is
        waited for), the lookup is a miss, and the FIFO is left alone."""
        fifo = marked / keys[0].hex()
        os.mkfifo(fifo)
        try:
            async with DiskTier(marked, namespace) as tier:
                with anyio.fail_after(5):
                    assert await tier.contains_many([keys[0]]) == [True]
                    assert await tier.get(keys[0]) is None
                stats = tier.statistics()
        finally:
            _release_readers(fifo)
        assert (stats.num_corrupt, stats.num_missed, stats.num_loaded) == (1, 0, 0)
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)

    async def test_a_link_is_never_followed(self, tmp_path, marked, namespace, keys, values):
        """A symbolic link under a block's name, even to a valid value of that
        key, is not followed: counted corrupt, a miss; link and target untouched."""
        target = tmp_path / "elsewhere"
        target.write_bytes(values[0])
        link = marked / keys[0].hex()
        link.symlink_to(target)
        async with DiskTier(marked, namespace) as tier:
            assert await tier.get(keys[0]) is None
            assert tier.statistics().num_corrupt == 1
            assert tier.take_removals() == []  # nothing was deleted
        assert link.is_symlink() and target.read_bytes() == values[0]

    async def test_a_directory_is_not_a_value(self, marked, namespace, keys):
        """A directory under a block's name is counted corrupt and left in place."""
        (marked / keys[0].hex()).mkdir()
        async with DiskTier(marked, namespace) as tier:
            assert await tier.get(keys[0]) is None
            assert tier.statistics().num_corrupt == 1
        assert (marked / keys[0].hex()).is_dir()

    @pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts bytes read through /proc")
    async def test_an_oversized_file_is_refused_unread(self, marked, namespace, keys):
        """A 300 MB sparse file under a block's name is refused from its size:
        not read (the process reads under one value's worth), answered at once,
        counted corrupt and deleted (a regular file under the tier's own name)."""
        path = marked / keys[0].hex()
        path.touch()
        os.truncate(path, 300 * 2**20)
        async with DiskTier(marked, namespace) as tier:
            before, started = _bytes_read(), time.perf_counter()
            assert await tier.get(keys[0]) is None
            elapsed, read = time.perf_counter() - started, _bytes_read() - before
            assert tier.statistics().num_corrupt == 1
        assert read < max_value_size(namespace) + 2**20
        assert elapsed < 1.0
        assert not path.exists()

    @pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak RSS from /proc")
    def test_an_oversized_file_does_not_grow_the_process(self, marked):
        """In a fresh process, refusing a 300 MB file raises its peak RSS by
        less than 32 MiB (reading it whole took 300 MB more)."""
        script = peak_rss_script(_PEAK_RSS_MAIN, directory=str(marked))
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        growth_kib, missed, corrupt = done.stdout.split()
        assert (missed, corrupt) == ("True", "1")
        assert int(growth_kib) < 32 * 1024

    async def test_a_value_one_byte_too_long_is_corrupt(self, marked, namespace, keys, values):
        """The size bound is exact: a valid value padded past the largest value
        of the namespace is refused by its size alone."""
        path = marked / keys[0].hex()
        path.write_bytes(values[0] + bytes(max_value_size(namespace) + 1 - len(values[0])))
        async with DiskTier(marked, namespace) as tier:
            assert await tier.get(keys[0]) is None
            assert tier.statistics().num_corrupt == 1

    async def test_a_write_never_goes_through_a_planted_link(self, tmp_path, marked, namespace, keys, values):
        """A link planted at a block's name is replaced by the value's file; the
        file it pointed to is not written."""
        victim = tmp_path / "victim"
        victim.write_bytes(b"precious")
        (marked / keys[0].hex()).symlink_to(victim)
        async with DiskTier(marked, namespace) as tier:
            assert await tier.put(keys[0], values[0])
            assert await tier.get(keys[0]) is not None
        assert victim.read_bytes() == b"precious"
        assert not (marked / keys[0].hex()).is_symlink()


_PEAK_RSS_MAIN = """
from mlxkv.cache.tiers import DiskTier, storage_key

async def main():
    namespace = namespace_of(kv_blocks(6)[0])
    key = storage_key(namespace, chain_of(1)[0])
    path = os.path.join({directory!r}, key.hex())
    open(path, "wb").close()
    os.truncate(path, 300 * 2**20)
    async with DiskTier({directory!r}, namespace) as tier:
        await tier.get(storage_key(namespace, b"warm up the worker threads"))
        before = peak_kib()
        value = await tier.get(key)
        after = peak_kib()
        print(after - before, value is None, tier.statistics().num_corrupt)
"""


class TestOwnership:
    """A disk tier uses only a directory of its own, and deletes only the names it makes."""

    @pytest.mark.parametrize("existing", [False, True], ids=["new", "empty"])
    async def test_a_new_or_empty_directory_is_marked(self, tmp_path, namespace, existing):
        """A directory the tier makes, or finds empty, gets the marker file."""
        directory = tmp_path / "a" / "kv"
        if existing:
            directory.mkdir(parents=True)
        async with DiskTier(directory, namespace):
            pass
        marker = directory / MARKER
        assert marker.is_file() and not marker.is_symlink()
        assert marker.read_bytes().startswith(b"mlxkv disk tier")

    async def test_a_directory_of_other_files_is_refused_untouched(self, tmp_path, namespace):
        """A directory holding a two-hour-old ``report.tmp`` and a file named with
        64 hex digits, and no marker, is refused with an error that names it and
        says what to do; both files stay and no marker is written."""
        directory = tmp_path / "reports"
        directory.mkdir()
        report, hexed = directory / "report.tmp", directory / ("ab" * 32)
        report.write_text("quarterly figures")
        hexed.write_text("not a block")
        two_hours_ago = time.time() - 2 * 3600
        for path in (report, hexed):
            os.utime(path, (two_hours_ago, two_hours_ago))
        with pytest.raises(InvalidInput, match="empty or new directory") as raised:
            async with DiskTier(directory, namespace):
                pass
        assert str(directory) in str(raised.value) and MARKER in str(raised.value)
        assert raised.value.argument == "tier"
        assert report.read_text() == "quarterly figures" and hexed.read_text() == "not a block"
        assert sorted(p.name for p in directory.iterdir()) == sorted([report.name, hexed.name])

    @pytest.mark.parametrize("foreign", [None, "notes.txt"])
    async def test_the_default_directory_of_an_earlier_version_is_adopted(
        self, tmp_path, namespace, monkeypatch, foreign
    ):
        """mlxkv's own ``<cache>/kv``, written before markers (block files and an
        old temporary file only), is marked and used; one holding anything else
        is refused like any other directory."""
        monkeypatch.setenv("MLXKV_CACHE_DIR", str(tmp_path))
        directory = tmp_path / "kv"
        directory.mkdir()
        (directory / ("ab" * 32)).write_bytes(b"an old block")
        (directory / f".{'cd' * 32}.k3j_9xq2.tmp").write_bytes(b"")
        if foreign is None:
            async with DiskTier(directory, namespace):
                pass
            assert (directory / MARKER).is_file()
        else:
            (directory / foreign).write_text("mine")
            with pytest.raises(InvalidInput, match="no .mlxkv-kv-tier marker"):
                async with DiskTier(directory, namespace):
                    pass
            assert not (directory / MARKER).exists() and (directory / foreign).read_text() == "mine"

    async def test_a_marker_that_is_not_a_file_does_not_count(self, tmp_path, namespace):
        """A link named like the marker does not make a directory the tier's."""
        directory = tmp_path / "kv"
        directory.mkdir()
        (tmp_path / "real").write_text("")
        (directory / MARKER).symlink_to(tmp_path / "real")
        with pytest.raises(InvalidInput, match="no .mlxkv-kv-tier marker"):
            async with DiskTier(directory, namespace):
                pass

    async def test_only_its_own_names_are_deleted(self, marked, namespace, keys, values):
        """In its own directory, scans, evictions and deletes remove block files
        and the tier's own stale temporary files, never anything else there,
        however old and whatever it is called."""
        old = time.time() - 2 * 3600
        foreign = [
            marked / "report.tmp",
            marked / "notes.txt",
            marked / f".{keys[0].hex()}.abcdefgh.tmp",  # another program's temporary file
            marked / ("AB" * 32),  # hex, but not a name the tier makes
            marked / "sub" / "file",
        ]
        (marked / "sub").mkdir()
        for path in foreign:
            path.write_text("someone else's")
            os.utime(path, (old, old))
        ours = marked / f".mlxkv-{keys[1].hex()}.{'2' * 16}.tmp"
        ours.write_bytes(b"half a value")
        os.utime(ours, (old, old))
        budget = 2 * len(values[0]) + 10
        async with DiskTier(marked, namespace, max_bytes=budget, rescan_every=2) as tier:
            for key, value in zip(keys, values):
                assert await tier.put(key, value)
            await tier.delete(keys[-1])
            await tier.rescan()
            assert tier.statistics().num_evicted == len(keys) - 2
        assert all(path.read_text() == "someone else's" for path in foreign)
        assert not ours.exists()
        assert {p.name for p in _files(marked)} == {keys[-2].hex(), "report.tmp", "notes.txt", "AB" * 32, "sub"}


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
