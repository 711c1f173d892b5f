"""One attention call over shared prefixes, each way, against fused attention over per-row copies.

For each shape -- decode steps (every row one query) and prefill chunks
(every row ``L`` queries), ``R`` rows over one group's ``P``-token prefix,
each row with its own ``S``-token suffix -- it times one layer's call of:

- ``cascade`` (``evaluate_slices`` on, as the runner calls every layer but
  the last) and ``cascade-lazy`` (off);
- ``gathered``, ``stacked``, ``mixed`` and ``kernel`` (:mod:`mlxkv.actors.prefix_attention`;
  ``mixed``: a decode step's products a KV head, a prefill chunk in bands;
  ``kernel``: a decode step by one CUDA kernel where MLX runs on CUDA,
  :mod:`mlxkv.actors.decode_kernel`, else as ``mixed``);
- ``copies``: ``mx.fast.scaled_dot_product_attention`` over per-row copies
  of prefix + suffix made beforehand (what a runtime without shared prefixes
  runs; its copies are memory the others do not hold).

Per way and shape: the median time of one call (evaluated; ``--repeats``
after ``--warmup``), the operations it puts in MLX's graph (primitives of
``mx.export_to_dot``; the fused ways build a step's mask once for all its
layers, so theirs is what every layer after a step's first adds), the peak
memory one call adds above what its inputs hold, the keys and values its
fused calls read (``kv MiB``: a fused way's copies of the prefix for the
call; on a GPU, whose fused kernel holds no score matrix, most of what the
call adds -- the CPU's peak counts the scores MLX's CPU attention
materialises), and the largest difference from ``copies``.
Timings are the device's (MLX's default device: the CPU here, a GPU where
MLX runs on one); the op counts and the peak are the same anywhere.

    .venv/bin/python scripts/bench_attention.py [--dtype bfloat16] [--quick] [--kind prefill] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fused_calls import graph_ops  # noqa: E402
from mlxkv.actors.prefix_attention import (
    cascade_attention,
    gathered_attention,
    kernel_attention,
    mixed_attention,
    stacked_attention,
)

#: (kind, rows, queries per row, prefix tokens, suffix tokens): the issue's shapes.
SHAPES = [
    ("decode", 8, 1, 2048, 64),
    ("decode", 32, 1, 2048, 64),
    ("decode", 8, 1, 8192, 64),
    ("decode", 32, 1, 8192, 64),
    ("prefill", 4, 256, 2048, 256),
    ("prefill", 8, 48, 2048, 48),
    ("prefill", 32, 32, 2048, 32),  # bench_memory.py's 32 requests
]
QUICK = [("decode", 8, 1, 512, 32), ("decode", 32, 1, 512, 32), ("prefill", 4, 64, 512, 64), ("prefill", 8, 16, 512, 16)]


def inputs(rows: int, length: int, prefix: int, suffix: int, heads: int, kv_heads: int, dim: int, dtype: Any, seed: int = 0) -> dict[str, Any]:
    """One layer's inputs: queries, the rows' suffixes (causal for a chunk), one group's prefix."""
    keys = mx.random.split(mx.random.key(seed), 5)
    normal = lambda key, shape: mx.random.normal(shape, key=key).astype(dtype)  # noqa: E731
    q = normal(keys[0], (rows, heads, length, dim))
    ks = normal(keys[1], (rows, kv_heads, suffix, dim))
    vs = normal(keys[2], (rows, kv_heads, suffix, dim))
    kp = normal(keys[3], (1, kv_heads, prefix, dim))
    vp = normal(keys[4], (1, kv_heads, prefix, dim))
    mask = "causal" if length > 1 else None
    copies_k = mx.concatenate([mx.broadcast_to(kp, (rows, kv_heads, prefix, dim)), ks], axis=2)
    copies_v = mx.concatenate([mx.broadcast_to(vp, (rows, kv_heads, prefix, dim)), vs], axis=2)
    total = prefix + suffix
    copies_mask = (mx.arange(total - length, total)[:, None] >= mx.arange(total)[None]) if length > 1 else None
    arrays = dict(q=q, ks=ks, vs=vs, kp=kp, vp=vp, copies_k=copies_k, copies_v=copies_v)
    mx.eval(*arrays.values())
    return {**arrays, "mask": mask, "copies_mask": copies_mask, "segments": [(list(range(rows)), kp, vp, [prefix] * rows)]}


def ways(args: dict[str, Any], scale: float) -> dict[str, Callable[[], Any]]:
    q, ks, vs, mask, segments = args["q"], args["ks"], args["vs"], args["mask"], args["segments"]
    return {
        "copies": lambda: mx.fast.scaled_dot_product_attention(
            q, args["copies_k"], args["copies_v"], scale=scale, mask=args["copies_mask"]
        ),
        "cascade": lambda: cascade_attention(q, ks, vs, mask, scale, segments),
        "cascade-lazy": lambda: cascade_attention(q, ks, vs, mask, scale, segments, evaluate_slices=False),
        "gathered": lambda: gathered_attention(q, ks, vs, mask, scale, segments),
        "stacked": lambda: stacked_attention(q, ks, vs, mask, scale, segments),
        "mixed": lambda: mixed_attention(q, ks, vs, mask, scale, segments),
        # A decode step by the CUDA kernel where MLX runs on CUDA (else as mixed):
        # the suffixes as a batch cache's whole buffers, no padding.
        "kernel": lambda: kernel_attention(
            q, ks, vs, mask, scale, segments, suffix_buffer=(ks, vs), padding=[0] * q.shape[0]
        ),
    }


def fused_inputs(call: Callable[[], Any]) -> int:
    """The bytes of keys and values ``call``'s fused attention calls read
    (0 for none): the copies of the prefix a fused way makes for its call."""
    real, read = mx.fast.scaled_dot_product_attention, [0]

    def spy(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        read[0] += k.nbytes + v.nbytes
        return real(q, k, v, **kwargs)

    mx.fast.scaled_dot_product_attention = spy
    try:
        call()
    finally:
        mx.fast.scaled_dot_product_attention = real
    return read[0]


def measure(call: Callable[[], Any], repeats: int, warmup: int) -> tuple[float, int, int, int, Any]:
    """(median seconds, graph ops, peak bytes above the start, bytes of
    keys and values its fused calls read, the output)."""
    for _ in range(warmup):
        mx.eval(call())
    mx.synchronize()
    ops = graph_ops(call())[0]
    kv = fused_inputs(call)
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    out = call()
    mx.eval(out)
    peak = mx.get_peak_memory() - start
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        mx.eval(call())
        mx.synchronize()
        times.append(time.perf_counter() - began)
    return statistics.median(times), ops, peak, kv, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small shapes (a CPU's minutes, not hours)")
    parser.add_argument("--kind", choices=["decode", "prefill"], help="only these shapes (default: both)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    scale = args.head_dim**-0.5
    results = []
    print(f"device {mx.default_device()}, {args.dtype}, {args.heads}/{args.kv_heads} heads of {args.head_dim}")
    print(f"{'shape':<28} {'way':<13} {'ms':>9} {'ops':>5} {'peak MiB':>9} {'kv MiB':>7} {'vs copies':>10} {'max diff':>9}")
    for kind, rows, length, prefix, suffix in QUICK if args.quick else SHAPES:
        if args.kind and kind != args.kind:
            continue
        shape = f"{kind} {rows}x{length} over {prefix}+{suffix}"
        data = inputs(rows, length, prefix, suffix, args.heads, args.kv_heads, args.head_dim, dtype)
        measured = {}
        for name, call in ways(data, scale).items():
            seconds, ops, peak, kv, out = measure(call, args.repeats, args.warmup)
            measured[name] = (seconds, ops, peak, kv, out.astype(mx.float32))
        anchor = measured["copies"]
        for name, (seconds, ops, peak, kv, out) in measured.items():
            diff = mx.abs(out - anchor[4]).max().item()
            ratio = seconds / anchor[0]
            print(f"{shape:<28} {name:<13} {seconds * 1e3:>9.3f} {ops:>5} {peak / 2**20:>9.1f} {kv / 2**20:>7.1f} {ratio:>9.2f}x {diff:>9.2e}")
            results.append(
                dict(shape=shape, kind=kind, rows=rows, queries=length, prefix=prefix, suffix=suffix, way=name,
                     ms=seconds * 1e3, ops=ops, peak_mib=peak / 2**20, kv_mib=kv / 2**20, vs_copies=ratio, max_diff=diff)
            )  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"device": str(mx.default_device()), "dtype": args.dtype, "results": results}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
