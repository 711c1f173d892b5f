"""One decode step, whole model: what each way puts in MLX's graph and what the host spends on it.

``R`` rows decode together over ``G`` prefixes of ``P`` tokens (``--groups``;
one by default), row ``i`` over prefix ``i % G``, each with ``S`` tokens of
its own (the prefixes' blocks computed by the model, the rows prefilled by
the runner): a served chat's batch has a few system prompts, each shared
by a few rows. For each method, ``--steps`` steps after
``--warmup`` are run the way the runtime runs them:

- ``mlxkv, WAY`` for each shared-prefix way (``--ways``; default every
  :class:`~mlxkv.actors.prefix_attention.PrefixAttention`): mlxkv's own
  :class:`~mlxkv.actors.decode_batch.DecodeBatch` over a
  :class:`~mlxkv.actors.model_runner.TextRunner` attending that way;
- ``mlxkv, copies``: the same with ``shared_prefix=False`` (per-row copies
  of the prefix in mlx-lm's ``BatchKVCache``);
- ``mlx-lm``: mlx-lm's ``BatchGenerator`` given a copy of the prefix cache
  per row (as ``batch_generate`` takes them), its steps after every row's
  first token.

Per method and step: the operations the step puts in MLX's graph (the
primitives ``mx.export_to_dot`` lists for what the step hands to
``mx.async_eval``; ``non-view``: less those that only view their input --
transposes, broadcasts, slices, expanded or squeezed axes -- so roughly the
kernels a GPU launches), the host's milliseconds to build the step (from
the step's start to its ``async_eval`` on a drained device: Python and MLX
building the graph; on a GPU, encoding its kernels follows), the step's
wall milliseconds (steps queued as the runtime queues them), and the
blocking evaluations (``mx.eval``) and ``async_eval`` calls a step makes.
The graph and the evaluations are the same on every device; on a CPU the
build time stands for the host's share of a GPU step, and the wall time is
the CPU's arithmetic -- only a GPU's says what a GPU step costs.

    .venv/bin/python scripts/bench_step.py [--model NAME|PATH] [--rows 8,32] [--prefix 2048] [--groups 1]
        [--own 32] [--ways cascade,stacked] [--steps 32] [--json FILE]
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_batch import _prefix  # noqa: E402

#: Primitives that only view their input (no kernel of their own).
VIEWS = frozenset({"Broadcast", "Transpose", "Slice", "ExpandDims", "Squeeze", "AsStrided", "StopGradient"})


def graph_ops(*arrays: Any) -> tuple[int, int]:
    """(primitives, non-view primitives) MLX would run to evaluate ``arrays``."""
    out = io.StringIO()
    mx.export_to_dot(out, *arrays)
    labels = [line.split('label ="', 1)[1].split('"', 1)[0] for line in out.getvalue().splitlines() if "shape=rectangle" in line]
    return len(labels), sum(label not in VIEWS for label in labels)


class StepProbe:
    """Counts what the code between two :meth:`mark` calls evaluates: wraps
    ``mx.eval`` and ``mx.async_eval`` (module attributes, so every caller's
    ``mx.`` sees the wrappers) while it is entered."""

    def __init__(self) -> None:
        self.evals = 0
        self.async_evals = 0
        self.built_at: float | None = None
        self.ops: tuple[int, int] | None = None
        self.count_ops = False

    def __enter__(self) -> StepProbe:
        self._eval, self._async_eval = mx.eval, mx.async_eval

        def eval_(*args: Any) -> Any:
            self.evals += 1
            return self._eval(*args)

        def async_eval(*args: Any) -> Any:
            self.async_evals += 1
            # The last one queues the step (a suffix growth comes first).
            self.built_at = time.perf_counter()
            if self.count_ops:
                self.ops = graph_ops(*[a for a in _flatten(args)])
                self.count_ops = False
            return self._async_eval(*args)

        mx.eval, mx.async_eval = eval_, async_eval
        return self

    def __exit__(self, *exc: Any) -> None:
        mx.eval, mx.async_eval = self._eval, self._async_eval

    def mark(self) -> None:
        self.evals = self.async_evals = 0
        self.built_at = None


def _flatten(items: Any) -> list[Any]:
    out = []
    for item in items:
        if isinstance(item, (list, tuple)):
            out.extend(_flatten(item))
        elif isinstance(item, dict):
            out.extend(_flatten(list(item.values())))
        elif isinstance(item, mx.array):
            out.append(item)
    return out


def measure(step: Callable[[], None], warmup: int, steps: int) -> dict[str, Any]:
    """Run ``step`` ``warmup`` times, then ``steps`` times measured as the
    runtime runs them (each queued while the one before computes: wall time,
    evaluations), then ``steps`` times more, each on a drained device, for
    the host's time to build one: the device's work in flight, on a CPU's
    other cores, would only add noise to it."""
    build, wall, evals, async_evals = [], [], [], []
    with StepProbe() as probe:
        for index in range(warmup + 2 * steps):
            drained = index >= warmup + steps
            if index == warmup or drained:
                # Counted on a drained device: the graph of a step still in
                # flight would be counted again with this one's.
                mx.synchronize()
            probe.mark()
            probe.count_ops = index == warmup
            started = time.perf_counter()
            step()
            ended = time.perf_counter()
            if drained:
                build.append((probe.built_at or ended) - started)
            elif index >= warmup:
                wall.append(ended - started)
                evals.append(probe.evals)
                async_evals.append(probe.async_evals)
        ops = probe.ops
    return {
        "ops": ops[0] if ops else None,
        "non_view_ops": ops[1] if ops else None,
        "build_ms": statistics.median(build) * 1e3,
        "wall_ms": statistics.median(wall) * 1e3,
        "evals_per_step": statistics.mean(evals),
        "async_evals_per_step": statistics.mean(async_evals),
    }


def prompts(rows: int, prefix: int, own: int, groups: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """``groups`` prefixes (bench_batch's, its first token changed for each
    group after the first), and each row's own tokens (row ``i`` goes after
    prefix ``i % groups``)."""
    shared = _prefix(prefix)
    prefixes = [shared if g == 0 else [32 + (shared[0] - 32 + g) % 95, *shared[1:]] for g in range(groups)]
    return prefixes, [[32 + (i * 13 + r * 29) % 95 for i in range(own)] for r in range(rows)]


def prefix_cache(model: Any, shared: list[int]) -> list[Any]:
    """``model``'s plain cache of ``shared``, prefilled 256 tokens at a time."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for start in range(0, len(shared), 256):
        model(mx.array(shared[start : start + 256])[None], cache=cache)
        mx.eval([layer.state for layer in cache])
    return cache


def mlxkv_steps(
    path: str, options: dict[str, Any], prefixes: list[list[int]], owns: list[list[int]], block: int
) -> Callable[[], None]:
    """A decode batch of mlxkv's runner with every row joined (row ``i`` over
    ``prefixes[i % len(prefixes)]``); one call: one step."""
    from mlxkv.actors.compute_config import RunnerConfig
    from mlxkv.actors.decode_batch import DecodeBatch
    from mlxkv.actors.model_runner import TextRunner
    from mlxkv.actors.request import RequestSpec
    from mlxkv.actors.sequence import SequenceState
    from mlxkv.cache import kv_state

    runner = TextRunner.load(path, RunnerConfig(**options))
    payloads = []
    for shared in prefixes:
        cache = prefix_cache(runner._model, shared)
        payloads.append(tuple(kv_state.slice_blocks(cache, block, range(len(shared) // block), num_tokens=len(shared))))
        del cache
    sequences = []
    for index, own in enumerate(owns):
        group = index % len(prefixes)
        spec = RequestSpec(
            request_id=f"r{index}", prompt=prefixes[group] + own, prefix=payloads[group], max_tokens=1 << 20,
            block_size=block, stop_tokens=frozenset(),
        )  # fmt: skip
        sequence = SequenceState(spec)
        runner.start(sequence)
        logits = runner.prefill(sequence, len(spec.prompt))
        sequence.emitted(int(mx.argmax(logits).item()))
        sequences.append(sequence)
    batch = DecodeBatch(runner)
    batch.join(sequences)

    def step() -> None:
        batch.advance(1)

    return step


def mlx_lm_steps(path: str, prefixes: list[list[int]], owns: list[list[int]]) -> Callable[[], None]:
    """mlx-lm's ``BatchGenerator`` past every row's first token (row ``i``
    given a copy of ``prefixes[i % len(prefixes)]``'s cache); one call: one step."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    model, _ = load(path)
    caches = [prefix_cache(model, shared) for shared in prefixes]
    generator = BatchGenerator(model, stop_tokens=[])
    generator.insert(owns, [1 << 20] * len(owns), caches=[copy.deepcopy(caches[i % len(caches)]) for i in range(len(owns))])
    started: set[int] = set()
    while len(started) < len(owns):
        started.update(response.uid for response in generator.next_generated())

    def step() -> None:
        generator.next_generated()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="an mlx-lm model directory, or a built-in model's name (default: the built-in model)")
    parser.add_argument("--rows", default="8,32", help="rows decoding together, comma-separated (8,32)")
    parser.add_argument("--prefix", type=int, default=2048, help="tokens of the shared prefix (2048)")
    parser.add_argument("--groups", type=int, default=1, help="prefixes the rows are spread over (1)")
    parser.add_argument("--own", type=int, default=32, help="each row's own tokens before decoding (32)")
    parser.add_argument("--ways", help="shared-prefix ways, comma-separated (default: all)")
    parser.add_argument("--steps", type=int, default=32, help="measured steps per method (32)")
    parser.add_argument("--warmup", type=int, default=4, help="unmeasured steps first (4)")
    parser.add_argument("--json", help="also write the results as JSON to FILE")
    args = parser.parse_args()
    from mlxkv.actors.prefix_attention import PrefixAttention
    from mlxkv.default_model import model_path

    path = model_path(args.model)
    block = 64
    if args.prefix < block or args.prefix % block:
        parser.error(f"--prefix must be a positive multiple of {block}")
    if args.groups < 1:
        parser.error("--groups must be at least 1")
    ways = [PrefixAttention(w) for w in args.ways.split(",")] if args.ways else list(PrefixAttention)
    methods: dict[str, Callable[..., Callable[[], None]]] = {
        f"mlxkv, {way.value}": (lambda s, o, way=way: mlxkv_steps(path, {"prefix_attention": way}, s, o, block))
        for way in ways
    }
    methods["mlxkv, copies"] = lambda s, o: mlxkv_steps(path, {"shared_prefix": False}, s, o, block)
    methods["mlx-lm"] = lambda s, o: mlx_lm_steps(path, s, o)
    results: list[dict[str, Any]] = []
    print(
        f"model {Path(path).name}, device {mx.default_device()}, {args.groups} prefix(es) of {args.prefix},"
        f" own {args.own}, {args.steps} steps"
    )
    print("| rows | method | ops | non-view ops | build ms | wall ms | evals | async_evals |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for rows in [int(r) for r in args.rows.split(",")]:
        prefixes, owns = prompts(rows, args.prefix, args.own, args.groups)
        for name, make in methods.items():
            step = make(prefixes, owns)
            row = {"rows": rows, "method": name, **measure(step, args.warmup, args.steps)}
            del step
            mx.clear_cache()
            results.append(row)
            print(
                f"| {rows} | {name} | {row['ops']} | {row['non_view_ops']} | {row['build_ms']:.2f} | {row['wall_ms']:.2f}"
                f" | {row['evals_per_step']:g} | {row['async_evals_per_step']:g} |",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"model": Path(path).name, "device": str(mx.default_device()), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
