"""The Redis/Valkey tier (``redis://host:port/db``): blocks shared across processes and hosts.

Each value is one Redis string under ``mlxkv:kv:<storage key hex>``, written
with a single ``SET`` (with ``PX`` when a TTL is set), so a reader sees the
whole value or none of it: header, arrays and checksum travel together.
Eviction is the server's business: give it a ``maxmemory`` and an
``allkeys-lru`` policy, or a TTL here.

The client is `coredis <https://coredis.readthedocs.io>`_ (the ``redis``
extra), which is built on anyio and runs on asyncio and trio alike; it is
imported only when a tier is made, so the plain install works without it.

A server that is down, slow or full costs misses and dropped writes, never
an error and never a slow caller:

- every call has a short timeout (``timeout``, 0.5 s by default; the same
  bounds connecting);
- the first failure of an outage logs one warning; after it, calls are
  refused at once (misses, dropped writes) and one probe goes through after a
  back-off delay that doubles from 0.5 s up to 30 s
  (:class:`~mlxkv.cache.tiers.tier_health.TierHealth`); the first call that
  succeeds logs one info line and everything flows again. coredis itself
  reconnects on the next call; its own retries are turned off, the back-off
  here replaces them;
- a command the server refuses (``OOM`` when full, ``READONLY`` on a
  replica, an ACL error) drops that write or misses that read: one warning
  until a call succeeds again, and no back-off (the server answers quickly).

Reads transfer no more than a value can take: each key is read with
``GETRANGE key 0 N`` (``N`` = :func:`~mlxkv.cache.tiers.block_format.max_value_size`),
then its ``TYPE``, all the keys of a call in one pipeline, so a value one byte
longer than any block is known to be corrupt without the rest of it crossing
the network. (Not in a ``MULTI``: a server out of memory refuses every
command queued in one, and a full server must still serve reads.) Values read
are verified (:func:`~mlxkv.cache.tiers.block_format.check_value`) in a worker
thread. A corrupt one (too long, not verifying, or not a string at all: a
list at a block's key) is counted, deleted from the server and answered as a
miss.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Sequence
from contextlib import AsyncExitStack
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Optional

import anyio

from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.tiers.block_format import CheckedValue, check_value, max_value_size
from mlxkv.cache.tiers.errors import CorruptValue, MissingExtra
from mlxkv.cache.tiers.storage_key import KEY_SIZE, StorageKey
from mlxkv.cache.tiers.tier import TierCounters, TierRemoval, TierStatistics
from mlxkv.cache.tiers.tier_health import TierHealth

if TYPE_CHECKING:
    from mlxkv.cache.tiers.namespace import Namespace

__all__ = ["DEFAULT_TIMEOUT", "KEY_PREFIX", "RedisTier"]

logger = logging.getLogger(__name__)

#: Seconds one call to the server may take before it counts as a failure.
DEFAULT_TIMEOUT = 0.5

#: What every key of this tier starts with.
KEY_PREFIX = b"mlxkv:kv:"


class _Unanswered:
    """The result of a call the server did not answer (down, slow, refused)."""

    def __repr__(self) -> str:
        return "UNANSWERED"


_UNANSWERED = _Unanswered()


def _import_coredis() -> Any:
    try:
        import coredis
        import coredis.connection
        import coredis.exceptions
        import coredis.retry
    except ImportError as exc:
        raise MissingExtra("redis", "coredis", "the redis:// tier") from exc
    return coredis


@functools.lru_cache(maxsize=None)
def _connection_pool_class(coredis: Any) -> Any:
    """coredis's ``ConnectionPool``, with connections that clean up after a failed connect.

    coredis 6.9's ``BaseConnection.__init__`` opens six memory object streams
    that only ``run()`` closes, and only once ``_connect()`` succeeded: every
    attempt to reach a server that is down leaves them to the garbage
    collector, which warns (``ResourceWarning: Unclosed
    <MemoryObjectSendStream>``). The connection here closes them when
    ``_connect()`` (coredis's documented extension point) fails.
    """
    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

    plain = coredis.connection.TCPConnection

    class TCPConnection(plain):  # type: ignore[misc, valid-type]
        async def _connect(self) -> Any:
            try:
                return await super()._connect()
            except BaseException:
                for value in vars(self).values():
                    if isinstance(value, (MemoryObjectSendStream, MemoryObjectReceiveStream)):
                        value.close()
                raise

    class ConnectionPool(coredis.ConnectionPool):  # type: ignore[misc, valid-type]
        def __init__(self, **kwargs: Any) -> None:
            if kwargs.get("connection_class") is plain:
                kwargs["connection_class"] = TCPConnection
            super().__init__(**kwargs)

    return ConnectionPool


class RedisTier:
    """Block values in one Redis/Valkey database (see the module docstring).

    Owns: its coredis client (open between ``__aenter__`` and ``__aexit__``),
    its counters and the health of its server.

    Invariants:
        - no call reaches the server while the health refuses it, and every
          call that does is bounded by ``timeout``;
        - a value is returned only if it verified against its key and the
          namespace (and its position, when the caller gives it);
        - no read transfers more than ``max_value_size(namespace) + 1``
          bytes of a value.
    """

    def __init__(
        self,
        namespace: Namespace,
        *,
        host: str = "localhost",
        port: int = 6379,
        db: int = 0,
        username: Optional[str] = None,
        password: Optional[str] = None,
        tls: bool = False,
        ttl: Optional[float] = None,
        timeout: float = DEFAULT_TIMEOUT,
        health: Optional[TierHealth] = None,
    ) -> None:
        """Args:
            namespace: the namespace every value must belong to.
            host, port, db: the server and database.
            username, password: credentials, if the server wants them.
            tls: connect with TLS (``rediss://``).
            ttl: seconds a value lives, or None for no expiry.
            timeout: seconds per call (and per connection attempt).
            health: the back-off policy (a fresh :class:`TierHealth` by default).

        Raises:
            MissingExtra: coredis (the ``redis`` extra) is not installed.
            InvalidInput: a bad port, db, ttl or timeout.
        """
        self._coredis = _import_coredis()
        if type(port) is not int or not 0 < port < 65536:
            raise InvalidInput("port", port, "must be an int in [1, 65535]")
        if type(db) is not int or db < 0:
            raise InvalidInput("db", db, "must be an int >= 0")
        if ttl is not None and not (isinstance(ttl, (int, float)) and ttl > 0):
            raise InvalidInput("ttl", ttl, "must be a positive number of seconds, or None")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise InvalidInput("timeout", timeout, "must be a positive number of seconds")
        self._namespace = namespace
        self._max_value = max_value_size(namespace)
        self._host, self._port, self._db = host, port, db
        self._username, self._password, self._tls = username, password, tls
        self._ttl_ms = None if ttl is None else max(1, int(ttl * 1000))
        self._timeout = float(timeout)
        self._health = health if health is not None else TierHealth()
        self._counters = TierCounters()
        self._client: Any = None
        self._exit_stack: Optional[AsyncExitStack] = None
        self._refusing = False
        self._warned_corrupt = False

    @property
    def name(self) -> str:
        """``redis://host:port/db`` (``rediss://`` with TLS; an IPv6 host in
        brackets), without credentials or options."""
        scheme = "rediss" if self._tls else "redis"
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{scheme}://{host}:{self._port}/{self._db}"

    @property
    def ttl(self) -> Optional[float]:
        """Seconds a value lives, or None."""
        return None if self._ttl_ms is None else self._ttl_ms / 1000

    async def __aenter__(self) -> RedisTier:
        # Connecting happens on the first call: a server that is down now
        # is an outage like any later one, not an error.
        client = self._coredis.Redis(
            host=self._host,
            port=self._port,
            db=self._db,
            username=self._username,
            password=self._password,
            ssl=self._tls,
            stream_timeout=self._timeout,
            connect_timeout=self._timeout,
            pool_timeout=self._timeout,
            decode_responses=False,
            retry_policy=self._coredis.retry.NoRetryPolicy(),
            connection_pool_cls=_connection_pool_class(self._coredis),
        )
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(client)
            self._exit_stack = stack.pop_all()
        self._client = client
        return self

    async def __aexit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        stack, self._exit_stack, self._client = self._exit_stack, None, None
        if stack is not None:
            await stack.aclose()

    async def contains_many(self, keys: Sequence[StorageKey]) -> list[bool]:
        """Whether each key is stored: one ``EXISTS`` per key, in one pipeline."""
        if not keys:
            return []
        names = [_redis_key(key) for key in keys]

        async def exists() -> list[bool]:
            async with self._client.pipeline(transaction=False) as pipeline:
                replies = [pipeline.exists([name]) for name in names]
            return [bool(await reply) for reply in replies]

        found = await self._ask(exists)
        if found is _UNANSWERED:
            found = [False] * len(keys)
        self._counters.num_missed += found.count(False)
        return found

    async def get_many(
        self, keys: Sequence[StorageKey], *, starts: Optional[Sequence[int]] = None
    ) -> list[Optional[CheckedValue]]:
        """Each key's verified value, or None: a bounded ``GETRANGE`` and a
        ``TYPE`` per key in one pipeline, verified in a worker thread.

        Args:
            keys: the keys to read.
            starts: the position (token index) each key's block must begin
                at, when the caller knows it.
        """
        if not keys:
            return []
        names = [_redis_key(key) for key in keys]
        wrong_type = self._coredis.exceptions.WrongTypeError
        limit = self._max_value

        async def read() -> list[tuple[Optional[str], Optional[bytes]]]:
            async with self._client.pipeline(transaction=False, raise_on_error=False) as pipeline:
                replies = [(pipeline.getrange(name, 0, limit), pipeline.type(name)) for name in names]
            got: list[tuple[Optional[str], Optional[bytes]]] = []
            for data, kind in replies:
                try:
                    value: Optional[bytes] = await data
                except wrong_type:  # not a string: the TYPE reply says what it is
                    value = None
                got.append((_text(await kind), value))
            return got

        raw = await self._ask(read)
        if raw is _UNANSWERED:
            self._counters.num_missed += len(keys)
            return [None] * len(keys)
        checked = await anyio.to_thread.run_sync(
            partial(
                _check_many,
                list(raw),
                list(keys),
                self._namespace,
                None if starts is None else list(starts),
                limit,
            ),
            abandon_on_cancel=True,
        )
        values: list[Optional[CheckedValue]] = []
        corrupt: list[StorageKey] = []
        for key, (value, reason) in zip(keys, checked):
            if value is None and reason is None:
                self._counters.num_missed += 1
            elif value is None:
                corrupt.append(key)
                self._log_corrupt(key, reason)
            values.append(value)
        if corrupt:
            deleted = await self._ask(lambda: self._client.delete([_redis_key(key) for key in corrupt]))
            for key in corrupt:
                self._counters.found_corrupt(key, removed=deleted is not _UNANSWERED)
        return values

    def count_loaded(self, num_values: int) -> None:
        """Count ``num_values`` values this tier returned that a lookup used."""
        self._counters.num_loaded += num_values

    async def get(self, key: StorageKey) -> Optional[CheckedValue]:
        """One key's verified value, or None."""
        (value,) = await self.get_many([key])
        return value

    async def put(self, key: StorageKey, value: bytes) -> bool:
        """``SET`` the value (one command: never seen half-written); whether it was stored."""
        name = _redis_key(key)
        if self._ttl_ms is None:
            stored = await self._ask(lambda: self._client.set(name, value))
        else:
            stored = await self._ask(lambda: self._client.set(name, value, px=self._ttl_ms))
        if stored is _UNANSWERED or not stored:
            self._counters.num_dropped += 1
            return False
        self._counters.num_written += 1
        return True

    async def delete(self, key: StorageKey) -> None:
        """Remove ``key``'s value, if the server answers."""
        if await self._ask(lambda: self._client.delete([_redis_key(key)])) is not _UNANSWERED:
            self._counters.removed(key, "deleted")

    def take_removals(self) -> list[TierRemoval]:
        """Values found corrupt or deleted since the last call (the server's
        own evictions and expiries are not seen)."""
        return self._counters.take_removals()

    def statistics(self) -> TierStatistics:
        """The counters now; ``num_bytes`` is None (the server is shared)."""
        return self._counters.snapshot(self.name, num_bytes=None, available=self._health.available)

    async def _ask(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """Run one call to the server under the timeout and the health.

        Returns:
            Its result, or :data:`_UNANSWERED` when it was refused by the
            health, failed, timed out or was refused by the server (each
            logged once per outage).
        """
        if self._client is None:
            raise RuntimeError(f"{self.name}: RedisTier used outside 'async with'")
        if not self._health.allows(anyio.current_time()):
            return _UNANSWERED
        exceptions = self._coredis.exceptions
        settled = False  # whether the health has heard how the call ended
        try:
            with anyio.fail_after(self._timeout):
                result = await call()
            settled = True
        except exceptions.ResponseError as exc:
            settled = True
            self._answered()
            if not self._refusing:
                self._refusing = True
                logger.warning(
                    "redis tier %s refuses commands (%s): those lookups miss and writes are dropped",
                    self.name,
                    exc,
                )
            return _UNANSWERED
        except (TimeoutError, OSError, exceptions.RedisError) as exc:
            settled = True
            if self._health.failed(anyio.current_time()):
                logger.warning(
                    "redis tier %s unavailable (%s): lookups miss and writes are dropped"
                    " until it answers again (retrying with back-off)",
                    self.name,
                    f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__,
                )
            return _UNANSWERED
        finally:
            if not settled:  # cancelled from outside: no outcome to report
                self._health.abandoned()
        self._answered()
        self._refusing = False
        return result

    def _answered(self) -> None:
        if self._health.succeeded():
            logger.info("redis tier %s available again", self.name)

    def _log_corrupt(self, key: StorageKey, reason: str) -> None:
        if not self._warned_corrupt:
            self._warned_corrupt = True
            logger.warning(
                "redis tier %s: corrupt value %s deleted (%s); further ones are counted, not logged",
                self.name,
                key.hex(),
                reason,
            )
        else:
            logger.debug("redis tier %s: corrupt value %s deleted (%s)", self.name, key.hex(), reason)


def _redis_key(key: StorageKey) -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_SIZE:
        raise InvalidInput("key", key, f"must be a {KEY_SIZE}-byte storage key")
    return KEY_PREFIX + key.hex().encode()


def _text(reply: Any) -> Optional[str]:
    """A ``TYPE`` reply as text: ``"string"``, ``"list"``..., None for no key."""
    if isinstance(reply, bytes):
        reply = reply.decode(errors="replace")
    return None if reply in (None, "none") else str(reply)


def _check_many(
    raw: list[tuple[Optional[str], Optional[bytes]]],
    keys: list[StorageKey],
    namespace: Namespace,
    starts: Optional[list[int]],
    limit: int,
) -> list[tuple[Optional[CheckedValue], Optional[str]]]:
    """(value, None) verified, (None, None) absent, (None, reason) corrupt.

    ``raw`` holds each key's ``TYPE`` (read just after its value) and the
    first ``limit + 1`` bytes of its value (None: not a string). An empty
    read is a missing key unless the key is there (an empty string, or one
    written in between: counted corrupt, at worst a value deleted that the
    next write puts back). Runs in a worker thread.
    """
    results: list[tuple[Optional[CheckedValue], Optional[str]]] = []
    for i, ((kind, data), key) in enumerate(zip(raw, keys)):
        if data is None:
            results.append((None, f"not a string value (a Redis {kind or 'value of another type'})"))
        elif not data and kind is None:
            results.append((None, None))
        elif len(data) > limit:
            results.append((None, f"over {limit} bytes, more than any value of its namespace"))
        else:
            try:
                start = None if starts is None else starts[i]
                results.append((check_value(data, key=key, namespace=namespace, start=start), None))
            except CorruptValue as exc:
                results.append((None, exc.reason))
    return results
