"""Where the tiers keep their files by default: under mlxkv's cache directory.

The one rule for mlxkv's cache directory: ``$MLXKV_CACHE_DIR``, else
``$XDG_CACHE_HOME/mlxkv``, else ``~/.cache/mlxkv``. The runtime writes its
built-in models there too (``mlxkv.default_model.default_cache_dir`` calls
this one).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_cache_dir", "default_fingerprint_memo", "default_kv_dir"]


def default_cache_dir() -> Path:
    """mlxkv's cache directory: ``$MLXKV_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/mlxkv``, else ``~/.cache/mlxkv``."""
    env = os.environ.get("MLXKV_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "mlxkv" if xdg else Path.home() / ".cache" / "mlxkv"


def default_kv_dir() -> Path:
    """The disk tier's directory when a ``file://`` URL names none: ``<cache>/kv``."""
    return default_cache_dir() / "kv"


def default_fingerprint_memo() -> Path:
    """The file that remembers weight-file digests: ``<cache>/fingerprints.json``."""
    return default_cache_dir() / "fingerprints.json"
