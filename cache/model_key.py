"""A stable key naming a model, for the seed's ``model_key`` attributes.

vllm-mlx keys its caches on ``id(model)``, which Python reuses as soon as the
model is garbage-collected: a new model can inherit a dead one's key and be
served its state. :func:`model_key` instead derives the key from what the
model computes with, so it is the same for the same model in any process and
differs for models that differ.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Optional

__all__ = ["model_key"]


def model_key(model: Any) -> Optional[str]:
    """Return a stable key of ``model``.

    - A path or hub name (``str`` or ``os.PathLike``) is its own key, as in
      mlx-lm's prompt-cache server.
    - A model with weights (an MLX ``nn.Module``, anything with
      ``parameters()``) is keyed by ``"sha256:"`` and the SHA-256 over its
      class, its ``args`` (the architecture config of mlx-lm models) and every
      parameter's name, dtype, shape and bytes. This reads all the weights
      once (seconds for a multi-GB model), so callers compute it lazily; the
      parameters must be evaluated, or built on the calling thread.
    - Anything else (``None``, a stand-in object) has no key: ``None``.

    Args:
        model: the model, or what names it.

    Returns:
        The key, or None.
    """
    if isinstance(model, str):
        return model
    if isinstance(model, os.PathLike):
        return os.fsdecode(model)
    parameters = getattr(model, "parameters", None)
    if not callable(parameters):
        return None
    from mlx.utils import tree_flatten

    kind = type(model)
    hasher = hashlib.sha256(b"mlxkv.model\0")
    hasher.update(f"{kind.__module__}.{kind.__qualname__}\0".encode())
    hasher.update(repr(getattr(model, "args", None)).encode() + b"\0")
    for name, array in sorted(tree_flatten(parameters()), key=lambda item: item[0]):
        _update(hasher, name, array)
    return "sha256:" + hasher.hexdigest()


def _update(hasher: Any, name: str, array: Any) -> None:
    # Names hold no NUL, dtypes no '|' and shapes only digits and commas:
    # the header of one parameter cannot run into the next.
    shape = ",".join(str(d) for d in getattr(array, "shape", ()))
    hasher.update(f"{name}\0{getattr(array, 'dtype', None)}|{shape}|".encode())
    try:
        view = memoryview(array)
    except TypeError:  # not a buffer: its repr is all we can read
        hasher.update(repr(array).encode())
        return
    hasher.update(view if view.c_contiguous else view.tobytes())
