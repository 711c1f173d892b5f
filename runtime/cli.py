"""The ``mlxkv`` command line.

Subcommands:

- ``mlxkv run``: the main job -- a concurrent chat-like workload on the
  built-in model (or ``--model PATH``), with a progress bar on standard error
  and a report (see :mod:`mlxkv.workload`).
- ``mlxkv bench``: the end-to-end time-to-first-token benchmark
  (``scripts/bench_e2e.py``).
- ``mlxkv stress``: the runtime under concurrent random load, with optional
  faults; exits 1 if any invariant is violated (see :mod:`mlxkv.stress`).
- ``mlxkv serve``: an OpenAI-compatible HTTP server on the runtime (the
  ``server`` extra; see :mod:`mlxkv.server`).

Every bad option or input -- an unparsable or out-of-range option, a model
that does not load, a workload or prompt beyond the model's context -- is one
line on standard error and exit status 2. Ctrl-C is one line, "interrupted",
and status 130, once what was running has stopped and released what it held.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Optional, TypeVar

import anyio
import attrs

from mlxkv.cache.errors import CacheError, InvalidInput
from mlxkv.cache.tiers.tier_url import redact_url
from mlxkv.runtime_options import add_runtime_options, add_tier_option, runtime_config
from mlxkv.server.cli import DESCRIPTION as SERVE_DESCRIPTION
from mlxkv.server.cli import HELP as SERVE_HELP
from mlxkv.server.cli import add_serve_options, serve_command

if TYPE_CHECKING:
    from mlxkv.workload import WorkloadReport

__all__ = ["BENCH_BLOCK", "add_bench_arguments", "main"]

T = TypeVar("T")

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

#: Exit statuses: a check failed; bad usage or input; interrupted (128 + SIGINT).
_FAILED, _USAGE, _INTERRUPTED = 1, 2, 130


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on standard error, exit 2
    (``--help`` still shows the whole usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _stress_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "stress",
        help="run concurrent random fetch/store/fork/release with invariant checks",
        description="Concurrent clients over shared prefixes, with optional faults;"
        " exits 1 on any violated invariant.",
    )
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (16)")
    parser.add_argument("--operations", type=int, default=20_000, help="most operations (20000)")
    parser.add_argument("--duration", type=float, default=10.0, help="most seconds (10)")
    parser.add_argument(
        "--check-every", type=int, default=1_000, help="operations between invariant checks (1000)"
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    parser.add_argument("--block-size", type=int, default=4, help="tokens per block (4)")
    parser.add_argument("--max-blocks", type=int, default=512, help="blocks in the pool (512)")
    parser.add_argument("--max-held", type=int, default=4, help="requests per client (4)")
    parser.add_argument(
        "--cancel-rate", type=float, default=0.0, help="share of calls cancelled at random (0)"
    )
    parser.add_argument(
        "--error-rate", type=float, default=0.0, help="share of handler errors injected (0)"
    )
    parser.add_argument(
        "--faults",
        action="store_true",
        help="shorthand: --cancel-rate 0.1 --error-rate 0.02 --max-blocks 48",
    )
    parser.add_argument(
        "--generate",
        action="store_true",
        help="clients also generate on the built-in model (or --model): shared prefixes"
        " in flight, batched decoding, cancellations and failures of computing requests",
    )
    parser.add_argument("--model", help="the model for --generate (default: the built-in model)")
    parser.add_argument(
        "--generate-rate", type=float, default=0.2, help="share of operations that generate (0.2)"
    )
    parser.add_argument(
        "--verify",
        type=int,
        default=64,
        help="finished generations computed again cold at the end, whose tokens must match (64)",
    )
    add_tier_option(parser)
    _backend_option(parser)
    _json_option(parser)


def _backend_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=("asyncio", "trio"),
        default="asyncio",
        help="the anyio event loop to run on (asyncio)",
    )


def _json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", metavar="FILE", help="also write the report as JSON to FILE ('-' for stdout)"
    )


def _check_json_target(target: Optional[str]) -> None:
    """Fail now, not after the work, if ``--json FILE`` cannot be written.

    Raises:
        OSError: the file cannot be opened for writing.
    """
    if target is not None and target != "-":
        open(target, "a").close()


def _write_json(target: Optional[str], data: object) -> None:
    if target is None:
        return
    text = json.dumps(data, indent=2) + "\n"
    if target == "-":
        sys.stdout.write(text)
    else:
        with open(target, "w") as out:
            out.write(text)


def _stress(args: argparse.Namespace) -> int:
    from mlxkv.stress import StressConfig, run_stress

    fields = dict(
        clients=args.clients,
        operations=args.operations,
        duration=args.duration,
        check_every=args.check_every,
        seed=args.seed,
        block_size=args.block_size,
        max_blocks=args.max_blocks,
        max_held=args.max_held,
        cancel_rate=args.cancel_rate,
        error_rate=args.error_rate,
        backend=args.backend,
        generate_rate=args.generate_rate,
        verify=args.verify,
        kv_tiers=tuple(getattr(args, "kv_tiers", ())),
    )
    if args.generate or args.model:
        from mlxkv.default_model import ensure_model

        fields["model"] = args.model or str(ensure_model())
    if args.faults:
        fields.update(cancel_rate=0.1, error_rate=0.02, max_blocks=48)
    config = StressConfig(**fields)
    _check_json_target(args.json)
    report = anyio.run(run_stress, config, backend=config.backend)
    # The report shows the tiers' URLs: never their passwords.
    shown = tuple(redact_url(url) for url in config.kv_tiers)
    report = attrs.evolve(report, config=attrs.evolve(report.config, kv_tiers=shown))
    if args.json != "-":
        print(report.format())
    _write_json(args.json, attrs.asdict(report, recurse=True))
    return 0 if report.ok else 1


def _run_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a concurrent chat workload on a model and report cache reuse",
        description="Concurrent multi-turn requests over shared system prompts on the"
        " built-in model (written on first use to $MLXKV_CACHE_DIR, else $XDG_CACHE_HOME/mlxkv or ~/.cache/mlxkv)"
        " or --model PATH; prints a report.",
    )
    parser.add_argument(
        "--model",
        help="an mlx-lm or mlx-vlm model directory (default: the built-in model; with"
        " --images, the built-in vision-language model)",
    )
    parser.add_argument(
        "--images",
        type=int,
        default=0,
        metavar="N",
        help="conversations about N images on a vision-language model (0: text only)"
        "; needs the vlm extra",
    )
    parser.add_argument("--requests", type=int, default=32, help="requests in all (32)")
    parser.add_argument(
        "--system-prompts", type=int, default=4, help="distinct shared system prompts (4)"
    )
    parser.add_argument("--turns", type=int, default=2, help="turns per conversation (2)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (8)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (32)")
    parser.add_argument(
        "--prompt-tokens", type=int, default=512, help="tokens per system prompt (512)"
    )
    parser.add_argument("--user-tokens", type=int, default=48, help="tokens per user turn (48)")
    parser.add_argument(
        "--logprobs",
        type=int,
        metavar="K",
        help="ask for every token's log-probability and its K likeliest alternatives (0-20; default: none)",
    )
    add_runtime_options(parser)
    parser.add_argument("--seed", type=int, default=0, help="seeds the texts (0)")
    _backend_option(parser)
    _json_option(parser)
    _trace_option(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress display")


def _serve_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help=SERVE_HELP, description=SERVE_DESCRIPTION)
    add_serve_options(parser)
    add_runtime_options(parser)
    _backend_option(parser)
    _trace_option(parser)


def _trace_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace", metavar="FILE", help="write the structured events as JSON lines to FILE"
    )


def _run(args: argparse.Namespace) -> int:
    from mlxkv.default_model import DEFAULT_MODEL, ensure_model
    from mlxkv.progress import Progress, print_table
    from mlxkv.workload import WorkloadConfig, run_workload

    if args.model:
        model = args.model
    elif args.images:
        from mlxkv.default_vlm import ensure_vlm

        try:
            model = str(ensure_vlm())
        except ImportError:
            raise InvalidInput(
                "images", args.images, "needs the vlm extra: pip install 'mlxkv[vlm]'"
            ) from None
    else:
        model = str(ensure_model(DEFAULT_MODEL))
    config = WorkloadConfig(
        runtime=runtime_config(args, model=model),
        requests=args.requests,
        system_prompts=args.system_prompts,
        turns=args.turns,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        prompt_tokens=args.prompt_tokens,
        user_tokens=args.user_tokens,
        images=args.images,
        seed=args.seed,
        logprobs=args.logprobs,
    )
    _check_json_target(args.json)
    with contextlib.ExitStack() as stack:
        if args.trace is not None:
            from mlxkv.tracing import configure

            configure(json=True, file=stack.enter_context(open(args.trace, "w")))
        progress = None if args.quiet else Progress(config.requests)
        if progress is not None:
            stack.callback(progress.close)  # before an error or "interrupted" is printed
        report = anyio.run(
            _interruptible,
            functools.partial(run_workload, config, progress=progress),
            backend=args.backend,
        )
    if report.interrupted:
        return _say(
            "run", f"interrupted ({report.requests} of {config.requests} requests done)", _INTERRUPTED
        )
    if args.json != "-":
        print_table(report.rows())
    _write_json(args.json, attrs.asdict(report))
    for line in _run_warnings(report, traced=args.trace is not None):
        print(f"mlxkv run: warning: {line}", file=sys.stderr)
    return 0 if report.requests == config.requests else _FAILED


def _run_warnings(report: WorkloadReport, *, traced: bool) -> list[str]:
    """One line per kind of per-request warning the run had (the events
    themselves go to the ``--trace`` file, not to the terminal)."""
    from mlxkv.units import format_count

    where = "details per request in the trace file" if traced else "details per request: --trace FILE"
    room = "raise --kv-memory or --max-blocks"
    lines = []
    if report.requests_not_stored:
        lines.append(
            f"{report.requests_not_stored} of {report.requests} requests could not cache"
            f" {format_count(report.blocks_not_stored, 'computed block')}: the KV pool"
            f" ({format_count(report.pool_blocks, 'block')}) had too few free blocks, the rest held by"
            f" requests in flight; {room} ({where})"
        )
    if report.prompts_over_pool:
        lines.append(
            f"{format_count(report.prompts_over_pool, 'prompt')} had more full blocks than the KV pool"
            f" holds ({report.pool_blocks}): none can be cached whole; {room} ({where})"
        )
    if report.cold_fallbacks:
        lines.append(
            f"{format_count(report.cold_fallbacks, 'request')} computed the whole prompt: the cached"
            f" prefix cannot be rebuilt for this model ({where})"
        )
    return lines


#: Tokens per block in ``mlxkv bench`` (the cached prefix is a whole number of them).
BENCH_BLOCK = 64


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mlxkv bench`` and ``scripts/bench_e2e.py``, defined once."""

    def cached(text: str) -> int:
        value = int(text)
        if value <= 0 or value % BENCH_BLOCK:
            raise argparse.ArgumentTypeError(f"must be a positive multiple of {BENCH_BLOCK}")
        return value

    def positive(text: str) -> int:
        value = int(text)
        if value <= 0:
            raise argparse.ArgumentTypeError("must be positive")
        return value

    def at_least_zero(text: str) -> int:
        value = int(text)
        if value < 0:
            raise argparse.ArgumentTypeError("must be >= 0")
        return value

    parser.add_argument(
        "--cached",
        type=cached,
        default=1984,
        metavar="N",
        help=f"prompt tokens cached, a multiple of {BENCH_BLOCK} (1984)",
    )
    parser.add_argument(
        "--new", type=positive, default=64, metavar="M", help="prompt tokens after them (64)"
    )
    parser.add_argument("--repeats", type=positive, default=9, help="timed repeats of each (9)")
    parser.add_argument("--warmup", type=at_least_zero, default=2, help="untimed repeats first (2)")
    parser.add_argument("--model", help="an mlx-lm model directory (default: the built-in model)")
    parser.add_argument(
        "--vllm-python",
        type=Path,
        metavar="PYTHON",
        help="the reference environment's python, with vllm-mlx 0.6.0"
        " (default: .bench/vllm/bin/python; without it vllm-mlx is skipped)",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results here")


def _bench_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="time to first token of a mostly cached 2k prompt vs cold, ideal and vllm-mlx",
        description="Time to first token of a prompt whose leading blocks are cached, against"
        " a cold prefill, a rebuild from blocks, the ideal and vllm-mlx 0.6.0, with parity"
        " checked (scripts/bench_e2e.py; needs a source checkout).",
    )
    add_bench_arguments(parser)


def _bench(args: argparse.Namespace) -> int:
    import runpy

    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_e2e.py"
    if not script.is_file():
        raise InvalidInput("bench", str(script), "is not here (mlxkv bench needs a source checkout)")
    return runpy.run_path(str(script), run_name="bench_e2e")["run"](args)


async def _interruptible(job: Callable[..., Awaitable[T]]) -> T:
    """Run ``job(stop=event)``; Ctrl-C (SIGINT) sets the event, a second one
    cancels ``job`` outright.

    Setting ``stop`` lets the job end the way a cancelled caller does inside
    a running runtime: each request releases what it holds, then the
    runtime closes in order (the MLX thread too). Only then does the
    command say "interrupted".

    Raises:
        KeyboardInterrupt: a second SIGINT arrived before ``job`` returned.
    """
    stop = anyio.Event()
    result: list[T] = []
    with anyio.open_signal_receiver(signal.SIGINT) as signals:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                async for _ in signals:
                    if stop.is_set():
                        tg.cancel_scope.cancel()
                    stop.set()

            tg.start_soon(watch)
            result.append(await job(stop=stop))
            tg.cancel_scope.cancel()
    if not result:
        raise KeyboardInterrupt
    return result[0]


def _show_warnings(level: int = logging.WARNING, hidden: frozenset[str] = frozenset()) -> None:
    """Route the library's events from ``level`` up to standard error, except the
    events named in ``hidden`` (the command summarizes those itself). The CLI
    is an application: it may show them; the library alone prints nothing.
    Idempotent."""
    logger = logging.getLogger("mlxkv")
    if _STDERR_HANDLER not in logger.handlers:
        logger.addHandler(_STDERR_HANDLER)
    logger.setLevel(level)
    _STDERR_HANDLER.filters = [_Hide(hidden)] if hidden else []


class _Hide(logging.Filter):
    """Drops the records of the events it names (``record.mlxkv["event"]``)."""

    def __init__(self, events: frozenset[str]) -> None:
        super().__init__()
        self._events = events

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "mlxkv", {}).get("event") not in self._events


_STDERR_HANDLER = logging.StreamHandler(sys.stderr)
_STDERR_HANDLER.setFormatter(logging.Formatter("mlxkv: %(levelname)s %(message)s"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``mlxkv`` command line.

    Bad usage or input (an option out of range, a model that does not load,
    a prompt beyond the model's context) is one line on standard error and
    exit status 2; an interruption (Ctrl-C) is one line, after everything
    running was stopped and released, and status 130.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 1 when a check failed, 2 on bad usage
        or input, 130 when interrupted.
    """
    from mlxkv import __version__

    parser = _Parser(prog="mlxkv", description="KV-cache runtime for MLX.")
    parser.add_argument("--version", action="version", version=f"mlxkv {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _run_parser(subparsers)
    _bench_parser(subparsers)
    _stress_parser(subparsers)
    _serve_parser(subparsers)
    args = parser.parse_args(argv)
    if args.command == "stress":  # it provokes failures on purpose and reports them itself
        _show_warnings(logging.ERROR)
    elif args.command == "run":  # it counts its per-request warnings and summarizes them
        from mlxkv.workload import SUMMARIZED_EVENTS

        _show_warnings(logging.WARNING, hidden=SUMMARIZED_EVENTS)
    else:
        _show_warnings(logging.WARNING)
    command = {"run": _run, "bench": _bench, "stress": _stress, "serve": serve_command}[args.command]
    try:
        return command(args)
    except KeyboardInterrupt:
        return _say(args.command, "interrupted", _INTERRUPTED)
    except CacheError as error:
        return _say(args.command, str(error), _status(error))
    except OSError as error:
        if error.filename is None:
            raise
        # A file an option names (--json, --trace) that cannot be written.
        return _say(args.command, f"cannot write {error.filename}: {error.strerror}", _USAGE)
    except BaseExceptionGroup as group:
        if group.subgroup(KeyboardInterrupt) is not None:  # through trio's task groups
            return _say(args.command, "interrupted", _INTERRUPTED)
        error = _cache_error(group)
        if error is None:
            raise
        return _say(args.command, str(error), _status(error))


def _say(command: str, text: str, status: int) -> int:
    """Print ``text`` as one line on standard error; return ``status``."""
    print(f"mlxkv {command}: {' '.join(text.split())}", file=sys.stderr)
    return status


def _status(error: CacheError) -> int:
    """Bad input (a setting, a model, a prompt) is a usage error; anything else
    mlxkv raised on purpose (a failed model call, a crashed actor) a failure."""
    from mlxkv.errors import ModelLoadError

    return _USAGE if isinstance(error, (InvalidInput, ModelLoadError)) else _FAILED


def _cache_error(group: BaseExceptionGroup) -> Optional[CacheError]:
    """The first CacheError in ``group`` if it holds nothing else (one request's
    bad input fails the workload's task group, and the group carries it)."""
    errors, rest = group.split(CacheError)
    if errors is None or rest is not None:
        return None
    while isinstance(errors, BaseExceptionGroup):
        errors = errors.exceptions[0]
    return errors


if __name__ == "__main__":
    sys.exit(main())
