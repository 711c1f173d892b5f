"""In-flight prefix sharing: N requests with a 2,048-token common prefix, nothing cached.

Eight requests share a 2,048-token prefix and add 64 tokens each; they arrive
all together, or 50 ms apart. Measured on the built-in model, side by side in
one process, rounds alternating:

- ``sharing``: ``CacheRuntime`` as it is: a request whose prefix another one
  is computing waits for those blocks as they are published;
- ``no sharing``: the same runtime with ``share_in_flight=False`` and
  ``keep_caches=False``: every request computes whatever is not cached
  when it arrives. (With the last cache kept, a request that starts after
  another one finished takes that one's KV: with one request's prefill a
  plan, each of the eight requests, generating one token, finished before
  the next started and the prefix was computed once, "no sharing" or not.)
- ``ideal``: one prefill of the prefix and one of each suffix, back to back
  on one thread (plain mlx-lm, timed once per round); request ``i`` gets its
  first token when the prefix and the suffixes of requests ``0..i`` are done
  (or, if it arrives later, when its own suffix is), measured from its
  arrival.

Every round uses a fresh ``cache_salt``, so nothing is cached when it starts.
The table shows medians over rounds of the mean and p95 time to first token,
and the prompt tokens the model computed.

    .venv/bin/python scripts/bench_sharing.py [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import anyio

N, PREFIX, OWN, GAP = 8, 2048, 64, 0.05


def _prefix() -> list[int]:
    return [32 + (i * 37 + (i // 11) ** 2) % 95 for i in range(PREFIX)]


def _own(i: int) -> list[int]:
    return [32 + (i * 53 + j * 17) % 95 for j in range(OWN)]


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


class Ideal:
    """The lower bound: prefix once, then each suffix, on plain mlx-lm."""

    def __init__(self, path: str) -> None:
        from mlx_lm import load

        self.model, _ = load(path)

    def times(self) -> tuple[float, float]:
        """Seconds to prefill the prefix (cold) and one suffix (on the prefix)."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

        cache = make_prompt_cache(self.model)
        prefix = _prefix()
        started = time.perf_counter()
        for start in range(0, PREFIX, 256):
            self.model(mx.array(prefix[start : start + 256])[None], cache=cache)
            mx.eval([c.state for c in cache])
        prefix_time = time.perf_counter() - started
        suffixes = []
        for i in range(3):
            started = time.perf_counter()
            own = _own(i)
            self.model(mx.array(own[:-1])[None], cache=cache)
            logits = self.model(mx.array(own[-1:])[None], cache=cache)
            mx.eval(mx.argmax(logits[0, -1]))
            suffixes.append(time.perf_counter() - started)
            trim_prompt_cache(cache, OWN)
        return prefix_time, statistics.median(suffixes)

    @staticmethod
    def ttfts(prefix_time: float, suffix_time: float, gap: float) -> list[float]:
        done = prefix_time
        out = []
        for i in range(N):
            arrival = i * gap
            done = max(done, arrival) + suffix_time
            out.append(done - arrival)
        return out


async def _round(rt: Any, salt: str, gap: float) -> tuple[list[float], int]:
    from mlxkv import GenerationReport

    before = (await rt.stats()).compute.num_prefill_tokens
    ttfts: list[float] = [0.0] * N

    async def one(i: int) -> None:
        await anyio.sleep(i * gap)
        async with rt.generate(_prefix() + _own(i), max_tokens=1, cache_salt=salt) as stream:
            async for record in stream:
                if isinstance(record, GenerationReport):
                    ttfts[i] = record.time_to_first_token

    async with anyio.create_task_group() as tg:
        for i in range(N):
            tg.start_soon(one, i)
    computed = (await rt.stats()).compute.num_prefill_tokens - before
    return ttfts, computed


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from mlxkv import CacheRuntime
    from mlxkv.default_model import ensure_model

    path = args.model or str(ensure_model())
    ideal = Ideal(path)
    results: dict[str, Any] = {}
    async with CacheRuntime(model=path, block_size=64, max_blocks=2048) as sharing, CacheRuntime(
        model=path, block_size=64, max_blocks=2048, share_in_flight=False, keep_caches=False
    ) as alone:
        for label, gap in (("together", 0.0), ("50 ms apart", GAP)):
            samples: dict[str, list[tuple[list[float], int]]] = {"sharing": [], "no sharing": [], "ideal": []}
            for round_ in range(args.rounds):
                order = ["sharing", "no sharing", "ideal"]
                order = order[round_ % 3 :] + order[: round_ % 3]
                for method in order:
                    if method == "ideal":
                        prefix_time, suffix_time = ideal.times()
                        samples[method].append((Ideal.ttfts(prefix_time, suffix_time, gap), PREFIX + N * OWN))
                    else:
                        rt = sharing if method == "sharing" else alone
                        samples[method].append(await _round(rt, f"{label}-{method}-{round_}", gap))
            row = {}
            for method, runs in samples.items():
                row[method] = {
                    "mean_ttft_ms": statistics.median(statistics.mean(t) for t, _ in runs) * 1e3,
                    "p95_ttft_ms": statistics.median(_p95(t) for t, _ in runs) * 1e3,
                    "prefill_tokens": statistics.median(c for _, c in runs),
                }
            results[label] = row
    return results


def _table(results: dict[str, Any]) -> str:
    lines = [
        "| arrivals | method | mean TTFT | p95 TTFT | prompt tokens computed | mean TTFT / ideal |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for label, row in results.items():
        ideal = row["ideal"]["mean_ttft_ms"]
        for method, figures in row.items():
            lines.append(
                f"| {label} | {method} | {figures['mean_ttft_ms']:.0f} ms | {figures['p95_ttft_ms']:.0f} ms |"
                f" {figures['prefill_tokens']:,.0f} | {figures['mean_ttft_ms'] / ideal:.2f}x |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds per arrival pattern (5)")
    parser.add_argument("--model", help="an mlx-lm model directory (default: the built-in model)")
    parser.add_argument("--json", help="also write the results as JSON to FILE")
    args = parser.parse_args()
    results = anyio.run(main_async, args)
    print(_table(results))
    for label, row in results.items():
        gain = row["no sharing"]["mean_ttft_ms"] / row["sharing"]["mean_ttft_ms"]
        print(f"{label}: sharing cuts mean TTFT {gain:.1f}x against no sharing")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
