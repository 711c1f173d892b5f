"""KV quantization (``kv_bits``): what it saves and what it costs in accuracy.

On a Llama of hidden 256, 4 layers, 4 query / 2 KV heads of 64 (written
once, like the built-in model, whose heads of 48 MLX cannot quantize), for
each setting -- float32, ``kv_bits=8``, ``kv_bits=4`` -- the same prompts
(random text, 512 tokens) are generated greedily (64 tokens) through
``CacheRuntime``, and compared with float32:

- KV bytes per token (what a block of the pool, and a live cache, holds);
- the logits of the last prompt position: max and mean absolute difference,
  and whether the argmax (the first token) agrees;
- the greedy continuation: prompts whose 64 tokens all agree, and the mean
  index of the first disagreement (64 when none);
- warm requests served from quantized blocks against their own cold runs
  (the pool adds no error of its own: it stores the quantized values).

    .venv/bin/python scripts/bench_kv_bits.py [--prompts 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

import anyio
import numpy as np

PROMPT, ANSWER = 512, 64


def _spec() -> Any:
    from mlxkv.default_model import UNTIED_SHARP, ModelSpec, _llama

    config = _llama(hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    return ModelSpec(name="mlxkv-bench-llama-256", model_type="llama", config=config, weight_scales=UNTIED_SHARP)


def _prompts(count: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(32, 127) for _ in range(PROMPT)] for _ in range(count)]


async def _generate(path: str, prompts: list[list[int]], bits: Any) -> dict[str, Any]:
    from mlxkv import CacheRuntime

    async with CacheRuntime(model=path, kv_bits=bits, block_size=64, keep_caches=False) as rt:
        out = {"bytes_per_token": rt.model_info.kv_bytes_per_token, "tokens": [], "logits": [], "warm_equal": 0}
        for prompt in prompts:
            async with rt.generate(prompt, max_tokens=ANSWER) as stream:
                async for _ in stream:
                    pass
            report = stream.report
            out["tokens"].append(list(report.tokens))
            out["logits"].append(np.array(report.prompt_logits))
            async with rt.generate(prompt, max_tokens=ANSWER) as again:  # served from its blocks
                async for _ in again:
                    pass
            assert again.report.cached_tokens > 0
            out["warm_equal"] += list(again.report.tokens) == list(report.tokens)
    return out


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from mlxkv.default_model import ensure_model

    path = str(ensure_model(_spec()))
    prompts = _prompts(args.prompts)
    runs = {bits: await _generate(path, prompts, bits) for bits in (None, 8, 4)}
    full = runs[None]
    rows = {}
    for bits, run in runs.items():
        diffs = [np.abs(a - b) for a, b in zip(run["logits"], full["logits"])]
        rows["float32" if bits is None else f"{bits} bits"] = {
            "bytes_per_token": run["bytes_per_token"],
            "saving": full["bytes_per_token"] / run["bytes_per_token"],
            "logits_max_abs": float(max(d.max() for d in diffs)),
            "logits_mean_abs": float(statistics.mean(float(d.mean()) for d in diffs)),
            "first_token_agrees": sum(int(a.argmax() == b.argmax()) for a, b in zip(run["logits"], full["logits"])),
            "all_tokens_agree": sum(a == b for a, b in zip(run["tokens"], full["tokens"])),
            "mean_first_difference": statistics.mean(
                _first_difference(a, b) for a, b in zip(run["tokens"], full["tokens"])
            ),
            "warm_equals_cold": run["warm_equal"],
        }
    return {"prompts": len(prompts), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="prompts per setting (16)")
    parser.add_argument("--json", help="also write the results as JSON to FILE")
    args = parser.parse_args()
    results = anyio.run(main_async, args)
    n = results["prompts"]
    print(f"{n} prompts of {PROMPT} tokens, {ANSWER} greedy tokens each, against float32")
    print("| KV | bytes/token | saving | logits max / mean abs diff | first token agrees | all 64 agree | first difference (mean) | warm = cold |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, row in results["rows"].items():
        print(
            f"| {name} | {row['bytes_per_token']} | {row['saving']:.1f}x | {row['logits_max_abs']:.4f} / {row['logits_mean_abs']:.5f}"
            f" | {row['first_token_agrees']}/{n} | {row['all_tokens_agree']}/{n} | {row['mean_first_difference']:.1f}"
            f" | {row['warm_equals_cold']}/{n} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
