"""Benchmark the cache layer against vllm-mlx 0.6.0, side by side in one run.

Both implementations expose the same (seed) API, so one set of workloads runs
on each: ``mlxkv.cache`` and ``vllm_mlx``'s ``paged_cache``/``prefix_cache``.
Each implementation runs in its own interpreter (vllm-mlx 0.6.0 needs
``mlx-lm<0.32``), one after the other, and the table shows medians and the
ratio ``vllm-mlx / mlxkv`` (above 1: mlxkv is faster).

Set up the reference environment once::

    python3 -m venv .bench/vllm
    .bench/vllm/bin/pip install --no-deps vllm-mlx==0.6.0
    .bench/vllm/bin/pip install "mlx[cpu]" "mlx-lm<0.32"

Then::

    .venv/bin/python scripts/bench_cache.py            # full table
    .venv/bin/python scripts/bench_cache.py --quick    # fewer repeats, smaller sizes

Without the reference environment only mlxkv's column is printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VLLM_PYTHON = REPO / ".bench" / "vllm" / "bin" / "python"


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------


def median_time(
    fn: Callable[[Any], Any],
    setup: Callable[[], Any] = lambda: None,
    teardown: Callable[[Any], Any] = lambda _: None,
    repeat: int = 30,
) -> float:
    """Median wall time of ``fn(setup())`` over ``repeat`` runs; setup untimed."""
    samples = []
    for _ in range(repeat):
        state = setup()
        gc.disable()
        start = time.perf_counter()
        result = fn(state)
        elapsed = time.perf_counter() - start
        gc.enable()
        teardown(result if result is not None else state)
        samples.append(elapsed)
    return statistics.median(samples)


def per_op(fn: Callable[[], Any], ops: int, repeat: int) -> float:
    """Median time of one op, timing ``ops`` back-to-back calls ``repeat`` times."""

    def run(_):
        for _ in range(ops):
            fn()

    return median_time(run, repeat=repeat) / ops


# --------------------------------------------------------------------------
# Workloads: written once against the seed API, run on both implementations
# --------------------------------------------------------------------------


class Impl:
    """The two modules of one implementation, plus its KV-state input format."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "vllm":
            from vllm_mlx import paged_cache, prefix_cache
        else:
            from mlxkv.cache import paged as paged_cache
            from mlxkv.cache import prefix as prefix_cache
        self.paged = paged_cache
        self.prefix = prefix_cache

    def manager(self, block_size: int = 64, max_blocks: int = 1000):
        return self.paged.PagedCacheManager(block_size=block_size, max_blocks=max_blocks)

    def block_cache(self, mgr):
        return self.prefix.BlockAwarePrefixCache(model=None, paged_cache_manager=mgr)


def kv_states(layers: int, heads: int, tokens: int, dim: int, dtype: str) -> list[dict]:
    """Exact-size KV state per layer, in the ``{'state': (keys, values)}`` form
    that both implementations accept from a scheduler."""
    import mlx.core as mx

    dtype = getattr(mx, dtype)
    out = []
    for i in range(layers):
        k = mx.random.normal((1, heads, tokens, dim), key=mx.random.key(2 * i)).astype(dtype)
        v = mx.random.normal((1, heads, tokens, dim), key=mx.random.key(2 * i + 1)).astype(dtype)
        out.append({"state": (k, v), "meta_state": (str(tokens),), "class_name": "KVCache"})
    mx.eval([s["state"] for s in out])
    return out


def bench_allocator(impl: Impl, quick: bool) -> dict[str, float]:
    rows: dict[str, float] = {}
    reps = 10 if quick else 30
    mgr = impl.manager(max_blocks=1000)

    def alloc_free():
        block = mgr.allocate_block()
        mgr.free_block(block.block_id)

    rows["allocate_block + free_block"] = per_op(alloc_free, 2000, reps)

    def batch():
        blocks = mgr.get_new_blocks(16)
        mgr.free_block_batch(blocks)

    rows["get_new_blocks(16) + free_block_batch"] = per_op(batch, 500, reps)

    table = mgr.create_block_table("src")
    for block in mgr.get_new_blocks(32):
        mgr.add_block_to_table(table, block, 64)
    counter = iter(range(10**9))

    def fork():
        rid = f"fork-{next(counter)}"
        mgr.fork_block_table(table, rid)
        mgr.delete_block_table(rid)

    rows["fork 32-block table + delete"] = per_op(fork, 300, reps)
    return rows


def bench_prefix_blocks(impl: Impl, quick: bool) -> dict[str, float]:
    rows: dict[str, float] = {}
    reps = 10 if quick else 30
    tokens = [(i * 7919) % 50000 for i in range(4096)]

    def cache_64(_):
        mgr = impl.manager(max_blocks=200)
        blocks = mgr.get_new_blocks(64)
        return mgr, blocks

    rows["cache_full_blocks (64 blocks)"] = median_time(
        lambda s: s[0].cache_full_blocks(s[1], tokens, 0, 64), setup=lambda: cache_64(None), repeat=reps
    )

    mgr, blocks = cache_64(None)
    mgr.cache_full_blocks(blocks, tokens, 0, 64)
    rows["get_computed_blocks (4k tokens, hit)"] = per_op(
        lambda: mgr.get_computed_blocks(tokens), 20, reps
    )
    return rows


def bench_bookkeeping(impl: Impl, quick: bool) -> dict[str, float]:
    """Store and miss-lookup cost with negligible KV (1 layer, 1 head, dim 1),
    so that only bookkeeping is measured; plus find_shared_prefix."""
    rows: dict[str, float] = {}
    sizes = [1024, 8192] if quick else [1024, 4096, 16384, 32768]
    reps = 3 if quick else 5
    for n in sizes:
        tokens = [(i * 31 + 7) % 50000 for i in range(n)]
        other = [(i * 17 + 3) % 50000 for i in range(n)]
        state = kv_states(1, 1, n, 1, "float16")
        blocks_needed = n // 64 + 4

        def setup():
            mgr = impl.manager(max_blocks=blocks_needed * 2)
            return mgr, impl.block_cache(mgr)

        rows[f"store_cache bookkeeping ({n} tokens)"] = median_time(
            lambda s: s[1].store_cache("a", tokens, state), setup=setup, repeat=reps
        )

        def stored():
            mgr, cache = setup()
            cache.store_cache("a", tokens, state)
            return mgr, cache

        rows[f"fetch_cache miss ({n} tokens)"] = median_time(
            lambda s: s[1].fetch_cache("b", other), setup=stored, repeat=reps
        )
        if n == sizes[-1]:
            rows[f"find_shared_prefix ({n} tokens)"] = median_time(
                lambda s: s[0].find_shared_prefix(tokens), setup=stored, repeat=reps
            )
    return rows


def release_all(cache) -> None:
    """Drop every block of a BlockAwarePrefixCache before the next repeat, so
    that each repeat starts from the same memory state."""
    cache.clear()
    gc.collect()


def bench_reconstruct(impl: Impl, quick: bool) -> dict[str, float]:
    """store -> fetch -> reconstruct -> first append of the suffix, evaluated."""
    import mlx.core as mx

    rows: dict[str, float] = {}
    geometries = {
        "tiny (2x2x16 fp32)": (2, 2, 16, "float32"),
        "7B-like (28x4x128 fp16)": (28, 4, 128, "float16"),
    }
    sizes = [512, 2048] if quick else [512, 2048, 8192]
    reps = 3 if quick else 5
    suffix = 64
    for label, (layers, heads, dim, dtype) in geometries.items():
        for n in sizes:
            tokens = list(range(1, n + 1))
            query = tokens + list(range(n + 1, n + 1 + suffix))
            state = kv_states(layers, heads, n, dim, dtype)
            new_k = mx.zeros((1, heads, suffix, dim), dtype=getattr(mx, dtype))
            mx.eval(new_k)

            def setup():
                mgr = impl.manager(max_blocks=n // 64 + 8)
                cache = impl.block_cache(mgr)
                cache.store_cache("writer", tokens, state)
                gc.collect()
                return cache

            def hit(cache):
                table, remaining = cache.fetch_cache("reader", query)
                assert table is not None and len(remaining) == suffix, "expected a hit"
                caches = cache.reconstruct_cache(table)
                assert caches is not None, "reconstruction refused"
                out = [c.update_and_fetch(new_k, new_k) for c in caches]
                mx.eval(out)
                return cache

            rows[f"fetch+reconstruct+append {label} ({n} tokens)"] = median_time(
                hit, setup=setup, teardown=release_all, repeat=reps
            )
    return rows


def bench_memory(impl: Impl, quick: bool) -> dict[str, float]:
    """MB of MLX memory freed by evicting half, then all, of the cached blocks.

    The source KV buffers are dropped first, as a finished request drops its
    cache: whatever memory remains is held by the stored blocks alone."""
    import mlx.core as mx

    n = 2048 if quick else 8192
    tokens = list(range(1, n + 1))
    mgr = impl.manager(max_blocks=n // 64 + 8)
    cache = impl.block_cache(mgr)
    state = kv_states(4, 4, n, 128, "float16")
    stored_bytes = sum(s["state"][0].nbytes + s["state"][1].nbytes for s in state)
    cache.store_cache("writer", tokens, state)
    cache.release_cache("writer")
    del state
    gc.collect()
    start = mx.get_active_memory()
    mgr.evict_lru_blocks(n // 64 // 2)
    gc.collect()
    half = mx.get_active_memory()
    mgr.evict_lru_blocks(mgr.max_blocks)
    gc.collect()
    end = mx.get_active_memory()
    return {
        f"KV stored (MB, {n} tokens 4x4x128 fp16)": stored_bytes / 2**20,
        "memory freed by evicting half the blocks (MB)": (start - half) / 2**20,
        "memory freed by evicting all blocks (MB)": (start - end) / 2**20,
    }


SUITES = [bench_allocator, bench_prefix_blocks, bench_bookkeeping, bench_reconstruct, bench_memory]


def run_impl(name: str, quick: bool, only: str | None = None) -> dict[str, float]:
    impl = Impl(name)
    rows: dict[str, float] = {}
    for suite in SUITES:
        if only and only not in suite.__name__:
            continue
        rows.update(suite(impl, quick))
        print(f"  {name}: {suite.__name__} done", file=sys.stderr, flush=True)
    return rows


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


def run_subprocess(python: str, name: str, quick: bool, only: str | None) -> dict[str, float]:
    cmd = [python, __file__, "--impl", name] + (["--quick"] if quick else [])
    cmd += ["--only", only] if only else []
    env = dict(os.environ)
    if name == "vllm":
        env.pop("PYTHONPATH", None)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    sys.stderr.write(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median_rows(rounds: list[dict[str, float]]) -> dict[str, float]:
    if not rounds:
        return {}
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def fmt(name: str, value: float | None) -> str:
    if value is None:
        return "—"
    if "(MB" in name or name.startswith("memory") or name.startswith("KV stored"):
        return f"{value:.1f} MB"
    if value >= 1e-1:
        return f"{value:.3f} s"
    if value >= 1e-4:
        return f"{value * 1e3:.3f} ms"
    return f"{value * 1e6:.2f} us"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impl", choices=["mlxkv", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and sizes")
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON))
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--only", help="run only the suites whose name contains this")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per side (3)")
    args = parser.parse_args()

    if args.impl:
        print(json.dumps(run_impl(args.impl, args.quick, args.only)))
        return

    have_vllm = Path(args.vllm_python).exists()
    if not have_vllm:
        print(f"(no vllm-mlx environment at {args.vllm_python}; see the module docstring)")
    # Alternate the two implementations round by round and keep each row's
    # median, so that background load hits both columns alike.
    our_rounds: list[dict[str, float]] = []
    their_rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):
        our_rounds.append(run_subprocess(sys.executable, "mlxkv", args.quick, args.only))
        if have_vllm:
            their_rounds.append(run_subprocess(args.vllm_python, "vllm", args.quick, args.only))
    ours = _median_rows(our_rounds)
    theirs = _median_rows(their_rounds)

    width = max(len(k) for k in ours) + 2
    print(f"| {'workload':<{width}}| {'mlxkv':>11} | {'vllm-mlx':>11} | ratio |")
    print(f"|{'-' * (width + 1)}|{'-' * 13}|{'-' * 13}|-------|")
    for key, value in ours.items():
        other = theirs.get(key)
        if key.startswith(("memory", "KV stored")):
            ratio = "—"
        else:
            ratio = f"{other / value:.1f}x" if other and value else "—"
        print(f"| {key:<{width}}| {fmt(key, value):>11} | {fmt(key, other):>11} | {ratio:>5} |")
    if args.json:
        args.json.write_text(json.dumps({"mlxkv": ours, "vllm-mlx": theirs}, indent=2))


if __name__ == "__main__":
    main()
