"""Which reshapes launch a copy on MLX's CUDA backend, counted off a GPU.

MLX 0.32 evaluates a ``Reshape`` on a GPU (``reshape_gpu``,
``mlx/backend/gpu/primitives.cpp``) as a view of its input's buffer where
``prepare_reshape`` (``mlx/backend/common/common.cpp``) finds strides for
it -- the input row-contiguous, or its contiguous runs of axes splitting
into the new shape -- and as a copy kernel otherwise. A graph does not say
which, so :class:`ReshapeViews` watches the reshapes Python code asks for
(``mx.reshape`` and ``array.reshape``), evaluates each input (count in a
step that is not timed) and reads its layout through the buffer protocol,
as MLX's own view rules lay it out on every device.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_matmul import collapse_axes, element_strides  # noqa: E402


def reshape_is_view(array: Any, shape: Sequence[int]) -> bool:
    """Whether MLX reshapes ``array`` (evaluated here) to ``shape`` without a
    copy: ``prepare_reshape``'s rule over the array's element strides."""
    mx.eval(array)
    axes = [(n, s) for n, s in zip(array.shape, element_strides(array)) if n != 1] if array.ndim else []
    if array.size == 0 or not axes:
        return True
    sizes, (strides,) = collapse_axes([n for n, _ in axes], [[s for _, s in axes]])
    if len(sizes) == 1 and strides[0] == 1:
        return True  # row-contiguous
    j = 0
    for n in shape:
        if j < len(sizes) and sizes[j] % n == 0:
            sizes[j] //= n
            j += sizes[j] == 1
        elif n != 1:
            return False
    return True


class ReshapeViews:
    """While entered, every ``mx.reshape`` and ``array.reshape`` that makes a
    graph node (another shape than its input's) is checked with
    :func:`reshape_is_view`: ``views`` and ``copies`` count them."""

    def __init__(self) -> None:
        self.views = 0
        self.copies = 0

    def __enter__(self) -> ReshapeViews:
        self._honest = honest = mx.reshape, mx.array.reshape

        def function(array: Any, shape: Sequence[int], **kwargs: Any) -> Any:
            out = honest[0](array, shape, **kwargs)
            self._note(array, out)
            return out

        def method(array: Any, *shape: Any, **kwargs: Any) -> Any:
            out = honest[1](array, *shape, **kwargs)
            self._note(array, out)
            return out

        mx.reshape, mx.array.reshape = function, method
        return self

    def __exit__(self, *exc: Any) -> None:
        mx.reshape, mx.array.reshape = self._honest

    def _note(self, array: Any, out: Any) -> None:
        if tuple(out.shape) == tuple(array.shape):
            return  # no node of its own
        if reshape_is_view(array, out.shape):
            self.views += 1
        else:
            self.copies += 1
