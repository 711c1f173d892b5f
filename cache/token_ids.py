"""Token-id validation, written once for every layer that takes token ids."""

from __future__ import annotations

from array import array
from typing import Any, Optional

from mlxkv.cache.errors import InvalidInput

__all__ = ["TokenIds", "check_token_ids"]

#: Token ids as the runtime keeps them: a compact, checked ``array('I')``.
TokenIds = array


def check_token_ids(
    tokens: Any,
    *,
    argument: str = "tokens",
    vocab_size: Optional[int] = None,
    allow_empty: bool = True,
) -> TokenIds:
    """Check token ids and return them as one ``array('I')`` copy.

    The conversion checks type and range at C speed; an ``array('I')``
    passed in is returned as it is (token arrays are never mutated).

    Args:
        tokens: a sequence of ints (Python or NumPy) in ``[0, 2**32)``.
        argument: the argument name errors report.
        vocab_size: if given, every id must also be below it.
        allow_empty: whether an empty sequence is accepted.

    Returns:
        The ids as ``array('I')``.

    Raises:
        InvalidInput: a str/bytes, a bool, a non-int or out-of-range id, or
            an empty sequence where one is not allowed.
    """
    if tokens.__class__ is array and tokens.typecode == "I":
        ids = tokens
    elif isinstance(tokens, (str, bytes, bytearray, memoryview)):
        raise InvalidInput(argument, tokens, "must be a sequence of int token ids")
    else:
        try:
            ids = array("I", tokens)
        except (TypeError, OverflowError, ValueError):
            raise InvalidInput(argument, tokens, "must be ints in [0, 2**32)") from None
        # array('I') takes True and False as 1 and 0; a list of flags is a bug.
        if _has_bools(tokens, ids):
            raise InvalidInput(argument, tokens, "must be ints, not bools")
    if not ids and not allow_empty:
        raise InvalidInput(argument, tokens, "must hold at least one token")
    if vocab_size is not None and ids:
        largest = int(_view(ids).max())
        if largest >= vocab_size:
            raise InvalidInput(argument, largest, f"token ids must be in [0, {vocab_size})")
    return ids


def _view(ids: TokenIds) -> Any:
    import numpy as np

    return np.frombuffer(ids, dtype=np.uint32)


def _has_bools(tokens: Any, ids: TokenIds) -> bool:
    """Whether ``tokens`` (converted to ``ids``) holds a ``bool``: only the
    places holding 0 or 1 are looked at (a prompt has few)."""
    if len(ids) < 64 or not isinstance(tokens, (list, tuple)):
        return bool in set(map(type, tokens))
    import numpy as np

    return any(tokens[i].__class__ is bool for i in np.flatnonzero(_view(ids) <= 1).tolist())
