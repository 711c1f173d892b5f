"""A decode step's decoder layers as two compiled MLX functions each, set up once as a model loads.

On a GPU, a decode step of a small model is bound by the host: each of a
layer's two dozen operations is a Python call that builds a node of MLX's
graph, and the device finishes the step's kernels before the host has
built the next one (docs/benchmarks.md). ``mx.compile`` traces a function
once for its inputs' shapes and afterwards builds the same nodes from the
trace in C++, without running the Python.

:func:`compile_decode_layers` puts a thin module in the place of every
decoder layer whose code is one of :data:`KNOWN_LAYERS` (mlx-lm's Llama and
Qwen2 layers: the same code). For an input of one token a row (a decode
step's, or a batched prefill's last token) and a cache whose offset is an
array (a batch's), the module runs the layer's own steps in three parts:

1. compiled: the input norm, the query, key and value projections split
   into heads, and rope at the cache's offsets;
2. as the layer's code runs them: the cache's write and the attention
   through the model module's ``scaled_dot_product_attention`` (mlxkv's
   hook over shared prefixes: :mod:`~mlxkv.actors.attention_hook`). These
   change the cache and read its rows, so they are not traced;
3. compiled: the output projection, the residual, the second norm, the MLP
   and its residual.

Any other call (a prefill chunk of several tokens, whose shapes change with
every request; a lone request's cache, whose offset is an int) runs the
layer's own code. A compiled part is traced once a batch size
(per thread and MLX stream: MLX keeps its traces per thread).

The outputs are the layer's own: the traces record the same operations, and
MLX's compiler only fuses chains of elementwise ones (on the CPU, rope's
and the norms' fallbacks; on a GPU those are single kernels already). On
the CPU they are the same bit for bit in every model and dtype tested. The
weights are constants of the traces: a model whose weights change after
loading must not be compiled (``RunnerConfig.compile_decode=False``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["KNOWN_LAYERS", "as_written", "compile_decode_layers", "compiled_layer", "known"]

#: The decoder layers whose code the compiled parts restate, as the layer's
#: class and its attention's class (module and qualified name): the calls of
#: both are mlx-lm's Llama code, which its Qwen2 model repeats (and its
#: Mistral and other models load as Llama).
KNOWN_LAYERS = frozenset(
    {
        ("mlx_lm.models.llama.TransformerBlock", "mlx_lm.models.llama.Attention"),
        ("mlx_lm.models.qwen2.TransformerBlock", "mlx_lm.models.qwen2.Attention"),
    }
)

#: What such a layer holds, by name.
_PARTS = frozenset({"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"})


def _name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def known(layer: Any) -> bool:
    """Whether ``layer`` is one of :data:`KNOWN_LAYERS` (its exact class and
    its attention's), holding exactly the parts their code reads."""
    import mlx.nn as nn

    if not isinstance(layer, nn.Module) or set(layer) != _PARTS:
        return False
    return (_name(layer), _name(layer["self_attn"])) in KNOWN_LAYERS


def _before_attention(layer: Any, x: Any, offset: Any) -> tuple[Any, Any, Any]:
    """The layer's queries, keys and values for input ``x`` ``(rows, n, hidden)``
    at the cache's ``offset``: its code up to the cache's write."""
    attention = layer.self_attn
    rows, length, _ = x.shape
    h = layer.input_layernorm(x)
    queries, keys, values = attention.q_proj(h), attention.k_proj(h), attention.v_proj(h)
    queries = queries.reshape(rows, length, attention.n_heads, -1).transpose(0, 2, 1, 3)
    keys = keys.reshape(rows, length, attention.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = values.reshape(rows, length, attention.n_kv_heads, -1).transpose(0, 2, 1, 3)
    return attention.rope(queries, offset=offset), attention.rope(keys, offset=offset), values


def _after_attention(layer: Any, x: Any, attended: Any) -> Any:
    """The layer's output for input ``x`` given its attention's output
    ``attended`` ``(rows, heads, n, head_dim)``: its code after the attention."""
    rows, length, _ = x.shape
    h = x + layer.self_attn.o_proj(attended.transpose(0, 2, 1, 3).reshape(rows, length, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


class _Held:
    """Holds the original layer on its stand-in without making it a child
    (its parts are the stand-in's own children already)."""

    __slots__ = ("layer",)

    def __init__(self, layer: Any) -> None:
        self.layer = layer


@functools.cache
def compiled_layer() -> Any:
    """The ``nn.Module`` class :func:`compile_decode_layers` puts in each
    layer's place (made on first use: this module imports no MLX until then)."""
    import mlx.core as mx
    import mlx.nn as nn

    class _CompiledDecodeLayer(nn.Module):
        """A known decoder layer whose decode steps run in compiled parts.

        Invariants:
            - its children are the layer's own parts, under the same names
              (the model's parameters and their paths are unchanged);
            - ``self(x, mask, cache)`` equals the layer's;
            - an attribute it lacks is read off the layer (``use_sliding``).
        """

        def __init__(self, layer: nn.Module) -> None:
            super().__init__()
            for name in sorted(_PARTS):
                self[name] = layer[name]
            self._held = _Held(layer)
            self._module = sys.modules[type(layer["self_attn"]).__module__]
            self._before = mx.compile(functools.partial(_before_attention, layer))
            self._after = mx.compile(functools.partial(_after_attention, layer))

        @property
        def layer(self) -> nn.Module:
            """The layer this module stands for."""
            return self._held.layer

        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:
                if name.startswith("_"):
                    raise
                return getattr(self._held.layer, name)

        def __call__(self, x: Any, mask: Any = None, cache: Any = None) -> Any:
            offset = None if cache is None or x.shape[1] != 1 else cache.offset
            if not isinstance(offset, mx.array):
                return self._held.layer(x, mask, cache)
            queries, keys, values = self._before(x, offset)
            keys, values = cache.update_and_fetch(keys, values)
            attended = self._module.scaled_dot_product_attention(
                queries, keys, values, cache=cache, scale=self.self_attn.scale, mask=mask
            )
            return self._after(x, attended)

    _CompiledDecodeLayer.__name__ = _CompiledDecodeLayer.__qualname__ = "CompiledDecodeLayer"
    return _CompiledDecodeLayer


def compile_decode_layers(model: Any) -> int:
    """Put a :func:`compiled_layer` module in the place of every layer of
    ``model`` that :func:`known` accepts (in any list of ``model``'s modules).

    Returns:
        The number of layers replaced (0 where there are none, or on a second call).
    """
    import mlx.nn as nn

    stand_in = compiled_layer()
    replaced = 0
    for _, module in model.named_modules():
        for value in module.values() if isinstance(module, nn.Module) else ():
            if isinstance(value, list):
                for index, layer in enumerate(value):
                    if known(layer):
                        value[index] = stand_in(layer)
                        replaced += 1
    return replaced


@contextlib.contextmanager
def as_written(model: Any) -> Iterator[None]:
    """Within the block, ``model``'s compiled layers run their parts as Python
    (nothing traced, nothing replayed): the same operations, for code that
    watches the Python calls a step makes (``scripts/bench_step.py``'s
    counts; a trace would hide them after its first step)."""
    stand_ins = [module for _, module in model.named_modules() if type(module) is compiled_layer()]
    compiled = [(layer._before, layer._after) for layer in stand_ins]
    for layer in stand_ins:
        layer._before = functools.partial(_before_attention, layer.layer)
        layer._after = functools.partial(_after_attention, layer.layer)
    try:
        yield
    finally:
        for layer, (before, after) in zip(stand_ins, compiled):
            layer._before, layer._after = before, after
