"""Benchmark the actor runtime: message cost, and fetch/release throughput
through ``CacheRuntime`` versus calling the synchronous classes directly.

Rows:

* Actor messages: one ``ask`` round trip (a single caller, so pure latency),
  ``tell`` pipelined by one caller, and ``ask`` from 64 concurrent callers
  (amortized cost per message), on asyncio and trio.
* Fetch + release throughput: 32 concurrent clients, each repeatedly
  starting a request whose prompt is a cached prefix plus 64 fresh tokens and
  then releasing it. Through ``CacheRuntime`` (asyncio, trio), and by calling
  ``BlockAwarePrefixCache`` + ``PagedCacheManager`` directly from the same
  kind of event loop (32 tasks, yielding between the two calls): mlxkv's seed
  API and vllm-mlx 0.6.0's, each in its own interpreter (vllm-mlx needs
  ``mlx-lm<0.32``; see ``scripts/bench_cache.py`` for the set-up).

vllm-mlx's ``release_cache`` does not release a request that only fetched (it
releases only requests that stored), so the vllm column also calls
``paged_cache.delete_block_table`` -- otherwise every fetch leaks its
references.

Usage::

    .venv/bin/python scripts/bench_runtime.py            # full table
    .venv/bin/python scripts/bench_runtime.py --quick    # fewer requests
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VLLM_PYTHON = REPO / ".bench" / "vllm" / "bin" / "python"
BLOCK_SIZE = 64
CLIENTS = 32
SUFFIX = 64


def cached_prefix(prefix_tokens: int) -> list[int]:
    """The prompt prefix every request shares (stored once, up front)."""
    return [(i * 7919) % 50_000 + 1 for i in range(prefix_tokens)]


def fresh_suffix(serial: int) -> list[int]:
    """64 tokens of request ``serial`` after the shared prefix: never cached."""
    return [(serial * 131 + i * 17) % 50_000 + 1 for i in range(SUFFIX)]


def kv_state(num_tokens: int) -> list[dict]:
    """A tiny one-layer KV state in the form both seed APIs accept from schedulers."""
    import mlx.core as mx

    k = mx.zeros((1, 1, num_tokens, 1), dtype=mx.float16)
    mx.eval(k)
    return [{"state": (k, k), "meta_state": (str(num_tokens),), "class_name": "KVCache"}]


# --------------------------------------------------------------------------
# Direct calls to the seed classes (run as --impl mlxkv|vllm)
# --------------------------------------------------------------------------


def direct_throughput(impl: str, prefix_tokens: int, requests: int) -> float:
    """Requests per second of fetch_cache + release_cache from 32 tasks of one loop."""
    import anyio

    if impl == "vllm":
        from vllm_mlx.paged_cache import PagedCacheManager
        from vllm_mlx.prefix_cache import BlockAwarePrefixCache
    else:
        from mlxkv.cache.block_prefix import BlockAwarePrefixCache
        from mlxkv.cache.paged import PagedCacheManager

    prefix = cached_prefix(prefix_tokens)
    paged = PagedCacheManager(block_size=BLOCK_SIZE, max_blocks=prefix_tokens // BLOCK_SIZE * 4 + 256)
    cache = BlockAwarePrefixCache(None, paged)
    cache.store_cache("seed", prefix, kv_state(prefix_tokens))
    serials = iter(range(10**9))
    expected = prefix_tokens // BLOCK_SIZE * BLOCK_SIZE

    async def client(quota: int) -> None:
        for _ in range(quota):
            serial = next(serials)
            request_id = f"r{serial}"
            table, remaining = cache.fetch_cache(request_id, prefix + fresh_suffix(serial))
            assert table is not None and table.num_tokens >= expected, "expected a hit"
            await anyio.sleep(0)
            cache.release_cache(request_id)
            if impl == "vllm" and paged.get_block_table(request_id) is not None:
                paged.delete_block_table(request_id)  # release_cache leaks fetch-only requests
            await anyio.sleep(0)

    async def main() -> float:
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(CLIENTS):
                tg.start_soon(client, requests // CLIENTS)
        return (requests // CLIENTS * CLIENTS) / (time.perf_counter() - start)

    return anyio.run(main)


def run_direct(impl: str, sizes: list[int], requests: int, repeat: int) -> dict[str, float]:
    return {
        f"fetch+release ({n} cached tokens)": statistics.median(
            direct_throughput(impl, n, requests) for _ in range(repeat)
        )
        for n in sizes
    }


# --------------------------------------------------------------------------
# The runtime (this interpreter)
# --------------------------------------------------------------------------


def actor_costs(backend: str, messages: int) -> dict[str, float]:
    """Microseconds per message of an echo actor."""
    import anyio
    import attrs

    from mlxkv.actors.actor import Actor, Ask, Tell

    @attrs.frozen(kw_only=True)
    class Ping(Ask[int]):
        pass

    @attrs.frozen(kw_only=True)
    class Note(Tell):
        pass

    class EchoActor(Actor):
        name = "echo"

        def handle(self, message: Any) -> Any:
            return 1 if isinstance(message, Ping) else None

    async def main() -> dict[str, float]:
        actor = EchoActor(mailbox_size=64)
        ref = actor.ref()
        actor.close()
        rows = {}
        async with anyio.create_task_group() as tg:
            await tg.start(actor.run)
            start = time.perf_counter()
            for _ in range(messages):
                await ref.ask(Ping)
            rows["ask round trip, 1 caller (us)"] = (time.perf_counter() - start) / messages * 1e6
            start = time.perf_counter()
            for _ in range(messages):
                await ref.tell(Note())
            await ref.ask(Ping)
            rows["tell, pipelined by 1 caller (us)"] = (time.perf_counter() - start) / messages * 1e6

            async def caller(quota: int) -> None:
                for _ in range(quota):
                    await ref.ask(Ping)

            start = time.perf_counter()
            async with anyio.create_task_group() as callers:
                for _ in range(64):
                    callers.start_soon(caller, messages // 64)
            rows["ask, 64 concurrent callers (us/msg)"] = (
                (time.perf_counter() - start) / (messages // 64 * 64) * 1e6
            )
            ref.close()
        return rows

    return anyio.run(main, backend=backend)


def runtime_throughput(backend: str, prefix_tokens: int, requests: int) -> float:
    """Requests per second of rt.fetch + rt.release from 32 concurrent clients."""
    import anyio

    from mlxkv import CacheRuntime

    prefix = cached_prefix(prefix_tokens)
    expected = prefix_tokens // BLOCK_SIZE * BLOCK_SIZE

    async def main() -> float:
        async with CacheRuntime(
            block_size=BLOCK_SIZE, max_blocks=prefix_tokens // BLOCK_SIZE * 4 + 256
        ) as rt:
            await rt.fetch("seed", prefix)
            payloads = [object()] * (prefix_tokens // BLOCK_SIZE)
            await rt.store("seed", prefix, payloads)
            serials = iter(range(10**9))

            async def client(quota: int) -> None:
                for _ in range(quota):
                    serial = next(serials)
                    request_id = f"r{serial}"
                    result = await rt.fetch(request_id, prefix + fresh_suffix(serial))
                    assert result.num_cached_tokens >= expected, "expected a hit"
                    await rt.release(request_id)

            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for _ in range(CLIENTS):
                    tg.start_soon(client, requests // CLIENTS)
            elapsed = time.perf_counter() - start
            await rt.release("seed")
            assert await rt.check_invariants()
        return (requests // CLIENTS * CLIENTS) / elapsed

    return anyio.run(main, backend=backend)


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


def run_subprocess(python: str, impl: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [python, __file__, "--impl", impl] + (["--quick"] if args.quick else [])
    env = dict(os.environ)
    if impl == "vllm":
        env.pop("PYTHONPATH", None)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impl", choices=["mlxkv", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="fewer requests and repeats")
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON))
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    sizes = [1024, 8192]
    requests = 640 if args.quick else 3200
    repeat = 1 if args.quick else 3

    if args.impl:
        print(json.dumps(run_direct(args.impl, sizes, requests, repeat)))
        return

    messages = 6400 if args.quick else 32000
    actor_rows = {backend: actor_costs(backend, messages) for backend in ("asyncio", "trio")}
    print("Actor messages (microseconds per message)\n")
    print(f"| {'measure':<38}| {'asyncio':>8} | {'trio':>8} |")
    print(f"|{'-' * 39}|{'-' * 10}|{'-' * 10}|")
    for key in actor_rows["asyncio"]:
        print(f"| {key:<38}| {actor_rows['asyncio'][key]:>8.1f} | {actor_rows['trio'][key]:>8.1f} |")

    runtime_rows = {
        backend: {
            f"fetch+release ({n} cached tokens)": statistics.median(
                runtime_throughput(backend, n, requests) for _ in range(repeat)
            )
            for n in sizes
        }
        for backend in ("asyncio", "trio")
    }
    direct_mlxkv = run_subprocess(sys.executable, "mlxkv", args)
    direct_vllm: dict[str, float] = {}
    if Path(args.vllm_python).exists():
        direct_vllm = run_subprocess(args.vllm_python, "vllm", args)
    else:
        print(f"\n(no vllm-mlx environment at {args.vllm_python}; see scripts/bench_cache.py)")

    print(f"\nFetch + release, {CLIENTS} concurrent clients, block size {BLOCK_SIZE}"
          " (requests per second; higher is better)\n")
    columns = ["runtime asyncio", "runtime trio", "mlxkv direct", "vllm-mlx direct"]
    print(f"| {'workload':<34}|" + "|".join(f" {c:>15} " for c in columns) + "|")
    print(f"|{'-' * 35}|" + "|".join("-" * 17 for _ in columns) + "|")
    for key in runtime_rows["asyncio"]:
        values = [
            runtime_rows["asyncio"][key],
            runtime_rows["trio"][key],
            direct_mlxkv.get(key),
            direct_vllm.get(key),
        ]
        cells = [f"{v:>15,.0f}" if v else f"{'—':>15}" for v in values]
        print(f"| {key:<34}|" + "|".join(f" {c} " for c in cells) + "|")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "actor": actor_rows,
                    "runtime": runtime_rows,
                    "mlxkv-direct": direct_mlxkv,
                    "vllm-mlx-direct": direct_vllm,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
