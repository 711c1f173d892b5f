"""The namespace of stored blocks: everything that makes a block's KV differ.

A chain hash says which tokens (and salt, images) a block covers; the
namespace says what computed it and how it is laid out. Two blocks are the
same only with the same chain hash *and* the same namespace, so the storage
key is derived from both (:mod:`~mlxkv.cache.tiers.storage_key`) and every
stored value repeats the namespace digest in its header. A namespace holds:

- ``schema_version``: how keys and namespaces are derived (this module);
- ``model_fingerprint``: config and weights of the model
  (:func:`~mlxkv.cache.tiers.fingerprint.model_fingerprint`), never its path;
- ``layout``: the KV layout, i.e. each layer's kind and parameters (sliding
  window, quantization group size and bits, recurrent state count) and every
  array's dtype and shape without the token axis (KV heads, head dim, packed
  widths), exactly as :class:`~mlxkv.cache.kv_state.BlockPayload` records it
  in ``layers`` and ``signature``;
- ``block_size``: tokens per block;
- ``payload_format``: the value format version
  (:data:`~mlxkv.cache.tiers.block_format.FORMAT_VERSION`);
- ``extra``: anything else the caller knows changes KV (an adapter's
  fingerprint, a RoPE override given at load time); empty by default.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any, Union

import attrs

from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.kv_state import LayerSpec
from mlxkv.cache.tiers.block_format import FORMAT_VERSION
from mlxkv.cache.tiers.fingerprint import model_fingerprint
from mlxkv.cache.tiers.kv_layout import KVLayout

__all__ = ["SCHEMA_VERSION", "Namespace", "namespace_for_model", "namespace_from_fields"]

#: Version of the key and namespace derivation. Changing it makes every
#: stored block a miss.
SCHEMA_VERSION = 1


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@attrs.frozen
class Namespace:
    """Everything besides the chain hash that a stored block must match.

    Build it with :func:`namespace_from_fields` or
    :func:`namespace_for_model`. ``digest`` is derived from every other field
    at construction.

    Invariants:
        - ``digest`` is the SHA-256 of the canonical JSON of all other fields:
          namespaces are equal exactly when their digests are.
    """

    model_fingerprint: str
    layout: KVLayout
    block_size: int
    schema_version: int = SCHEMA_VERSION
    payload_format: int = FORMAT_VERSION
    extra: str = ""
    digest: bytes = attrs.field(init=False, eq=False, repr=False)

    @digest.default
    def _digest(self) -> bytes:
        description = {
            "schema_version": self.schema_version,
            "model_fingerprint": self.model_fingerprint,
            "layout": self.layout.to_json(),
            "block_size": self.block_size,
            "payload_format": self.payload_format,
            "extra": self.extra,
        }
        return hashlib.sha256(b"mlxkv.namespace\0" + _canonical(description)).digest()

    @property
    def short(self) -> str:
        """The digest's first 12 hex digits, for logs."""
        return self.digest.hex()[:12]


def namespace_from_fields(
    *,
    model_fingerprint: str,
    layers: Sequence[LayerSpec],
    signature: Sequence[Any],
    block_size: int,
    extra: str = "",
) -> Namespace:
    """A namespace from explicit fields (pure; tests and callers that know them).

    Args:
        model_fingerprint: what names the model's config and weights.
        layers: the layer specs of the model's blocks.
        signature: the blocks' ``signature``.
        block_size: tokens per block, > 0.
        extra: anything else that changes KV.

    Returns:
        The namespace, at the current schema and payload format versions.

    Raises:
        InvalidInput: an empty fingerprint, a bad block size, or a layout that
            is not a payload's.
    """
    if not isinstance(model_fingerprint, str) or not model_fingerprint:
        raise InvalidInput("model_fingerprint", model_fingerprint, "must be a non-empty string")
    if type(block_size) is not int or block_size <= 0:
        raise InvalidInput("block_size", block_size, "must be a positive int")
    if not isinstance(extra, str):
        raise InvalidInput("extra", extra, "must be a string")
    layout = KVLayout(layers=tuple(layers), signature=tuple(signature))
    return Namespace(model_fingerprint=model_fingerprint, layout=layout, block_size=block_size, extra=extra)


def namespace_for_model(
    model_path: Union[str, "os.PathLike[str]", None],
    *,
    layout: KVLayout,
    block_size: int,
    model: Any = None,
    memo_path: Union[str, "os.PathLike[str]", None] = None,
    extra: str = "",
) -> Namespace:
    """The namespace of a loaded model's blocks.

    The fingerprint comes from the model's directory (config.json and weight
    file contents, memoized; see :mod:`~mlxkv.cache.tiers.fingerprint`).
    A model with no directory (built in memory) is fingerprinted from its
    parameters instead (:func:`mlxkv.cache.model_key.model_key`), which reads
    every weight each time.

    Args:
        model_path: the model's local directory, or None.
        layout: the KV layout of its blocks (:meth:`KVLayout.probe`, or
            :meth:`KVLayout.of` on any of its payloads).
        block_size: tokens per block.
        model: the loaded model; used only when ``model_path`` is None.
        memo_path: where weight digests are remembered.
        extra: anything else that changes KV (adapters, load-time overrides).

    Returns:
        The namespace.

    Raises:
        InvalidInput: neither a model directory nor a model with parameters,
            or bad fields (see :func:`namespace_from_fields`).
    """
    if model_path is not None:
        fingerprint = model_fingerprint(model_path, memo_path=memo_path)
    else:
        from mlxkv.cache.model_key import model_key

        fingerprint = model_key(model) if model is not None else None
        if not fingerprint or not fingerprint.startswith("sha256:"):
            raise InvalidInput("model", model, "needs a model directory or a model with parameters")
    return namespace_from_fields(
        model_fingerprint=fingerprint,
        layers=layout.layers,
        signature=layout.signature,
        block_size=block_size,
        extra=extra,
    )
