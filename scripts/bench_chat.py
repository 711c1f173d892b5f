"""The chat workload of ``mlxkv run``, embedded, with shared prefixes on and off.

``mlxkv run``'s default workload (4 system prompts of 512 tokens, 16
two-turn conversations, 48-token user turns, 32 greedy tokens per answer, 8
requests in flight; each run on a fresh runtime) on the built-in model (or
``--model``), alternating two runtimes per round:

- ``shared``: ``shared_prefix=True`` (the default): requests over the same
  cached blocks hold one copy of them and attend to it the device's way
  (``--prefix-attention``: another);
- ``copies``: ``shared_prefix=False``: each request rebuilds its own copy of
  its cached prefix and attends through fused attention over it.

Both run the same requests (a warning says so if their generated or reused
token counts differ: reuse depends on timing, in-flight sharing and the kept
last cache), and once the rounds are over each request's greedy answer with
shared prefixes is compared with its answer from copies: where one parts,
whether at a tie within float noise (``scripts/divergence.py``). Per
method: generated tokens per second of wall time and warm TTFT p50/p95
(medians over rounds), and the paired ratio shared / copies (the median of
each round's own ratio). Rounds rotate the order and seed the texts by
round.

    .venv/bin/python scripts/bench_chat.py [--rounds 5] [--model DIR] [--prefix-attention WAY] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = {"shared": True, "copies": False}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every round of both methods; the per-round figures and their medians."""
    from mlxkv.default_model import model_path
    from mlxkv.runtime_config import RuntimeConfig
    from mlxkv.workload import WorkloadConfig, run_workload

    model = model_path(args.model)
    runs: list[dict[str, Any]] = []
    answers: dict[tuple[int, str], dict[str, tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    way = {"prefix_attention": args.prefix_attention} if args.prefix_attention else {}
    for round_ in range(args.rounds):
        order = list(METHODS) if round_ % 2 == 0 else list(METHODS)[::-1]
        for method in order:
            config = WorkloadConfig(
                runtime=RuntimeConfig(model=model, shared_prefix=METHODS[method], **way),
                requests=args.requests,
                concurrency=args.concurrency,
                max_tokens=args.max_tokens,
                prompt_tokens=args.prompt_tokens,
                user_tokens=args.user_tokens,
                seed=round_,
            )
            seen = answers[(round_, method)] = {}

            def keep(report: Any, seen: dict[str, Any] = seen) -> None:
                seen[report.request_id] = (report.prompt_ids, report.tokens)

            report = await run_workload(config, on_report=keep)
            runs.append(
                {
                    "method": method,
                    "round": round_,
                    "tokens_per_s": report.throughput_tokens_per_second,
                    "ttft_warm_p50_ms": report.ttft_warm_p50_ms,
                    "ttft_warm_p95_ms": report.ttft_warm_p95_ms,
                    "generated_tokens": report.generated_tokens,
                    "reused_tokens": report.reused_tokens,
                }
            )
            print(
                f"round {round_ + 1}/{args.rounds} {method}: {report.throughput_tokens_per_second:,.1f} tok/s, "
                f"warm TTFT p50 {report.ttft_warm_p50_ms} ms",
                file=sys.stderr,
            )
    summary = summarize(runs)
    summary["token_comparison"] = compare_answers(model, answers, args.rounds)
    return {"model": model, "runs": runs, "summary": summary}


def compare_answers(
    model: str, answers: dict[tuple[int, str], dict[str, tuple[tuple[int, ...], tuple[int, ...]]]], rounds: int
) -> list[str]:
    """Each round's shared-prefix answers against the copies' (greedy, the
    same requests), once every round is over: where one parts, whether at a
    tie within float noise (``scripts/divergence.py``). A request whose
    prompt differs between the two (a second turn after answers that
    parted) is not compared; the lines count them."""
    from divergence import TokenComparison, compare_tokens
    from mlx_lm import load

    loaded, tokenizer = load(model)
    seen = TokenComparison(loaded, "copies", stop_tokens=tokenizer.eos_token_ids)
    apart = 0
    for round_ in range(rounds):
        shared, copies = answers[(round_, "shared")], answers[(round_, "copies")]
        same = [i for i in sorted(shared.keys() & copies.keys()) if shared[i][0] == copies[i][0]]
        apart += len(shared.keys() | copies.keys()) - len(same)
        seen.add(
            "chat",
            "shared",
            [copies[i][0] for i in same],
            [copies[i][1] for i in same],
            [shared[i][1] for i in same],
        )
    lines = compare_tokens(seen)
    if apart:
        lines.append(f"requests not compared (their prompts differ: an earlier turn's answer parted): {apart}")
    return lines


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per method, the paired ratio, and whether both computed the same."""
    summary: dict[str, Any] = {}
    for method in METHODS:
        mine = [r for r in runs if r["method"] == method]
        summary[method] = {
            key: statistics.median(r[key] for r in mine if r[key] is not None)
            for key in ("tokens_per_s", "ttft_warm_p50_ms", "ttft_warm_p95_ms")
        }
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["method"]] = r
    pairs = [m for m in by_round.values() if len(m) == len(METHODS)]
    summary["ratio"] = statistics.median(m["shared"]["tokens_per_s"] / m["copies"]["tokens_per_s"] for m in pairs)
    summary["same_work"] = all(
        m["shared"]["generated_tokens"] == m["copies"]["generated_tokens"]
        and m["shared"]["reused_tokens"] == m["copies"]["reused_tokens"]
        for m in pairs
    )
    return summary


def table(summary: dict[str, Any], rounds: int) -> str:
    lines = [
        f"the `mlxkv run` chat workload, embedded, medians of {rounds} rounds",
        "| prefixes | generated tok/s | warm TTFT p50 / p95 |",
        "| --- | ---: | ---: |",
    ]
    for method in METHODS:
        m = summary[method]
        lines.append(
            f"| {method} | {m['tokens_per_s']:,.1f} | {m['ttft_warm_p50_ms']:.1f} / {m['ttft_warm_p95_ms']:.1f} ms |"
        )
    lines.append(f"shared / copies (median of each round's ratio): {summary['ratio']:.3f}x generated tokens/s")
    if not summary["same_work"]:
        lines.append("note: the two methods generated or reused different token counts in some round")
    lines.extend(summary.get("token_comparison", []))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each running both methods (5)")
    parser.add_argument(
        "--model",
        help="an mlx-lm model directory, or a built-in model's name (bench-llama-722m-bf16: the"
        " GPU measurements' model; default: the built-in model)",
    )
    parser.add_argument("--requests", type=int, default=32, help="requests per run (32)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (8)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (32)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="tokens per system prompt (512)")
    parser.add_argument("--user-tokens", type=int, default=48, help="tokens per user turn (48)")
    parser.add_argument(
        "--prefix-attention",
        choices=["cascade", "gathered", "stacked", "mixed", "kernel"],
        help="the way shared prefixes are attended to (default: the device's)",
    )
    parser.add_argument("--json", help="also write the runs and their summary as JSON to FILE")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    results = anyio.run(run, args)
    print(table(results["summary"], args.rounds))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
