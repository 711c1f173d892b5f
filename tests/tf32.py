"""A GPU's float32 products, emulated on the CPU: ``MLXKV_TEST_TF32=1``.

MLX's CUDA backend multiplies float32 matrices with TF32-like inputs by
default (``MLX_ENABLE_TF32``): each input rounded to a 10-bit mantissa, the
products summed in float32, in an order that depends on the kernel cuBLAS
picks for the shapes. Two exact paths that agree within a few ulps on the
CPU then differ by about ``2^-11`` of their values (4.9e-4 apart on an
H200, issue 31). :func:`install` makes the CPU do the same to every float32
product the tests and the library ask for from Python -- ``@``,
``mx.matmul``, ``mx.addmm`` and fused attention -- so that a run of the
suite on this machine shows which checks a GPU's arithmetic would fail
(``tests/device_arithmetic.py`` takes the GPU's bounds then):

- a float32 product's inputs are rounded to TF32 (:func:`tf32`), and its
  sums' order is stood in for by moving the last three bits of each result
  in a pattern fixed by the operands' shapes (a result whose last bits are
  all zero, a sum no order rounds, stays); a half-precision product is
  summed in float32, reordered so, and rounded once;
- fused attention runs as MLX's CUDA backend runs it in float32: a query a
  row over a head of 64, 96, 128 or 256 by its vector kernel (float32
  arithmetic, no TF32), anything else -- a prefill, the tiny test models'
  heads -- by its fallback, two such products around a softmax.

It stands in for the rounding, not for a GPU: its kernels' own arithmetic
(half-precision attention, a custom kernel's) and the order of other
reductions are not emulated.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx

__all__ = ["install", "tf32"]

_MANTISSA_DROPPED = 13  # float32 has 23 mantissa bits, TF32 10
_HALF = (1 << (_MANTISSA_DROPPED - 1)) - 1
_KEPT = 0xFFFFFFFF ^ ((1 << _MANTISSA_DROPPED) - 1)
#: Half-precision dtypes: products summed in float32, rounded once.
_HALVES = (mx.bfloat16, mx.float16)
#: Head sizes MLX's CUDA vector attention kernel takes (one query a row).
_VECTOR_HEADS = frozenset({64, 96, 128, 256})


def tf32(x: Any) -> Any:
    """``x`` with each float32 value rounded to the nearest TF32 value (ties
    to even); any other dtype as it is."""
    if not isinstance(x, mx.array) or x.dtype != mx.float32:
        return x
    bits = x.view(mx.uint32)
    odd = (bits >> _MANTISSA_DROPPED) & 1
    return ((bits + _HALF + odd) & _KEPT).view(mx.float32)


def reordered(out: Any, *shapes: tuple[int, ...]) -> Any:
    """``out`` (float32) with the last three bits of each value moved in a
    pattern fixed by ``shapes``: another kernel's order of the same sums.
    A value whose last thirteen bits are zero (a sum no order rounds, such
    as a small integer) stays."""
    if not isinstance(out, mx.array) or out.dtype != mx.float32:
        return out
    pattern = mx.array((hash(shapes) & 0x7FFFFFFF) | 1, dtype=mx.uint32)
    bits = out.view(mx.uint32)
    moved = bits ^ (((bits * pattern) >> 29) & 7)
    return mx.where((bits & ((1 << _MANTISSA_DROPPED) - 1)) == 0, bits, moved).view(mx.float32)


def install() -> Callable[[], None]:
    """Emulate a GPU's float32 products (the module's list) in every MLX call
    made from Python from now on (for the process, where tests run so);
    returns what undoes it."""
    matmul, addmm, sdpa = mx.matmul, mx.addmm, mx.fast.scaled_dot_product_attention
    array_matmul = mx.array.__matmul__

    def emulated(multiply: Callable[..., Any], a: Any, b: Any, *rest: Any, **options: Any) -> Any:
        half = next((x.dtype for x in (a, b) if isinstance(x, mx.array) and x.dtype in _HALVES), None)
        if half is None:
            return reordered(multiply(*rest, tf32(a), tf32(b), **options), tuple(a.shape), tuple(b.shape))
        # Half precision: float32 sums in the kernel's order, rounded once at the end.
        wide = [x.astype(mx.float32) if isinstance(x, mx.array) else x for x in (*rest, a, b)]
        return reordered(multiply(*wide, **options), tuple(a.shape), tuple(b.shape)).astype(half)

    def product(a: Any, b: Any) -> Any:
        return emulated(array_matmul, a, b)

    def rounded_matmul(a: Any, b: Any, **options: Any) -> Any:
        return emulated(matmul, a, b, **options)

    def rounded_addmm(c: Any, a: Any, b: Any, **options: Any) -> Any:
        return emulated(addmm, a, b, c, **options)

    def attention(q: Any, k: Any, v: Any, *, scale: float, mask: Optional[Any] = None, **options: Any) -> Any:
        vector = q.shape[2] == 1 and q.shape[3] == v.shape[3] and q.shape[3] in _VECTOR_HEADS
        if q.dtype != mx.float32 or vector or options.get("sinks") is not None:
            return sdpa(q, k, v, scale=scale, mask=mask, **options)
        return _fallback_attention(product, q, k, v, scale, mask)

    def undo() -> None:
        mx.matmul, mx.addmm, mx.fast.scaled_dot_product_attention = matmul, addmm, sdpa
        mx.array.__matmul__ = array_matmul

    mx.matmul, mx.addmm, mx.fast.scaled_dot_product_attention = rounded_matmul, rounded_addmm, attention
    mx.array.__matmul__ = product
    return undo


def _fallback_attention(product: Callable[[Any, Any], Any], q: Any, k: Any, v: Any, scale: float, mask: Any) -> Any:
    """Attention as MLX's unfused fallback computes it, with ``product`` for
    its two products: a KV head's query heads together, the mask (``"causal"``,
    boolean or additive) on the scores, a precise softmax."""
    batch, heads, length, _ = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    repeats = heads // kv_heads
    grouped = (q * scale).reshape(batch, kv_heads, repeats, length, q.shape[3])
    scores = product(grouped, k[:, :, None].swapaxes(-1, -2))  # (batch, kv_heads, repeats, length, keys)
    if isinstance(mask, str):
        assert mask == "causal", mask
        mask = mx.arange(keys)[None] <= mx.arange(length)[:, None] + (keys - length)
    if mask is not None:
        if mask.ndim == 4:
            mask = mask.reshape(mask.shape[0], kv_heads, repeats, *mask.shape[2:]) if mask.shape[1] == heads else (
                mx.expand_dims(mask, 2)
            )
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
    weights = mx.softmax(scores, axis=-1, precise=True)
    return product(weights, v[:, :, None]).reshape(batch, heads, length, v.shape[3])
