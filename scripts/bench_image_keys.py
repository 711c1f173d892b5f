"""What keying an image by its decoded pixels costs, against keying it by its file.

For photo-like pictures (smooth gradients and some noise) from the built-in
model's 64 px up to 4000 px, saved as PNG and as JPEG (quality 90), the
median time of each way of keying one image, over repeated runs:

- ``file digest``: the file's bytes hashed (``mlxkv.cache.mllm.images_digest``
  of the path: how the runtime keyed a path before it keyed pixels);
- ``pixels, new``: :func:`mlxkv.images.key_images` of the path with nothing
  remembered: read, hash the bytes, open, decode, convert to RGB, hash the
  pixels;
- ``pixels, remembered``: the same path again: read, hash the bytes, find
  the pixel key in the runtime's memo (a repeated file);
- ``PIL image``: ``key_images`` of the picture already decoded (convert to
  RGB, hash the pixels), and ``uint8 array`` of its pixels as an array;
- ``decode``: ``Image.open(path).convert("RGB")`` alone, which generation
  pays anyway on an image-cache miss, to feed the processor.

Every ``key_images`` call is awaited on an asyncio loop, worker-thread hops
included, as the runtime makes it.

    .venv/bin/python scripts/bench_image_keys.py [--runs 9] [--sizes 64,256,1024,2048,4000] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any, Awaitable, Callable

import anyio

COLUMNS = ("file digest", "pixels, new", "pixels, remembered", "PIL image", "uint8 array", "decode")


def _pixels(size: int) -> Any:
    import numpy as np

    y, x = np.mgrid[0:size, 0:size]
    rng = np.random.default_rng(size)
    rgb = np.stack([x * 255 // size, y * 255 // size, (x + y) * 127 // size], axis=-1)
    return (rgb + rng.integers(0, 8, rgb.shape)).clip(0, 255).astype(np.uint8)


async def _median_ms(runs: int, call: Callable[[], Awaitable[Any]]) -> float:
    await call()  # warm: imports, first allocation
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        await call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


async def _measure(folder: str, sizes: list[int], runs: int) -> dict[str, dict[str, float]]:
    import numpy as np
    from PIL import Image

    from mlxkv.cache.mllm import images_digest
    from mlxkv.images import PixelMemo, key_images

    results: dict[str, dict[str, float]] = {}
    for size in sizes:
        pixels = _pixels(size)
        for fmt, suffix, options in (("PNG", "png", {}), ("JPEG", "jpg", {"quality": 90})):
            path = os.path.join(folder, f"picture-{size}.{suffix}")
            Image.fromarray(pixels).save(path, format=fmt, **options)
            decoded = Image.open(path).convert("RGB")
            array = np.asarray(decoded)
            warm = PixelMemo()
            await key_images([path], warm, for_model=True)

            async def file_digest() -> Any:
                return images_digest([path])

            async def new() -> Any:
                return await key_images([path], PixelMemo(), for_model=True)

            async def remembered() -> Any:
                return await key_images([path], warm, for_model=True)

            async def pil() -> Any:
                return await key_images([decoded], PixelMemo(), for_model=True)

            async def uint8() -> Any:
                return await key_images([array], PixelMemo(), for_model=True)

            async def decode() -> Any:
                return Image.open(path).convert("RGB")

            calls = (file_digest, new, remembered, pil, uint8, decode)
            row = {name: round(await _median_ms(runs, call), 3) for name, call in zip(COLUMNS, calls)}
            row["file_bytes"] = os.path.getsize(path)
            # Every form of the picture keys alike.
            keys = {(await call()).digest for call in (new, remembered, pil, uint8)}
            assert len(keys) == 1, f"{size} {fmt}: forms key differently"
            results[f"{size} {fmt}"] = row
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--sizes", default="64,256,1024,2048,4000", help="picture sides in pixels")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        results = anyio.run(_measure, folder, sizes, args.runs)
    print(f"median ms of {args.runs} runs per cell")
    print(f"{'picture':<12}{'file':>10}" + "".join(f"{c:>20}" for c in COLUMNS))
    for name, row in results.items():
        print(f"{name:<12}{row['file_bytes'] / 1e6:>8.2f}MB" + "".join(f"{row[c]:>20.3f}" for c in COLUMNS))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"runs": args.runs, "results": results}, fh, indent=2)


if __name__ == "__main__":
    main()
