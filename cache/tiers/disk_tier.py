"""The disk tier (``file:///path``): one file per block, a byte budget, LRU eviction.

Each value is a file named by its storage key in hex, directly in the
tier's directory (default ``~/.cache/mlxkv/kv``). A file is written to a
temporary name in the same directory (``.<key>.<random>.tmp``) and then
``os.replace``-d into place, so a reader sees either no file or a whole
one; values are not ``fsync``-ed (this is a cache: a file torn by a power
cut fails its checksum and is a counted miss).

Use order is the files' modification times: a hit bumps the file's times
(``os.utime``), so that every process sharing the directory sees the same
least-recently-used order when it scans it. The tier keeps a
:class:`~mlxkv.cache.tiers.disk_index.DiskIndex` of what it knows is there:
its own writes and hits, plus a full rescan on entry and every
``rescan_every`` writes (which also removes other processes' temporary files
left for over an hour). Before each write it evicts least recently used files
until the new one fits, so the directory never exceeds ``max_bytes`` by
anything this process knows of; several processes sharing a directory each
enforce the budget on their own view, which can lag by the writes of the
others since its last rescan.

Sharing the directory is safe: a file deleted by another process between a
probe and a read is a miss, never an error, and every read is verified.
Blocking file work runs in worker threads (``anyio.to_thread.run_sync``);
the index and the counters are written on the event loop only.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Optional, Union

import anyio

from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.tiers.block_format import CheckedValue, check_value
from mlxkv.cache.tiers.cache_dir import default_kv_dir
from mlxkv.cache.tiers.disk_index import DiskIndex
from mlxkv.cache.tiers.errors import CorruptValue
from mlxkv.cache.tiers.storage_key import KEY_SIZE, StorageKey
from mlxkv.cache.tiers.tier import RemovalReason, TierCounters, TierRemoval, TierStatistics
from mlxkv.cache.tiers.tier_health import TierHealth

if TYPE_CHECKING:
    from mlxkv.cache.tiers.namespace import Namespace

__all__ = ["DEFAULT_MAX_BYTES", "DiskTier"]

logger = logging.getLogger(__name__)

#: The budget of a disk tier whose URL names none: 10 GiB.
DEFAULT_MAX_BYTES = 10 * 2**30

_STALE_TEMPORARY_NS = 3600 * 10**9
_HEX = frozenset("0123456789abcdef")

#: What reading one file gave: (value, None) a hit, (None, None) a miss,
#: (None, reason) a corrupt value (already deleted).
_Read = tuple[Optional[CheckedValue], Optional[str]]


class DiskTier:
    """A directory of block values under a byte budget (see the module docstring).

    Owns: its index of files (sizes, use order), its counters, the health of
    its writes, and the names it is writing right now.

    Invariants:
        - a file under a key's name is a whole value (written elsewhere,
          then renamed into place);
        - room is made before a file is written, so by what the index knows
          the directory holds at most ``max_bytes``;
        - a name being written is never chosen for eviction.
    """

    def __init__(
        self,
        directory: Union[str, "os.PathLike[str]", None],
        namespace: Namespace,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        rescan_every: int = 256,
    ) -> None:
        """Args:
            directory: where the files go (created if missing); None for
                :func:`~mlxkv.cache.tiers.cache_dir.default_kv_dir`.
            namespace: the namespace every value must belong to.
            max_bytes: the byte budget, > 0.
            rescan_every: rescan the directory after this many writes.

        Raises:
            InvalidInput: a bad budget or rescan interval.
        """
        if type(rescan_every) is not int or rescan_every <= 0:
            raise InvalidInput("rescan_every", rescan_every, "must be a positive int")
        self._directory = Path(os.path.abspath(directory if directory is not None else default_kv_dir()))
        self._namespace = namespace
        self._index = DiskIndex(max_bytes)
        self._rescan_every = rescan_every
        self._writes_since_scan = 0
        self._writing: dict[str, int] = {}
        self._counters = TierCounters()
        self._write_health = TierHealth()
        self._warned_corrupt = False

    @property
    def name(self) -> str:
        """``file://`` and the directory's absolute path."""
        return f"file://{self._directory}"

    @property
    def directory(self) -> Path:
        """The tier's directory."""
        return self._directory

    @property
    def max_bytes(self) -> int:
        """The byte budget."""
        return self._index.max_bytes

    async def __aenter__(self) -> DiskTier:
        await self.rescan()
        return self

    async def __aexit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        return None

    async def contains_many(self, keys: Sequence[StorageKey]) -> list[bool]:
        """Whether a file exists for each key (a ``stat`` each, in one thread)."""
        names = [_file_name(key) for key in keys]
        found = await anyio.to_thread.run_sync(
            partial(_exist_many, self._directory, names), abandon_on_cancel=True
        )
        for name, present in zip(names, found):
            if not present:
                self._index.forget(name)
                self._counters.num_missed += 1
        return found

    async def get_many(self, keys: Sequence[StorageKey]) -> list[Optional[CheckedValue]]:
        """Each key's verified value, or None (missing, unreadable or corrupt).

        Files are read and verified in one worker thread; a corrupt one is
        deleted there and counted here.
        """
        names = [_file_name(key) for key in keys]
        reads = await anyio.to_thread.run_sync(
            partial(_read_many, self._directory, names, list(keys), self._namespace),
            abandon_on_cancel=True,
        )
        values: list[Optional[CheckedValue]] = []
        for key, name, (value, corrupt) in zip(keys, names, reads):
            if value is not None:
                self._index.touch(name, value.nbytes)
                self._counters.num_loaded += 1
            else:
                self._index.forget(name)
                if corrupt is None:
                    self._counters.num_missed += 1
                else:
                    self._counters.removed(key, "corrupt")
                    self._log_corrupt(name, corrupt)
            values.append(value)
        return values

    async def get(self, key: StorageKey) -> Optional[CheckedValue]:
        """One key's verified value, or None."""
        (value,) = await self.get_many([key])
        return value

    async def put(self, key: StorageKey, value: bytes) -> bool:
        """Write ``value`` as ``key``'s file, evicting least recently used files first.

        Returns:
            Whether the file is there now. False (counted dropped) for a
            value over the whole budget, when every other file is being
            written, or when the directory cannot be written (logged once
            per outage; writes are skipped until a retry succeeds).
        """
        name = _file_name(key)
        size = len(value)
        if size > self._index.max_bytes or not self._write_health.allows(anyio.current_time()):
            self._counters.num_dropped += 1
            return False
        if name in self._writing or (
            self._index.size_of(name) == size
            and await anyio.to_thread.run_sync(partial(_refresh, self._directory / name))
        ):
            # Values are content-addressed: the same bytes are there already
            # (or on their way); a refresh of their use time is all it takes.
            self._index.touch(name, size)
            self._counters.num_written += 1
            return True
        victims = self._index.make_room(size, keep=self._writing)
        if not self._index.fits(size):
            self._counters.num_dropped += 1
            await self._delete_files(victims, "evicted")
            return False
        self._index.touch(name, size)
        self._writing[name] = size
        try:
            # Shielded: once the thread runs, the index must learn how it ended.
            with anyio.CancelScope(shield=True):
                error = await anyio.to_thread.run_sync(
                    partial(_write_file, self._directory, name, value, victims)
                )
        finally:
            del self._writing[name]
        for victim in victims:
            self._counters.removed(_key_of(victim), "evicted")
        if error is not None:
            self._index.forget(name)
            self._counters.num_dropped += 1
            if self._write_health.failed(anyio.current_time()):
                logger.warning(
                    "disk tier %s cannot write (%s): writes are dropped until it can", self.name, error
                )
            return False
        if self._write_health.succeeded():
            logger.info("disk tier %s writes again", self.name)
        self._counters.num_written += 1
        self._writes_since_scan += 1
        if self._writes_since_scan >= self._rescan_every:
            await self.rescan()
        return True

    async def delete(self, key: StorageKey) -> None:
        """Remove ``key``'s file, if any."""
        await self._delete_files([_file_name(key)], "deleted")

    async def rescan(self) -> None:
        """Rebuild the index from the directory (other processes' writes
        included) and evict least recently used files while it is over budget."""
        scanned = await anyio.to_thread.run_sync(partial(_scan, self._directory))
        self._writes_since_scan = 0
        if scanned is None:
            return
        self._index.replace(scanned, keep=self._writing)
        await self._delete_files(self._index.make_room(0, keep=self._writing), "evicted")

    def take_removals(self) -> list[TierRemoval]:
        """Files evicted, found corrupt or deleted since the last call."""
        return self._counters.take_removals()

    def statistics(self) -> TierStatistics:
        """The counters now; ``num_bytes`` is what the index knows of."""
        return self._counters.snapshot(
            self.name, num_bytes=self._index.num_bytes, available=self._write_health.available
        )

    def check_invariants(self) -> None:
        """Check the index (tests)."""
        self._index.check_invariants()

    async def _delete_files(self, names: Sequence[str], reason: RemovalReason) -> None:
        if not names:
            return
        for name in names:
            self._index.forget(name)
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(partial(_unlink_many, self._directory, list(names)))
        for name in names:
            self._counters.removed(_key_of(name), reason)

    def _log_corrupt(self, name: str, reason: str) -> None:
        if not self._warned_corrupt:
            self._warned_corrupt = True
            logger.warning(
                "disk tier %s: corrupt value %s deleted (%s); further ones are counted, not logged",
                self.name,
                name,
                reason,
            )
        else:
            logger.debug("disk tier %s: corrupt value %s deleted (%s)", self.name, name, reason)


def _file_name(key: StorageKey) -> str:
    if not isinstance(key, bytes) or len(key) != KEY_SIZE:
        raise InvalidInput("key", key, f"must be a {KEY_SIZE}-byte storage key")
    return key.hex()


def _key_of(name: str) -> StorageKey:
    return StorageKey(bytes.fromhex(name))


def _is_key_name(name: str) -> bool:
    return len(name) == 2 * KEY_SIZE and _HEX.issuperset(name)


# Everything below runs in worker threads: file system calls only, no tier state.


def _exist_many(directory: Path, names: list[str]) -> list[bool]:
    return [os.path.isfile(directory / name) for name in names]


def _read_many(
    directory: Path, names: list[str], keys: list[StorageKey], namespace: Namespace
) -> list[_Read]:
    return [_read_one(directory / name, key, namespace) for name, key in zip(names, keys)]


def _read_one(path: Path, key: StorageKey, namespace: Namespace) -> _Read:
    try:
        data = _read_file(path)
    except OSError:  # gone (another process evicted it), or unreadable: a miss
        return None, None
    try:
        value = check_value(data, key=key, namespace=namespace)
    except CorruptValue as exc:
        _unlink_quietly(path)
        return None, exc.reason
    try:
        os.utime(path)  # the use order every process sees
    except OSError:
        pass
    return value, None


def _read_file(path: Path) -> bytearray:
    """The file's bytes, read straight into a buffer of its size (no file
    object or buffered reader: 128 blocks of 49 KB read in 8.2 ms, not 10.1).
    A file that shrinks meanwhile gives fewer bytes, which fail verification;
    files are replaced whole, never grown."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        data = bytearray(os.fstat(fd).st_size)
        view = memoryview(data)
        done = 0
        while done < len(data):
            count = os.readv(fd, [view[done:]])
            if not count:
                break
            done += count
        view.release()
    finally:
        os.close(fd)
    if done < len(data):
        del data[done:]
    return data


def _refresh(path: Path) -> bool:
    try:
        os.utime(path)
    except OSError:
        return False
    return True


def _write_file(directory: Path, name: str, value: bytes, victims: list[str]) -> Optional[str]:
    """Evict ``victims``, then write ``value`` whole as ``name``; the error, or None."""
    _unlink_many(directory, victims)
    try:
        try:
            fd, temporary = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
        except FileNotFoundError:  # the directory was removed under us
            directory.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(value)
            os.replace(temporary, directory / name)
        except BaseException:
            _unlink_quietly(Path(temporary))
            raise
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _unlink_many(directory: Path, names: list[str]) -> None:
    for name in names:
        _unlink_quietly(directory / name)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:  # already gone: another process got there first
        pass


def _scan(directory: Path) -> Optional[list[tuple[str, int, int]]]:
    """``(name, size, mtime_ns)`` of every value file; None if the directory
    cannot be made or read. Removes temporary files left for over an hour."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        entries = list(os.scandir(directory))
    except OSError as exc:
        logger.warning("disk tier directory %s cannot be read: %s", directory, exc)
        return None
    now_ns = time.time_ns()
    scanned = []
    for entry in entries:
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(info.st_mode):
            continue
        if _is_key_name(entry.name):
            scanned.append((entry.name, info.st_size, info.st_mtime_ns))
        elif entry.name.endswith(".tmp") and now_ns - info.st_mtime_ns > _STALE_TEMPORARY_NS:
            _unlink_quietly(Path(entry.path))
    return scanned
