"""What callers know about a loaded model: :class:`ModelInfo`, made once by its
runner (:mod:`mlxkv.actors.model_runner`) and read anywhere, on any thread.

Also the facts it is made from that are not the runner's: where MLX runs
(:func:`device_name`) and what a token's attention to its context costs beside
its other work (:func:`context_unit`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import attrs

from mlxkv.actors import decode_kernel
from mlxkv.cache.tiers.kv_layout import KVLayout

__all__ = ["ModelInfo", "context_unit", "device_name"]


@attrs.frozen(kw_only=True)
class ModelInfo:
    """What callers need to know about the model.

    Attributes:
        vocab_size: token ids are in ``[0, vocab_size)`` (``None`` if the
            model does not say).
        eos_token_ids: tokens that end a generation.
        cache_layers: class names of the model's cache layers, in order.
        has_recurrent: whether some layer keeps recurrent state
            (``ArraysCache``): its prefills stop at every block end to
            snapshot that state, so every stored block can end a reused
            prefix.
        batchable: whether requests decode together in one model call
            (else each decodes at batch size one).
        shared_prefix: whether requests that begin with the same cached
            blocks hold that prefix's KV once (:mod:`mlxkv.cache.shared_prefix`:
            a text model whose layers are all plain KV and whose attention
            routes through the shared-prefix dispatcher); else each request
            holds a copy.
        prefix_attention: how attention reads a shared prefix
            (:class:`~mlxkv.actors.prefix_attention.PrefixAttention`'s value:
            ``cascade``, ``gathered``, ``stacked``, ``mixed`` or ``kernel``;
            chosen per device unless given; ``kernel`` asked for where its
            kernel does not serve is ``mixed``), or None without shared
            prefixes.
        batch_prefill: whether requests' prefill chunks run together in
            one model call (right-padded, as mlx-lm's ``BatchGenerator``
            prefills): plain and sliding-window KV layers of a text model;
            recurrent layers and vision-language models prefill one
            request at a time.
        prefill_streams: the MLX streams a batched prefill's rows are
            spread over, a call each (:mod:`mlxkv.actors.prefill_streams`;
            1 without ``batch_prefill``).
        takes_images: whether the model sees images (a vision-language
            model).
        max_context: the most tokens a request may hold (prompt and
            answer): the config's ``max_position_embeddings``, or None if
            it does not say.
        kv_bytes_per_token: bytes of KV one token takes across the
            sequence layers (attention keys and values).
        context_unit: the context (tokens) over which a token's attention
            costs as much as the rest of its computation, from the model's
            sizes (what the scheduler weighs a prefill chunk's context by).
        state_bytes: bytes of one snapshot of every recurrent layer's state
            (0 without recurrent layers); every stored block carries one.
        kv_layout: the layer kinds, dtypes and shapes of every stored
            block (what a KV tier's namespace commits to), or None if a
            block of this model could not be cut.
        transposed_layers: linear layers held transposed
            (:mod:`mlxkv.actors.weight_layout`; 0: the model's own layout).
        fused_projections: sets of sibling projections held as one product
            (:mod:`mlxkv.actors.fused_projections`; 0: none).
        compiled_layers: decoder layers whose decode steps run compiled
            (:mod:`mlxkv.actors.compiled_decode`; 0: none).
        device: where the model runs, as a person names it
            (:func:`device_name`: ``cpu``, ``gpu (Metal)``, ``gpu (CUDA)``).
    """

    vocab_size: Optional[int]
    eos_token_ids: frozenset[int]
    cache_layers: tuple[str, ...]
    has_recurrent: bool
    batchable: bool = True
    batch_prefill: bool = False
    prefill_streams: int = 1
    shared_prefix: bool = False
    prefix_attention: Optional[str] = None
    takes_images: bool = False
    max_context: Optional[int] = None
    kv_bytes_per_token: int = 0
    context_unit: int = 512
    state_bytes: int = 0
    kv_layout: Optional[KVLayout] = None
    transposed_layers: int = 0
    fused_projections: int = 0
    compiled_layers: int = 0
    device: str = "cpu"

    @classmethod
    def from_args(cls, args: Any, eos_token_ids: Iterable[int], **fields: Any) -> ModelInfo:
        """The info of a model whose mlx-lm ``args`` (its config) say its
        vocabulary, context and sizes, ending on ``eos_token_ids``; ``fields``
        are what its runner found out (cache layers, batching, layout)."""
        max_context = getattr(args, "max_position_embeddings", None)
        return cls(
            vocab_size=getattr(args, "vocab_size", None),
            eos_token_ids=frozenset(int(t) for t in eos_token_ids),
            max_context=max_context if isinstance(max_context, int) and max_context > 0 else None,
            context_unit=context_unit(args),
            **fields,
        )

    def block_bytes(self, block_size: int) -> int:
        """Bytes one stored block of ``block_size`` tokens takes, snapshot included."""
        return block_size * self.kv_bytes_per_token + self.state_bytes

    def summary(self) -> str:
        """Where the model runs and what the runner chose for it there, in one
        line: ``"cpu, shared-prefix attention cascade; decode compiled in 2 of 2
        layers, 4 projection sets fused, 7 linear layers transposed"`` (the
        attention ``-`` without shared prefixes; fused and transposed layers
        only where there are any)."""
        chosen = [f"decode compiled in {self.compiled_layers} of {len(self.cache_layers)} layers"]
        if self.fused_projections:
            chosen.append(f"{self.fused_projections} projection sets fused")
        if self.transposed_layers:
            chosen.append(f"{self.transposed_layers} linear layers transposed")
        return f"{self.device}, shared-prefix attention {self.prefix_attention or '-'}; {', '.join(chosen)}"


def device_name() -> str:
    """MLX's default device as a person names it: ``cpu``, ``gpu (Metal)``,
    ``gpu (CUDA)`` (``gpu`` for another backend)."""
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "gpu (Metal)"
    return "gpu (CUDA)" if decode_kernel.on_cuda() else "gpu"


def context_unit(args: Any) -> int:
    """:attr:`ModelInfo.context_unit` of a model with these arguments: the
    multiply-adds of one token's projections and MLP over those of its
    attention to one context token (512 when the sizes are not all known)."""
    hidden = getattr(args, "hidden_size", None)
    inner = getattr(args, "intermediate_size", None)
    heads = getattr(args, "num_attention_heads", None)
    if not all(isinstance(v, int) and v > 0 for v in (hidden, inner, heads)):
        return 512
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or hidden // heads
    per_token = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inner
    return max(1, round(per_token / (2 * heads * head_dim)))
