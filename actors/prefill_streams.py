"""A batched prefill's rows spread over several MLX streams, where that is faster: on the CPU.

MLX runs each stream's operations in order on one thread, and ``mlx[cpu]``
on Linux multiplies with a reference BLAS that uses one core: a prefill
chunk of several requests, however large, then keeps one core busy and
leaves the others idle. Split into one model call per stream, the rows'
calls run side by side, each on its own core (on this project's 2-core
machine a 4-row x 256-token chunk of the built-in model takes about half
the time: docs/benchmarks.md). A GPU runs the kernels of one queue and
gains nothing: it keeps one stream.

Only calls with enough tokens per stream are split
(:data:`MIN_TOKENS_PER_STREAM`): a call of a few tokens a row (a
prompt's last token, a short chunk) is bound by the operations MLX
dispatches, not by arithmetic, and each extra call dispatches them all
again.

The split changes no row's result: each row is computed as in any batched
call, right-padded to the longest row of its own group instead of the
whole batch (padding is masked; it changes which positions are computed,
not what a real one attends to).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any, Optional, TypeVar

__all__ = ["MAX_DEFAULT_STREAMS", "MIN_TOKENS_PER_STREAM", "StreamPool", "default_prefill_streams", "spread"]

#: The most streams a batched prefill uses by default (one per core).
MAX_DEFAULT_STREAMS = 8

#: Fewer tokens than this per stream and a call is not split (measured on the
#: built-in model, this project's CPU: 4 rows x 4 tokens take 1.6 ms in one
#: call and 2.3 ms in two; 4 x 16, 3.6 ms and 2.9 ms).
MIN_TOKENS_PER_STREAM = 32

Row = TypeVar("Row")


def default_prefill_streams(device: Optional[Any] = None) -> int:
    """Streams for ``device`` (default: MLX's default device): where MLX runs
    on the CPU, the cores this process may use, at most
    :data:`MAX_DEFAULT_STREAMS`; on a GPU, one."""
    import mlx.core as mx

    device = device if device is not None else mx.default_device()
    if device.type != mx.DeviceType.cpu:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_DEFAULT_STREAMS))


def spread(rows: Sequence[tuple[Row, int]], streams: int) -> list[list[Row]]:
    """``rows`` (each with its token count) in groups, one per stream, of
    about equal tokens: the longest first, each to the group with the
    fewest tokens so far. As many groups as ``streams`` allows with at least
    :data:`MIN_TOKENS_PER_STREAM` tokens each, never more than rows, at
    least one; each group keeps the rows' order."""
    total = sum(tokens for _, tokens in rows)
    count = max(1, min(streams, len(rows), total // MIN_TOKENS_PER_STREAM))
    if count == 1:
        return [[row for row, _ in rows]]
    loads = [0] * count
    chosen: list[list[int]] = [[] for _ in range(count)]
    for index in sorted(range(len(rows)), key=lambda i: -rows[i][1]):
        least = loads.index(min(loads))
        chosen[least].append(index)
        loads[least] += rows[index][1]
    return [[rows[i][0] for i in sorted(group)] for group in chosen if group]


class StreamPool:
    """The extra streams of the thread that asks (MLX streams belong to the
    thread that made them), made on first use: the thread's current stream
    and ``count - 1`` more on its device. MLX drops them with the thread's
    other streams (``mx.clear_streams()``)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._local = threading.local()

    def streams(self) -> list[Any]:
        """``count`` streams of this thread's default device, its current one first."""
        import mlx.core as mx

        device = mx.default_device()
        extra = getattr(self._local, "extra", None)
        if extra is None or extra[0] != device:
            extra = (device, [mx.new_stream(device) for _ in range(self.count - 1)])
            self._local.extra = extra
        return [mx.default_stream(device), *extra[1]]
