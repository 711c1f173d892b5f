"""A GPU's float32 products, emulated on the CPU: ``MLXKV_TEST_TF32=1``.

MLX's CUDA backend multiplies float32 matrices with TF32-like inputs by
default (``MLX_ENABLE_TF32``): each input rounded to a 10-bit mantissa, the
products summed in float32. Two exact paths that agree within a few ulps on
the CPU then differ by about ``2^-11`` of their values (4.9e-4 apart on an
H200, issue 31). :func:`install` makes the CPU do the same to every float32
product the tests and the library ask for -- ``@``, ``mx.matmul``,
``mx.addmm``, and the queries, keys and values of fused attention -- so that
a run of the suite on this machine shows which checks a GPU's arithmetic
would fail (``tests/device_arithmetic.py`` takes the GPU's bounds then).

It stands in for the rounding, not for a GPU: the order of a GPU's sums,
its attention kernels' own arithmetic (a flash kernel's running softmax)
and products in half precision are not emulated.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

__all__ = ["install", "tf32"]

_MANTISSA_DROPPED = 13  # float32 has 23 mantissa bits, TF32 10
_HALF = (1 << (_MANTISSA_DROPPED - 1)) - 1
_KEPT = 0xFFFFFFFF ^ ((1 << _MANTISSA_DROPPED) - 1)


def tf32(x: Any) -> Any:
    """``x`` with each float32 value rounded to the nearest TF32 value (ties
    to even); any other dtype as it is."""
    if not isinstance(x, mx.array) or x.dtype != mx.float32:
        return x
    bits = x.view(mx.uint32)
    odd = (bits >> _MANTISSA_DROPPED) & 1
    return ((bits + _HALF + odd) & _KEPT).view(mx.float32)


def install() -> Callable[[], None]:
    """Round the inputs of every float32 product MLX computes from Python from
    now on (for the process, where tests run so); returns what undoes it."""
    matmul, addmm, sdpa = mx.matmul, mx.addmm, mx.fast.scaled_dot_product_attention
    array_matmul = mx.array.__matmul__

    def rounded_matmul(a: Any, b: Any, **options: Any) -> Any:
        return matmul(tf32(a), tf32(b), **options)

    def rounded_addmm(c: Any, a: Any, b: Any, **options: Any) -> Any:
        return addmm(c, tf32(a), tf32(b), **options)

    def rounded_attention(q: Any, k: Any, v: Any, **options: Any) -> Any:
        return sdpa(tf32(q), tf32(k), tf32(v), **options)

    def undo() -> None:
        mx.matmul, mx.addmm, mx.fast.scaled_dot_product_attention = matmul, addmm, sdpa
        mx.array.__matmul__ = array_matmul

    mx.matmul, mx.addmm, mx.fast.scaled_dot_product_attention = rounded_matmul, rounded_addmm, rounded_attention
    mx.array.__matmul__ = lambda a, b: array_matmul(tf32(a), tf32(b))
    return undo
