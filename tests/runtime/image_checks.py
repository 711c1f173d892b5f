"""Helpers of the image tests: which threads touch pixels (nothing heavy may run on
the event loop), and a huge picture in a small file."""

from __future__ import annotations

import threading
import zlib
from typing import Any

import pytest


def spy_on_pixel_work(monkeypatch: pytest.MonkeyPatch) -> dict[str, set[int]]:
    """Record, by operation, the ids of the threads that decode, convert or serialize
    pixels (PIL), read an encoded image, hash pixels, or hand over or free decoded
    pictures (mlxkv.images): the dict fills as they run, until ``monkeypatch`` undoes
    the spies."""
    from PIL import Image, ImageFile

    import mlxkv.images as images

    seen: dict[str, set[int]] = {}
    targets = [
        (ImageFile.ImageFile, "load"),
        (Image.Image, "convert"),
        (Image.Image, "tobytes"),
        (Image, "fromarray"),
        (images, "_read"),  # a file, a data URL or bytes, hashed next
        (images, "_pixel_key"),
        (images.KeyedImages, "take_pictures"),  # decodes, and the pictures die on its thread
        (images.KeyedImages, "release"),  # frees pictures
    ]
    def spy(owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            seen.setdefault(name, set()).add(threading.get_ident())
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for owner, name in targets:
        spy(owner, name)
    return seen


def on_this_thread(seen: dict[str, set[int]]) -> set[str]:
    """The operations in ``seen`` that ran on the calling thread (the event loop's)."""
    here = threading.get_ident()
    return {name for name, idents in seen.items() if here in idents}


def blank_png(width: int, height: int) -> bytes:
    """A complete, valid 1-bit PNG of ``width`` x ``height`` zeros (small however large)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([1, 0, 0, 0, 0])
    row = bytes(1 + (width + 7) // 8)  # filter byte 0, then the row's bits
    compressor = zlib.compressobj(9)
    body = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")
