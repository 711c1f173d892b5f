"""Stand-ins, on a machine without a GPU, for what a GPU runs as one kernel.

The measuring scripts (``bench_step.py``, ``bench_memory.py``) take them by
flag, where MLX runs on the CPU or has no CUDA backend, so that a CPU
measures more nearly what a GPU's host pays (build times) or what a GPU's
fused kernels hold (memory). Each replaces a function process-wide, for
the rest of the process; the outputs are then wrong: a run with a stand-in
says nothing of tokens or of the device's arithmetic time.

- :func:`kernel`: mlxkv's CUDA decode kernel (:mod:`mlxkv.actors.decode_kernel`)
  taken as present and checked, its one launch a fused attention call over
  the suffix buffers (the ``kernel`` way's host path as on CUDA).
- :func:`fast_ops`: ``mx.fast.rms_norm`` and ``mx.fast.rope``, which the CPU
  runs as their fallbacks (about ten operations each), as one elementwise
  operation each (a GPU's one kernel each).
- :func:`fused_attention_memory`: ``mx.fast.scaled_dot_product_attention``,
  which the CPU runs as its fallback (every score of a call materialised),
  as an operation that allocates only its
  output and holds its inputs until it runs, as a GPU's flash kernel does.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

__all__ = ["fast_ops", "fused_attention_memory", "kernel"]


def _on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def kernel() -> None:
    """Where MLX has no CUDA backend, the decode kernel taken as present and
    checked, its one launch replaced by one fused attention call over the
    suffix buffers: the kernel way's host path runs as it would on CUDA (its
    checks, the rows' layout, the kernel's inputs and template), for the
    counts, the build time and the memory of a step (not its output)."""
    from mlxkv.actors import decode_kernel

    if decode_kernel.on_cuda():
        return

    def one_launch(*, inputs: Any, output_shapes: Any, **_: Any) -> list[Any]:
        queries, _scale, _info, suffix_keys, suffix_values = inputs[:5]
        return [mx.fast.scaled_dot_product_attention(queries, suffix_keys, suffix_values, scale=1.0)]

    decode_kernel.on_cuda = lambda device=None: True
    decode_kernel.self_check = lambda *build: None
    decode_kernel._kernel = lambda: one_launch


def fast_ops() -> None:
    """On the CPU, ``mx.fast.rms_norm`` and ``mx.fast.rope`` replaced by one
    elementwise operation each (a GPU's one kernel each; the CPU's
    fallbacks are chains of operations): for host times, not outputs."""
    if not _on_cpu():
        return
    mx.fast.rms_norm = lambda x, weight, eps, **_: mx.abs(x)
    mx.fast.rope = lambda x, *_, **__: mx.abs(x)


def fused_attention_memory() -> None:
    """On the CPU, ``mx.fast.scaled_dot_product_attention`` replaced by an
    operation with its output's shape and dtype that reads one element of
    each input (the keys, the values and an array mask: each held until it
    runs, as the fused kernel holds them) and allocates nothing else: the
    memory a GPU's flash kernel needs, for peak-memory estimates (the CPU's
    fallback holds the whole score matrix of a call). The output is the
    queries scaled, not attention."""
    if not _on_cpu():
        return

    def held(queries: Any, keys: Any, values: Any, *, scale: float, mask: Any = None, **_: Any) -> Any:
        first = keys[:1, :1, :1, :1].astype(queries.dtype) + values[:1, :1, :1, :1].astype(queries.dtype)
        if mask is not None and not isinstance(mask, str):
            corner = mask[(slice(0, 1),) * mask.ndim].reshape(1, 1, 1, 1)
            first = first + (corner == 0).astype(queries.dtype)  # finite where the mask is -inf
        if values.shape[-1] != queries.shape[-1]:
            queries = queries[..., : values.shape[-1]]
        return queries * scale + 0 * first

    mx.fast.scaled_dot_product_attention = held
