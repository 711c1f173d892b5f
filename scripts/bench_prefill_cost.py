"""Does a prefill's time follow the scheduler's cost (``chunk_cost``)? On plain mlx-lm.

Times one model call for a few prefill shapes on the built-in model (median
of 5 after 2 untimed) and prints each one's milliseconds per cost unit and
per token. The scheduler's budget counts cost, so the per-unit figures
should agree where the per-token ones do not.

    .venv/bin/python scripts/bench_prefill_cost.py
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

#: (label, tokens cached before, new tokens per row, rows)
SHAPES = [
    ("256 cold", 0, 256, 1),
    ("512 cold", 0, 512, 1),
    ("256 after 1,024", 1024, 256, 1),
    ("8 x 64 after 2,048", 2048, 64, 8),
]


def _prefilled(model: Any, tokens: int, rows: int) -> list[Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for start in range(0, tokens, 512):
        chunk = [5 + i % 200 for i in range(start, min(tokens, start + 512))]
        model(mx.array([chunk] * rows), cache=cache)
    mx.eval([layer.state for layer in cache] if tokens else [])
    return cache


def _time(model: Any, cached: int, new: int, rows: int) -> float:
    import mlx.core as mx

    base = _prefilled(model, cached, rows)
    times = []
    for _ in range(7):
        cache = copy.deepcopy(base)
        started = time.perf_counter()
        mx.eval(model(mx.array([[7 + i % 100 for i in range(new)]] * rows), cache=cache))
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    from mlx_lm import load

    from mlxkv.actors.scheduler import chunk_cost
    from mlxkv.default_model import ensure_model
    from mlxkv.runtime import CacheRuntime

    path = str(ensure_model())
    model, _ = load(path)
    import anyio

    async def unit() -> int:
        async with CacheRuntime(model=path) as rt:
            assert rt.model_info is not None
            return rt.model_info.context_unit

    context_unit = anyio.run(unit)
    print(f"context unit {context_unit}")
    print("| shape | ms | cost | us per unit | us per token |")
    print("| --- | --- | --- | --- | --- |")
    for label, cached, new, rows in SHAPES:
        ms = _time(model, cached, new, rows)
        cost = rows * chunk_cost(cached, cached + new, context_unit)
        print(f"| {label} | {ms:.1f} | {cost:,.0f} | {ms / cost * 1e3:.0f} | {ms / (rows * new) * 1e3:.0f} |")


if __name__ == "__main__":
    main()
