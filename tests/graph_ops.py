"""What MLX would run to evaluate arrays: the primitives of their graph, read
from ``mx.export_to_dot`` (an evaluated array's graph is empty)."""

from __future__ import annotations

import io
from typing import Any

import mlx.core as mx


def primitives(*arrays: Any) -> list[str]:
    """The names of the primitives MLX would run to evaluate ``arrays``, one per node."""
    out = io.StringIO()
    mx.export_to_dot(out, *arrays)
    return [line.split('label ="', 1)[1].split('"', 1)[0] for line in out.getvalue().splitlines() if "shape=rectangle" in line]
