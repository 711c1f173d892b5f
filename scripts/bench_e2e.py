"""End to end: time to first token of a prompt whose leading blocks are cached.

By default a 2048-token prompt whose first 1984 tokens (31 blocks of 64) are
cached; ``--cached N --new M`` sets another shape (N a multiple of 64).

Four ways to get the first token of the same prompt on the built-in model:

- cold: ``CacheRuntime.generate`` with nothing cached (a fresh ``cache_salt``
  per repeat): the whole 2048-token prefill;
- warm: ``CacheRuntime.generate`` with the first 1984 tokens (31 blocks of
  64) cached, right after an untimed request of the same 1984 tokens under
  another ``cache_salt``: fetch, take the cache that request left (the
  runtime keeps the last finished requests' caches; across salts one is cut
  back to the blocks the request holds), prefill the 64 new tokens, sample;
- rebuilt: the same right after unrelated 8-token requests (untimed), as
  many as the runtime keeps caches, so the kept caches hold other tokens and
  the 1984 tokens of KV are rebuilt from the 31 blocks' payloads (what
  ``keep_caches=False`` always does; the warm run flushes them too
  before its primer, so its own earlier runs are not what it takes);
- ideal: plain mlx-lm on one thread, prefilling the 64 new tokens on a cache
  that already holds the 1984 (no lookup, no reconstruction; the cache is
  trimmed back after each repeat);
- vllm-mlx: vllm-mlx 0.6.0's ``BlockAwarePrefixCache`` ``fetch_cache`` +
  ``reconstruct_cache`` on the same stored prefix, then the same 64-token
  prefill, in a child process with the reference environment (vllm-mlx 0.6.0
  needs ``mlx-lm<0.32``; see ``scripts/bench_cache.py`` for its set-up).

Repeats are interleaved, the order rotated every repeat (so no method
always follows the heavy cold prefill), and the table shows medians and
ratios of medians; the "paired" ratios are the median of each repeat's own
ratio (its runs seconds apart), steadier when the machine drifts. Parity is
checked: the warm, rebuilt and vllm-mlx logits at the last prompt position
must equal the cold ones within 1e-4, and the warm greedy token must equal
the cold one.

    .venv/bin/python scripts/bench_e2e.py [--repeats 9] [--model DIR] [--json FILE]

(``mlxkv bench`` runs it with the same options, defined once in
:func:`mlxkv.cli.add_bench_arguments`.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mlxkv.actors.kept_caches import MAX_KEPT_CACHES
from mlxkv.cli import BENCH_BLOCK as BLOCK
from mlxkv.cli import add_bench_arguments

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VLLM_PYTHON = REPO / ".bench" / "vllm" / "bin" / "python"
ATOL = 1e-4

#: The child process: one repeat per "go" line on stdin, one JSON line back.
CHILD = r"""
import gc, json, sys, time
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from vllm_mlx.paged_cache import PagedCacheManager
from vllm_mlx.prefix_cache import BlockAwarePrefixCache

path, cached, block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompt = json.loads(sys.stdin.readline())
model, _ = load(path)
writer = make_prompt_cache(model)
for start in range(0, cached, 256):
    model(mx.array(prompt[start:min(start + 256, cached)])[None], cache=writer)
    mx.eval([c.state for c in writer])
store = BlockAwarePrefixCache(model, PagedCacheManager(block_size=block, max_blocks=256))
states = [{"state": c.state, "meta_state": c.meta_state, "class_name": type(c).__name__}
          for c in writer]
mx.eval([s["state"] for s in states])
store.store_cache("writer", prompt[:cached], states)
del writer
gc.collect()
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    gc.disable()
    start = time.perf_counter()
    table, remaining = store.fetch_cache("reader", prompt)
    cache = store.reconstruct_cache(table)
    model(mx.array(remaining[:-1])[None], cache=cache)
    logits = model(mx.array(remaining[-1:])[None], cache=cache)[0, -1]
    token = mx.argmax(logits)
    mx.eval(token, logits)
    elapsed = time.perf_counter() - start
    gc.enable()
    store.release_cache("reader")
    print(json.dumps({"seconds": elapsed, "cached": len(prompt) - len(remaining),
                      "token": int(token.item()), "logits": logits.tolist()}), flush=True)
"""


def _prompt(length: int) -> list[int]:
    # Printable bytes of the byte-level tokenizer, in a long non-repeating pattern.
    return [32 + (i * 37 + (i // 11) ** 2) % 95 for i in range(length)]


class Vllm:
    """The vllm-mlx child: one timed fetch+reconstruct+prefill per :meth:`repeat`."""

    def __init__(self, python: Path, model: str, prompt: list[int], cached: int) -> None:
        self.proc = subprocess.Popen(
            [str(python), "-c", CHILD, model, str(cached), str(BLOCK)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._send(json.dumps(prompt))
        assert self._receive().get("ready"), "the vllm-mlx child did not start"

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _receive(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the vllm-mlx child exited")
        return json.loads(line)

    def repeat(self) -> dict[str, Any]:
        self._send("go")
        return self._receive()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mlxkv import CacheRuntime, ModelLoadError
    from mlxkv.actors.model_source import check_model_source
    from mlxkv.default_model import DEFAULT_MODEL, ensure_model

    model_dir = args.model or str(ensure_model(DEFAULT_MODEL))
    check_model_source(model_dir)  # a bad path is one ModelLoadError, before any work
    cached, total = args.cached, args.cached + args.new
    prompt = _prompt(total)
    # The ideal: mlx-lm alone, a cache already holding the cached prefix.
    try:
        model, _ = load(model_dir)
    except Exception as error:  # a repo id that cannot be fetched, a model mlx-lm refuses
        raise ModelLoadError(model_dir, f"{type(error).__name__}: {error}") from error
    vllm = None
    vllm_python = args.vllm_python or DEFAULT_VLLM_PYTHON
    if vllm_python.is_file():
        vllm = Vllm(vllm_python, model_dir, prompt, cached)
    else:
        print(f"no reference environment at {vllm_python}: vllm-mlx skipped", file=sys.stderr)

    ideal_cache = make_prompt_cache(model)
    for start in range(0, cached, 256):
        model(mx.array(prompt[start : min(start + 256, cached)])[None], cache=ideal_cache)
        mx.eval([c.state for c in ideal_cache])

    def ideal() -> tuple[float, Any]:
        start = time.perf_counter()
        model(mx.array(prompt[cached:-1])[None], cache=ideal_cache)
        logits = model(mx.array(prompt[-1:])[None], cache=ideal_cache)[0, -1]
        token = mx.argmax(logits)
        mx.eval(token, logits)
        elapsed = time.perf_counter() - start
        for layer in ideal_cache:
            layer.trim(total - cached)
        return elapsed, logits

    samples: dict[str, list[float]] = {"cold": [], "warm": [], "rebuilt": [], "ideal": [], "vllm-mlx": []}
    # Only what ran has a worst difference: a skipped vllm-mlx is absent, not 0.0.
    worst: dict[str, float] = dict.fromkeys(("warm", "rebuilt", "ideal"), 0.0)
    if vllm is not None:
        worst["vllm-mlx"] = 0.0
    same_token = True
    blocks = max(4096, 4 * (total // BLOCK + 2))
    async with CacheRuntime(model=model_dir, block_size=BLOCK, max_blocks=blocks) as rt:

        async def first(prompt_ids: list[int], salt: str) -> Any:
            async with rt.generate(prompt_ids, max_tokens=1, cache_salt=salt) as stream:
                async for record in stream:
                    pass
            return stream.report

        await first(prompt[: cached + 1], "warm")  # stores the blocks of the prefix
        kinds = ["cold", "warm", "rebuilt", "ideal"] + (["vllm-mlx"] if vllm is not None else [])
        for i in range(args.warmup + args.repeats):
            # Rotate the order, so that no method always follows the heavy cold prefill.
            shift = i % len(kinds)
            results: dict[str, Any] = {}
            for kind in kinds[shift:] + kinds[:shift]:
                if kind == "cold":
                    results[kind] = await first(prompt, f"cold-{i}")
                elif kind in ("warm", "rebuilt"):
                    # Untimed: what the kept caches hold when the timed request starts.
                    for k in range(MAX_KEPT_CACHES):
                        await first(list(range(40 + k, 48 + k)), "other")
                    if kind == "warm":
                        await first(prompt[: cached + 1], "primer")
                    results[kind] = await first(prompt, "warm")
                    assert results[kind].cached_tokens == cached, results[kind]
                elif kind == "ideal":
                    results[kind] = ideal()
                else:
                    results[kind] = vllm.repeat()  # type: ignore[union-attr]
                    assert results[kind]["cached"] == cached, results[kind]["cached"]
            cold, warm = results["cold"], results["warm"]
            reference = np.array(cold.prompt_logits)
            diffs = {
                "warm": np.abs(np.array(warm.prompt_logits) - reference).max(),
                "rebuilt": np.abs(np.array(results["rebuilt"].prompt_logits) - reference).max(),
                "ideal": np.abs(np.array(results["ideal"][1]) - reference).max(),
            }
            same_token &= warm.tokens[:1] == cold.tokens[:1]
            if vllm is not None:
                diffs["vllm-mlx"] = np.abs(np.array(results["vllm-mlx"]["logits"]) - reference).max()
            if i < args.warmup:
                continue
            samples["cold"].append(cold.time_to_first_token)
            samples["warm"].append(warm.time_to_first_token)
            samples["rebuilt"].append(results["rebuilt"].time_to_first_token)
            samples["ideal"].append(results["ideal"][0])
            if vllm is not None:
                samples["vllm-mlx"].append(results["vllm-mlx"]["seconds"])
            for name, diff in diffs.items():
                worst[name] = max(worst[name], float(diff))
    if vllm is not None:
        vllm.close()

    medians = {name: statistics.median(v) for name, v in samples.items() if v}
    parity = same_token and all(diff <= ATOL for diff in worst.values())
    return {
        "model": model_dir,
        "prompt_tokens": total,
        "cached_tokens": cached,
        "repeats": args.repeats,
        "median_ms": {name: round(m * 1e3, 3) for name, m in medians.items()},
        "warm_over_ideal": round(medians["warm"] / medians["ideal"], 3),
        "rebuilt_over_ideal": round(medians["rebuilt"] / medians["ideal"], 3),
        # Each repeat's ratio (its runs were seconds apart), then their median:
        # steadier than a ratio of medians when the machine drifts.
        "paired_warm_over_ideal": round(_paired(samples["warm"], samples["ideal"]), 3),
        "paired_rebuilt_over_ideal": round(_paired(samples["rebuilt"], samples["ideal"]), 3),
        "cold_over_warm": round(medians["cold"] / medians["warm"], 2),
        "vllm_over_warm": (
            round(medians["vllm-mlx"] / medians["warm"], 3) if "vllm-mlx" in medians else None
        ),
        "max_logit_diff_vs_cold": {name: float(f"{d:.3g}") for name, d in worst.items()},
        "parity": parity,
    }


def _paired(mine: list[float], ideal: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(mine, ideal))


def run(args: argparse.Namespace) -> int:
    """Run the benchmark with parsed options (see :func:`mlxkv.cli.add_bench_arguments`)
    and print its table; the exit status: 0, or 1 if parity failed."""
    import anyio

    result = anyio.run(bench, args)
    m = result["median_ms"]
    total, cached = result["prompt_tokens"], result["cached_tokens"]
    rows = [
        (f"cold: full {total}-token prefill", m["cold"], result["cold_over_warm"]),
        (f"warm: mlxkv generate, {cached} cached", m["warm"], 1.0),
        ("rebuilt: the same, rebuilt from blocks", m["rebuilt"], m["rebuilt"] / m["warm"]),
        (f"ideal: {total - cached}-token prefill on a present cache", m["ideal"], m["ideal"] / m["warm"]),
    ]
    if "vllm-mlx" in m:
        rows.append(("vllm-mlx 0.6.0 fetch+reconstruct+prefill", m["vllm-mlx"], m["vllm-mlx"] / m["warm"]))
    print(f"{'time to first token (median)':<46} {'ms':>9}  {'/ warm':>7}")
    for label, ms, ratio in rows:
        print(f"{label:<46} {ms:9.2f}  {ratio:7.3f}")
    print(f"warm / ideal = {result['warm_over_ideal']} (paired {result['paired_warm_over_ideal']}),"
          f" rebuilt / ideal = {result['rebuilt_over_ideal']} (paired {result['paired_rebuilt_over_ideal']})")
    diffs = ", ".join(f"{name} {diff:.3g}" for name, diff in result["max_logit_diff_vs_cold"].items())
    skipped = "" if "vllm-mlx" in result["max_logit_diff_vs_cold"] else "; vllm-mlx skipped"
    print(f"parity (max |logits - cold| <= {ATOL}): {'ok' if result['parity'] else 'FAILED'}"
          f" ({diffs}{skipped})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["parity"] else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
