"""Where the host waits for the device while mlxkv serves: ``mlxkv run``'s workload, its plans counted.

Runs the chat workload of ``mlxkv run`` (on the built-in model, or
``--model``) with a probe on ``mx.eval`` and on the executor, and counts per
kind of plan (decode: it steps the batch; prefill: it runs chunks; other:
it only publishes, lets go or joins): the plans, the blocking evaluations
with work to run (``mx.eval`` of a graph not yet queued: on a GPU a wait
for everything queued before it), and the decode plans that made one before
their step was queued (the device, its step in flight done, then idles
while the host builds the next one). Reads of values are not counted: a
decode step's ``tolist`` of the tokens the step before sampled (queued a
plan before), a prefill's ``item`` of its first tokens. The counts are the
same on every device; they do not depend on its speed.

    .venv/bin/python scripts/plan_waits.py [--model DIR] [--requests 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fused_calls import graph_ops  # noqa: E402

KINDS = ("decode", "prefill", "other")


class PlanProbe:
    """Counts, per kind of plan, the plans, their blocking evaluations with
    work, and the decode plans that made one before their step was queued."""

    def __init__(self) -> None:
        self.counts = {kind: {"plans": 0, "evals with work": 0, "waited before the step": 0} for kind in KINDS}
        self._plan: Any = None
        self._stepped = False
        self._waited = False

    def __enter__(self) -> PlanProbe:
        from mlxkv.actors.decode_batch import DecodeBatch
        from mlxkv.actors.executor import Executor

        self._undo = [(mx, "eval", mx.eval), (Executor, "run", Executor.run), (DecodeBatch, "_step", DecodeBatch._step)]
        honest_eval, honest_run, honest_step = mx.eval, Executor.run, DecodeBatch._step
        probe = self

        def evaluate(*arrays: Any) -> Any:
            if probe._plan is not None and graph_ops(*_flat(arrays))[0]:
                probe.counts[_kind(probe._plan)]["evals with work"] += 1
                probe._waited |= not probe._stepped
            return honest_eval(*arrays)

        def run(executor: Any, plan: Any) -> Any:
            probe._plan, probe._stepped, probe._waited = plan, False, False
            try:
                return honest_run(executor, plan)
            finally:
                counts = probe.counts[_kind(plan)]
                counts["plans"] += 1
                counts["waited before the step"] += bool(plan.steps and probe._waited)
                probe._plan = None

        def step(batch: Any) -> Any:
            try:
                return honest_step(batch)  # queues its step before it reads the fed tokens
            finally:
                probe._stepped = True

        mx.eval, Executor.run, DecodeBatch._step = evaluate, run, step
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, value in self._undo:
            setattr(owner, name, value)


def _kind(plan: Any) -> str:
    return "decode" if plan.steps else "prefill" if plan.prefill else "other"


def _flat(tree: Any) -> list[Any]:
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [a for item in tree for a in _flat(item)]
    if isinstance(tree, dict):
        return [a for item in tree.values() for a in _flat(item)]
    return []


async def measure(model: str, requests: int) -> dict[str, dict[str, int]]:
    from mlxkv.runtime_config import RuntimeConfig
    from mlxkv.workload import WorkloadConfig, run_workload

    with PlanProbe() as probe:
        await run_workload(WorkloadConfig(runtime=RuntimeConfig(model=model), requests=requests))
    return probe.counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="an mlx-lm model directory, or a built-in model's name")
    parser.add_argument("--requests", type=int, default=64, help="requests in all (64)")
    args = parser.parse_args()
    from mlxkv.default_model import model_path

    counts = anyio.run(measure, model_path(args.model), args.requests)
    print(f"`mlxkv run --requests {args.requests}`, device {mx.default_device()}")
    print("| plans | count | blocking evaluations with work | decode plans that waited before their step |")
    print("| --- | --- | --- | --- |")
    for kind in KINDS:
        row = counts[kind]
        waited = row["waited before the step"] if kind == "decode" else "-"
        print(f"| {kind} | {row['plans']} | {row['evals with work']} | {waited} |")


if __name__ == "__main__":
    main()
