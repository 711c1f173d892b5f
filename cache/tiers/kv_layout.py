"""The KV layout of a model's blocks: layer kinds and parameters, array dtypes and shapes.

Part of a block's namespace (:mod:`~mlxkv.cache.tiers.namespace`) and
written in every stored value's header (:mod:`~mlxkv.cache.tiers.block_value`),
so it has an exact JSON form: :meth:`KVLayout.to_json` and
:meth:`KVLayout.from_json` round-trip to an equal layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import attrs

from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.kv_state import (
    ArraysLayer,
    BlockPayload,
    KVLayer,
    LayerSpec,
    QuantizedLayer,
    RotatingLayer,
    slice_blocks,
)

__all__ = ["KVLayout", "layer_spec_from_json", "layer_spec_to_json"]


def layer_spec_to_json(spec: LayerSpec) -> dict[str, Any]:
    """A layer spec as a JSON object (``{"kind": "kv"}``, ...)."""
    if isinstance(spec, KVLayer):
        return {"kind": "kv"}
    if isinstance(spec, RotatingLayer):
        return {"kind": "rotating", "max_size": spec.max_size, "keep": spec.keep}
    if isinstance(spec, QuantizedLayer):
        return {"kind": "quantized", "group_size": spec.group_size, "bits": spec.bits}
    if isinstance(spec, ArraysLayer):
        return {"kind": "arrays", "size": spec.size}
    raise InvalidInput("layer", spec, "is not a LayerSpec")


_SPEC_FIELDS: dict[str, tuple[Callable[..., LayerSpec], tuple[str, ...]]] = {
    "kv": (KVLayer, ()),
    "rotating": (RotatingLayer, ("max_size", "keep")),
    "quantized": (QuantizedLayer, ("group_size", "bits")),
    "arrays": (ArraysLayer, ("size",)),
}


def layer_spec_from_json(data: Any) -> LayerSpec:
    """The layer spec a :func:`layer_spec_to_json` object describes.

    Raises:
        InvalidInput: not such an object (unknown kind, missing, extra or
            non-integer fields).
    """
    if not isinstance(data, dict) or data.get("kind") not in _SPEC_FIELDS:
        raise InvalidInput("layer", data, "is not a layer spec object")
    make, fields = _SPEC_FIELDS[data["kind"]]
    if set(data) != {"kind", *fields}:
        raise InvalidInput("layer", data, f"needs exactly the fields {fields}")
    values = [data[name] for name in fields]
    if not all(type(v) is int and v >= 0 for v in values):
        raise InvalidInput("layer", data, "fields must be non-negative ints")
    return make(*values)


def _signature_atom(value: Any) -> bool:
    if value is None or type(value) in (int, str):
        return True
    return isinstance(value, tuple) and all(_signature_atom(v) for v in value)


def _as_tuples(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_as_tuples(v) for v in value)
    return value


@attrs.frozen
class KVLayout:
    """The layers of a block and every array's dtype and shape (token axis left out).

    Attributes:
        layers: one spec per layer (``BlockPayload.layers``).
        signature: ``BlockPayload.signature``: nested tuples of strings, ints
            and ``None`` only, so that it survives JSON exactly.

    Invariants:
        - ``len(layers) == len(signature)``.
    """

    layers: tuple[LayerSpec, ...]
    signature: tuple[Any, ...]

    def __attrs_post_init__(self) -> None:
        if len(self.layers) != len(self.signature):
            raise InvalidInput(
                "signature", self.signature, f"has {len(self.signature)} entries for {len(self.layers)} layers"
            )
        if not _signature_atom(self.signature):
            raise InvalidInput("signature", self.signature, "must hold only tuples, ints, strings and None")
        for spec in self.layers:
            layer_spec_to_json(spec)

    @classmethod
    def of(cls, payload: BlockPayload) -> KVLayout:
        """The layout of ``payload``."""
        return cls(layers=tuple(payload.layers), signature=tuple(payload.signature))

    @classmethod
    def probe(cls, model: Any, make_cache: Optional[Callable[[], list[Any]]] = None) -> KVLayout:
        """Run ``model`` on one token and read the layout of the cache it fills.

        MLX work: call it on the thread that owns the model (the compute
        thread), like any model call.

        Args:
            model: an mlx-lm model (``model(tokens, cache=...)``).
            make_cache: builds the cache the runtime would use (with KV
                quantization, if it quantizes); ``mlx_lm``'s
                ``make_prompt_cache(model)`` by default.

        Returns:
            The layout of that cache's blocks.
        """
        import mlx.core as mx

        if make_cache is None:
            from mlx_lm.models.cache import make_prompt_cache

            cache = make_prompt_cache(model)
        else:
            cache = make_cache()
        model(mx.array([[0]]), cache=cache)
        (payload,) = slice_blocks(cache, 1)
        return cls.of(payload)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able description; :meth:`from_json` gives back an equal layout."""
        return {
            "layers": [layer_spec_to_json(spec) for spec in self.layers],
            "signature": self.signature,
        }

    @classmethod
    def from_json(cls, data: Any) -> KVLayout:
        """The layout :meth:`to_json` described.

        Raises:
            InvalidInput: ``data`` is not such a description.
        """
        if not isinstance(data, dict) or set(data) != {"layers", "signature"}:
            raise InvalidInput("layout", data, "needs exactly 'layers' and 'signature'")
        if not isinstance(data["layers"], list) or not isinstance(data["signature"], list):
            raise InvalidInput("layout", data, "'layers' and 'signature' must be lists")
        return cls(
            layers=tuple(layer_spec_from_json(item) for item in data["layers"]),
            signature=_as_tuples(data["signature"]),
        )
