"""The ``mlxkv`` command line.

Subcommands:

- ``mlxkv run``: the main job -- a concurrent chat-like workload on the
  built-in model (or ``--model PATH``), with a progress bar on standard error
  and a report (see :mod:`mlxkv.workload`).
- ``mlxkv bench``: the end-to-end time-to-first-token benchmark
  (``scripts/bench_e2e.py``).
- ``mlxkv stress``: the runtime under concurrent random load, with optional
  faults; exits 1 if any invariant is violated (see :mod:`mlxkv.stress`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import sys
from collections.abc import Sequence
from typing import Optional

import anyio
import attrs

from mlxkv.cache.errors import CacheError, InvalidInput

__all__ = ["main"]


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
    )
    if args.generate or args.model:
        from mlxkv.default_model import ensure_model

        fields["model"] = args.model or str(ensure_model())
    if args.faults:
        fields.update(cancel_rate=0.1, error_rate=0.02, max_blocks=48)
    try:
        config = StressConfig(**fields)
    except InvalidInput as error:
        print(f"mlxkv stress: {error}", file=sys.stderr)
        return 2
    report = anyio.run(run_stress, config, backend=config.backend)
    if args.json != "-":
        print(report.format())
    _write_json(args.json, attrs.asdict(report, recurse=True))
    return 0 if report.ok else 1


def _run_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a concurrent chat workload on a model and report cache reuse",
        description="Concurrent multi-turn requests over shared system prompts on the"
        " built-in model (written on first use to $MLXKV_CACHE_DIR or ~/.cache/mlxkv)"
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
    parser.add_argument("--block-size", type=int, default=64, help="tokens per block (64)")
    parser.add_argument("--max-blocks", type=int, default=1024, help="blocks in the pool (1024)")
    parser.add_argument(
        "--kv-memory",
        metavar="SIZE",
        help="size the KV pool in bytes instead, e.g. 256MiB or 2GB (overrides --max-blocks)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the texts (0)")
    _backend_option(parser)
    _json_option(parser)
    parser.add_argument(
        "--trace", metavar="FILE", help="write the structured events as JSON lines to FILE"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress display")


def _run(args: argparse.Namespace) -> int:
    from mlxkv.default_model import DEFAULT_MODEL, ensure_model
    from mlxkv.progress import Progress, print_table
    from mlxkv.workload import WorkloadConfig, run_workload

    try:
        if args.model:
            model = args.model
        elif args.images:
            from mlxkv.default_vlm import ensure_vlm

            try:
                model = str(ensure_vlm())
            except ImportError:
                print("mlxkv run: --images needs the vlm extra: pip install 'mlxkv[vlm]'", file=sys.stderr)
                return 2
        else:
            model = str(ensure_model(DEFAULT_MODEL))
        config = WorkloadConfig(
            model=model,
            requests=args.requests,
            system_prompts=args.system_prompts,
            turns=args.turns,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            prompt_tokens=args.prompt_tokens,
            user_tokens=args.user_tokens,
            block_size=args.block_size,
            max_blocks=args.max_blocks,
            kv_memory=args.kv_memory,
            images=args.images,
            seed=args.seed,
            trace=args.trace is not None,
        )
    except InvalidInput as error:
        print(f"mlxkv run: {error}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        if args.trace is not None:
            from mlxkv.tracing import configure

            configure(json=True, file=stack.enter_context(open(args.trace, "w")))
        progress = None if args.quiet else Progress(config.requests)
        if progress is not None:
            stack.callback(progress.close)
        try:
            report = anyio.run(
                functools.partial(run_workload, config, progress=progress), backend=args.backend
            )
        except CacheError as error:  # a model that does not load, a budget too small
            if progress is not None:
                progress.close()
            print(f"mlxkv run: {error}", file=sys.stderr)
            return 2
    if args.json != "-":
        print_table(report.rows())
    _write_json(args.json, attrs.asdict(report))
    return 0 if report.requests == config.requests else 1


def _bench_parser(subparsers: argparse._SubParsersAction) -> None:
    subparsers.add_parser(
        "bench",
        help="time to first token of a mostly cached 2k prompt vs cold, ideal and vllm-mlx",
        description="Runs scripts/bench_e2e.py from a source checkout; arguments after"
        " 'bench' are passed on.",
    )


def _bench(args: argparse.Namespace) -> int:
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_e2e.py"
    if not script.is_file():
        print("mlxkv bench: scripts/bench_e2e.py is not here (needs a source checkout)",
              file=sys.stderr)
        return 2
    saved = sys.argv
    sys.argv = [str(script), *args.args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        return int(done.code or 0) if not isinstance(done.code, str) else 1
    finally:
        sys.argv = saved
    return 0


def _show_warnings(level: int = logging.WARNING) -> None:
    """Route the library's events from ``level`` up to standard error (the CLI is
    an application: it may show them; the library alone prints nothing). Idempotent."""
    logger = logging.getLogger("mlxkv")
    if _STDERR_HANDLER not in logger.handlers:
        logger.addHandler(_STDERR_HANDLER)
    logger.setLevel(level)


_STDERR_HANDLER = logging.StreamHandler(sys.stderr)
_STDERR_HANDLER.setFormatter(logging.Formatter("mlxkv: %(levelname)s %(message)s"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``mlxkv`` command line.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 1 when a check failed, 2 on bad usage.
    """
    from mlxkv import __version__

    parser = argparse.ArgumentParser(prog="mlxkv", description="KV-cache runtime for MLX.")
    parser.add_argument("--version", action="version", version=f"mlxkv {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _run_parser(subparsers)
    _bench_parser(subparsers)
    _stress_parser(subparsers)
    # bench passes every unknown argument on to the script.
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.args = extra
    # A stress run provokes failures on purpose: it reports them itself.
    _show_warnings(logging.ERROR if args.command == "stress" else logging.WARNING)
    if args.command == "run":
        return _run(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "stress":
        return _stress(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
