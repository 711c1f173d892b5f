"""The runtime's command-line options, declared once for every command that
starts a runtime (``mlxkv run``, ``mlxkv serve``), and the one function that
builds a :class:`~mlxkv.runtime_config.RuntimeConfig` from them.

Each option's destination is the configuration field it sets (a part's
field by its own name, as :class:`~mlxkv.runtime_config.RuntimeConfig` takes it),
and an option not given is absent from the parsed namespace: the
configuration's default applies, and the help shows it. So a new option is
one ``add_argument`` here; :func:`runtime_config` picks it up by its name
and the configuration checks its value.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Optional

import attrs

from mlxkv.actors.compute_config import RunnerConfig, SchedulingConfig
from mlxkv.actors.prefix_attention import PrefixAttention

if TYPE_CHECKING:
    from mlxkv.runtime_config import RuntimeConfig

__all__ = ["add_runtime_options", "add_tier_option", "runtime_config"]

#: ``--transpose-weights``', ``--fuse-projections``' and ``--compile-decode``'s words, as ``RunnerConfig``'s fields.
_WEIGHT_LAYOUTS = {"auto": None, "on": True, "off": False}


def _default(cls: type, name: str) -> Any:
    default = attrs.fields_dict(cls)[name].default
    return default.factory() if isinstance(default, attrs.Factory) else default  # type: ignore[union-attr]


def _weight_layout(text: str) -> Optional[bool]:
    try:
        return _WEIGHT_LAYOUTS[text]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from auto, on, off") from None


def add_tier_option(parser: argparse.ArgumentParser) -> None:
    """``--kv-tier URL`` (repeatable), into ``kv_tiers``."""
    parser.add_argument(
        "--kv-tier",
        dest="kv_tiers",
        metavar="URL",
        action="append",
        default=argparse.SUPPRESS,
        help="a tier below the pool that keeps KV across runs and processes, fastest first"
        " (repeatable): file:///DIR[?max_bytes=N] (file:// alone: the default directory)"
        " or redis://HOST:PORT/DB[?ttl=S] (needs the redis extra)",
    )


def add_runtime_options(parser: argparse.ArgumentParser) -> None:
    """Declare the runtime's options: the block pool's, the tiers, the
    scheduling's and the runner's (each absent unless given)."""
    from mlxkv.runtime_config import RuntimeConfig

    def option(flag: str, dest: str, cls: type = RuntimeConfig, **kwargs: Any) -> None:
        kwargs.setdefault("type", int)
        kwargs["help"] = kwargs["help"].replace("{default}", str(_default(cls, dest)))
        parser.add_argument(flag, dest=dest, default=argparse.SUPPRESS, **kwargs)

    option("--block-size", "block_size", help="tokens per block ({default})")
    option("--max-blocks", "max_blocks", help="usable blocks in the KV pool ({default})")
    option(
        "--kv-memory",
        "kv_memory",
        type=str,
        metavar="SIZE",
        help="size the KV pool in bytes instead, e.g. 256MiB or 2GB (overrides --max-blocks)",
    )
    add_tier_option(parser)
    option(
        "--prefill-chunk",
        "prefill_chunk",
        SchedulingConfig,
        metavar="TOKENS",
        help="the most prompt tokens of one request per model call ({default})",
    )
    option(
        "--prefill-budget",
        "prefill_budget",
        SchedulingConfig,
        metavar="COST",
        help="the most prefill work one model call runs while others decode, in tokens, a long context"
        " counting more ({default}; larger prefills requests arriving meanwhile faster, at some latency"
        " for those decoding)",
    )
    option(
        "--decode-wait",
        "decode_wait",
        SchedulingConfig,
        metavar="N",
        help="the most prefill calls a decode step waits behind while more requests wait than decode,"
        " together of that many calls' budget ({default}; 1: decode and prefill always alternate)",
    )
    option(
        "--kv-bits",
        "kv_bits",
        RunnerConfig,
        choices=(4, 8),
        help="quantize the KV cache (blocks and live caches) to 4 or 8 bits (default: the model's precision)",
    )
    option(
        "--transpose-weights",
        "transpose_weights",
        RunnerConfig,
        type=_weight_layout,
        metavar="{auto,on,off}",
        help="hold the model's linear weights transposed: the same outputs, faster on the CPU"
        " (auto, the default: where MLX runs on the CPU)",
    )
    option(
        "--kept-cache-memory",
        "kept_cache_memory",
        RunnerConfig,
        type=str,
        metavar="SIZE",
        help="bytes the caches of the generations that finished last may hold beside the pool,"
        " e.g. 1GiB ({default} bytes)",
    )
    option(
        "--fuse-projections",
        "fuse_projections",
        RunnerConfig,
        type=_weight_layout,
        metavar="{auto,on,off}",
        help="hold each layer's key and value projections (and an MLP's gate and up) as one product:"
        " the same outputs, fewer kernel launches (auto, the default: on)",
    )
    option(
        "--compile-decode",
        "compile_decode",
        RunnerConfig,
        type=_weight_layout,
        metavar="{auto,on,off}",
        help="run each decode step's known decoder layers (Llama, Qwen2) as compiled MLX functions:"
        " the same outputs, less host time a step (auto, the default: on)",
    )
    option(
        "--prefix-attention",
        "prefix_attention",
        RunnerConfig,
        type=str,
        choices=[way.value for way in PrefixAttention],
        help="how attention reads a shared prefix (default: the device's: cascade on the CPU, kernel on CUDA,"
        " mixed on Metal; kernel: mixed with decode steps by one CUDA kernel a layer where MLX runs on CUDA)",
    )
    option(
        "--prefill-streams",
        "prefill_streams",
        RunnerConfig,
        metavar="N",
        help="MLX streams a prefill of several requests is spread over, a model call each, side by side"
        " (default: on the CPU, where one stream multiplies on one core, the cores, at most 8; on a GPU 1)",
    )
    option(
        "--max-request-images",
        "max_request_images",
        metavar="N",
        help="the most images one request may have ({default})",
    )
    option(
        "--max-request-pixels",
        "max_request_pixels",
        metavar="N",
        help="the most pixels one request's images may have together, checked before decoding ({default})",
    )


def runtime_config(args: argparse.Namespace, **fields: Any) -> RuntimeConfig:
    """The :class:`~mlxkv.runtime_config.RuntimeConfig` of the parsed ``args``: every
    option whose destination is a configuration field, then ``fields``, and
    ``trace`` on where ``--trace FILE`` was given.

    Raises:
        InvalidInput: a value the configuration refuses, naming its field.
    """
    from mlxkv.runtime_config import RuntimeConfig

    names = RuntimeConfig.field_names() - {"trace"}
    given = {name: value for name, value in vars(args).items() if name in names}
    if getattr(args, "trace", None) is not None:
        given["trace"] = True
    return RuntimeConfig(**{**given, **fields})
