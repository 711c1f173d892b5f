"""The disk tier (``file:///path``): one file per block, a byte budget, LRU eviction.

Each value is a file named by its storage key in hex, directly in the
tier's directory (default ``kv`` in the cache directory:
:mod:`~mlxkv.cache.tiers.cache_dir`). A file is written to a temporary name
in the same directory (``.mlxkv-<key>.<random>.tmp``, created exclusively,
never through a link) and then ``os.replace``-d into place, so a reader sees
either no file or a whole one; values are not ``fsync``-ed (this is a cache:
a file torn by a power cut fails its checksum and is a counted miss).

The directory must be the tier's own. A directory the tier makes, or finds
empty, gets a marker file (:data:`MARKER`), and so does mlxkv's default one
(``<cache>/kv``) when it holds only files named as a tier names them (written
by a version before markers); any other that holds anything and no marker is
refused (:class:`~mlxkv.cache.errors.InvalidInput` on entry):
the tier deletes files (evicted, corrupt, stale temporary ones), and it
deletes only in a marked directory and only names it makes (block names,
its own temporary-file pattern), never another file that happens to be
there.

Nothing found in the directory is trusted. A file is opened without
following a link and without blocking (``O_NOFOLLOW | O_NONBLOCK``), checked
to be a regular file no larger than any value of the namespace
(:func:`~mlxkv.cache.tiers.block_format.max_value_size`), and read no further
than its size: a FIFO, a link, a directory or a device under a block's name
is counted corrupt and left where it is (the tier never made it, so it is
not the tier's to delete); an oversized or failing regular file is counted
corrupt and deleted.

Use order is the files' modification times: a hit bumps the file's times,
so that every process sharing the directory sees the same
least-recently-used order when it scans it. The tier keeps a
:class:`~mlxkv.cache.tiers.disk_index.DiskIndex` of what it knows is there:
its own writes and hits, plus a full rescan on entry and every
``rescan_every`` writes (which also removes the tier's temporary files left
for over an hour, by any process). Before each write it evicts least
recently used files until the new one fits, so the directory never exceeds
``max_bytes`` by anything this process knows of; several processes sharing a
directory each enforce the budget on their own view, which can lag by the
writes of the others since its last rescan.

Sharing the directory is safe: a file deleted by another process between a
probe and a read is a miss, never an error, and every read is verified.
Blocking file work runs in worker threads (``anyio.to_thread.run_sync``);
the index and the counters are written on the event loop only.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Optional, Union

import anyio

from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.tiers.block_format import CheckedValue, check_value, max_value_size
from mlxkv.cache.tiers.cache_dir import default_kv_dir
from mlxkv.cache.tiers.disk_index import DiskIndex
from mlxkv.cache.tiers.errors import CorruptValue
from mlxkv.cache.tiers.storage_key import KEY_SIZE, StorageKey
from mlxkv.cache.tiers.tier import RemovalReason, TierCounters, TierRemoval, TierStatistics
from mlxkv.cache.tiers.tier_health import TierHealth

if TYPE_CHECKING:
    from mlxkv.cache.tiers.namespace import Namespace

__all__ = ["DEFAULT_MAX_BYTES", "MARKER", "DiskTier"]

logger = logging.getLogger(__name__)

#: The budget of a disk tier whose URL names none: 10 GiB.
DEFAULT_MAX_BYTES = 10 * 2**30

#: The file that marks a directory as a disk tier's.
MARKER = ".mlxkv-kv-tier"

_MARKER_TEXT = b"mlxkv disk tier, format 1: block values; mlxkv deletes only the names it makes here\n"
_STALE_TEMPORARY_NS = 3600 * 10**9
_HEX = frozenset("0123456789abcdef")
_TEMPORARY = re.compile(r"\.mlxkv-[0-9a-f]{64}\.[0-9a-f]{16}\.tmp")
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: Reading never follows a link, never waits (a FIFO) and never takes a terminal.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | _NOFOLLOW | _CLOEXEC
#: Writing creates a new file, never one that is there (a link, a FIFO).
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC

#: What reading one file gave: (value, None, False) a hit, (None, None,
#: False) a miss, (None, reason, deleted) a corrupt value.
_Read = tuple[Optional[CheckedValue], Optional[str], bool]


class DiskTier:
    """A directory of block values under a byte budget (see the module docstring).

    Owns: its index of files (sizes, use order), its counters, the health of
    its writes, and the names it is writing right now.

    Invariants:
        - a file under a key's name is a whole value (written elsewhere,
          then renamed into place);
        - room is made before a file is written, so by what the index knows
          the directory holds at most ``max_bytes``;
        - a name being written is never chosen for eviction;
        - files are deleted only once the directory holds the marker, and
          only block names and the tier's temporary names;
        - no read takes more than ``max_value_size(namespace)`` bytes of a
          file, or waits on what is not a regular file.
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
            InvalidInput: a bad budget or rescan interval. (A directory
                that is not the tier's is refused on entry.)
        """
        if type(rescan_every) is not int or rescan_every <= 0:
            raise InvalidInput("rescan_every", rescan_every, "must be a positive int")
        self._directory = Path(os.path.abspath(directory if directory is not None else default_kv_dir()))
        self._namespace = namespace
        self._max_value = max_value_size(namespace)
        self._owned = False  # whether the directory is known to hold the marker
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
        """Make the directory the tier's (create it, or mark it if empty)
        and scan it. A directory that cannot be made or read now is a tier
        whose writes are dropped until it can (logged).

        Raises:
            InvalidInput: the directory holds files and no :data:`MARKER`:
                it is not a disk tier's.
        """
        try:
            refusal = await anyio.to_thread.run_sync(partial(_claim_directory, self._directory))
        except OSError as exc:
            logger.warning("disk tier directory %s cannot be used now: %s", self._directory, exc)
        else:
            if refusal is not None:
                raise InvalidInput("tier", self.name, refusal)
            self._owned = True
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
        """Whether something is under each key's name (an ``lstat`` each, in
        one thread; links are not followed: a read tells what it is)."""
        names = [_file_name(key) for key in keys]
        found = await anyio.to_thread.run_sync(
            partial(_exist_many, self._directory, names), abandon_on_cancel=True
        )
        for name, present in zip(names, found):
            if not present:
                self._index.forget(name)
                self._counters.num_missed += 1
        return found

    async def get_many(
        self, keys: Sequence[StorageKey], *, starts: Optional[Sequence[int]] = None
    ) -> list[Optional[CheckedValue]]:
        """Each key's verified value, or None (missing, unreadable or corrupt).

        Files are read and verified in one worker thread; a corrupt one is
        deleted there (if the tier owns it) and counted here.

        Args:
            keys: the keys to read.
            starts: the position (token index) each key's block must begin
                at, when the caller knows it.
        """
        names = [_file_name(key) for key in keys]
        reads = await anyio.to_thread.run_sync(
            partial(
                _read_many,
                self._directory,
                names,
                list(keys),
                self._namespace,
                [None] * len(keys) if starts is None else list(starts),
                self._max_value,
                self._owned,
            ),
            abandon_on_cancel=True,
        )
        values: list[Optional[CheckedValue]] = []
        for key, name, (value, corrupt, deleted) in zip(keys, names, reads):
            if value is not None:
                self._index.touch(name, value.nbytes)
            else:
                self._index.forget(name)
                if corrupt is None:
                    self._counters.num_missed += 1
                else:
                    self._counters.found_corrupt(key, removed=deleted)
                    self._log_corrupt(name, corrupt, deleted)
            values.append(value)
        return values

    def count_loaded(self, num_values: int) -> None:
        """Count ``num_values`` values this tier returned that a lookup used."""
        self._counters.num_loaded += num_values

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
                    partial(_write_file, self._directory, name, value, victims, claim=not self._owned)
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
        self._owned = True  # the write went through: the directory holds the marker
        if self._write_health.succeeded():
            logger.info("disk tier %s writes again", self.name)
        self._counters.num_written += 1
        self._writes_since_scan += 1
        if self._writes_since_scan >= self._rescan_every:
            await self.rescan()
        return True

    async def delete(self, key: StorageKey) -> None:
        """Remove ``key``'s file, if any (none while the directory is not
        known to be the tier's)."""
        if self._owned:
            await self._delete_files([_file_name(key)], "deleted")

    async def rescan(self) -> None:
        """Rebuild the index from the directory (other processes' writes
        included) and evict least recently used files while it is over budget.
        Nothing is scanned while the directory is not known to be the tier's."""
        self._writes_since_scan = 0
        if not self._owned:
            return
        scanned = await anyio.to_thread.run_sync(partial(_scan, self._directory))
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

    def _log_corrupt(self, name: str, reason: str, deleted: bool) -> None:
        what = "deleted" if deleted else "left in place"
        if not self._warned_corrupt:
            self._warned_corrupt = True
            logger.warning(
                "disk tier %s: corrupt value %s %s (%s); further ones are counted, not logged",
                self.name,
                name,
                what,
                reason,
            )
        else:
            logger.debug("disk tier %s: corrupt value %s %s (%s)", self.name, name, what, reason)


def _file_name(key: StorageKey) -> str:
    if not isinstance(key, bytes) or len(key) != KEY_SIZE:
        raise InvalidInput("key", key, f"must be a {KEY_SIZE}-byte storage key")
    return key.hex()


def _key_of(name: str) -> StorageKey:
    return StorageKey(bytes.fromhex(name))


def _is_key_name(name: str) -> bool:
    return len(name) == 2 * KEY_SIZE and _HEX.issuperset(name)


# Everything below runs in worker threads: file system calls only, no tier state.


def _claim_directory(directory: Path) -> Optional[str]:
    """Make ``directory`` a disk tier's: create it if missing, and mark it
    (:data:`MARKER`) if it is empty.

    Returns:
        None if it is a disk tier's now, else why it cannot be.

    Raises:
        OSError: it cannot be made, read or marked.
    """
    directory.mkdir(parents=True, exist_ok=True)
    if _is_marked(directory):
        return None
    with os.scandir(directory) as entries:
        found = [entry.name for _, entry in zip(range(4), entries)]
    if found and _is_default(directory) and _holds_tier_names_only(directory):
        found = []  # mlxkv's own directory, written before there were markers: adopted
    if found:
        shown = ", ".join(repr(name) for name in found[:3]) + (", ..." if len(found) > 3 else "")
        return (
            f"{directory} holds files ({shown}) and no {MARKER} marker: it is not a disk tier's"
            " directory, and a tier deletes files in its directory; name an empty or new directory"
            f" (or, for one that only a disk tier ever wrote, create an empty file {MARKER} in it)"
        )
    try:
        fd = os.open(directory / MARKER, _CREATE_FLAGS, 0o644)
    except FileExistsError:  # another process marked it first, or planted something there
        return None if _is_marked(directory) else f"{directory / MARKER} is not a regular file"
    with os.fdopen(fd, "wb") as file:
        file.write(_MARKER_TEXT)
    return None


#: A temporary file of a disk tier that wrote no marker (mkstemp's names).
_UNMARKED_TEMPORARY = re.compile(r"\.[0-9a-f]{64}\.[a-z0-9_]{8}\.tmp")


def _is_default(directory: Path) -> bool:
    try:
        return directory.resolve() == default_kv_dir().resolve()
    except OSError:
        return False


def _holds_tier_names_only(directory: Path) -> bool:
    """Whether every entry is a regular file named as a disk tier names its files."""
    with os.scandir(directory) as entries:
        return all(
            entry.is_file(follow_symlinks=False)
            and (_is_key_name(entry.name) or _TEMPORARY.fullmatch(entry.name) or _UNMARKED_TEMPORARY.fullmatch(entry.name))
            for entry in entries
        )


def _is_marked(directory: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(directory / MARKER).st_mode)
    except OSError:
        return False


def _exist_many(directory: Path, names: list[str]) -> list[bool]:
    return [os.path.lexists(directory / name) for name in names]


def _read_many(
    directory: Path,
    names: list[str],
    keys: list[StorageKey],
    namespace: Namespace,
    starts: list[Optional[int]],
    limit: int,
    owned: bool,
) -> list[_Read]:
    return [
        _read_one(directory / name, key, namespace, start, limit, owned)
        for name, key, start in zip(names, keys, starts)
    ]


def _read_one(
    path: Path, key: StorageKey, namespace: Namespace, start: Optional[int], limit: int, owned: bool
) -> _Read:
    """Read and verify one file: never following a link, never waiting on a
    FIFO, never reading more than ``limit`` bytes. A corrupt regular file is
    deleted if ``owned``; anything else under the name is left in place."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:  # gone (another process evicted it): a miss
        return None, None, False
    except OSError:
        kind = _kind_of(path)
        if kind is None:  # a file this process may not read, or gone since: a miss
            return None, None, False
        return None, f"a {kind}, not a value file", False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None, f"a {_KINDS.get(stat.S_IFMT(info.st_mode), 'special file')}, not a value file", False
        if info.st_size > limit:
            reason = f"{info.st_size} bytes, more than any value of its namespace ({limit})"
        else:
            try:
                value = check_value(_read_fd(fd, info.st_size), key=key, namespace=namespace, start=start)
            except CorruptValue as exc:
                reason = exc.reason
            else:
                _touch(fd)
                return value, None, False
    except OSError:  # it could not be read: a miss
        return None, None, False
    finally:
        os.close(fd)
    return None, reason, owned and _unlink_quietly(path)


#: What a file that is not a regular file is, by ``stat.S_IFMT``.
_KINDS = {
    stat.S_IFDIR: "directory",
    stat.S_IFIFO: "FIFO",
    stat.S_IFLNK: "symbolic link",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFSOCK: "socket",
}


def _kind_of(path: Path) -> Optional[str]:
    """What is at ``path`` if it is not a regular file (a link is not
    followed); None for a regular file or nothing."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "special file")


def _read_fd(fd: int, size: int) -> bytearray:
    """At most ``size`` bytes of an open file, read straight into a buffer of
    that size (no file object or buffered reader, which copy once more). A file that shrinks meanwhile gives fewer bytes, which
    fail verification; one that grows is not read past ``size``."""
    data = bytearray(size)
    view = memoryview(data)
    done = 0
    try:
        while done < size:
            count = os.readv(fd, [view[done:]])
            if not count:
                break
            done += count
    finally:
        view.release()
    if done < size:
        del data[done:]
    return data


def _touch(fd: int) -> None:
    """Bump an open file's times: the use order every process sees."""
    try:
        os.utime(fd)
    except (OSError, NotImplementedError):
        pass


def _refresh(path: Path) -> bool:
    try:
        os.utime(path, follow_symlinks=False)
    except (OSError, NotImplementedError):
        return False
    return True


def _write_file(
    directory: Path, name: str, value: bytes, victims: list[str], *, claim: bool
) -> Optional[str]:
    """Evict ``victims``, then write ``value`` whole as ``name``; the error, or None.

    With ``claim``, the directory is made the tier's first (see
    :func:`_claim_directory`); one that is not the tier's is the error.
    """
    try:
        if claim:
            refusal = _claim_directory(directory)
            if refusal is not None:
                return refusal
        _unlink_many(directory, victims)
        temporary = directory / f".mlxkv-{name}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(temporary, _CREATE_FLAGS, 0o600)
        except FileNotFoundError:  # the directory was removed under us: make it again
            refusal = _claim_directory(directory)
            if refusal is not None:
                return refusal
            fd = os.open(temporary, _CREATE_FLAGS, 0o600)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(value)
            # rename() replaces whatever is at the name (a planted link
            # included) and never writes through it.
            os.replace(temporary, directory / name)
        except BaseException:
            _unlink_quietly(temporary)
            raise
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _unlink_many(directory: Path, names: list[str]) -> None:
    for name in names:
        _unlink_quietly(directory / name)


def _unlink_quietly(path: Path) -> bool:
    """Whether ``path`` was removed here."""
    try:
        os.unlink(path)
    except OSError:  # already gone: another process got there first
        return False
    return True


def _scan(directory: Path) -> Optional[list[tuple[str, int, int]]]:
    """``(name, size, mtime_ns)`` of every value file; None if the directory
    cannot be read. Removes the tier's temporary files left for over an
    hour; nothing else."""
    try:
        with os.scandir(directory) as found:
            entries = list(found)
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
        elif _TEMPORARY.fullmatch(entry.name) and now_ns - info.st_mtime_ns > _STALE_TEMPORARY_NS:
            _unlink_quietly(Path(entry.path))
    return scanned
