"""One decode step or prefill chunk, whole model: what each way puts in MLX's graph and what the host spends on it.

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
transposes, broadcasts, slices, expanded or squeezed axes); ``CUDA
kernels``: what a CUDA step launches, each launch costing the host tens of
microseconds there -- the non-view ops (a concatenation once an input:
MLX's CUDA backend copies each in with a kernel of its own), each of MLX's
fused calls counted as the one kernel the backend runs for it where it has
one (off a GPU they run as several: :class:`FusedCalls`), and the launches
its matrix products make beyond one each and the copies inside them
(below), less the reshapes that need no copy (``scripts/cuda_reshape.py``:
those Python code asks for, read off their inputs' layouts; a fold of a
product's rows, ``Flatten``/``Unflatten``, is a view). Then the host's milliseconds to build the step (from
the step's start to its ``async_eval`` on a drained device: Python and MLX
building the graph; on a GPU, encoding its kernels follows), the step's
wall milliseconds (steps queued as the runtime queues them), and the
blocking evaluations (``mx.eval``) and ``async_eval`` calls a step makes.
Decode steps (and prefills, in their kernels only) also count the step's matrix products (``@`` and
``mx.matmul``: the model's own projections and attention's) and the kernel
launches and operand copies MLX's CUDA backend makes for them, read off
each product's layouts as its source does (:mod:`cuda_matmul`): one
launch a product whose batch axes collapse into one (or a vector product),
two one whose axes do not (a pointer array and a cuBLAS call, MLX built
with CUDA 12.9 or later).
The graph and the evaluations are the same on every device; on a CPU the
build time stands for the host's share of a GPU step, and the wall time is
the CPU's arithmetic -- only a GPU's says what a GPU step costs.

``--kernel-stand-in``: where MLX has no CUDA backend, the ``kernel`` way's
decode steps run their host path as on CUDA (the kernel taken as checked,
the rows' layout and the kernel's inputs made) and launch a stand-in for
the CUDA kernel -- one fused attention call over the suffix buffers, counted
as the one launch the kernel is -- so that its counts and build time say
what a CUDA step of that way would cost the host (its output is not the
kernel's: its wall times say nothing). Without it, the ``kernel`` way runs
as ``mixed`` off CUDA.

``--fast-op-stand-ins``: where MLX runs on the CPU, ``mx.fast.rms_norm``
and ``mx.fast.rope`` -- which the CPU runs as their fallbacks, about ten
operations each, and a GPU as one kernel -- are replaced by one elementwise
operation each, so that the build times of every method say more nearly
what a GPU's host pays (their outputs are wrong: wall times say nothing;
nor do the counts, from which a rope's array offset, mlx-lm's sum a step,
drops out).

``--compile-decode off``: mlxkv's runners run the decoder layers as their
own code (:mod:`mlxkv.actors.compiled_decode`; default ``on``, the
runtime's); ``both``: each mlxkv method both ways, the second's rows
ending in ``as written``. The counts are the same either way: watched
steps run the compiled layers' parts as Python.

``--temperature T`` (and ``--top-p``): every row sampled, not greedy --
mlxkv's requests unseeded with the same settings (the server's default is
a temperature of 1), mlx-lm's ``BatchGenerator`` given one sampler for its
batch.

``--phase prefill``: instead of decode steps, the prefill of the rows' own
tokens after their cached prefixes (row ``i``'s first ``S - i * S // (2R)``
of its ``S``: requests differ in length, so the batch is right-padded),
each row's first token's logits
evaluated (the runtime reads the first token at once) -- a served request's
last chunk, its prompt's own part after a shared system prompt. ``mlxkv``'s
methods: its runner starts every row (over its prefix group, or a copy of
the prefix for ``copies``; each group held live by another request, as a
served group is) and prefills them in one ``prefill_batch`` (its prefill
streams as the device's default). ``mlx-lm``: ``BatchGenerator`` given a
copy of the prefix cache per row, until every row's first token is out
(which also queues its first decode step). Per method: the operations of
every graph the prefill evaluates (summed over its evaluations), the
host's milliseconds (the prefill's wall time less the time spent waiting
in evaluations: building graphs), the wall milliseconds on a drained
device, and the blocking evaluations (``evals``: the calls; ``working``:
those with anything left to run -- mlx-lm's ``BatchKVCache.extract``
evaluates its padding for every row, already evaluated after the first)
and ``async_eval`` calls it makes: a blocking one with work waits for
everything queued before it, a GPU's queue drained.

    .venv/bin/python scripts/bench_step.py [--model NAME|PATH] [--phase decode|prefill] [--rows 8,32]
        [--prefix 2048] [--groups 1] [--own 32] [--ways cascade,stacked] [--steps 32] [--prefill-streams N]
        [--compile-decode on|off|both] [--fast-op-stand-ins] [--kernel-stand-in] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stand_ins  # noqa: E402
from bench_batch import _prefix  # noqa: E402
from cuda_matmul import GemmLaunches  # noqa: E402
from cuda_reshape import ReshapeViews  # noqa: E402
from fused_calls import FusedCalls, graph_ops  # noqa: E402

class StepProbe:
    """Counts what the code between two :meth:`mark` calls evaluates: wraps
    ``mx.eval`` and ``mx.async_eval`` (module attributes, so every caller's
    ``mx.`` sees the wrappers) while it is entered."""

    def __init__(self) -> None:
        self.fused = FusedCalls()
        self.evals = 0
        self.async_evals = 0
        self.built_at: float | None = None
        self.ops: tuple[int, int, int] | None = None
        self.count_ops = False
        #: count the graph of every evaluation into ``summed`` (a prefill's),
        #: and the blocking ones that had any to run (``working_evals``)
        self.sum_ops = False
        self.summed = (0, 0, 0)
        self.working_evals = 0
        #: seconds spent inside blocking evaluations
        self.waiting = 0.0

    def _add_ops(self, args: Any) -> int:
        ops = graph_ops(*_flatten(args))
        self.summed = (self.summed[0] + ops[0], self.summed[1] + ops[1], self.summed[2] + ops[2])
        return ops[0]

    def _with_kernels(self, ops: tuple[int, int, int]) -> tuple[int, int, int]:
        """``ops`` with its third count, launches so far, made the CUDA
        kernels: less the fused calls' surplus since :meth:`mark`."""
        return (ops[0], ops[1], ops[2] - self.fused.surplus)

    def __enter__(self) -> StepProbe:
        self._eval, self._async_eval = mx.eval, mx.async_eval

        def eval_(*args: Any) -> Any:
            self.evals += 1
            if self.sum_ops and self._add_ops(args):
                self.working_evals += 1
            started = time.perf_counter()
            try:
                return self._eval(*args)
            finally:
                self.waiting += time.perf_counter() - started

        def async_eval(*args: Any) -> Any:
            self.async_evals += 1
            if self.sum_ops:
                self._add_ops(args)
            # The last one queues the step (a suffix growth comes first).
            self.built_at = time.perf_counter()
            if self.count_ops:
                self.ops = self._with_kernels(graph_ops(*_flatten(args)))
                self.count_ops = False
            return self._async_eval(*args)

        mx.eval, mx.async_eval = eval_, async_eval
        return self

    def __exit__(self, *exc: Any) -> None:
        mx.eval, mx.async_eval = self._eval, self._async_eval

    def mark(self) -> None:
        self.evals = self.async_evals = 0
        self.built_at = None
        self.fused.surplus = 0
        self.summed = (0, 0, 0)
        self.working_evals = 0
        self.waiting = 0.0


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
    gemms, reshapes = GemmLaunches(), ReshapeViews()
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
            # The fused calls are watched in the counted step only (their
            # wrappers would add to a timed step's host time); the products'
            # launches and the reshapes' copies in the last unmeasured one
            # (their counts evaluate the operands).
            counted, layouts = probe.count_ops, index == warmup - 1
            with _watch(probe, gemms, reshapes, counted=counted, layouts=layouts), _as_written(step, counted or layouts):
                step()
            ended = time.perf_counter()
            if drained:
                build.append((probe.built_at or ended) - started)
            elif index >= warmup:
                wall.append(ended - started)
                evals.append(probe.evals)
                async_evals.append(probe.async_evals)
        ops = probe.ops
    return _summary(ops or (None, None, None), build, wall, evals, async_evals, **_with_products(gemms, reshapes, warmup))


def _as_written(step: Callable[..., Any], watched: bool) -> Any:
    """In a watched run, the compiled decoder layers of ``step``'s model (its
    ``model`` attribute, if any; a step's or a prefill's maker's) run their parts as Python
    (:func:`~mlxkv.actors.compiled_decode.as_written`): the same operations,
    each seen by the watchers (a trace's replay calls no Python)."""
    from mlxkv.actors.compiled_decode import as_written

    model = getattr(step, "model", None)
    return as_written(model) if watched and model is not None else contextlib.nullcontext()


def _watch(probe: StepProbe, gemms: GemmLaunches, reshapes: ReshapeViews, *, counted: bool, layouts: bool) -> Any:
    """What watches a run: the fused calls in the counted one, the products
    and reshapes (whose counts evaluate their operands) in ``layouts``,
    nothing in a timed one."""
    if counted:
        return probe.fused
    if layouts:
        stack = contextlib.ExitStack()
        stack.enter_context(gemms)
        stack.enter_context(reshapes)
        return stack
    return contextlib.nullcontext()


def _with_products(gemms: GemmLaunches, reshapes: ReshapeViews, warmup: int) -> dict[str, Any]:
    """What ``gemms`` and ``reshapes`` counted (in a warmup run: none without
    one): the products, their launches and the copies inside them, the
    reshapes that launch nothing, and the launches a CUDA step makes
    beyond one a non-view op (``extra_launches``: a product's beyond one,
    its operands' copies, less the reshapes the graph counts that are
    views)."""
    if not warmup:
        return {}
    return {
        "gemm_products": len(gemms.products),
        "gemm_launches": gemms.launches,
        "gemm_copies": gemms.copies,
        "reshape_views": reshapes.views,
        "extra_launches": gemms.launches - len(gemms.products) + gemms.copies - reshapes.views,
    }


def _summary(
    ops: tuple[Any, Any], build: list[float], wall: list[float], evals: list[int], async_evals: list[int], **more: Any
) -> dict[str, Any]:
    """One method's row: its graph's ops, and the medians (means for counts) of its timed runs."""
    extra = more.get("extra_launches", 0)
    return {
        "ops": ops[0],
        "non_view_ops": ops[1],
        "cuda_kernels": None if ops[2] is None else ops[2] + extra,
        "build_ms": statistics.median(build) * 1e3,
        "wall_ms": statistics.median(wall) * 1e3,
        "evals_per_step": statistics.mean(evals),
        **more,
        "async_evals_per_step": statistics.mean(async_evals),
    }


def measure_prefill(prepare: Callable[[], Callable[[], None]], warmup: int, repeats: int) -> dict[str, Any]:
    """Run ``prepare()``'s prefill ``warmup`` times, once more counting its
    graphs, then ``repeats`` times timed, each on a drained device (the
    runtime waits for a prefill's first token before it goes on)."""
    host, wall, evals, async_evals = [], [], [], []
    gemms, reshapes = GemmLaunches(), ReshapeViews()
    with StepProbe() as probe:
        for index in range(warmup + 1 + repeats):
            run = prepare()
            mx.synchronize()
            probe.mark()
            probe.sum_ops = index == warmup
            started = time.perf_counter()
            counted, layouts = probe.sum_ops, index == warmup - 1
            with _watch(probe, gemms, reshapes, counted=counted, layouts=layouts), _as_written(prepare, counted or layouts):
                run()
            ran = time.perf_counter()
            mx.synchronize()
            ended = time.perf_counter()
            if index == warmup:
                ops, working = probe._with_kernels(probe.summed), probe.working_evals
            elif index > warmup:
                host.append(ran - started - probe.waiting)
                wall.append(ended - started)
                evals.append(probe.evals)
                async_evals.append(probe.async_evals)
    return _summary(
        ops, host, wall, evals, async_evals, working_evals_per_step=working, **_with_products(gemms, reshapes, warmup)
    )


def prompts(rows: int, prefix: int, own: int, groups: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """``groups`` prefixes (bench_batch's, its first token changed for each
    group after the first), and each row's own tokens (row ``i`` goes after
    prefix ``i % groups``)."""
    shared = _prefix(prefix)
    prefixes = [shared if g == 0 else [32 + (shared[0] - 32 + g) % 95, *shared[1:]] for g in range(groups)]
    return prefixes, [[32 + (i * 13 + r * 29) % 95 for i in range(own)] for r in range(rows)]


def uneven(owns: list[list[int]]) -> list[list[int]]:
    """Row ``i``'s first ``S - i * S // (2R)`` own tokens (a prefill's rows differ in length)."""
    rows = len(owns)
    return [own[: len(own) - i * len(own) // (2 * rows)] for i, own in enumerate(owns)]


def prefix_cache(model: Any, shared: list[int]) -> list[Any]:
    """``model``'s plain cache of ``shared``, prefilled 256 tokens at a time."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for start in range(0, len(shared), 256):
        model(mx.array(shared[start : start + 256])[None], cache=cache)
        mx.eval([layer.state for layer in cache])
    return cache


def _mlxkv_runner(
    path: str, options: dict[str, Any], prefixes: list[list[int]], block: int, sampling: Any = None
) -> tuple[Any, Callable[..., Any]]:
    """mlxkv's runner with ``options``, and a maker of request specs over
    ``prefixes`` (their blocks computed by the model): ``spec(request_id,
    group, own tokens, max_tokens)``, sampled by ``sampling`` (default greedy)."""
    from mlxkv.actors.compute_config import RunnerConfig
    from mlxkv.actors.model_runner import TextRunner
    from mlxkv.actors.request import RequestSpec
    from mlxkv.cache import kv_state

    runner = TextRunner.load(path, RunnerConfig(**options))
    payloads = []
    for shared in prefixes:
        cache = prefix_cache(runner._model, shared)
        payloads.append(tuple(kv_state.slice_blocks(cache, block, range(len(shared) // block), num_tokens=len(shared))))
        del cache

    def spec(request_id: str, group: int, own: list[int], max_tokens: int) -> Any:
        return RequestSpec(
            request_id=request_id, prompt=prefixes[group] + own, prefix=payloads[group], max_tokens=max_tokens,
            block_size=block, stop_tokens=frozenset(), **({} if sampling is None else {"sampling": sampling}),
        )  # fmt: skip

    return runner, spec


def mlxkv_steps(
    path: str, options: dict[str, Any], prefixes: list[list[int]], owns: list[list[int]], block: int,
    sampling: Any = None,
) -> Callable[[], None]:
    """A decode batch of mlxkv's runner with every row joined (row ``i`` over
    ``prefixes[i % len(prefixes)]``), each row sampled by ``sampling``
    (default greedy); one call: one step."""
    from mlxkv.actors.decode_batch import DecodeBatch
    from mlxkv.actors.sequence import SequenceState

    runner, spec = _mlxkv_runner(path, options, prefixes, block, sampling)
    sequences = []
    for index, own in enumerate(owns):
        sequence = SequenceState(spec(f"r{index}", index % len(prefixes), own, 1 << 20))
        runner.start(sequence)
        logits = runner.prefill(sequence, len(sequence.prompt))
        sequence.emitted(int(mx.argmax(logits).item()))
        sequences.append(sequence)
    batch = DecodeBatch(runner)
    batch.join(sequences)

    def step() -> None:
        batch.advance(1)

    step.model = runner._model  # type: ignore[attr-defined]
    return step


def mlxkv_prefills(
    path: str, options: dict[str, Any], prefixes: list[list[int]], owns: list[list[int]], block: int
) -> Callable[[], Callable[[], None]]:
    """Each call: a prefill to run -- every row (row ``i`` over
    ``prefixes[i % len(prefixes)]``) started and prefilled in one
    ``prefill_batch``, its first token's logits evaluated."""
    from mlxkv.actors.sequence import SequenceState

    owns = uneven(owns)
    runner, spec = _mlxkv_runner(path, options, prefixes, block)
    numbers = itertools.count()
    # Another request holds each group live, as a served group is held by its decoding rows.
    holders = [SequenceState(spec(f"holder{g}", g, [33], 1)) for g in range(len(prefixes))]
    for holder in holders:
        runner.start(holder)

    def prepare() -> Callable[[], None]:
        number = next(numbers)
        specs = [spec(f"p{number}-{i}", i % len(prefixes), own, 1) for i, own in enumerate(owns)]

        def run() -> None:
            rows = []
            for one in specs:
                sequence = SequenceState(one)
                runner.start(sequence)
                rows.append((sequence, len(one.prompt)))
            logits = runner.prefill_batch(rows)
            mx.eval([row for row in logits if row is not None])

        return run

    prepare.holders = holders  # type: ignore[attr-defined]
    prepare.model = runner._model  # type: ignore[attr-defined]
    return prepare


def mlx_lm_prefills(path: str, prefixes: list[list[int]], owns: list[list[int]]) -> Callable[[], Callable[[], None]]:
    """Each call: a prefill to run -- mlx-lm's ``BatchGenerator`` given a copy
    of each row's prefix cache, until every row's first token is out."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    owns = uneven(owns)
    model, _ = load(path)
    caches = [prefix_cache(model, shared) for shared in prefixes]

    def prepare() -> Callable[[], None]:
        copies = [copy.deepcopy(caches[i % len(caches)]) for i in range(len(owns))]

        def run() -> None:
            generator = BatchGenerator(model, stop_tokens=[])
            generator.insert(owns, [1 << 20] * len(owns), caches=copies)
            started: set[int] = set()
            while len(started) < len(owns):
                started.update(response.uid for response in generator.next_generated())

        return run

    return prepare


def mlx_lm_steps(
    path: str, prefixes: list[list[int]], owns: list[list[int]], sampler: Any = None
) -> Callable[[], None]:
    """mlx-lm's ``BatchGenerator`` past every row's first token (row ``i``
    given a copy of ``prefixes[i % len(prefixes)]``'s cache), its rows drawn
    by one ``sampler`` (default greedy); one call: one step."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    model, _ = load(path)
    caches = [prefix_cache(model, shared) for shared in prefixes]
    generator = BatchGenerator(model, stop_tokens=[], sampler=sampler)
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
    parser.add_argument("--phase", choices=("decode", "prefill"), default="decode", help="what to measure (decode)")
    parser.add_argument("--rows", default="8,32", help="rows decoding together, comma-separated (8,32)")
    parser.add_argument("--prefix", type=int, default=2048, help="tokens of the shared prefix (2048)")
    parser.add_argument("--groups", type=int, default=1, help="prefixes the rows are spread over (1)")
    parser.add_argument("--own", type=int, default=32, help="each row's own tokens before decoding; with --phase prefill, those prefilled (32)")
    parser.add_argument("--ways", help="shared-prefix ways, comma-separated (default: all)")
    parser.add_argument(
        "--prefill-streams", type=int, help="mlxkv's prefill streams (default: the device's; a GPU's is 1)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0,
        help="decode: every row sampled at this temperature (unseeded; mlx-lm: one sampler for its batch); 0: greedy",
    )  # fmt: skip
    parser.add_argument("--top-p", type=float, default=0.0, help="decode, with --temperature: nucleus sampling (0: off)")
    parser.add_argument(
        "--kernel-stand-in", action="store_true",
        help="off CUDA, count the kernel way's decode steps with a one-launch stand-in for its CUDA kernel",
    )  # fmt: skip
    parser.add_argument(
        "--fast-op-stand-ins", action="store_true",
        help="on the CPU, rms_norm and rope as one elementwise op each, as a GPU's one kernel (host times only)",
    )  # fmt: skip
    parser.add_argument(
        "--compile-decode", choices=("on", "off", "both"), default="on",
        help="mlxkv's decoder layers compiled for decode steps (on, the runtime's default), as written (off),"
        " or each mlxkv method both ways (both: the second one's rows end in 'as written')",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=32, help="measured steps (or prefills) per method (32)")
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
    known = [way.value for way in PrefixAttention]
    unknown = [w for w in (args.ways or "").split(",") if w and w not in known]
    if unknown:
        parser.error(f"--ways: unknown {', '.join(unknown)} (known: {', '.join(known)}; copies and mlx-lm always run)")
    ways = [PrefixAttention(w) for w in args.ways.split(",")] if args.ways else list(PrefixAttention)
    prefill = args.phase == "prefill"
    if args.kernel_stand_in:
        stand_ins.kernel()
    if args.fast_op_stand_ins:
        stand_ins.fast_ops()
    if prefill and (args.temperature or args.top_p):
        parser.error("--temperature and --top-p are for decode steps")
    mlxkv_maker, mlx_lm_maker = (mlxkv_prefills, mlx_lm_prefills) if prefill else (mlxkv_steps, mlx_lm_steps)
    if args.temperature:
        from mlx_lm.sample_utils import make_sampler

        from mlxkv.actors.sampling import Sampling

        sampling = Sampling(temperature=args.temperature, top_p=args.top_p)
        mlxkv_maker = functools.partial(mlxkv_steps, sampling=sampling)
        mlx_lm_maker = functools.partial(mlx_lm_steps, sampler=make_sampler(temp=args.temperature, top_p=args.top_p))
    streams = {} if args.prefill_streams is None else {"prefill_streams": args.prefill_streams}
    methods: dict[str, Callable[..., Any]] = {}
    for compiled in {"on": [True], "off": [False], "both": [True, False]}[args.compile_decode]:
        options = {**streams, "compile_decode": compiled}
        written = "" if compiled or args.compile_decode == "off" else ", as written"
        for way in ways:
            methods[f"mlxkv, {way.value}{written}"] = functools.partial(
                mlxkv_maker, path, {"prefix_attention": way, **options}, block=block
            )
        methods[f"mlxkv, copies{written}"] = functools.partial(
            mlxkv_maker, path, {"shared_prefix": False, **options}, block=block
        )
    methods["mlx-lm"] = lambda s, o: mlx_lm_maker(path, s, o)
    measured = measure_prefill if prefill else measure
    results: list[dict[str, Any]] = []
    print(
        f"model {Path(path).name}, device {mx.default_device()}, {args.phase}, {args.groups} prefix(es) of"
        f" {args.prefix}, own {args.own}, {args.steps} {'prefills' if prefill else 'steps'}"
        + (f", sampled at temperature {args.temperature:g}, top_p {args.top_p:g}" if args.temperature else "")
    )
    working = " (working)" if prefill else ""
    gemms = "" if prefill else " products (launches, copies) |"
    print(f"| rows | method | ops | non-view ops | CUDA kernels |{gemms} build ms | wall ms | evals{working} | async_evals |")
    print("| --- " * (9 if prefill else 10) + "|")
    for rows in [int(r) for r in args.rows.split(",")]:
        prefixes, owns = prompts(rows, args.prefix, args.own, args.groups)
        for name, make in methods.items():
            step = make(prefixes, owns)
            row = {"rows": rows, "method": name, **measured(step, args.warmup, args.steps)}
            del step
            mx.clear_cache()
            results.append(row)
            evals = f"{row['evals_per_step']:g}"
            if prefill:
                evals += f" ({row['working_evals_per_step']})"
            print(
                f"| {rows} | {name} | {row['ops']} | {row['non_view_ops']} | {row['cuda_kernels']} |"
                + ("" if prefill else f" {row.get('gemm_products', '-')} ({row.get('gemm_launches', '-')}, {row.get('gemm_copies', '-')}) |")
                + f" {row['build_ms']:.2f}"
                f" | {row['wall_ms']:.2f}"
                f" | {evals} | {row['async_evals_per_step']:g} |",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"model": Path(path).name, "device": str(mx.default_device()), "phase": args.phase, "results": results},
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
