"""A model's fingerprint: what it computes with (config and weights), never its path.

Two directories holding the same model have the same fingerprint; any
change of architecture config or of a weight byte changes it. The
fingerprint is SHA-256 over:

- the canonical JSON of ``config.json`` (keys sorted, no whitespace), so that
  reformatting the file changes nothing while any value does;
- for each ``*.safetensors`` file, in name order, its name and the SHA-256
  of its contents (the files mlx-lm and mlx-vlm load; the tokenizer is left
  out: KV depends on token ids, which the chain hash already covers).

Hashing weights reads every byte (seconds for a multi-GB model), so each
file's digest is remembered in a small JSON file (by default
``<cache>/fingerprints.json``) under the file's real path and keyed by its
``(size, mtime_ns, ctime_ns)``. ``ctime`` is part of the key because no user
tool can set it: a file replaced by one of the same size with its mtime
preserved (``cp -p``, ``rsync -t``) still gets rehashed. The cost of that
choice is a needless rehash after a ``chmod`` or a move. The memo file is
written atomically (temporary file, then ``os.replace``), re-read and merged
before each write so concurrent processes lose at most a digest, which is
then recomputed; a memo that cannot be read or written only costs time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional, Union

from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.tiers.cache_dir import default_fingerprint_memo

__all__ = ["file_digest", "model_fingerprint"]

logger = logging.getLogger(__name__)

_MEMO_VERSION = 1
_CHUNK = 1 << 20

PathLike = Union[str, "os.PathLike[str]"]


def model_fingerprint(model_dir: PathLike, *, memo_path: Optional[PathLike] = None) -> str:
    """Fingerprint the model in ``model_dir`` (config and weight contents).

    Args:
        model_dir: a local mlx-lm / mlx-vlm model directory.
        memo_path: where weight digests are remembered; by default
            :func:`~mlxkv.cache.tiers.cache_dir.default_fingerprint_memo`.

    Returns:
        ``"sha256:"`` and 64 hex digits.

    Raises:
        InvalidInput: no such directory, no readable ``config.json`` (or
            one that is not a JSON object), or no ``*.safetensors`` file.
    """
    directory = Path(model_dir)
    if not directory.is_dir():
        raise InvalidInput("model_dir", str(model_dir), "is not a directory")
    config = _canonical_config(directory / "config.json")
    weights = sorted(directory.glob("*.safetensors"), key=lambda path: path.name)
    if not weights:
        raise InvalidInput("model_dir", str(model_dir), "holds no *.safetensors weight file")
    digests = _digests(weights, Path(memo_path) if memo_path is not None else default_fingerprint_memo())
    hasher = hashlib.sha256(b"mlxkv.model-fingerprint.v1\0")
    hasher.update(len(config).to_bytes(8, "little") + config)
    for path, digest in zip(weights, digests):
        hasher.update(path.name.encode() + b"\0" + digest.encode())
    return "sha256:" + hasher.hexdigest()


def file_digest(path: PathLike) -> str:
    """SHA-256 of a file's contents, read in 1 MiB chunks, as 64 hex digits."""
    hasher = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while True:
            n = file.readinto(buffer)
            if not n:
                break
            hasher.update(view[:n])
    return hasher.hexdigest()


def _canonical_config(path: Path) -> bytes:
    try:
        config = json.loads(path.read_bytes())
    except OSError as exc:
        raise InvalidInput("model_dir", str(path.parent), f"config.json unreadable: {exc}") from exc
    except ValueError as exc:
        raise InvalidInput("model_dir", str(path.parent), f"config.json is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise InvalidInput("model_dir", str(path.parent), "config.json is not a JSON object")
    return json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _stamp(stat: os.stat_result) -> list[int]:
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def _digests(paths: Iterable[Path], memo_path: Path) -> list[str]:
    memo = _read_memo(memo_path)
    fresh: dict[str, list[Any]] = {}
    digests = []
    for path in paths:
        real = os.path.realpath(path)
        stamp = _stamp(os.stat(real))
        known = memo.get(real)
        if isinstance(known, list) and len(known) == 4 and known[:3] == stamp:
            digests.append(known[3])
            continue
        digest = file_digest(real)
        # The file may have changed while it was read: remember the digest
        # only if its stamp held, so a torn read is recomputed next time.
        if _stamp(os.stat(real)) == stamp:
            fresh[real] = [*stamp, digest]
        digests.append(digest)
    if fresh:
        _write_memo(memo_path, fresh)
    return digests


def _read_memo(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _MEMO_VERSION:
        return {}
    files = data.get("files")
    return files if isinstance(files, dict) else {}


def _write_memo(path: Path, fresh: dict[str, list[Any]]) -> None:
    # Merge with what other processes wrote since we read it; forget files
    # that are gone, so the memo does not grow with every model ever seen.
    files = {
        name: entry for name, entry in _read_memo(path).items() if os.path.exists(name)
    }
    files.update(fresh)
    text = json.dumps({"version": _MEMO_VERSION, "files": files}, sort_keys=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as file:
                file.write(text)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as exc:
        logger.debug("fingerprint memo %s not written: %s", path, exc)
