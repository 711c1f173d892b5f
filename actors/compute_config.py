"""What the compute path is built from: how it schedules, and how its runner runs the model.

Each part is declared, validated and documented here once; the components
take the part they use whole (:class:`~mlxkv.actors.scheduler.Scheduler` and
:class:`~mlxkv.actors.executor.Executor` a :class:`SchedulingConfig`, the
runners a :class:`RunnerConfig`) and check nothing again.
:class:`~mlxkv.runtime_config.RuntimeConfig` holds one of each, and accepts their
fields by name too. The figures behind each default are in
docs/benchmarks.md ("The defaults and why").
"""

from __future__ import annotations

from typing import Any, Optional

import attrs

from mlxkv.actors.prefix_attention import PrefixAttention
from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.validators import int_at_least, is_bool, is_optional_bool
from mlxkv.units import parse_bytes

__all__ = [
    "DEFAULT_DECODE_BURST",
    "DEFAULT_DECODE_WAIT",
    "DEFAULT_PREFILL_BATCH",
    "DEFAULT_PREFILL_BUDGET",
    "DEFAULT_PREFILL_CHUNK",
    "KV_BITS",
    "RunnerConfig",
    "SchedulingConfig",
]

#: Tokens per prefill chunk of one request.
DEFAULT_PREFILL_CHUNK = 256
#: The cost one prefill plan runs at most while rows decode (a throughput
#: setting above it trades the decoding requests' latency).
DEFAULT_PREFILL_BUDGET = 512
#: Requests one prefill plan serves at most (mlx-lm's ``BatchGenerator``
#: prefills 8 prompts at once too).
DEFAULT_PREFILL_BATCH = 8
#: Request-steps one decode plan runs back to back while nothing else waits.
DEFAULT_DECODE_BURST = 64
#: Prefill plans a decode step waits behind at most during a wave of arrivals.
DEFAULT_DECODE_WAIT = 8
#: The KV quantizations served (mlx-lm's ``QuantizedKVCache``).
KV_BITS = frozenset({4, 8})


def _prefix_attention(value: Any) -> Optional[PrefixAttention]:
    if value is None or isinstance(value, PrefixAttention):
        return value
    try:
        return PrefixAttention(value)
    except ValueError:
        names = ", ".join(way.value for way in PrefixAttention)
        raise InvalidInput("prefix_attention", value, f"must be one of {names}, or None") from None


def _kv_bits(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (type(value) is not int or value not in KV_BITS):
        raise InvalidInput("kv_bits", value, f"must be one of {', '.join(map(str, sorted(KV_BITS)))}, or None")


@attrs.frozen(kw_only=True)
class SchedulingConfig:
    """How the scheduler cuts the work into plans (:mod:`mlxkv.actors.scheduler`).

    Attributes:
        prefill_chunk: the most prompt tokens of one request one prefill
            plan runs.
        prefill_budget: the most work one prefill plan runs over all the
            requests it serves while some request decodes, in token units:
            a chunk of ``n`` new tokens after ``c`` earlier ones costs
            ``n * (1 + (c + n/2) / u)`` with ``u`` the model's
            ``model_info.context_unit`` (attention over a long context
            counts; :func:`~mlxkv.actors.scheduler.chunk_cost`), and the
            oldest request's chunk always fits. A decode step waits behind
            at most ``decode_wait`` such plans' worth (while more requests
            wait than decode, the plans in a row share their budgets). With
            nothing decoding, a plan takes ``prefill_batch`` requests' chunks
            at once (up to a one-token request, whose chunk keeps it).
            Larger prefills requests arriving while others decode faster, at
            some latency for those decoding.
        prefill_batch: the most requests whose chunks one prefill plan runs
            (in one model call where the model batches prefill).
        decode_burst: the most request-steps one decode plan runs back to
            back while nothing else waits: ``decode_burst // rows`` steps, at
            least one and at most
            :data:`~mlxkv.actors.scheduler.MAX_BURST_STEPS`. A message that
            arrives meanwhile waits for at most that many steps, and tokens
            reach the consumer in bursts of as many.
        decode_wait: the most prefill plans a decode step waits behind.
            Decode and prefill plans alternate, except while more requests
            wait for their first token than there are rows decoding (a wave
            of arrivals, prefilled first: fewer, fuller decode steps); 1
            makes them always alternate.

    Raises:
        InvalidInput: a field is not an int >= 1.
    """

    prefill_chunk: int = attrs.field(default=DEFAULT_PREFILL_CHUNK, validator=int_at_least(1))
    prefill_budget: int = attrs.field(default=DEFAULT_PREFILL_BUDGET, validator=int_at_least(1))
    prefill_batch: int = attrs.field(default=DEFAULT_PREFILL_BATCH, validator=int_at_least(1))
    decode_burst: int = attrs.field(default=DEFAULT_DECODE_BURST, validator=int_at_least(1))
    decode_wait: int = attrs.field(default=DEFAULT_DECODE_WAIT, validator=int_at_least(1))


@attrs.frozen(kw_only=True)
class RunnerConfig:
    """How a model runner holds the model and its caches (:mod:`mlxkv.actors.model_runner`).

    Attributes:
        shared_prefix: requests that begin with the same cached blocks hold
            that prefix's KV once (one buffer per prefix, attended to once
            per step for all of them) and own only their suffix, where the
            model allows (``model_info.shared_prefix``: a text model whose
            layers are all plain KV); off, each request holds a copy (only
            to measure what it saves).
        prefix_attention: how attention reads a shared prefix:
            ``"cascade"`` (scores against the prefix merged through softmax
            statistics; the CPU's way), ``"gathered"`` (fused attention over
            each row's prefix part copied beside its suffix for the call),
            ``"stacked"`` (fused attention, the rows' queries as one sequence
            over the prefix and every suffix), ``"mixed"`` (decode steps as
            products a KV head, prefill chunks in bands: a GPU's way) or
            ``"kernel"`` (as ``"mixed"``, but decode steps by one CUDA kernel
            a layer where MLX runs on CUDA: ``mlxkv.actors.decode_kernel``;
            ``"mixed"`` where it does not); None (the default): the device's way
            (the cascade on the CPU, ``"kernel"`` on CUDA, ``"mixed"`` on Metal)
            (:meth:`~mlxkv.actors.prefix_attention.PrefixAttention.for_device`).
            All are exact; ``model_info.prefix_attention`` says which serves.
            Held as a :class:`~mlxkv.actors.prefix_attention.PrefixAttention`.
        kv_bits: quantize the model's attention KV to 4 or 8 bits (mlx-lm's
            ``QuantizedKVCache``) in live caches and in the block pool, so
            each block takes about 3.8x (8 bits) or 6.4x (4 bits) less
            memory than float32; requests then decode one at a time (mlx-lm
            cannot batch quantized caches) and hold their own prefix copies.
            None (the default) keeps the model's precision. Text models only.
        transpose_weights: hold the model's linear weights transposed, in
            place, as it loads (:mod:`mlxkv.actors.weight_layout`): the same
            outputs (bit for bit on the CPU; within float noise on a GPU,
            where the products are other kernels), and a faster model call
            where MLX's CPU BLAS multiplies by a transposed weight slowly.
            None (the default): for a model the runner loads, where MLX's
            default device is the CPU; for a model handed in (the caller's
            object), only when True.
        fuse_projections: hold each layer's sibling projections (keys and
            values; an MLP's gate and up) as one matrix product,
            in place, as the model loads (:mod:`mlxkv.actors.fused_projections`):
            the same outputs (bit for bit on the CPU; within float noise on
            a GPU), a launch where there were two or three (a GPU's decode
            step is its launches). None (the default): for a model the
            runner loads, on every device; for a model handed in, only when
            True.
        compile_decode: run each decoder layer of a decode step, where
            mlxkv knows the layer's code (mlx-lm's Llama and Qwen2 layers),
            as two compiled MLX functions around its cache's write and its
            attention (:mod:`mlxkv.actors.compiled_decode`): the same outputs
            (bit for bit on the CPU), built by MLX from a trace instead of
            by Python, operation by operation (a GPU's decode step of a small
            model waits on the host). None (the default): for a model the
            runner loads, on every device; for a model handed in, only
            when True. Off the CPU a runner first checks one compiled decode
            step against the layer's own code on the device and keeps the
            layers as written if it fails
            (:func:`~mlxkv.actors.compiled_decode.compile_checked`). A model
            whose weights change after loading must not be compiled (the
            traces hold them as constants).
        keep_caches: the runner keeps the KV of the generations that
            finished last (up to
            :data:`~mlxkv.actors.kept_caches.MAX_KEPT_CACHES`, of at most
            ``kept_cache_memory`` together unless only one, beside the block
            pool) and hands each to a later one that shares its first tokens
            (see :mod:`mlxkv.actors.compute`), which then computes only the
            rest (on by default).
        kept_cache_memory: bytes the kept caches may hold together (an int or
            a size such as ``"1GiB"``: :func:`~mlxkv.units.parse_bytes`; 64 MiB
            by default); the most recent is kept whatever its size.
        prefill_streams: the MLX streams a batched prefill's rows are spread
            over, one model call each, run side by side
            (:mod:`mlxkv.actors.prefill_streams`: where MLX runs on the CPU,
            one stream multiplies on one core); None (the default): the
            device's (on the CPU the cores this process may use, at most 8;
            on a GPU one). ``model_info.prefill_streams`` says how many serve.

    Raises:
        InvalidInput: a field of the wrong type or out of range.
    """

    shared_prefix: bool = attrs.field(default=True, validator=is_bool)
    prefix_attention: Optional[PrefixAttention] = attrs.field(default=None, converter=_prefix_attention)
    kv_bits: Optional[int] = attrs.field(default=None, validator=_kv_bits)
    transpose_weights: Optional[bool] = attrs.field(default=None, validator=is_optional_bool)
    fuse_projections: Optional[bool] = attrs.field(default=None, validator=is_optional_bool)
    compile_decode: Optional[bool] = attrs.field(default=None, validator=is_optional_bool)
    keep_caches: bool = attrs.field(default=True, validator=is_bool)
    kept_cache_memory: int = attrs.field(
        default=64 << 20, converter=lambda value: parse_bytes(value, argument="kept_cache_memory")
    )
    prefill_streams: Optional[int] = attrs.field(default=None, validator=attrs.validators.optional(int_at_least(1)))
