"""How long the event loop stalls while a request takes a large image.

A ticker task sleeps 1 ms at a time and records the longest gap between its
wake-ups while one call takes a 6000x6000 picture; the stall is that gap
less the 1 ms asked for. A stall also counts time the loop waits for the GIL
or a core (worker threads decoding, other processes), so beside it is the
CPU time the event loop's thread itself spent during the same call made
again without the ticker (``time.thread_time``): the work done on the loop,
the runtime's own per-request work included. Calls, each on the built-in
tiny Qwen2-VL:

- ``generate``: ``rt.generate(prompt, images=[picture], max_tokens=1)`` run
  to the end (keying, image-cache lookup, decoding, processing; the vision
  encoder and the model run on the compute thread);
- ``fetch``: ``rt.fetch(id, tokens, images=[picture])`` and its release
  (keying and lookups only).

Forms of the picture: a PNG's ``path``, its ``bytes``, ``PIL opened`` (what
``Image.open`` returns: nothing decoded yet) and ``PIL decoded`` (pixels in
memory). Every round uses a fresh cache salt, so no image or block is
reused, and a fresh PIL object. Figures are medians over rounds, on asyncio
and on trio; a call that refuses the form shows the error's type.

    .venv/bin/python scripts/bench_image_stall.py [--rounds 5] [--size 6000] [--json FILE]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import tempfile
import time
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import anyio  # noqa: E402

TICK = 0.001
FORMS = ("path", "bytes", "PIL opened", "PIL decoded")
CALLS = ("generate", "fetch")


def _picture(folder: str, size: int) -> str:
    """A photo-like PNG (smooth gradients, some noise) of ``size`` x ``size``."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:size, 0:size]
    rng = np.random.default_rng(0)
    rgb = np.stack([x * 255 // size, y * 255 // size, (x + y) * 127 // size], axis=-1)
    rgb = (rgb + rng.integers(0, 8, rgb.shape)).clip(0, 255).astype(np.uint8)
    path = os.path.join(folder, f"picture-{size}.png")
    Image.fromarray(rgb).save(path, compress_level=1)
    return path


def _form(form: str, path: str, data: bytes) -> Any:
    from PIL import Image

    if form == "path":
        return path
    if form == "bytes":
        return data
    picture = Image.open(io.BytesIO(data))
    if form == "PIL decoded":
        picture.load()
    return picture


async def _longest_stall(call: Callable[[], Any]) -> tuple[float, float, str]:
    """(longest stall, the call's wall time -- in s --, its outcome) of one call."""
    longest = 0.0
    done = False

    async def tick() -> None:
        nonlocal longest
        while not done:
            before = time.perf_counter()
            await anyio.sleep(TICK)
            longest = max(longest, time.perf_counter() - before - TICK)

    outcome = "ok"
    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        await anyio.sleep(0.02)  # the ticker is running
        longest = 0.0
        started = time.perf_counter()
        try:
            await call()
        except Exception as error:  # noqa: BLE001  (a refused form is a result)
            outcome = type(error).__name__
        elapsed = time.perf_counter() - started
        done = True
    return longest, elapsed, outcome


async def _loop_cpu(call: Callable[[], Any]) -> float:
    """The CPU time (s) of the event loop's thread during one call, nothing else running."""
    cpu = time.thread_time()
    try:
        await call()
    except Exception:  # noqa: BLE001, S110  (refusals are reported by the stall pass)
        pass
    return time.thread_time() - cpu


async def _measure(model: str, path: str, rounds: int) -> dict[str, dict[str, Any]]:
    from mlxkv import CacheRuntime

    data = open(path, "rb").read()
    results: dict[str, dict[str, Any]] = {}
    async with CacheRuntime(model=model, block_size=16) as rt:
        tokens = list(await rt.tokenize("<|vision_start|><|image_pad|><|vision_end|>What is this?"))
        # Warm-up: the processor and the encoder's first call are not measured.
        async for _ in rt.generate("Warm up.", images=[_form("bytes", path, data)], max_tokens=1):
            pass
        for call in CALLS:
            for form in FORMS:
                stalls, cpus, times, outcomes = [], [], [], set()
                for k in range(2 * rounds):  # even: with the ticker; odd: loop CPU alone
                    image = _form(form, path, data)
                    salt = f"{call}-{form}-{k}"

                    async def one() -> None:
                        if call == "generate":
                            async for _ in rt.generate(
                                "What is this?", images=[image], max_tokens=1, cache_salt=salt
                            ):
                                pass
                        else:
                            await rt.fetch(salt, tokens, images=[image], cache_salt=salt)
                            await rt.release(salt)  # a refused fetch holds nothing

                    if k % 2:
                        cpus.append(await _loop_cpu(one))
                        continue
                    stall, elapsed, outcome = await _longest_stall(one)
                    stalls.append(stall)
                    times.append(elapsed)
                    outcomes.add(outcome)
                results[f"{call} {form}"] = {
                    "stall_ms": round(statistics.median(stalls) * 1e3, 1),
                    "max_stall_ms": round(max(stalls) * 1e3, 1),
                    "loop_cpu_ms": round(statistics.median(cpus) * 1e3, 1),
                    "call_ms": round(statistics.median(times) * 1e3, 1),
                    "outcome": "/".join(sorted(outcomes)),
                }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", type=int, default=6000, help="picture side in pixels")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    from mlxkv.default_vlm import ensure_vlm

    model = str(ensure_vlm())
    out: dict[str, Any] = {"size": args.size, "rounds": args.rounds}
    with tempfile.TemporaryDirectory() as folder:
        path = _picture(folder, args.size)
        out["file_bytes"] = os.path.getsize(path)
        for backend in ("asyncio", "trio"):
            out[backend] = anyio.run(_measure, model, path, args.rounds, backend=backend)
    print(f"{args.size}x{args.size} PNG ({out['file_bytes'] / 1e6:.1f} MB), median of {args.rounds} rounds")
    print(f"{'':<22}{'longest stall':>22}{'loop CPU':>22}{'call':>22}")
    print(f"{'call and form':<22}" + f"{'asyncio':>11}{'trio':>11}" * 3 + "  outcome")
    for name in out["asyncio"]:
        a, t = out["asyncio"][name], out["trio"][name]
        outcome = a["outcome"] if a["outcome"] == t["outcome"] else f"{a['outcome']} | {t['outcome']}"
        cells = "".join(f"{a[k]:>8.1f} ms{t[k]:>8.1f} ms" for k in ("stall_ms", "loop_cpu_ms", "call_ms"))
        print(f"{name:<22}{cells}  {outcome}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
