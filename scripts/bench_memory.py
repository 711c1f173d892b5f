"""Memory of concurrent requests over a shared prefix: mlxkv against mlx-lm and the floor.

N requests begin with one cached prefix (2,048 tokens on the built-in
model), add 32 tokens of their own and generate 32 greedily, all at once.
Peak MLX memory above what was active just before (the model and the
cached prefix are loaded already; or just after, where less: memory freed
during a round that was garbage before it), side by side in one process,
rounds alternating:

- ``mlxkv``: ``CacheRuntime.generate`` for all N; the prefix is in the
  runtime's block pool (stored by a warm-up request), and requests that
  begin with it read one shared copy of it (``shared_prefix=True``);
- ``mlxkv, copies``: the same with ``shared_prefix=False``: each request
  rebuilds its own copy of the prefix, as before shared prefixes;
- ``mlxkv, KEY=VALUE`` (with ``--also KEY=VALUE,...``): ``mlxkv`` with
  other runtime options, e.g. ``prefix_attention=stacked`` (another way of
  attending over the shared prefix), ``decode_wait=1`` (the scheduling before a
  wave of arrivals was prefilled first) or ``prefill_budget=1024`` (five
  requests over 2,048 tokens a prefill plan instead of two);
- ``batch_generate``: mlx-lm's ``BatchGenerator`` given a copy of the
  prefix cache per request (``caches=``), as ``batch_generate`` takes them;
- ``floor``: the KV the work needs: the prefix once and each request's own
  tokens, ``P + N * (S + T)`` tokens at the model's bytes per token.

``--groups K`` splits the N requests over K different prefixes of the same
length (K prefixes cached, each shared by N/K requests; the floor counts
each once). Also reported: generated tokens per second of each method (its
greedy tokens compared with ``batch_generate``'s once the rounds are over:
where they part, whether at a tie within float noise, ``scripts/divergence.py``),
each round's ratio of
mlxkv's to ``batch_generate``'s (their median), and time to first token
(median and 95th percentile over every request of every round, from the
round's start), and the decode model calls each mlxkv method made
(``batch_generate`` makes one per generated token: 32).

Before each round the garbage of the previous one is collected, and the
runtime runs with ``keep_caches=False``: the kept last cache (one
finished request's KV beside the pool, replaced as requests finish) would
sit in "what was active just before" and be freed during the round, so the
peak above it would undercount (even below zero). Each method is set up
once and serves every round (mlx-lm's model and prefix caches, and one
runtime for each mlxkv method), so no method's timed rounds include its
start-up; until 7609661 each mlxkv round ran on a fresh runtime, whose
first requests are slower (its tokens/s were 0.73x ``batch_generate``'s
at 8 requests that way).

Each mlxkv round also says which of the executor's plans was running when
its peak was reached (``peak set by``: a prefill's rows and new tokens, a
join, decode steps and their rows; the median round's): on a GPU, MLX
allocates an operation's output as the host queues it and frees its inputs
only once the kernels of its batch (on MLX's CUDA backend, a CUDA graph of
up to 100 operations on an H100 or H200) have run, so a plan's peak is what
it queues ahead of the device. On a CPU the operations run behind the
host, so the plan named may be the one after.

On a CPU, ``--fused-attention-stand-in`` gives every fused attention call
the memory a GPU's flash kernel needs (its output; the CPU's fallback
materialises the scores) and ``--kernel-stand-in`` runs the ``kernel``
way's decode steps as on CUDA (``scripts/stand_ins.py``): an estimate of
what the fused ways hold on a GPU, from below (a GPU frees later). Their
tokens are not the model's (they are not compared). ``--memory-limit MIB``
sets MLX's memory limit that far above what is active once every method is
set up: past it an evaluation waits for queued work to finish before it
queues more (MLX's own bound on what runs ahead of a GPU), for every method
alike.

    .venv/bin/python scripts/bench_memory.py [--sizes 8,16,32,64] [--groups 1] [--rounds 3] [--also decode_wait=1]
        [--fused-attention-stand-in] [--kernel-stand-in] [--memory-limit MIB] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import statistics
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stand_ins  # noqa: E402
from divergence import TokenComparison, compare_tokens  # noqa: E402

PREFIX, OWN, GENERATED = 2048, 32, 32
BLOCK = 64


def _prefixes(groups: int) -> list[list[int]]:
    return [[32 + (i * 37 + k * 101 + (i // 11) ** 2) % 95 for i in range(PREFIX)] for k in range(groups)]


def _owns(round_: int, n: int) -> list[list[int]]:
    rng = random.Random(round_ * 1000 + n)
    return [[rng.randrange(32, 127) for _ in range(OWN)] for _ in range(n)]


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _runtime_options(text: str) -> dict[str, Any]:
    """``"a=1,b=x,c=false"`` as ``{"a": 1, "b": "x", "c": False}`` (integers as
    ints, true/false as bools, the rest as strings)."""
    options: dict[str, Any] = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        value = value.strip()
        if value.lower() in ("true", "false"):
            options[key.strip()] = value.lower() == "true"
        else:
            options[key.strip()] = int(value) if value.lstrip("-").isdigit() else value
    return options


def _percentiles(seconds: list[float]) -> tuple[float, float]:
    """Median and 95th percentile."""
    ordered = sorted(seconds)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def _peak_above(base: int) -> int:
    """The round's peak MLX memory above ``base`` (active just before it), or
    above what is active after it where that is less: memory active before
    the round but freed during it (a previous method's garbage) would
    otherwise hide part of the round's own peak (rounds measured 0.4 or
    even -2.2 MiB that way, beside 4.1)."""
    import mlx.core as mx

    peak = mx.get_peak_memory()
    gc.collect()
    mx.synchronize()
    return peak - min(base, mx.get_active_memory())


def describe_plan(plan: Any, result: Any) -> str:
    """What an executor's plan did, in a few words: its prefill calls' rows
    and the new tokens of the requests it started, its joins and leaves,
    and its decode steps' rows."""
    parts = []
    if result.prefill_calls:
        rows = "+".join(str(n) for n in result.prefill_calls)
        new = sum(c.computed - c.num_cached for c in result.chunks if c.started)
        parts.append(f"prefill {rows} rows" + (f", {new} new tokens" if new else ""))
    if plan.join:
        parts.append(f"join {len(plan.join)}")
    if plan.leave:
        parts.append(f"leave {len(plan.leave)}")
    if result.steps:
        parts.append(f"{len(result.steps)} steps of {max(result.steps)} rows")
    return ", ".join(parts) or "publish"


class PeakByPlan:
    """Within the block, each plan the executors run, with MLX's peak memory
    when it returned: :meth:`setter` names the first whose peak was the
    block's."""

    def __init__(self) -> None:
        self.plans: list[tuple[str, int]] = []

    def __enter__(self) -> PeakByPlan:
        import mlx.core as mx

        from mlxkv.actors.executor import Executor

        self._run = run = Executor.run

        def noted(executor: Any, plan: Any) -> Any:
            result = run(executor, plan)
            self.plans.append((describe_plan(plan, result), mx.get_peak_memory()))
            return result

        Executor.run = noted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        from mlxkv.actors.executor import Executor

        Executor.run = self._run  # type: ignore[method-assign]

    def setter(self) -> str:
        """The first plan whose return saw the block's peak ("" if none ran)."""
        if not self.plans:
            return ""
        top = max(peak for _, peak in self.plans)
        return next(what for what, peak in self.plans if peak == top)


def _ms(pair: tuple[float, float]) -> str:
    return f"{pair[0] * 1e3:.0f} / {pair[1] * 1e3:.0f} ms"


class MlxLm:
    """mlx-lm's BatchGenerator with a copy of the prefix cache per request."""

    def __init__(self, path: str, prefixes: list[list[int]]) -> None:
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.models.cache import make_prompt_cache

        self.model, self.tokenizer = load(path)
        self.caches = []
        for prefix in prefixes:
            cache = make_prompt_cache(self.model)
            for start in range(0, PREFIX, 256):
                self.model(mx.array(prefix[start : start + 256])[None], cache=cache)
                mx.eval([c.state for c in cache])
            self.caches.append(cache)

    def run(self, owns: list[list[int]]) -> dict[str, Any]:
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator

        groups = len(self.caches)
        gc.collect()
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        started = time.perf_counter()
        generator = BatchGenerator(self.model, stop_tokens=[[t] for t in self.tokenizer.eos_token_ids])
        caches = [copy.deepcopy(self.caches[i % groups]) for i in range(len(owns))]
        uids = generator.insert(owns, [GENERATED] * len(owns), caches=caches)
        del caches
        out: dict[int, list[int]] = {uid: [] for uid in uids}
        first: dict[int, float] = {}
        while responses := generator.next_generated():
            now = time.perf_counter() - started
            for response in responses:
                first.setdefault(response.uid, now)
                if response.finish_reason != "stop":
                    out[response.uid].append(response.token)
        wall = time.perf_counter() - started
        generator.close()
        peak = _peak_above(base)
        return {"peak": peak, "wall": wall, "tokens": [out[u] for u in uids], "ttft": [first[u] for u in uids]}


async def _open(stack: AsyncExitStack, path: str, prefixes: list[list[int]], **options: Any) -> Any:
    """A runtime with every prefix's blocks in its pool (stored by a warm-up
    request each), open for the rest of the run."""
    from mlxkv import CacheRuntime

    rt = await stack.enter_async_context(
        CacheRuntime(model=path, block_size=BLOCK, max_blocks=4096, keep_caches=False, **options)
    )
    for prefix in prefixes:
        async with rt.generate(prefix + [33], max_tokens=1, cache_salt=None) as warm:
            async for _ in warm:
                pass
    return rt


async def _mlxkv(rt: Any, prefixes: list[list[int]], owns: list[list[int]]) -> dict[str, Any]:
    """One round on ``rt``: every request at once; peak memory above what was active before."""
    import mlx.core as mx

    from mlxkv import GenerationReport

    groups = len(prefixes)
    reports: list[Any] = [None] * len(owns)

    async def one(i: int) -> None:
        async with rt.generate(prefixes[i % groups] + owns[i], max_tokens=GENERATED) as stream:
            async for record in stream:
                if isinstance(record, GenerationReport):
                    reports[i] = record

    before = await rt.stats()
    gc.collect()  # the previous method's arrays: freed now, not during the round
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    started = time.perf_counter()
    with PeakByPlan() as plans:
        async with anyio.create_task_group() as tg:
            for i in range(len(owns)):
                tg.start_soon(one, i)
    wall = time.perf_counter() - started
    peak = _peak_above(base)
    assert all(r.cached_tokens == PREFIX // BLOCK * BLOCK for r in reports), "the prefix was not reused"
    after = await rt.stats()
    return {
        "decode_calls": after.compute.num_decode_steps - before.compute.num_decode_steps,
        "peak": peak,
        "peak_set_by": plans.setter(),
        "wall": wall,
        "tokens": [list(r.tokens) for r in reports],
        "ttft": [r.time_to_first_token for r in reports],
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from mlxkv.default_model import model_path

    path = model_path(args.model)
    prefixes = _prefixes(args.groups)
    mlx_lm = MlxLm(path, prefixes)
    table: dict[int, dict[str, list[dict[str, Any]]]] = {}
    tokens_seen = TokenComparison(mlx_lm.model, "batch_generate", stop_tokens=mlx_lm.tokenizer.eos_token_ids)
    async with AsyncExitStack() as stack:
        options: dict[str, dict[str, Any]] = {"mlxkv": {}, "mlxkv, copies": {"shared_prefix": False}}
        for extra in args.also:
            options[f"mlxkv, {extra}"] = _runtime_options(extra)
        runtimes = {method: await _open(stack, path, prefixes, **kw) for method, kw in options.items()}
        assert runtimes["mlxkv"].model_info is not None, "a runtime with a model describes it"
        per_token = runtimes["mlxkv"].model_info.kv_bytes_per_token
        if args.memory_limit is not None:
            import mlx.core as mx

            gc.collect()
            mx.synchronize()
            unbounded = mx.set_memory_limit(mx.get_active_memory() + args.memory_limit * 2**20)
        for n in args.sizes:
            samples: dict[str, list[dict[str, Any]]] = {method: [] for method in [*options, "batch_generate"]}
            rounds = [_owns(r, n) for r in range(args.rounds)]
            for r, owns in enumerate(rounds):
                turn = r % len(samples)
                order = list(samples)[turn:] + list(samples)[:turn]
                outs = {}
                for method in order:
                    if method == "batch_generate":
                        outs[method] = mlx_lm.run(owns)
                    else:
                        outs[method] = await _mlxkv(runtimes[method], prefixes, owns)
                    samples[method].append(outs[method])
                reference = outs["batch_generate"]["tokens"]
                prompts = [prefixes[i % args.groups] + own for i, own in enumerate(owns)]
                for method in options if not args.stand_ins else ():
                    tokens_seen.add(f"N={n}", method, prompts, reference, outs[method]["tokens"])
            table[n] = samples
        stats = await runtimes["mlxkv"].stats()
        assert stats.compute is not None and stats.compute.num_shared_prefix_tokens > 0, "no request read a shared prefix"
    if args.memory_limit is not None:
        mx.set_memory_limit(unbounded)  # the comparison's float32 weights are not the rounds' memory
    tokens = compare_tokens(tokens_seen) if not args.stand_ins else ["greedy tokens: not compared (the stand-ins')"]
    return {"per_token": per_token, "groups": args.groups, "table": table, "token_comparison": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="8,16,32,64", help="concurrent requests (8,16,32,64)")
    parser.add_argument("--groups", type=int, default=1, help="different prefixes the requests share (1)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per size (3)")
    parser.add_argument(
        "--model",
        help="an mlx-lm model directory, or a built-in model's name (bench-llama-722m-bf16: the"
        " GPU measurements' model; default: the built-in model)",
    )
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="also run mlxkv with these runtime options (integers), e.g. prefill_budget=1024,decode_wait=1; repeatable",
    )
    parser.add_argument(
        "--fused-attention-stand-in",
        action="store_true",
        help="on the CPU, fused attention calls hold only what a GPU's flash kernel holds (an estimate; tokens wrong)",
    )
    parser.add_argument(
        "--kernel-stand-in",
        action="store_true",
        help="off CUDA, the kernel way's decode steps run as on CUDA (with a stand-in for the kernel; tokens wrong)",
    )
    parser.add_argument(
        "--memory-limit",
        type=int,
        metavar="MIB",
        help="set MLX's memory limit this many MiB above what is active once every method is set up (every"
        " method's evaluations then wait for queued work past it): whether a limit bounds a GPU's peak, and"
        " at what speed",
    )
    parser.add_argument("--json", help="also write the results as JSON to FILE")
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    if args.fused_attention_stand_in:
        stand_ins.fused_attention_memory()
    if args.kernel_stand_in:
        stand_ins.kernel()
    args.stand_ins = args.fused_attention_stand_in or args.kernel_stand_in
    results = anyio.run(main_async, args)
    per_token, groups = results["per_token"], results["groups"]
    print(f"peak MLX memory above idle, {groups} prefix group(s) of {PREFIX} tokens, {OWN} own + {GENERATED} generated each")
    print(
        "| N | mlxkv | mlxkv, copies | batch_generate | floor | mlxkv / floor | tok/s mlxkv | tok/s batch_generate"
        " | tok/s ratio | TTFT p50 / p95 mlxkv | TTFT p50 / p95 batch_generate |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    summary = {}
    for n, samples in results["table"].items():
        floor = per_token * (groups * PREFIX + n * (OWN + GENERATED))
        peaks = {m: statistics.median(s["peak"] for s in v) for m, v in samples.items()}
        tps = {m: statistics.median(n * GENERATED / s["wall"] for s in v) for m, v in samples.items()}
        # Each round's ratio, then their median: the methods ran side by side.
        ratios = {
            m: statistics.median(b["wall"] / a["wall"] for a, b in zip(v, samples["batch_generate"]))
            for m, v in samples.items()
        }
        ttft = {m: _percentiles([t for s in v for t in s["ttft"]]) for m, v in samples.items()}
        calls = {m: statistics.median(s["decode_calls"] for s in v) for m, v in samples.items() if m != "batch_generate"}
        # The plan of the round whose peak was the median (the lower middle of an even count).
        set_by = {
            m: sorted(v, key=lambda s: s["peak"])[(len(v) - 1) // 2]["peak_set_by"]
            for m, v in samples.items()
            if m != "batch_generate"
        }
        summary[n] = {
            "peak": peaks,
            "floor": floor,
            "tokens_per_second": tps,
            "ratio": ratios,
            "ttft": ttft,
            "decode_calls": calls,
            "peak_set_by": set_by,
        }
        print(
            f"| {n} | {_mib(peaks['mlxkv'])} | {_mib(peaks['mlxkv, copies'])} | {_mib(peaks['batch_generate'])}"
            f" | {_mib(floor)} | {peaks['mlxkv'] / floor:.2f}x | {tps['mlxkv']:,.0f} | {tps['batch_generate']:,.0f}"
            f" | {ratios['mlxkv']:.2f}x | {_ms(ttft['mlxkv'])} | {_ms(ttft['batch_generate'])} |"
        )
    for method in [m for m in results["table"][args.sizes[0]] if m != "batch_generate"]:
        for n in args.sizes:
            row = summary[n]
            print(
                f"{method}, N={n}: {_mib(row['peak'][method])}, {row['tokens_per_second'][method]:,.0f} tok/s,"
                f" {row['ratio'][method]:.2f}x batch_generate, TTFT {_ms(row['ttft'][method])},"
                f" {row['decode_calls'][method]:.0f} decode calls; peak set by: {row['peak_set_by'][method]}"
            )
    for line in results["token_comparison"]:
        print(line)
    if args.json:
        summary["token_comparison"] = results["token_comparison"]
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
