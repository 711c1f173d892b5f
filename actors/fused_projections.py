"""Sibling projections of a layer as one matrix product, once, as a model loads.

A decoder layer projects one input several times: attention's keys and
values (``k_proj``, ``v_proj``; its queries too, which are left apart:
:data:`SIBLINGS`), a gated MLP's gate and up
projections (``gate_proj``, ``up_proj``). Each is a matrix product, and on a
GPU a decode step of a small model is its kernel launches: two launches
where one product over the weights side by side gives the same outputs.
:func:`fuse_projections` holds each such set's weights as one matrix (the
originals' buffers go back) and puts thin modules in the siblings' places:
the first of them called with an input computes the one product and every
sibling called with that same input (the same array object, as mlx-lm's
models pass it) takes its columns of it, a view. A set whose siblings are
called with different inputs (cross-attention) or not all called (a layer
reusing another's keys and values) goes apart: each then multiplies by its
own columns of the weight.

The outputs are the original layers' on the CPU bit for bit (each output's
dot product is the same sum over the same inputs; checked in every dtype
and shape tested), within float noise on a GPU (another product's kernel).
Only sets of plain float ``nn.Linear`` layers with the same input size, the
same dtype, and biases on all or none of them change; quantized and other
layers stay as they are.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

__all__ = ["SIBLINGS", "fuse_projections"]

#: The sibling projections that share their input, per module (``w1``, ``w3``:
#: LFM2's gated MLP). Not the queries: a slice of a joint product is not
#: row-contiguous, and the queries go on to fused attention (and to
#: :mod:`~mlxkv.actors.decode_kernel`) whole, where a strided input is copied
#: first (a launch back); the keys and values go only into the cache's
#: buffers, and the gate and up into one elementwise kernel, which read any
#: layout.
SIBLINGS = (("k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))


class _Product:
    """One set's weights side by side and the last product over them.

    Reads: the joint ``weight`` (``(in, out)`` contiguous where
    ``transposed``, else ``(out, in)``) and ``bias`` (or None) off the set's
    first sibling, whose parameters they are (so that a model's update of
    its parameters reaches the product). Owns: each sibling's column range, and
    ``last``: the input the product was last computed for and the columns
    of the product (views, split at once) of the siblings that have not
    taken theirs yet (dropped when the last of them has, so no activation
    outlives its layer's call);
    ``apart``: set once siblings were called with different inputs (or one
    was not called before the next input came), after which each multiplies
    by its own columns.
    Not an ``nn.Module``: the weight is a parameter of the first sibling
    only (:func:`fused_linear`), so the model's parameters count it once.
    """

    def __init__(self, ranges: dict[str, tuple[int, int]], transposed: bool) -> None:
        self.owner: Any = None
        self.ranges = ranges
        self.transposed = transposed
        #: the siblings in column order, and where each after the first starts
        self.order = sorted(ranges, key=lambda name: ranges[name][0])
        self.starts = [ranges[name][0] for name in self.order[1:]]
        self.last: Optional[tuple[Any, dict[str, Any]]] = None
        self.apart = False

    @property
    def weight(self) -> Any:
        return self.owner.weight_joint

    @property
    def bias(self) -> Any:
        return self.owner.get("bias_joint")

    def columns(self, name: str) -> Any:
        """Sibling ``name``'s weight as ``(out, in)``: a view of the joint weight."""
        start, stop = self.ranges[name]
        return self.weight[:, start:stop].T if self.transposed else self.weight[start:stop]

    def __call__(self, name: str, x: Any) -> Any:
        """Sibling ``name``'s output for ``x``: its columns of the joint product
        (computed by the first sibling called with ``x`` and split into every
        sibling's columns at once: views), or its own product once the set
        has been seen apart."""
        import mlx.core as mx

        if self.apart:
            return self._alone(name, x)
        last = self.last
        if last is None:
            out = x @ self.weight if self.transposed else x @ self.weight.T
            if self.bias is not None:
                out = out + self.bias
            last = (x, dict(zip(self.order, mx.split(out, self.starts, axis=-1))))
        elif last[0] is not x or name not in last[1]:
            # Siblings called with different inputs, or some not at all (a layer
            # that reuses another's keys and values): the set goes apart for good.
            self.apart, self.last = True, None
            return self._alone(name, x)
        part = last[1].pop(name)
        self.last = last if last[1] else None
        return part

    def _alone(self, name: str, x: Any) -> Any:
        start, stop = self.ranges[name]
        weight = self.weight[:, start:stop] if self.transposed else self.weight[start:stop].T
        out = x @ weight
        if self.bias is not None:
            out = out + self.bias[start:stop]
        return out


class _Ref:
    """Holds a :class:`_Product` on a module without making it a child (an
    ``nn.Module`` registers arrays, modules, dicts and lists it is given)."""

    __slots__ = ("product",)

    def __init__(self, product: _Product) -> None:
        self.product = product


@functools.cache
def fused_linear() -> Any:
    """The ``nn.Module`` class put in each sibling's place (made on first use:
    this module imports no MLX until then)."""
    import mlx.nn as nn

    class _FusedLinear(nn.Module):
        """One sibling of a fused set: its columns of the set's product.

        Invariants:
            - ``self(x)`` equals the original layer's ``x``;
            - the set's joint weight (and bias) is a parameter of its first
              sibling only.
        """

        def __init__(self, product: _Product, name: str, joint: Optional[tuple[Any, Any]] = None) -> None:
            """A sibling ``name`` of ``product``'s set; the first one is given
            the ``joint`` weight and bias (or None) as its parameters."""
            super().__init__()
            self._ref = _Ref(product)
            self._name = name
            if joint is not None:
                self.weight_joint = joint[0]
                if joint[1] is not None:
                    self.bias_joint = joint[1]
                product.owner = self

        @property
        def weight(self) -> Any:
            """This layer's ``(out, in)`` weight, a view, for code that reads it."""
            return self._ref.product.columns(self._name)

        def __call__(self, x: Any) -> Any:
            return self._ref.product(self._name, x)

    _FusedLinear.__name__ = _FusedLinear.__qualname__ = "FusedLinear"
    return _FusedLinear


def fuse_projections(model: Any, *, transposed: bool = False) -> int:
    """Fuse every set of :data:`SIBLINGS` in ``model`` whose layers are plain
    float ``nn.Linear`` with one input size, one dtype and biases on all or
    none (see the module docstring), evaluated on the calling (MLX) thread;
    ``transposed``: hold the joint weight as ``(in, out)``, as
    :mod:`~mlxkv.actors.weight_layout` holds the CPU's. The model's
    parameters take the same bytes afterwards.

    Returns:
        The number of sets fused (0 where there are none, or on a second call).
    """
    import mlx.core as mx
    import mlx.nn as nn

    fused = 0
    for _, module in model.named_modules():
        for names in SIBLINGS:
            layers = [module.get(name) if isinstance(module, dict) else None for name in names]
            if not all(type(layer) is nn.Linear for layer in layers):
                continue
            weights = [layer.weight for layer in layers]
            biases = ["bias" in layer for layer in layers]
            if len({w.shape[1] for w in weights}) != 1 or len({w.dtype for w in weights}) != 1:
                continue
            if any(biases) != all(biases) or not mx.issubdtype(weights[0].dtype, mx.floating):
                continue
            joint = mx.concatenate(weights, axis=0)
            if transposed:
                joint = mx.contiguous(joint.T)
            bias = mx.concatenate([layer.bias for layer in layers]) if all(biases) else None
            mx.eval(joint, *([] if bias is None else [bias]))
            ranges, start = {}, 0
            for name, w in zip(names, weights):
                ranges[name] = (start, start + w.shape[0])
                start += w.shape[0]
            product = _Product(ranges, transposed)
            cls = fused_linear()
            for index, name in enumerate(names):
                module[name] = cls(product, name, (joint, bias) if index == 0 else None)
            fused += 1
    if fused:
        mx.clear_cache()  # the originals' buffers, not kept for reuse
    return fused
