"""Garbage-collector pauses while the runtime serves, with ``freeze_gc`` on and off.

A full collection (generation 2) visits every object the cyclic collector
tracks; every request in flight waits for it (it holds the interpreter).
``RuntimeConfig.freeze_gc`` (on by default) moves what is alive once the
runtime has started -- the model, mlx-lm, the tokenizer and their
libraries -- out of those scans. Two measurements, alternating ``on`` and
``off`` per round, on the built-in model (or ``--model``), in one process:

- ``pause``: a runtime is started, serves a few requests, and a full
  collection is forced (``gc.collect()``) while it runs: how long every
  request in flight would wait for one;
- ``workload``: ``mlxkv run``'s chat workload (4 system prompts of 512
  tokens, 16 two-turn conversations -- ``--requests`` 32 -- 8 in flight, a
  fresh runtime per run):
  generated tokens/s, warm TTFT p95, and the full collections that happened
  on their own during the run (``gc.callbacks``): how many, the longest.

Figures are medians over rounds; ratios are medians of each round's own
ratio (on / off).

    .venv/bin/python scripts/bench_gc.py [--rounds 5] [--requests 32] [--model DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from typing import Any, Optional, Sequence

import anyio

METHODS = {"on": True, "off": False}


class FullCollections:
    """The full collections that start while it is entered (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._started: Optional[float] = None

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc_info: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.pauses.append(time.perf_counter() - self._started)
            self._started = None


async def forced_pause(model: str, freeze: bool) -> float:
    """Seconds a full collection takes while a runtime (just started, a few
    requests served) runs."""
    from mlxkv import CacheRuntime

    async with CacheRuntime(model=model, freeze_gc=freeze) as rt:
        for seed in range(4):
            async with rt.generate([32 + (seed * 7 + i) % 90 for i in range(200)], max_tokens=8) as stream:
                async for _ in stream:
                    pass
        started = time.perf_counter()
        gc.collect()
        return time.perf_counter() - started


async def workload(model: str, freeze: bool, seed: int, requests: int) -> dict[str, Any]:
    from mlxkv.runtime_config import RuntimeConfig
    from mlxkv.workload import WorkloadConfig, run_workload

    with FullCollections() as collections:
        config = WorkloadConfig(runtime=RuntimeConfig(model=model, freeze_gc=freeze), requests=requests, seed=seed)
        report = await run_workload(config)
    return {
        "tokens_per_s": report.throughput_tokens_per_second,
        "ttft_warm_p95_ms": report.ttft_warm_p95_ms,
        "full_collections": len(collections.pauses),
        "longest_collection_ms": max(collections.pauses, default=0.0) * 1e3,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from mlxkv.default_model import ensure_model

    model = args.model or str(ensure_model())
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        order = list(METHODS) if round_ % 2 == 0 else list(METHODS)[::-1]
        for method in order:
            pause = await forced_pause(model, METHODS[method])
            figures = await workload(model, METHODS[method], round_, args.requests)
            runs.append({"method": method, "round": round_, "forced_collection_ms": pause * 1e3, **figures})
            print(
                f"round {round_ + 1}/{args.rounds} {method}: forced full collection {pause * 1e3:.1f} ms, "
                f"{figures['tokens_per_s']:,.1f} tok/s, {figures['full_collections']} full collections "
                f"(longest {figures['longest_collection_ms']:.1f} ms)",
                file=sys.stderr,
            )
    return {"model": model, "runs": runs, "summary": summarize(runs)}


KEYS = ("forced_collection_ms", "tokens_per_s", "ttft_warm_p95_ms", "full_collections", "longest_collection_ms")


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {
        method: {key: statistics.median(r[key] for r in runs if r["method"] == method) for key in KEYS}
        for method in METHODS
    }
    pairs: dict[int, dict[str, dict[str, Any]]] = {}
    for r in runs:
        pairs.setdefault(r["round"], {})[r["method"]] = r
    both = [p for p in pairs.values() if len(p) == len(METHODS)]
    summary["tokens_per_s_ratio"] = statistics.median(p["on"]["tokens_per_s"] / p["off"]["tokens_per_s"] for p in both)
    summary["forced_collection_ratio"] = statistics.median(
        p["off"]["forced_collection_ms"] / p["on"]["forced_collection_ms"] for p in both
    )
    return summary


def table(summary: dict[str, Any], rounds: int) -> str:
    lines = [
        f"garbage-collector pauses, freeze_gc on and off, medians of {rounds} rounds",
        "| freeze_gc | forced full collection | generated tok/s | warm TTFT p95 | full collections in a run (longest) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for method in METHODS:
        m = summary[method]
        lines.append(
            f"| {method} | {m['forced_collection_ms']:.1f} ms | {m['tokens_per_s']:,.1f} | "
            f"{m['ttft_warm_p95_ms']:.1f} ms | {m['full_collections']:g} ({m['longest_collection_ms']:.1f} ms) |"
        )
    lines.append(
        f"on / off: {summary['tokens_per_s_ratio']:.3f}x generated tokens/s; a forced full collection "
        f"{summary['forced_collection_ratio']:.1f}x shorter"
    )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each running both settings (5)")
    parser.add_argument("--model", help="an mlx-lm model directory (default: the built-in model)")
    parser.add_argument("--requests", type=int, default=32, help="requests per workload run (32)")
    parser.add_argument("--json", help="also write the runs and their summary as JSON to FILE")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.requests < 1:
        parser.error("--rounds and --requests must be >= 1")
    results = anyio.run(run, args)
    print(table(results["summary"], args.rounds))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
