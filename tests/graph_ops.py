"""What MLX would run to evaluate arrays: the primitives of their graph, read
from ``mx.export_to_dot`` (an evaluated array's graph is empty)."""

from __future__ import annotations

import io
from typing import Any

import mlx.core as mx


def arrays_in(tree: Any) -> list[Any]:
    """The MLX arrays in ``tree`` (an array, or lists and tuples of them and of other things), in order."""
    if isinstance(tree, mx.array):
        return [tree]
    return [a for item in tree for a in arrays_in(item)] if isinstance(tree, (list, tuple)) else []


def primitives(*arrays: Any) -> list[str]:
    """The names of the primitives MLX would run to evaluate ``arrays``, one per node."""
    out = io.StringIO()
    mx.export_to_dot(out, *arrays)
    return [line.split('label ="', 1)[1].split('"', 1)[0] for line in out.getvalue().splitlines() if "shape=rectangle" in line]


#: Primitives that (can) run as views of their input: no work of their own on any device.
VIEWS = frozenset({"Broadcast", "Transpose", "Slice", "ExpandDims", "Squeeze", "Reshape"})


def working(names: list[str]) -> int:
    """How many of the primitives ``names`` do work of their own (are not views)."""
    return sum(name not in VIEWS for name in names)
