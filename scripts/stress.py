"""Stress-test the mlxkv runtime; the same as ``mlxkv stress``.

Examples::

    python scripts/stress.py --clients 32 --operations 50000 --duration 20
    python scripts/stress.py --faults --backend trio

Exits 1 if any invariant is violated (see :mod:`mlxkv.stress`).
"""

from __future__ import annotations

import sys

from mlxkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["stress", *sys.argv[1:]]))
