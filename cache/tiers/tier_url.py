"""Tier URLs: ``file:///path`` and ``redis://host:port/db``, parsed into specs and opened.

- ``file:///abs/path[?max_bytes=N]``: a :class:`~mlxkv.cache.tiers.disk_tier.DiskTier`
  in that directory; ``file://`` alone means the default directory
  (``kv`` in :mod:`~mlxkv.cache.tiers.cache_dir`'s directory). ``max_bytes`` is an integer byte count (10 GiB
  by default).
- ``redis://[user:password@]host[:port][/db][?ttl=S&timeout=S]``, or
  ``rediss://`` for TLS: a :class:`~mlxkv.cache.tiers.redis_tier.RedisTier`.
  Port 6379 and db 0 by default; ``ttl`` and ``timeout`` are seconds.

Anything else (another scheme, a relative path, a host on a ``file`` URL,
an unknown or malformed option) raises :class:`~mlxkv.cache.errors.InvalidInput`
naming the URL and what is wrong with it.

A URL is shown only through :func:`redact_url`, which replaces its password
with ``***``: in errors, in tier names (which name no credentials at all) and
in reports. The user information of a ``redis://`` URL runs to its last
``@``, so a password holding ``/``, ``?``, ``#`` or ``@`` unescaped is still
the password, not a host or a path that an error would echo.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, TypeVar, Union
from urllib.parse import parse_qs, unquote, urlsplit

import attrs

from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.tiers.cache_dir import default_kv_dir
from mlxkv.cache.tiers.disk_tier import DEFAULT_MAX_BYTES, DiskTier
from mlxkv.cache.tiers.redis_tier import DEFAULT_TIMEOUT, RedisTier

if TYPE_CHECKING:
    from mlxkv.cache.tiers.namespace import Namespace
    from mlxkv.cache.tiers.tier import Tier

T = TypeVar("T")

__all__ = ["DiskTierSpec", "RedisTierSpec", "TierSpec", "open_tier", "parse_tier_url", "redact_url"]

#: A URL's scheme and what separates it from the rest (``//``, when there).
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):(//)?")


@attrs.frozen
class DiskTierSpec:
    """A disk tier's directory and byte budget."""

    directory: Path
    max_bytes: int = DEFAULT_MAX_BYTES


@attrs.frozen
class RedisTierSpec:
    """A Redis/Valkey tier's server, database, credentials and options."""

    host: str = "localhost"
    port: int = 6379
    db: int = 0
    username: Optional[str] = None
    password: Optional[str] = attrs.field(default=None, repr=False)
    tls: bool = False
    ttl: Optional[float] = None
    timeout: float = DEFAULT_TIMEOUT


TierSpec = Union[DiskTierSpec, RedisTierSpec]


def redact_url(url: str) -> str:
    """``url`` as it may be shown: its password replaced by ``***``.

    The user name stays (``redis://user:***@host:6379/0``,
    ``redis://:***@host``); a URL without a password is returned as it is.
    Any string is taken, valid URL or not, so that an error about a
    malformed URL can show it too.
    """
    head, userinfo, rest = _split_userinfo(url)
    if userinfo is None or ":" not in userinfo:
        return url
    return f"{head}{userinfo.partition(':')[0]}:***@{rest}"


def _split_userinfo(url: str) -> tuple[str, Optional[str], str]:
    """``(scheme with its ':' or '://', user information or None, the rest)``.

    A ``file`` URL's user information ends its authority (before the first
    ``/``); any other URL's runs to its last ``@`` (nothing after a Redis
    URL's user information holds one).
    """
    match = _SCHEME.match(url)
    if match is None:
        return "", None, url
    head, tail = url[: match.end()], url[match.end() :]
    if match.group(1).lower() == "file":
        at = tail.split("/", 1)[0].rfind("@")
    else:
        at = tail.rfind("@")
    if at < 0:
        return head, None, tail
    return head, tail[:at], tail[at + 1 :]


def parse_tier_url(url: str) -> TierSpec:
    """The tier ``url`` names (see the module docstring).

    Raises:
        InvalidInput: ``url`` names no tier, or has a malformed part (the
            error shows the URL with its password redacted).
    """
    if not isinstance(url, str):
        raise InvalidInput("tier", url, "must be a URL string")
    shown = redact_url(url)
    head, userinfo, rest = _split_userinfo(url)
    # Parsed without its user information: no error below can echo a piece of a password.
    bare = head + rest if userinfo is not None else url
    try:
        parts = urlsplit(bare)
        port = parts.port
    except ValueError as exc:
        raise InvalidInput("tier", shown, f"is not a valid URL: {exc}") from None
    options = _options(shown, parts.query)
    if parts.scheme == "file":
        if userinfo is not None or parts.netloc not in ("", "localhost"):
            raise InvalidInput("tier", shown, "a file URL names a local directory (file:///path)")
        path = unquote(parts.path)
        if path and not path.startswith("/"):
            raise InvalidInput("tier", shown, "the directory must be an absolute path (file:///path)")
        max_bytes = _take(shown, options, "max_bytes", _positive_int, DEFAULT_MAX_BYTES)
        _no_more(shown, options)
        return DiskTierSpec(directory=Path(path) if path else default_kv_dir(), max_bytes=max_bytes)
    if parts.scheme in ("redis", "rediss") and head.endswith("//"):
        database = parts.path.lstrip("/")
        if database and not database.isdigit():
            raise InvalidInput("tier", shown, f"the database must be a number, not {database!r}")
        ttl = _take(shown, options, "ttl", _positive_seconds, None)
        timeout = _take(shown, options, "timeout", _positive_seconds, DEFAULT_TIMEOUT)
        _no_more(shown, options)
        user, colon, password = (userinfo or "").partition(":")
        return RedisTierSpec(
            host=parts.hostname or "localhost",
            port=port if port is not None else 6379,
            db=int(database) if database else 0,
            username=unquote(user) if user else None,
            password=unquote(password) if colon else None,
            tls=parts.scheme == "rediss",
            ttl=ttl,
            timeout=timeout,
        )
    raise InvalidInput("tier", shown, "must be a file:///path or redis://host:port/db URL")


def open_tier(spec: Union[str, TierSpec], namespace: Namespace) -> Tier:
    """The (not yet entered) tier a URL or spec names, for ``namespace``.

    Raises:
        InvalidInput: a URL that names no tier.
        MissingExtra: a Redis tier without the ``redis`` extra (coredis).
    """
    if isinstance(spec, str):
        spec = parse_tier_url(spec)
    if isinstance(spec, DiskTierSpec):
        return DiskTier(spec.directory, namespace, max_bytes=spec.max_bytes)
    return RedisTier(
        namespace,
        host=spec.host,
        port=spec.port,
        db=spec.db,
        username=spec.username,
        password=spec.password,
        tls=spec.tls,
        ttl=spec.ttl,
        timeout=spec.timeout,
    )


def _options(url: str, query: str) -> dict[str, str]:
    try:
        parsed = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise InvalidInput("tier", url, f"malformed options: {exc}") from exc
    repeated = sorted(name for name, values in parsed.items() if len(values) > 1)
    if repeated:
        raise InvalidInput("tier", url, f"option {repeated[0]!r} given more than once")
    return {name: values[0] for name, values in parsed.items()}


def _take(
    url: str, options: dict[str, str], name: str, parse: Callable[[str], Optional[T]], default: Optional[T]
) -> Optional[T]:
    if name not in options:
        return default
    text = options.pop(name)
    value = parse(text)
    if value is None:
        raise InvalidInput("tier", url, f"option {name}={text!r} is not a positive number")
    return value


def _no_more(url: str, options: dict[str, str]) -> None:
    if options:
        raise InvalidInput("tier", url, f"unknown option {sorted(options)[0]!r}")


def _positive_int(text: str) -> Optional[int]:
    return int(text) if text.isdigit() and int(text) > 0 else None


def _positive_seconds(text: str) -> Optional[float]:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 < value < float("inf") else None
