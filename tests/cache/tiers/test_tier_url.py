"""Tier URLs: what each names, and a clear error for anything else."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tier_blocks import kv_blocks, namespace_of

from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.tiers import (
    DiskTier,
    DiskTierSpec,
    MissingExtra,
    RedisTier,
    RedisTierSpec,
    default_kv_dir,
    open_tier,
    parse_tier_url,
    redact_url,
)


class TestParseTierUrl:
    @pytest.mark.parametrize(
        ("url", "spec"),
        [
            ("file:///var/kv", DiskTierSpec(Path("/var/kv"))),
            ("file://localhost/var/kv?max_bytes=1000", DiskTierSpec(Path("/var/kv"), max_bytes=1000)),
            ("file:///a%20b", DiskTierSpec(Path("/a b"))),
            ("redis://cache:6380/2", RedisTierSpec(host="cache", port=6380, db=2)),
            ("redis://localhost", RedisTierSpec()),
            ("redis://u:p%40ss@h/1?ttl=60&timeout=0.1", RedisTierSpec(host="h", db=1, username="u", password="p@ss", ttl=60.0, timeout=0.1)),
            ("rediss://h:7000", RedisTierSpec(host="h", port=7000, tls=True)),
        ],
    )
    def test_valid_urls(self, url, spec):
        """Each form parses into its spec, with defaults for what it leaves out."""
        assert parse_tier_url(url) == spec

    def test_file_without_a_path_is_the_default_directory(self, monkeypatch, tmp_path):
        """``file://`` alone means ``<cache>/kv``."""
        monkeypatch.setenv("MLXKV_CACHE_DIR", str(tmp_path))
        assert parse_tier_url("file://").directory == default_kv_dir() == tmp_path / "kv"

    @pytest.mark.parametrize(
        ("url", "reason"),
        [
            ("s3://bucket/kv", "must be a file:///path or redis://"),
            ("/var/kv", "must be a file:///path or redis://"),
            ("file://otherhost/kv", "local directory"),
            ("file:relative/kv", "absolute path"),
            ("file:///kv?max_bytes=lots", "max_bytes='lots'"),
            ("file:///kv?max_bytes=0", "max_bytes='0'"),
            ("file:///kv?ttl=5", "unknown option 'ttl'"),
            ("redis://h:port", "not a valid URL"),
            ("redis://h/db1", "database must be a number"),
            ("redis://h?ttl=-1", "ttl='-1'"),
            ("redis://h?ttl=1&ttl=2", "more than once"),
            ("redis://h?colour=blue", "unknown option 'colour'"),
        ],
    )
    def test_invalid_urls_name_the_problem(self, url, reason):
        """Anything else raises InvalidInput naming the URL and what is wrong."""
        with pytest.raises(InvalidInput, match=reason.replace("?", r"\?")) as raised:
            parse_tier_url(url)
        assert raised.value.argument == "tier" and raised.value.value == url


class TestRedaction:
    """A tier URL's password never reaches text: errors, names, reports."""

    @pytest.mark.parametrize(
        ("url", "shown"),
        [
            ("redis://user:pass@host", "redis://user:***@host"),
            ("redis://:pass@host:6379/0", "redis://:***@host:6379/0"),
            ("rediss://user:pass@host:6380/1?ttl=5", "rediss://user:***@host:6380/1?ttl=5"),
            ("redis://user:pass@[::1]:6379/0", "redis://user:***@[::1]:6379/0"),
            ("redis://u:p%40ss@h", "redis://u:***@h"),
            ("redis://u:p@s/s?w#rd@host/0", "redis://u:***@host/0"),
            ("REDIS://u:pass@host", "REDIS://u:***@host"),
            ("redis:u:pass@host", "redis:u:***@host"),
            ("ftp://u:pass@host/x", "ftp://u:***@host/x"),
            ("file://u:pass@/kv", "file://u:***@/kv"),
            ("redis://user@host", "redis://user@host"),
            ("redis://host:6379/0", "redis://host:6379/0"),
            ("redis://[::1]:6379", "redis://[::1]:6379"),
            ("file:///var/k@v:1", "file:///var/k@v:1"),
            ("not a url", "not a url"),
        ],
    )
    def test_the_password_is_replaced_and_the_rest_kept(self, url, shown):
        """Every form of URL shows with its password as ``***`` (the user name
        kept), and a URL without one as it is."""
        assert redact_url(url) == shown

    @pytest.mark.parametrize(
        "url",
        [
            "redis://u:s3cret@h/db1",
            "redis://u:s3cret@h?colour=blue",
            "redis://u:s3cret@h?ttl=-1",
            "redis://u:s3cret@h:port",
            "redis://u:s3cret@[::1/0",
            "redis:u:s3cret@h",
            "ftp://u:s3cret@h/x",
            "file://u:s3cret@/kv",
            "file://u:s3cret@localhost/kv",
        ],
    )
    def test_errors_never_show_the_password(self, url):
        """A malformed URL's error names it, with its password redacted."""
        with pytest.raises(InvalidInput) as raised:
            parse_tier_url(url)
        assert "s3cret" not in str(raised.value) and "s3cret" not in repr(raised.value.args)
        assert raised.value.value == redact_url(url)

    def test_a_password_with_reserved_characters_is_the_password(self):
        """A password holding ``/``, ``?``, ``#`` or ``@`` unescaped runs to the
        last ``@``: it is the password, not a host, a path or an option."""
        spec = parse_tier_url("redis://u:p/s?w#r@d@h:7000/2")
        assert spec == RedisTierSpec(host="h", port=7000, db=2, username="u", password="p/s?w#r@d")
        assert "p/s" not in repr(spec)

    def test_tier_names_carry_no_credentials(self):
        """A Redis tier's name (its statistics' name, a metric label) is its
        server and database only; an IPv6 host is bracketed."""
        pytest.importorskip("coredis")
        namespace = namespace_of(kv_blocks(1)[0])
        assert open_tier("redis://alice:s3cret@[::1]:7000/3", namespace).name == "redis://[::1]:7000/3"
        tier = open_tier("rediss://:s3cret@cache?ttl=9", namespace)
        assert tier.name == "rediss://cache:6379/0" and tier.statistics().name == tier.name


class TestOpenTier:
    def test_opens_each_kind(self, tmp_path):
        """A file URL opens a DiskTier, a redis URL a RedisTier, with their options."""
        namespace = namespace_of(kv_blocks(1)[0])
        disk = open_tier(f"file://{tmp_path}?max_bytes=4096", namespace)
        assert isinstance(disk, DiskTier) and disk.max_bytes == 4096 and disk.directory == tmp_path
        pytest.importorskip("coredis")
        redis = open_tier("redis://h:7000/3?ttl=9", namespace)
        assert isinstance(redis, RedisTier) and redis.name == "redis://h:7000/3" and redis.ttl == 9

    def test_redis_without_the_extra_names_it(self, monkeypatch):
        """Without coredis, a redis:// tier says which extra to install."""
        monkeypatch.setitem(sys.modules, "coredis", None)
        with pytest.raises(MissingExtra, match=r"pip install 'mlxkv\[redis\]'") as raised:
            open_tier("redis://localhost", namespace_of(kv_blocks(1)[0]))
        assert raised.value.extra == "redis" and isinstance(raised.value, ImportError)

    def test_plain_install_imports_without_coredis(self, run_optimized):
        """The tiers package imports, and disk tiers open, with coredis absent."""
        run_optimized(
            "import sys; sys.modules['coredis'] = None\n"
            "import mlxkv.cache.tiers as tiers\n"
            "assert 'coredis' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        )
