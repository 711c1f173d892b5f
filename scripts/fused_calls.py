"""MLX's fused calls as a CUDA device runs them, counted off a GPU.

Off a GPU, ``mx.fast.rms_norm``, ``layer_norm``, ``rope`` and
``scaled_dot_product_attention`` run as their unfused fallbacks: several
primitives each, where MLX's CUDA backend launches one kernel (attention:
where it has a kernel for the call). :class:`FusedCalls` counts the
difference, so that ``scripts/bench_step.py`` reports the kernels a CUDA
step launches; :class:`AttentionShapes` counts the shapes of the attention
calls CUDA runs through cuDNN, which builds a graph for every new shape
(``scripts/bench_batch.py --fused-shapes``).
"""

from __future__ import annotations

import collections
import io
from typing import Any, Callable, Optional

import mlx.core as mx

#: Primitives that only view their input (no kernel of their own; a
#: ``Split``'s outputs are views of its input on every backend). A
#: ``Flatten`` and ``Unflatten`` are reshapes (MLX's ``reshape_gpu``: a copy
#: only where the input's strides cannot be regrouped) that MLX's matrix
#: product puts around every product of a batch of rows with a matrix --
#: ``(B, L, in) @ (in, out)`` folds ``B * L`` into one axis and back -- over
#: contiguous activations: views there. A ``Reshape`` is counted here;
#: ``bench_step.py`` takes off those that need no copy, read off their
#: inputs' layouts (``cuda_reshape.py``).
VIEWS = frozenset(
    {
        "Broadcast", "Transpose", "Slice", "Split", "ExpandDims", "Squeeze", "AsStrided", "StopGradient", "Flatten",
        "Unflatten",
    }
)


def graph_ops(*arrays: Any) -> tuple[int, int, int]:
    """(primitives, non-view primitives, their launches) MLX would run to
    evaluate ``arrays``. Launches count a ``Concatenate`` once an input: MLX's
    CUDA backend copies each input into the output with a kernel of its own
    (``concatenate_gpu``); every other non-view primitive once (a ``Reshape``
    that needs no copy launches nothing, which a graph does not say)."""
    out = io.StringIO()
    mx.export_to_dot(out, *arrays)
    lines = out.getvalue().splitlines()
    # (node, label) a line, not a set: a compiled function's primitive can be
    # one node for every call of it (mlx-lm's ``swiglu``, once a layer).
    nodes = [
        (line.split("{", 1)[1].split("[", 1)[0].strip(), line.split('label ="', 1)[1].split('"', 1)[0])
        for line in lines
        if "shape=rectangle" in line
    ]
    inputs = collections.Counter(line.rsplit("->", 1)[1].strip() for line in lines if "->" in line)
    non_view = [(node, label) for node, label in nodes if label not in VIEWS]
    launches = sum(inputs[node] if label == "Concatenate" else 1 for node, label in non_view)
    return len(nodes), len(non_view), launches


class FusedCalls:
    """While entered, MLX's fused calls (``mx.fast.rms_norm``, ``layer_norm``,
    ``rope``, ``scaled_dot_product_attention``) note how many primitives each
    call put in the graph beyond the one kernel MLX's CUDA backend would run
    for it (``surplus``): off a GPU each runs as its unfused fallback, several
    primitives. A graph's non-view ops less the surplus of the calls that
    built it are the kernels a CUDA device launches for it (``cuda_kernels``).

    Attention is one kernel on CUDA where MLX 0.32's backend has one for
    the call (its ``use_fallback``): cuDNN for several queries a row in
    float16/bfloat16 (not a causal mask with more queries than keys), the
    vector kernel for fewer than four without an array mask; else its
    fallback runs there too. Head dimensions are taken as supported (the
    GPU model's 64; ``bench-llama-722m-graph`` has 8).
    """

    NAMES = ("rms_norm", "layer_norm", "rope", "scaled_dot_product_attention")

    def __init__(self) -> None:
        self.surplus = 0
        self._sizes: dict[Any, int] = {}

    def __enter__(self) -> FusedCalls:
        self._real = {name: getattr(mx.fast, name) for name in self.NAMES}
        for name, real in self._real.items():
            setattr(mx.fast, name, self._wrap(name, real))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, real in self._real.items():
            setattr(mx.fast, name, real)

    def _wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def fused(*args: Any, **kwargs: Any) -> Any:
            if name != "scaled_dot_product_attention" or _cuda_fuses_attention(*args, **kwargs):
                self.surplus += self._fallback_size(name, real, args, kwargs) - 1
            return real(*args, **kwargs)

        return fused

    def _fallback_size(self, name: str, real: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> int:
        """Non-view primitives of ``real``'s fallback for arguments like these (by shape)."""

        def like(value: Any) -> Any:
            return mx.zeros(value.shape, dtype=value.dtype) if isinstance(value, mx.array) else value

        def signature(value: Any) -> Any:
            return (value.shape, str(value.dtype)) if isinstance(value, mx.array) else repr(value)

        key = (name, tuple(signature(a) for a in args), tuple((k, signature(v)) for k, v in sorted(kwargs.items())))
        if key not in self._sizes:
            fresh_args = [like(a) for a in args]
            fresh_kwargs = {k: like(v) for k, v in kwargs.items()}
            inputs = [a for a in [*fresh_args, *fresh_kwargs.values()] if isinstance(a, mx.array)]
            out = real(*fresh_args, **fresh_kwargs)
            self._sizes[key] = max(1, graph_ops(out)[2] - graph_ops(*inputs)[2])
        return self._sizes[key]


def _cuda_fuses_attention(q: Any, k: Any, v: Any, *, mask: Any = None, **_: Any) -> bool:
    """Whether MLX's CUDA backend runs this attention call as one kernel (see :class:`FusedCalls`)."""
    cudnn = q.dtype in (mx.float16, mx.bfloat16) and cudnn_attention(q, k, mask=mask)
    vector = q.shape[2] < 4 and not isinstance(mask, mx.array) and q.shape[-1] == v.shape[-1]
    return cudnn or vector


def cudnn_attention(q: Any, k: Any, *, mask: Any = None, **_: Any) -> bool:
    """Whether MLX 0.32's CUDA backend runs this attention call through cuDNN
    in a half-precision model: several queries a row, not a causal mask over
    fewer keys than queries (its ``supports_sdpa_cudnn``; head dimensions of
    at most 128 taken as given)."""
    return q.shape[2] > 1 and not (isinstance(mask, str) and mask == "causal" and q.shape[2] > k.shape[2])


class AttentionShapes:
    """While entered, counts the distinct shapes (queries, keys, mask) of the
    attention calls :func:`cudnn_attention` says cuDNN runs, per ``label``
    (set it before each method runs; None: not counted)."""

    def __init__(self) -> None:
        self.label: Optional[str] = None
        self.shapes: dict[str, collections.Counter[Any]] = collections.defaultdict(collections.Counter)

    def __enter__(self) -> AttentionShapes:
        self._real = real = mx.fast.scaled_dot_product_attention

        def spy(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
            label = self.label
            if label is not None and cudnn_attention(q, k, **kwargs):
                mask = kwargs.get("mask")
                self.shapes[label][(q.shape, k.shape, getattr(mask, "shape", mask))] += 1
            return real(q, k, v, *args, **kwargs)

        mx.fast.scaled_dot_product_attention = spy
        return self

    def __exit__(self, *exc: Any) -> None:
        mx.fast.scaled_dot_product_attention = self._real

    def summary(self) -> dict[str, dict[str, int]]:
        """Per label: its distinct shapes, its calls, and each shape's calls (most first)."""
        return {
            label: {"shapes": len(counts), "calls": sum(counts.values()), "calls_per_shape": sorted(counts.values(), reverse=True)}
            for label, counts in sorted(self.shapes.items())
        }
