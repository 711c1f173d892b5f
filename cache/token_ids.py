"""Token-id validation, written once for every layer that takes token ids.

Token ids come as a sequence of ints (a list, a tuple, a ``range``, an
``array('I')``, what ``CacheRuntime.tokenize`` returns) or as a 1-D integer
array (NumPy, MLX, anything ``numpy.asarray`` reads). :func:`check_token_ids`
checks either kind and converts it once, to the ``array('I')`` the runtime
keeps.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Optional

from mlxkv.cache.errors import InvalidInput

__all__ = ["TokenIds", "check_token_ids"]

#: Token ids as the runtime keeps them: a compact, checked ``array('I')``.
TokenIds = array

_LIMIT = 1 << 32


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
        tokens: a sequence of ints (Python or NumPy) in ``[0, 2**32)``, or a
            1-D integer array (NumPy or MLX) of them.
        argument: the argument name errors report.
        vocab_size: if given, every id must also be below it.
        allow_empty: whether an empty sequence is accepted.

    Returns:
        The ids as ``array('I')``.

    Raises:
        InvalidInput: a str/bytes, a set or other unordered collection, a
            bool, a non-int or out-of-range id, an array that is not 1-D or
            whose dtype is not an integer one (bool and float arrays
            included), or an empty sequence where one is not allowed.
    """
    if tokens.__class__ is array and tokens.typecode == "I":
        ids = tokens
    elif isinstance(tokens, (str, bytes, bytearray, memoryview)):
        raise InvalidInput(argument, tokens, "must be a sequence of int token ids")
    elif _is_array(tokens):
        ids = _from_array(tokens, argument)
    elif not isinstance(tokens, (Sequence, array)):
        raise InvalidInput(
            argument, tokens, "must be a sequence of int token ids (a list, a tuple) or a 1-D int array"
        )
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
        view = _view(ids)
        if int(view.max()) >= vocab_size:
            import numpy as np

            at = int(np.flatnonzero(view >= vocab_size)[0])
            raise InvalidInput(
                argument,
                tokens,
                f"token id {ids[at]} (at index {at}) is outside the model's vocabulary"
                f" [0, {vocab_size})",
            )
    return ids


def _is_array(tokens: Any) -> bool:
    """Whether ``tokens`` is an n-dimensional array (NumPy, MLX, ...) rather than a sequence."""
    return hasattr(tokens, "dtype") and hasattr(tokens, "ndim") and hasattr(tokens, "shape")


def _from_array(tokens: Any, argument: str) -> TokenIds:
    """A 1-D integer array's ids as ``array('I')``, in one conversion.

    Raises:
        InvalidInput: not 1-D, not an integer dtype, or an id outside ``[0, 2**32)``.
    """
    import numpy as np

    try:
        values = np.asarray(tokens)
    except (TypeError, ValueError, RuntimeError) as error:
        raise InvalidInput(argument, tokens, f"must be a 1-D int array ({error})") from None
    if values.ndim != 1:
        raise InvalidInput(
            argument, tokens, f"must be a 1-D array of token ids, not {values.ndim}-D {values.shape}"
        )
    if values.dtype.kind not in "iu":
        raise InvalidInput(argument, tokens, f"must hold integer token ids, not {values.dtype}")
    if values.size:
        outside = np.flatnonzero((values < 0) | (values >= _LIMIT))
        if outside.size:
            at = int(outside[0])
            raise InvalidInput(
                argument, tokens, f"token id {values[at]} (at index {at}) is not in [0, 2**32)"
            )
    ids = array("I")
    ids.frombytes(values.astype(np.uint32, copy=False).tobytes())
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
