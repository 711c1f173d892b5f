"""What holding answers to JSON costs: decode throughput, and a vocabulary's masks.

**Throughput.** ``--requests`` prompts of ``--prompt-tokens`` random tokens,
all in flight together, greedy, ``--max-tokens`` each, on the built-in
model (or ``--model``), each run on a fresh runtime, alternating per round:

- ``free``: no constraint;
- ``json``: every request held to a schema (an object holding a list of
  integers; the tokens column says whether any answer ended before
  ``--max-tokens``, as free ones do not on the built-in model);
- ``mixed``: half of them held, decoding in the same batches as the free
  half (whose tokens per second say what a constrained row costs the rows
  beside it: a step with one waits for the tokens before it).

Each runtime runs the requests twice: ``cold``, where every grammar state
met is new (its tokens found walking the vocabulary), then ``warm``, where
they are cached (a server's steady state under one schema). Per method and
pass: generated tokens per second of wall time (all requests; the free
rows' alone in ``mixed``) and the host's milliseconds a call of
``JsonConstraint.allowed`` takes (timed here), medians over rounds.

**Masks over a large vocabulary.** ``--vocab`` random byte strings (2-9 of
letters, digits, spaces and JSON's punctuation; the built-in model's
vocabulary is its 256 bytes): how long the first walk of a state takes (at a
value's start, after a key, inside a string, after a backslash, inside
strings held to a pattern, a maxLength and a format, inside a bounded
number) and a cached one, medians over ``--walks`` fresh constraints. A
synthetic vocabulary: a real one (no weights can be fetched here) has more
tokens that share long prefixes.

**Compiling schemas.** How long :class:`JsonGrammar` takes to compile a
realistic schema with patterns and bounds, one at the size bound, and two
past the patterns' budgets (refused: how soon), medians over ``--walks``:
a request's schema is compiled on the event loop.

    .venv/bin/python scripts/bench_json.py [--rounds 5] [--model DIR] [--vocab 150000] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any, Optional, Sequence

import anyio

METHODS = ("free", "json", "mixed")
#: The throughput's schema: a list of integers (whose states repeat: their
#: masks are cached); the answers' token counts say whether any ended early.
NUMBERS = {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"}}},
           "required": ["numbers"]}  # fmt: skip
#: The masks' schema: an object with one string.
NAMED = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "tag": {"type": "string", "maxLength": 40},
        "day": {"type": "string", "format": "date-time"},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "note": {"type": "string", "pattern": "^(.*x){8}$"},
        "name": {"type": "string"},
    },
    "required": ["name"],
}
#: The states whose first walk is timed: (name, the text read to reach it).
STATES = (
    ("value start", b""),
    ("after a key", b'{"name"'),
    ("after a colon", b'{"name":'),
    ("inside a string", b'{"name":"ab'),
    ("after a backslash", b'{"name":"ab\\'),
    ("in a pattern's string", b'{"code":"AB-1'),
    ("in a string of maxLength", b'{"tag":"abc'),
    ("in a date-time", b'{"day":"2024-05-06T1'),
    ("in a bounded number", b'{"score":1'),
    ("in a permissive pattern's string", b'{"note":"axbx'),
)


class _Timed:
    """``JsonConstraint.allowed`` with its calls' host time summed."""

    def __init__(self) -> None:
        from mlxkv.actors.json_constraint import JsonConstraint

        self.seconds = 0.0
        self.calls = 0
        self._allowed = JsonConstraint.allowed
        timed = self

        def allowed(constraint: Any, state: Any) -> Any:
            start = time.perf_counter()
            try:
                return timed._allowed(constraint, state)
            finally:
                timed.seconds += time.perf_counter() - start
                timed.calls += 1

        JsonConstraint.allowed = allowed  # type: ignore[method-assign]

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


async def _one_run(
    model: str, method: str, prompts: list[list[int]], max_tokens: int, timer: _Timed
) -> list[dict[str, Any]]:
    """Two passes of the requests on one fresh runtime: the first finds every
    state's tokens (cold masks), the second finds them cached (warm)."""
    from mlxkv import CacheRuntime, GeneratedToken

    passes = []
    async with CacheRuntime(model=model) as rt:
        # The vocabulary is read before the clock starts.
        async with rt.generate(prompts[0], max_tokens=2, json_schema=NUMBERS, cache_salt="warm-up") as stream:
            async for _ in stream:
                pass
        for name in ("cold", "warm"):
            counts: dict[int, int] = {}
            held = {i for i in range(len(prompts)) if method == "json" or (method == "mixed" and i % 2 == 0)}

            async def one(index: int, prompt: list[int]) -> None:
                schema = NUMBERS if index in held else None
                async with rt.generate(prompt, max_tokens=max_tokens, json_schema=schema, cache_salt=name) as stream:
                    counts[index] = sum([isinstance(record, GeneratedToken) async for record in stream])

            timer.reset()
            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for index, prompt in enumerate(prompts):
                    tg.start_soon(one, index, prompt)
            wall = time.perf_counter() - start
            passes.append(
                {
                    "masks": name, "tokens": sum(counts.values()), "wall_s": wall,
                    "free_tokens": sum(counts[i] for i in counts if i not in held),
                    "allowed_ms_per_call": timer.seconds / timer.calls * 1e3 if timer.calls else None,
                    "allowed_calls": timer.calls,
                }
            )  # fmt: skip
    return passes


async def throughput(args: argparse.Namespace) -> dict[str, Any]:
    from mlxkv.default_model import model_path

    model = model_path(args.model)
    timer = _Timed()
    runs = []
    for round_ in range(args.rounds):
        rng = random.Random(round_)
        prompts = [[rng.randrange(256) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
        order = METHODS if round_ % 2 == 0 else METHODS[::-1]
        for method in order:
            for result in await _one_run(model, method, prompts, args.max_tokens, timer):
                runs.append(
                    {
                        "method": method, "round": round_, **result,
                        "tokens_per_s": result["tokens"] / result["wall_s"],
                        "free_tokens_per_s": result["free_tokens"] / result["wall_s"],
                    }
                )  # fmt: skip
            print(f"round {round_ + 1}/{args.rounds} {method}: {runs[-1]['tokens_per_s']:,.1f} tok/s", file=sys.stderr)
    summary = {}
    for method in METHODS:
        for masks in ("cold", "warm"):
            mine = [r for r in runs if r["method"] == method and r["masks"] == masks]
            summary[f"{method} {masks}"] = {
                key: statistics.median(r[key] for r in mine if r[key] is not None)
                if any(r[key] is not None for r in mine) else None
                for key in ("tokens_per_s", "free_tokens_per_s", "tokens", "allowed_ms_per_call")
            }  # fmt: skip
    return {"model": model, "runs": runs, "summary": summary}


def mask_walks(vocab: int, walks: int) -> dict[str, Any]:
    """First and cached walks of each of :data:`STATES` over a synthetic vocabulary."""
    from mlxkv.actors.json_constraint import JsonConstraint, TokenBytes
    from mlxkv.actors.json_grammar import JsonGrammar

    rng = random.Random(0)
    letters = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ      0123456789.,;:!?-_'\"{}[]()\n\\/<>=+*"
    pieces: list[Optional[bytes]] = [bytes([b]) for b in range(256)]
    seen = set(pieces)
    while len(pieces) < vocab:
        piece = bytes(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
    pieces.append(None)
    start = time.perf_counter()
    tokens = TokenBytes(pieces, len(pieces))
    read_s = time.perf_counter() - start
    first: dict[str, list[float]] = {name: [] for name, _ in STATES}
    cached: dict[str, list[float]] = {name: [] for name, _ in STATES}
    allowed: dict[str, int] = {}
    for _ in range(walks):
        constraint = JsonConstraint(JsonGrammar(NAMED), tokens, [len(pieces) - 1])
        for name, text in STATES:
            state = constraint.grammar.read(constraint.grammar.start, text)
            for times in (first, cached):
                start = time.perf_counter()
                mask = constraint.allowed(state)
                times[name].append((time.perf_counter() - start) * 1e3)
            allowed[name] = int(mask.sum())
    return {
        "vocab": len(pieces), "read_s": read_s,
        "states": {
            name: {"allowed": allowed[name], "first_ms": statistics.median(first[name]),
                   "cached_ms": statistics.median(cached[name])}
            for name, _ in STATES
        },
    }  # fmt: skip


#: Schemas whose compiling is timed: (name, schema). The last two sit past
#: the patterns' budgets, so they are refused; what matters is how soon.
COMPILED = (
    ("a booking: pattern, lengths, bounds, date, uuid", {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "label": {"type": "string", "minLength": 1, "maxLength": 40},
            "seats": {"type": "integer", "minimum": 1, "maximum": 9},
            "day": {"type": "string", "format": "date"},
            "ref": {"type": "string", "format": "uuid"},
        },
        "required": ["code", "label", "seats", "day", "ref"],
    }),
    ("4,000 integer properties", {"properties": {f"k{i}": {"type": "integer"} for i in range(4000)}}),
    ("24 patterns of 1,000 repeats (refused)",
     {"properties": {f"k{i}": {"pattern": f"^[a-{chr(98 + i)}]{{0,1000}}$"} for i in range(24)}}),
    ("60 dotted patterns with maxLength (refused)",
     {"properties": {f"k{i}": {"pattern": f"^.{{1,{4 + i}}}$", "maxLength": 99} for i in range(60)}}),
)  # fmt: skip


def compile_times(walks: int) -> dict[str, float]:
    """Median milliseconds compiling each of :data:`COMPILED` (refused or not):
    what a request's schema costs the event loop."""
    from mlxkv.actors.json_grammar import JsonGrammar, SchemaNotSupported

    times: dict[str, list[float]] = {name: [] for name, _ in COMPILED}
    for _ in range(walks):
        for name, schema in COMPILED:
            start = time.perf_counter()
            try:
                JsonGrammar(schema)
            except SchemaNotSupported:
                pass
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(spent) for name, spent in times.items()}


def table(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = []
    if "throughput" in results:
        summary = results["throughput"]["summary"]
        lines += [
            f"{args.requests} requests of {args.prompt_tokens} tokens, greedy, {args.max_tokens} tokens each, "
            f"medians of {args.rounds} rounds",
            "| method | masks | generated tok/s | free rows' tok/s | tokens | host ms a mask (allowed) |",
            "| --- | --- | ---: | ---: | ---: | ---: |",
        ]
        for method in METHODS:
            for masks in ("cold", "warm"):
                m = summary[f"{method} {masks}"]
                ms = "-" if m["allowed_ms_per_call"] is None else f"{m['allowed_ms_per_call']:.3f}"
                lines.append(
                    f"| {method} | {masks} | {m['tokens_per_s']:,.1f} | {m['free_tokens_per_s']:,.1f} "
                    f"| {m['tokens']:.0f} | {ms} |"
                )
        for masks in ("cold", "warm"):
            free = summary[f"free {masks}"]["tokens_per_s"]
            lines.append(
                f"{masks} masks: json / free {summary[f'json {masks}']['tokens_per_s'] / free:.3f}x; mixed's free "
                f"rows / free (per row) {2 * summary[f'mixed {masks}']['free_tokens_per_s'] / free:.3f}x"
            )
    if "masks" in results:
        masks = results["masks"]
        lines += [
            f"masks over a synthetic vocabulary of {masks['vocab']:,} tokens (read in {masks['read_s']:.2f} s)",
            "| state | tokens allowed | first walk ms | cached ms |",
            "| --- | ---: | ---: | ---: |",
        ]
        for name, m in masks["states"].items():
            lines.append(f"| {name} | {m['allowed']:,} | {m['first_ms']:.2f} | {m['cached_ms']:.4f} |")
    lines += ["| schema compiled | ms |", "| --- | ---: |"]
    lines += [f"| {name} | {ms:.1f} |" for name, ms in results["compile"].items()]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each running every method (5)")
    parser.add_argument("--model", help="an mlx-lm model directory or a built-in model's name (default: built-in)")
    parser.add_argument("--requests", type=int, default=8, help="requests in flight (8)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt (64)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per answer at most (128)")
    parser.add_argument("--vocab", type=int, default=150_000, help="the synthetic vocabulary's size (150000; 0: skip)")
    parser.add_argument("--walks", type=int, default=5, help="fresh constraints whose walks are timed (5)")
    parser.add_argument("--skip-throughput", action="store_true", help="time the masks only")
    parser.add_argument("--json", help="also write the runs and their summary as JSON to FILE")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.requests < 2:
        parser.error("--rounds must be at least 1 and --requests at least 2")
    results: dict[str, Any] = {}
    if not args.skip_throughput:
        results["throughput"] = anyio.run(throughput, args)
    if args.vocab:
        results["masks"] = mask_walks(args.vocab, args.walks)
    results["compile"] = compile_times(args.walks)
    print(table(results, args))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
