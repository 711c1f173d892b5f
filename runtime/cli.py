"""The ``mlxkv`` command line.

Subcommands:

- ``mlxkv stress``: the runtime under concurrent random load, with optional
  faults; exits 1 if any invariant is violated (see :mod:`mlxkv.stress`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Optional

import anyio
import attrs

from mlxkv.cache.errors import InvalidInput

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
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


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
    )
    if args.faults:
        fields.update(cancel_rate=0.1, error_rate=0.02, max_blocks=48)
    try:
        config = StressConfig(**fields)
    except InvalidInput as error:
        print(f"mlxkv stress: {error}", file=sys.stderr)
        return 2
    report = anyio.run(run_stress, config, backend=config.backend)
    if args.json:
        print(json.dumps(attrs.asdict(report, recurse=True), indent=2))
    else:
        print(report.format())
    return 0 if report.ok else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``mlxkv`` command line.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 1 when a check failed, 2 on bad usage.
    """
    parser = argparse.ArgumentParser(prog="mlxkv", description="KV-cache runtime for MLX.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _stress_parser(subparsers)
    args = parser.parse_args(argv)
    if args.command == "stress":
        return _stress(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
