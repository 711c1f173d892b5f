"""Concurrent generation throughput: mlxkv's batched decode against mlx-lm's own engines.

Every request shares a 512-token prefix (``--prefix-tokens``) that is
already cached, adds 32 tokens of its own and generates greedily. Three ways to serve N such
requests on the built-in model, side by side in one process:

- ``batch_generate``: mlx-lm's ``BatchGenerator`` (what ``batch_generate``
  runs), given a copy of the prefix cache per request (``caches=``), so it
  prefills only the 32 own tokens, all requests in one batch;
- ``stream_generate``: mlx-lm's ``stream_generate``, one request after
  another, each on the prefix cache (trimmed back after each request);
- ``mlxkv``: ``CacheRuntime.generate`` for all N at once; the prefix is in
  the runtime's blocks (stored by a warm-up request), so each request
  rebuilds it, prefills its 32 tokens and joins the decode batch.

With ``--baseline-python PATH`` a fourth method, ``baseline``, runs the same
``mlxkv`` workload in a child process of another environment -- say a
checkout of an earlier mlxkv in its own venv -- alternating with the others:

    git worktree add /tmp/mlxkv-old <commit> && python3 -m venv /tmp/mlxkv-old/.venv
    /tmp/mlxkv-old/.venv/bin/pip install -e /tmp/mlxkv-old
    .venv/bin/python scripts/bench_batch.py --baseline-python /tmp/mlxkv-old/.venv/bin/python

Rounds alternate the methods (order rotated each round), with fresh own
tokens every round so nothing but the prefix is ever cached. Figures are
medians over rounds: generated tokens per second of wall time, and time to
first token (p50, p95) measured from the moment all N requests were handed
over. Ratios are medians of the per-round ratios (each round's methods ran
back to back, so a slow patch of the machine affects both sides of a ratio).
Greedy tokens are compared with ``stream_generate``'s once the rounds are
over: where a method's first differs, the model's logits there say whether
the two choices were a tie within float noise (two exact paths round
differently; a random bfloat16 model has many near-ties) or apart by more,
which is warned of (``scripts/divergence.py``).

With ``--fused-shapes`` it also counts, per method, the distinct shapes of
the attention calls MLX's CUDA backend would run through cuDNN (several
queries a row, in a half-precision model), which builds a graph for every
new shape (``scripts/fused_calls.py``): a figure of the CPU that says what
a GPU would pay in graphs.

With ``--also KEY=VALUE`` another ``mlxkv`` runtime with those options runs
too (``--also prefix_attention=stacked``: another way of attending over the
shared prefix). With ``--plain`` a fifth, ``mlxkv-plain``, runs ``mlxkv``'s workload on a
second runtime with ``transpose_weights=False``: the model's own weight
layout, as mlx-lm runs it (what mlxkv gains without its CPU weight layout).

    .venv/bin/python scripts/bench_batch.py [--rounds 5] [--prefix-tokens 512]
        [--settings 1x128,8x48,32x48] [--plain] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import _runtime_options  # noqa: E402
from divergence import TokenComparison, compare_tokens  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PREFIX, OWN = 512, 32  # the default shared prefix's tokens; each request's own
SETTINGS = "1x128,8x48,32x48"  # concurrent requests x tokens each


def _prefix(num_tokens: int = PREFIX) -> list[int]:
    return [32 + (i * 37 + (i // 11) ** 2) % 95 for i in range(num_tokens)]


def _own(round_: int, n: int) -> list[list[int]]:
    rng = random.Random(round_ * 1000 + n)
    return [[rng.randrange(32, 127) for _ in range(OWN)] for _ in range(n)]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class MlxLm:
    """mlx-lm on the main thread: the model, and the prefix's cache computed once."""

    def __init__(self, path: str, prefix: list[int]) -> None:
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.models.cache import make_prompt_cache

        self.model, self.tokenizer = load(path)
        self.prefix_cache = make_prompt_cache(self.model)
        self.num_prefix = len(prefix)
        for start in range(0, len(prefix), 256):
            self.model(mx.array(prefix[start : start + 256])[None], cache=self.prefix_cache)
            mx.eval([c.state for c in self.prefix_cache])

    def batch(self, owns: list[list[int]], tokens: int) -> dict[str, Any]:
        import copy

        from mlx_lm.generate import BatchGenerator

        stop = [[t] for t in self.tokenizer.eos_token_ids]
        generator = BatchGenerator(self.model, stop_tokens=stop)
        started = time.perf_counter()
        uids = generator.insert(owns, [tokens] * len(owns), caches=[copy.deepcopy(self.prefix_cache) for _ in owns])
        first: dict[int, float] = {}
        out: dict[int, list[int]] = {uid: [] for uid in uids}
        while responses := generator.next_generated():
            now = time.perf_counter()
            for response in responses:
                first.setdefault(response.uid, now - started)
                if response.finish_reason != "stop":
                    out[response.uid].append(response.token)
        wall = time.perf_counter() - started
        generator.close()
        return {"wall": wall, "ttft": [first[u] for u in uids], "tokens": [out[u] for u in uids]}

    def sequential(self, owns: list[list[int]], tokens: int) -> dict[str, Any]:
        import mlx.core as mx
        from mlx_lm.generate import stream_generate
        from mlx_lm.models.cache import trim_prompt_cache

        started = time.perf_counter()
        ttft, outs = [], []
        for own in owns:
            out: list[int] = []
            for response in stream_generate(
                self.model, self.tokenizer, mx.array(own), max_tokens=tokens, prompt_cache=self.prefix_cache
            ):
                if not out:
                    ttft.append(time.perf_counter() - started)
                if response.finish_reason == "stop":
                    break
                out.append(response.token)
            outs.append(out)
            trim_prompt_cache(self.prefix_cache, self.prefix_cache[0].offset - self.num_prefix)
        return {"wall": time.perf_counter() - started, "ttft": ttft, "tokens": outs}


#: The baseline child: one round per JSON line on stdin (own tokens, max
#: tokens), one JSON line back; written against the public API only.
CHILD = r"""
import json, sys, time, anyio
from mlxkv import CacheRuntime, GenerationReport
path, prefix = sys.argv[1], json.loads(sys.argv[2])

async def main():
    async with CacheRuntime(model=path, block_size=64) as rt:
        async with rt.generate(prefix + [33], max_tokens=1) as warm:
            async for _ in warm:
                pass
        print(json.dumps({"ready": True}), flush=True)
        while line := sys.stdin.readline():
            owns, tokens = json.loads(line)
            reports = [None] * len(owns)
            started = time.perf_counter()

            async def one(i):
                async with rt.generate(prefix + owns[i], max_tokens=tokens) as stream:
                    async for record in stream:
                        if isinstance(record, GenerationReport):
                            reports[i] = record

            async with anyio.create_task_group() as tg:
                for i in range(len(owns)):
                    tg.start_soon(one, i)
            print(json.dumps({"wall": time.perf_counter() - started,
                              "ttft": [r.time_to_first_token for r in reports],
                              "tokens": [list(r.tokens) for r in reports]}), flush=True)

anyio.run(main)
"""


class Baseline:
    """The same mlxkv workload on another environment's mlxkv, in a child process."""

    def __init__(self, python: str, path: str, prefix: list[int]) -> None:
        self.proc = subprocess.Popen(
            [python, "-c", CHILD, path, json.dumps(prefix)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._receive().get("ready"), "the baseline child did not start"

    def _receive(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the baseline child exited")
        return json.loads(line)

    def run(self, owns: list[list[int]], tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps([owns, tokens]) + "\n")
        self.proc.stdin.flush()
        return self._receive()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


async def _mlxkv(rt: Any, prefix: list[int], owns: list[list[int]], tokens: int) -> dict[str, Any]:
    from mlxkv import GenerationReport

    reports: list[Any] = [None] * len(owns)
    started = time.perf_counter()

    async def one(i: int) -> None:
        async with rt.generate(prefix + owns[i], max_tokens=tokens) as stream:
            async for record in stream:
                if isinstance(record, GenerationReport):
                    reports[i] = (time.perf_counter(), record)

    async with anyio.create_task_group() as tg:
        for i in range(len(owns)):
            tg.start_soon(one, i)
    wall = time.perf_counter() - started
    cached = [r.cached_tokens for _, r in reports]
    # The kept last cache may serve a token or two more (own tokens that begin alike).
    assert all(c >= len(prefix) // 64 * 64 for c in cached), f"the prefix was not reused: {cached}"
    return {
        "wall": wall,
        "ttft": [r.time_to_first_token for _, r in reports],
        "tokens": [list(r.tokens) for _, r in reports],
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from fused_calls import AttentionShapes

    with AttentionShapes() if args.fused_shapes else contextlib.nullcontext() as shapes:
        results = await _run(args, shapes)
    if shapes is not None:
        results["fused_shapes"] = shapes.summary()
    return results


async def _run(args: argparse.Namespace, shapes: Any) -> dict[str, Any]:
    from mlxkv import CacheRuntime
    from mlxkv.default_model import model_path

    path = model_path(args.model)
    prefix = _prefix(args.prefix_tokens)
    mlx_lm = MlxLm(path, prefix)
    baseline = Baseline(args.baseline_python, path, prefix) if args.baseline_python else None
    results: dict[str, Any] = {}
    tokens_seen = TokenComparison(mlx_lm.model, "stream_generate", stop_tokens=mlx_lm.tokenizer.eos_token_ids)
    async with contextlib.AsyncExitStack() as stack:
        rt = await stack.enter_async_context(CacheRuntime(model=path, block_size=64))
        runtimes = {"mlxkv": rt}
        if args.plain:
            runtimes["mlxkv-plain"] = await stack.enter_async_context(
                CacheRuntime(model=path, block_size=64, transpose_weights=False)
            )
        for extra in args.also:
            runtimes[f"mlxkv, {extra}"] = await stack.enter_async_context(
                CacheRuntime(model=path, block_size=64, **_runtime_options(extra))
            )
        for runtime in runtimes.values():
            async with runtime.generate(prefix + [33], max_tokens=1) as warm:  # stores the prefix
                async for _ in warm:
                    pass
        for n, tokens in args.settings:
            samples: dict[str, list[dict[str, Any]]] = {"batch_generate": [], "stream_generate": []}
            samples.update({name: [] for name in runtimes})
            if baseline is not None:
                samples["baseline"] = []
            for round_ in range(args.rounds):
                owns = _own(round_, n)
                shift = round_ % len(samples)
                order = list(samples)[shift:] + list(samples)[:shift]
                outs = {}
                for method in order:
                    if shapes is not None:
                        shapes.label = method
                    if method in runtimes:
                        outs[method] = await _mlxkv(runtimes[method], prefix, owns, tokens)
                    elif method == "batch_generate":
                        outs[method] = mlx_lm.batch(owns, tokens)
                    elif method == "baseline":
                        outs[method] = baseline.run(owns, tokens)  # type: ignore[union-attr]
                    else:
                        outs[method] = mlx_lm.sequential(owns, tokens)
                    samples[method].append(outs[method])
                    if shapes is not None:
                        shapes.label = None
                reference = outs["stream_generate"]["tokens"]
                prompts = [prefix + own for own in owns]
                for method in [m for m in samples if m != "stream_generate"]:
                    tokens_seen.add(f"{n}x{tokens}", method, prompts, reference, outs[method]["tokens"])
            row = {}
            ours = [sum(map(len, r["tokens"])) / r["wall"] for r in samples["mlxkv"]]
            for method, runs in samples.items():
                rates = [sum(map(len, r["tokens"])) / r["wall"] for r in runs]
                row[method] = {
                    "tokens_per_second": statistics.median(rates),
                    "mlxkv_over_this": statistics.median(o / r for o, r in zip(ours, rates)),
                    "ttft_p50_ms": statistics.median(_percentile(r["ttft"], 50) for r in runs) * 1e3,
                    "ttft_p95_ms": statistics.median(_percentile(r["ttft"], 95) for r in runs) * 1e3,
                    "generated": sum(map(len, runs[0]["tokens"])),
                }
            results[f"{n}x{tokens}"] = row
        stats = await rt.stats()
    if baseline is not None:
        baseline.close()
    assert stats.compute is not None
    results["mlxkv_mean_batch_size"] = stats.compute.mean_batch_size
    results["token_comparison"] = compare_tokens(tokens_seen)
    return results


def _table(results: dict[str, Any]) -> str:
    lines = [
        "| requests x tokens | method | tokens/s | TTFT p50 | TTFT p95 | mlxkv / this |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for setting, row in results.items():
        if not isinstance(row, dict) or setting == "fused_shapes":
            continue
        for method, figures in row.items():
            ratio = figures["mlxkv_over_this"]
            lines.append(
                f"| {setting} | {method} | {figures['tokens_per_second']:,.0f} |"
                f" {figures['ttft_p50_ms']:.1f} ms | {figures['ttft_p95_ms']:.1f} ms |"
                f" {'-' if method == 'mlxkv' else f'{ratio:.2f}x'} |"
            )
    return "\n".join(lines)


def _settings(text: str) -> list[tuple[int, int]]:
    """``"8x48,32x48"`` as ``[(8, 48), (32, 48)]``."""
    try:
        pairs = [tuple(int(n) for n in item.split("x")) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not REQUESTSxTOKENS,...: {text!r}") from None
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"not REQUESTSxTOKENS,... with both >= 1: {text!r}")
    return pairs  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds per setting (5)")
    parser.add_argument(
        "--plain",
        action="store_true",
        help="also mlxkv-plain: a second runtime with transpose_weights=False (the model's own weight layout)",
    )
    parser.add_argument(
        "--model",
        help="an mlx-lm model directory, or a built-in model's name (bench-llama-722m-bf16: the"
        " GPU measurements' model; default: the built-in model)",
    )
    parser.add_argument("--json", help="also write the results as JSON to FILE")
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="KEY=VALUE,...",
        help="also a runtime with these options, e.g. prefix_attention=stacked (repeatable)",
    )
    parser.add_argument(
        "--baseline-python", help="python of another environment whose mlxkv runs as 'baseline'"
    )
    parser.add_argument(
        "--prefix-tokens", type=int, default=PREFIX, help=f"tokens of the shared cached prefix ({PREFIX})"
    )
    parser.add_argument(
        "--settings", type=_settings, default=_settings(SETTINGS),
        help=f"comma-separated REQUESTSxTOKENS ({SETTINGS})",
    )  # fmt: skip
    parser.add_argument(
        "--fused-shapes",
        action="store_true",
        help="also count, per method, the shapes of the attention calls MLX's CUDA backend runs through"
        " cuDNN (a graph built for each new shape)",
    )
    args = parser.parse_args()
    if args.prefix_tokens < 64:
        parser.error("--prefix-tokens must be at least one block (64)")
    results = anyio.run(main_async, args)
    print(_table(results))
    print(f"\nmlxkv mean decode batch size: {results['mlxkv_mean_batch_size']:.1f}")
    for line in results["token_comparison"]:
        print(line)
    for method, counts in results.get("fused_shapes", {}).items():
        print(f"{method}: {counts['shapes']} shapes of attention calls cuDNN would run, in {counts['calls']} calls")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
