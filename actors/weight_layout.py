"""Linear weights laid out for the CPU's matrix multiply, once, as a model loads.

mlx's ``nn.Linear`` holds its weight as ``(out, in)`` and computes
``x @ weight.T``: a product with a transposed operand. On the CPU, the
Linux wheel (``mlx[cpu]``) multiplies through the reference BLAS it bundles,
whose ``sgemm`` runs that product slower than the same product over a
contiguous ``(in, out)`` matrix. Holding each weight transposed once
(:func:`transposed_linear`) makes every layer the fast product (the figures:
docs/benchmarks.md, "2026-12-03: linear weights held transposed on the CPU").

The output is bit-identical: both products sum each dot product over the
inner dimension in the same order (a bias is added after the product; that
matched ``nn.Linear``'s ``addmm`` bit for bit in every shape tested).
Nothing is held twice: the transposed weight replaces the original. On
Metal, MLX multiplies transposed operands in its own kernels (not measured
here), so the layout is left alone there by default (:func:`wanted`).

Only plain float ``nn.Linear`` layers change (not quantized, LoRA or other
subclasses, nor an embedding used as the output layer); a layer that reads
``weight`` still gets the ``(out, in)`` view.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

__all__ = ["hold_weights", "loading", "transpose_linear_weights", "transposed_linear", "wanted"]


def wanted(choice: Optional[bool]) -> bool:
    """Whether to transpose: ``choice`` if given, else where MLX's default
    device is the CPU."""
    if choice is not None:
        return choice
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.cpu


@functools.cache
def transposed_linear() -> Any:
    """The ``nn.Module`` class :func:`transpose_linear_weights` puts in place
    of each layer (made on first use: this module imports no MLX until then)."""
    import mlx.core as mx
    import mlx.nn as nn

    class _TransposedLinear(nn.Module):
        """``nn.Linear`` over its weight held as ``(in, out)``, contiguous.

        Invariants:
            - ``weight_t`` is the original ``weight.T``, contiguous;
            - ``self(x)`` equals the original layer's ``x``, bit for bit, on
              the CPU (see the module docstring).
        """

        def __init__(self, layer: nn.Linear) -> None:
            super().__init__()
            self.weight_t = mx.contiguous(layer.weight.T)
            if "bias" in layer:
                self.bias = layer.bias

        @property
        def weight(self) -> Any:
            """The ``(out, in)`` view, for code that reads a layer's weight."""
            return self.weight_t.T

        def __call__(self, x: Any) -> Any:
            out = x @ self.weight_t
            if "bias" in self:
                out = out + self.bias
            return out

    _TransposedLinear.__name__ = _TransposedLinear.__qualname__ = "TransposedLinear"
    return _TransposedLinear


def transpose_linear_weights(model: Any) -> int:
    """Replace every plain float ``nn.Linear`` in ``model`` by a
    :func:`transposed_linear` over the same weight, evaluated (on the MLX
    thread that runs the model). The model's parameters take the same
    bytes afterwards; at most one layer's weight is held twice meanwhile,
    and the originals' buffers go back (MLX's buffer cache is cleared).

    Returns:
        The number of layers replaced (0 where there are none, or on a
        second call).
    """
    import mlx.core as mx
    import mlx.nn as nn

    made: dict[int, Any] = {}
    transposed = transposed_linear()

    def replace(value: Any) -> Any:
        """``value`` with its plain linear layers replaced (a container in place)."""
        if type(value) is nn.Linear and mx.issubdtype(value.weight.dtype, mx.floating):
            if id(value) not in made:  # a layer used in two places stays one
                made[id(value)] = transposed(value)
            return made[id(value)]
        if isinstance(value, nn.Module) or isinstance(value, dict):
            for key in list(value):
                value[key] = replace(value[key])
        elif isinstance(value, list):
            value[:] = [replace(item) for item in value]
        return value

    replace(model)
    # One layer at a time: the original weight is freed as its copy lands.
    for layer in made.values():
        mx.eval(layer.parameters())
    if made:
        mx.clear_cache()  # the originals' buffers, not kept for reuse
    return len(made)


def hold_weights(model: Any, config: Any) -> tuple[int, int]:
    """Lay out ``model``'s weights as ``config`` (a
    :class:`~mlxkv.actors.compute_config.RunnerConfig`) says, in place, each
    only where its field is True: sibling projections fused first
    (:func:`~mlxkv.actors.fused_projections.fuse_projections`, transposed
    with the rest where ``transpose_weights``), then every other plain
    linear layer transposed.

    Returns:
        (sets of projections fused, linear layers transposed).
    """
    from mlxkv.actors.fused_projections import fuse_projections

    transpose = config.transpose_weights is True
    fused = fuse_projections(model, transposed=transpose) if config.fuse_projections is True else 0
    return fused, transpose_linear_weights(model) if transpose else 0


def loading(config: Any) -> Any:
    """``config`` with its layout choices made for a model the runner loads
    itself: weights transposed where MLX runs on the CPU (unless given),
    projections fused and decode layers compiled (unless off)."""
    import attrs

    return attrs.evolve(
        config,
        transpose_weights=wanted(config.transpose_weights),
        fuse_projections=config.fuse_projections is not False,
        compile_decode=config.compile_decode is not False,
    )
