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
the CPU they are the same bit for bit in every model and dtype tested
(``tests/actors/test_compiled_decode.py``). Elsewhere :func:`compile_checked`
first runs one decode step of a compiled layer beside the layer's own code
(:func:`self_check`), and puts the layers back (logged) if it raises or
disagrees: a runner then decodes as written. The weights are constants of
the traces: a model whose weights change after loading must not be compiled
(``RunnerConfig.compile_decode=False``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any, Optional

from mlxkv.actors.event_log import EventLog

__all__ = [
    "KNOWN_LAYERS",
    "as_written",
    "compile_checked",
    "compile_decode_layers",
    "compiled_layer",
    "known",
    "restore_layers",
    "self_check",
]

_LOG = EventLog(component="compiled_decode")

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


def _swap_layers(model: Any, swap: Callable[[Any], Optional[Any]]) -> int:
    """Put ``swap(layer)`` in the place of each layer in any list of
    ``model``'s modules where it is not None; how many."""
    import mlx.nn as nn

    swapped = 0
    for _, module in model.named_modules():
        for value in module.values() if isinstance(module, nn.Module) else ():
            if isinstance(value, list):
                for index, layer in enumerate(value):
                    other = swap(layer)
                    if other is not None:
                        value[index] = other
                        swapped += 1
    return swapped


def compile_decode_layers(model: Any) -> int:
    """Put a :func:`compiled_layer` module in the place of every layer of
    ``model`` that :func:`known` accepts (in any list of ``model``'s modules).

    Returns:
        The number of layers replaced (0 where there are none, or on a second call).
    """
    stand_in = compiled_layer()
    return _swap_layers(model, lambda layer: stand_in(layer) if known(layer) else None)


def _stand_ins(model: Any) -> list[Any]:
    return [module for _, module in model.named_modules() if type(module) is compiled_layer()]


def restore_layers(model: Any) -> int:
    """Put each :func:`compiled_layer` module of ``model`` back to the layer it
    stands for (undoes :func:`compile_decode_layers`); how many."""
    stand_in = compiled_layer()
    return _swap_layers(model, lambda layer: layer.layer if type(layer) is stand_in else None)


def self_check(model: Any) -> Optional[str]:
    """One decode step of ``model``'s first compiled layer against its layer's
    own code, on the device MLX runs on: two rows of a batch cache (mlx-lm's
    ``BatchKVCache``, one row left-padded) after three tokens each, the
    inputs random in the layer's dtype. None where the outputs agree (within
    a twentieth of their largest magnitude in half precision, a thousandth
    in float32: compiled kernels round alike; this catches a part that
    fails, not an ulp), else what differed or what was raised. The check
    evaluates; run it as a model loads, not inside a step."""
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import BatchKVCache

    stand_ins = _stand_ins(model)
    if not stand_ins:
        return None
    stand_in = stand_ins[0]
    try:
        weight = stand_in.input_layernorm.weight
        first, second = mx.random.split(mx.random.key(11))
        prompt = mx.random.normal((2, 3, weight.shape[0]), key=first).astype(weight.dtype)
        step = mx.random.normal((2, 1, weight.shape[0]), key=second).astype(weight.dtype)
        outputs = []
        for run in (stand_in, stand_in.layer):
            cache = BatchKVCache([1, 0])
            stand_in.layer(prompt, create_attention_mask(prompt, cache), cache)
            outputs.append(run(step, create_attention_mask(step, cache), cache).astype(mx.float32))
        compiled, written = outputs
        difference = mx.abs(compiled - written).max().item()
        scale = mx.abs(written).max().item()
    except Exception as exc:  # a trace or a kernel that fails: the layers' own code serves
        return f"{type(exc).__name__}: {exc}"
    bound = (1e-3 if weight.dtype == mx.float32 else 5e-2) * max(scale, 1.0)
    if not difference <= bound:  # (NaN fails too)
        return f"max difference {difference:.3g} from the layer's own code (bound {bound:.3g})"
    return None


def compile_checked(model: Any, *, check: Optional[bool] = None) -> int:
    """:func:`compile_decode_layers`, kept where :func:`self_check` passes;
    else the layers put back and the failure logged. ``check``: None checks
    off the CPU (where MLX's compiled kernels are not the CPU's, which the
    tests hold to the layers' own bit for bit).

    Returns:
        The layers compiled and kept (0 where none were, or they were put back).
    """
    import mlx.core as mx

    compiled = compile_decode_layers(model)
    if not compiled or not (check if check is not None else mx.default_device().type != mx.DeviceType.cpu):
        return compiled
    error = self_check(model)
    if error is None:
        _LOG.info("compiled_decode_checked", layers=compiled)
        return compiled
    restore_layers(model)
    _LOG.warning("compiled_decode_unusable", layers=compiled, reason=error)
    return 0


@contextlib.contextmanager
def as_written(model: Any) -> Iterator[None]:
    """Within the block, ``model``'s compiled layers run their parts as Python
    (nothing traced, nothing replayed): the same operations, for code that
    watches the Python calls a step makes (``scripts/bench_step.py``'s
    counts; a trace would hide them after its first step)."""
    stand_ins = _stand_ins(model)
    compiled = [(layer._before, layer._after) for layer in stand_ins]
    for layer in stand_ins:
        layer._before = functools.partial(_before_attention, layer.layer)
        layer._after = functools.partial(_after_attention, layer.layer)
    try:
        yield
    finally:
        for layer, (before, after) in zip(stand_ins, compiled):
            layer._before, layer._after = before, after
