"""The hook that routes a model's attention over shared prefixes.

mlx-lm models pass their cache object into their attention call; mlxkv's
shared-prefix caches (:class:`~mlxkv.cache.shared_prefix.SharedPrefixCache`,
:class:`~mlxkv.cache.shared_prefix.BatchSharedPrefixCache`) hold only a
request's own tokens, so their attention must also read the prefix.
:func:`install` routes the name ``scaled_dot_product_attention`` of the
modules that define a model's attention layers (mlx-lm's and mlx-vlm's model
modules import it from their ``base``) through a dispatcher: for those two
cache classes it runs the shared-prefix attention of the calling thread
(:func:`use`; a runner sets its way on its MLX thread as it is made), and it
calls the original for every other cache, so other models of those modules
in the process are unchanged. A model whose attention does not go through
that name is not served (``install`` says so) and keeps per-request copies.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

from mlxkv.actors.prefix_attention import PrefixAttention, attention_for
from mlxkv.cache.shared_prefix import BatchSharedPrefixCache, SharedPrefixCache

__all__ = ["install", "use", "way_in_use"]

#: module name -> the original ``scaled_dot_product_attention`` of every
#: module :func:`install` routed
_ROUTED: dict[str, Callable[..., Any]] = {}

#: The shared-prefix attention each thread runs (set by :func:`use`).
_CHOSEN = threading.local()


def use(way: PrefixAttention) -> None:
    """Attend over shared prefixes ``way`` on the calling thread from now on."""
    _CHOSEN.way = way
    _CHOSEN.attend = attention_for(way)


def way_in_use() -> PrefixAttention:
    """The calling thread's way (the device's, :meth:`PrefixAttention.for_device`,
    until :func:`use` sets one)."""
    if getattr(_CHOSEN, "way", None) is None:
        use(PrefixAttention.for_device())
    return _CHOSEN.way


def install(model: Any) -> bool:
    """Route ``model``'s attention through the shared-prefix dispatcher.

    The attention layers are the submodules with ``q_proj``, ``k_proj`` and
    ``v_proj``; each must come from a module that calls a module-level
    ``scaled_dot_product_attention`` (as mlx-lm's and mlx-vlm's models
    do), which is replaced, once per module, by a dispatcher that runs the
    thread's shared-prefix attention for :class:`SharedPrefixCache` and
    :class:`BatchSharedPrefixCache` and the original for anything else.

    Returns:
        Whether every attention layer is routed (else nothing is changed,
        and the model keeps per-request copies).
    """
    modules = set()
    for _, layer in model.named_modules():
        if all(hasattr(layer, name) for name in ("q_proj", "k_proj", "v_proj")):
            module = sys.modules.get(type(layer).__module__)
            if module is None or not callable(getattr(module, "scaled_dot_product_attention", None)):
                return False
            modules.add(module)
    if not modules:
        return False
    for module in modules:
        if module.__name__ not in _ROUTED:
            original = module.scaled_dot_product_attention
            _ROUTED[module.__name__] = original
            module.scaled_dot_product_attention = _dispatcher(original)
    return True


def _dispatcher(original: Callable[..., Any]) -> Callable[..., Any]:
    def scaled_dot_product_attention(
        queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any, sinks: Any = None
    ) -> Any:
        if not isinstance(cache, (SharedPrefixCache, BatchSharedPrefixCache)):
            if sinks is None:
                return original(queries, keys, values, cache, scale=scale, mask=mask)
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        assert sinks is None, "a shared prefix does not serve attention sinks"
        segments = cache.segments()
        if not segments:
            import mlx.core as mx

            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
        attend = getattr(_CHOSEN, "attend", None)
        if attend is None:
            way_in_use()
            attend = _CHOSEN.attend
        if queries.shape[2] == 1 and isinstance(cache, BatchSharedPrefixCache):
            # A decode step (every layer: a lookup each, nothing walked over the rows).
            return attend(
                queries, keys, values, mask, scale, segments, evaluate_slices=not cache.last_layer,
                suffix_buffer=cache.suffix_buffer(), rows=cache.batch_rows(),
            )  # fmt: skip
        return attend(queries, keys, values, mask, scale, segments, evaluate_slices=not cache.last_layer)

    scaled_dot_product_attention.__wrapped__ = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention
