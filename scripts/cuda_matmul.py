"""The kernel launches MLX's CUDA backend makes for a matrix product, counted off a GPU.

MLX 0.32's CUDA ``Matmul`` (``mlx/backend/cuda/matmul.cpp``) takes each
operand's last two axes as they are if they are row- or column-major with
no gap (else it copies the operand first: ``check_transpose``), then
collapses the batch axes that are one stride apart in both operands
(``collapse_batches``). A vector product (``gemv``: one row with the right
operand transposed, or one column) takes any batch layout in one kernel;
otherwise cuBLAS runs the last collapsed batch axis as one strided-batched
call. Batch axes that do not collapse into one -- a KV head's rows of a
``(batch, kv_heads, S, dim)`` buffer read KV head first, say -- go through
``CublasGemm::run_batched``, which MLX builds one of two ways by the CUDA
toolkit it is compiled with: from 12.9 (``cublas_gemm_batched_12_9.cu``;
the ``cuda13`` wheel) a kernel writes every matrix's address into a
pointer array (allocated for the call) and one cuBLAS call runs them all:
two launches; before 12.9 (``cublas_gemm_batched_12_0.cpp``) one cuBLAS
call for every index of the axes before the last.

The layout of an operand is MLX's own: the same view rules run on every
device, and an evaluated array's strides are readable through the buffer
protocol. :func:`gemm_launches` gives the launches and copies of one
product; :class:`GemmLaunches` counts them for every ``mx.matmul`` and
``@`` while it is entered (it evaluates the operands it sees: count in a
step that is not timed).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import mlx.core as mx

#: ``collapse_contiguous_dims``'s default cap on a collapsed axis.
_SIZE_CAP = 2**31 - 1


@attrs.frozen
class Product:
    """One product as MLX's CUDA backend runs it: ``launches``, the kernels
    it launches for the product (cuBLAS calls, MLX's vector kernel, the
    kernel that writes a pointer array), and ``copies``, operands copied
    first (a launch each, not in ``launches``)."""

    launches: int
    copies: int


def gemm_launches(a: Any, b: Any, *, pointer_array: bool = True) -> Product:
    """The launches ``mx.matmul(a, b)`` makes on MLX 0.32's CUDA backend (``a``
    and ``b`` at least 2-D; they are evaluated). ``pointer_array``: MLX built
    with CUDA 12.9 or later (batch axes that do not collapse: a pointer
    array and one cuBLAS call); False: an earlier toolkit's (a cuBLAS call
    for every index of the batch axes before the last)."""
    mx.eval(a, b)
    batch = tuple(mx.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    a_shape, a_strides = _broadcast(a, batch)
    b_shape, b_strides = _broadcast(b, batch)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    copies = 0
    a_transposed, a_strides, copied = _check_transpose(a_shape, a_strides)
    copies += copied
    b_transposed, b_strides, copied = _check_transpose(b_shape, b_strides)
    copies += copied
    if not batch:
        return Product(1, copies)
    shape, (a_batch, b_batch) = collapse_axes(list(batch), [a_strides[:-2], b_strides[:-2]])
    count = math.prod(batch)
    if count > 1 and not a_transposed and len(shape) == 1 and a_strides[-2] == k and a_batch[-1] == m * k and b_batch[-1] == 0:
        return Product(1, copies)  # the batch folded into the rows
    if (m == 1 and b_transposed) or (n == 1 and not a_transposed):
        return Product(1, copies)  # gemv: any batch layout
    outer = count // shape[-1]
    if outer <= 1:
        return Product(1, copies)
    return Product(2 if pointer_array else outer, copies)


def _broadcast(array: Any, batch: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """``array``'s shape and element strides broadcast to the ``batch`` axes (a
    broadcast axis has stride 0)."""
    strides = element_strides(array)
    extra = len(batch) - (array.ndim - 2)
    shape = [1] * extra + list(array.shape)
    strides = [0] * extra + strides
    for axis, size in enumerate(batch):
        if shape[axis] != size:
            shape[axis], strides[axis] = size, 0
    return shape, strides


def _check_transpose(shape: list[int], strides: list[int]) -> tuple[bool, list[int], int]:
    """``check_transpose``: whether the operand is used transposed, its strides
    then, and 1 if it is copied (row-major) first."""
    stx, sty = strides[-2], strides[-1]
    if sty == 1 and stx == shape[-1]:
        return False, strides, 0
    if stx == 1 and sty == shape[-2]:
        return True, strides, 0
    return False, _row_major(shape), 1


def _row_major(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def element_strides(array: Any) -> list[int]:
    """An evaluated array's strides in elements, read through the buffer protocol."""
    return [s // array.itemsize for s in memoryview(array).strides]


def collapse_axes(shape: list[int], strides: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """``collapse_contiguous_dims`` over several operands' strides: runs of
    axes one stride apart in every operand merged (size-1 axes dropped),
    each run's size and its innermost stride in each operand."""
    if not shape:
        return [1], [[0] for _ in strides]
    groups: list[list[int]] = [[0]] if shape[0] != 1 else [[]]
    size = shape[0]
    for i in range(1, len(shape)):
        size *= shape[i]
        if any(st[i] * shape[i] != st[i - 1] for st in strides) or size > _SIZE_CAP:
            size = shape[i]
            groups.append([])
        if shape[i] != 1:
            groups[-1].append(i)
    groups = [g for g in groups if g]
    if not groups:
        return [1], [[0] for _ in strides]
    out_shape = [math.prod(shape[i] for i in g) for g in groups]
    return out_shape, [[st[g[-1]] for g in groups] for st in strides]


class GemmLaunches:
    """While entered, every ``mx.matmul`` and ``a @ b`` is counted as MLX's CUDA
    backend (built with CUDA 12.9 or later) runs it: ``products`` (one
    :class:`Product` each, in order)."""

    def __init__(self) -> None:
        self.products: list[Product] = []

    def __enter__(self) -> GemmLaunches:
        self._honest = honest = mx.matmul, mx.array.__matmul__

        def counting(product: Any) -> Any:
            def counted(a: Any, b: Any, **kwargs: Any) -> Any:
                self.products.append(gemm_launches(a, b))
                return product(a, b, **kwargs)

            return counted

        mx.matmul, mx.array.__matmul__ = (counting(product) for product in honest)
        return self

    def __exit__(self, *exc: Any) -> None:
        mx.matmul, mx.array.__matmul__ = self._honest

    @property
    def launches(self) -> int:
        return sum(p.launches for p in self.products)

    @property
    def copies(self) -> int:
        return sum(p.copies for p in self.products)
