"""Token-id validation shared by every layer."""

from __future__ import annotations

from array import array

import numpy as np
import pytest

from mlxkv.cache import InvalidInput
from mlxkv.cache.token_ids import check_token_ids


class TestCheckTokenIds:
    def test_returns_compact_copy(self):
        """A list of ints comes back as an equal array('I')."""
        ids = check_token_ids([3, 1, 2])
        assert isinstance(ids, array) and ids.typecode == "I"
        assert list(ids) == [3, 1, 2]

    def test_array_passes_through(self):
        """An array('I') is returned as it is, not copied."""
        ids = array("I", [1, 2])
        assert check_token_ids(ids) is ids

    def test_numpy_ints_accepted(self):
        """NumPy integer ids convert like Python ints."""
        assert list(check_token_ids(np.array([5, 6], dtype=np.int64))) == [5, 6]

    @pytest.mark.parametrize(
        "bad", ["abc", b"ab", [1.5], [-1], [2**32], [None], [True, False], (1, True), np.array([True])]
    )
    def test_bad_ids_rejected(self, bad):
        """Strings, bytes, bools, non-ints and out-of-range ids are InvalidInput."""
        with pytest.raises(InvalidInput):
            check_token_ids(bad)

    def test_vocab_bound(self):
        """With a vocabulary size, an id at or above it is refused, naming the
        argument, the id and its index (the prompt is the value, not the id)."""
        assert list(check_token_ids([0, 9], vocab_size=10)) == [0, 9]
        with pytest.raises(InvalidInput) as info:
            check_token_ids([0, 4, 10], argument="prompt", vocab_size=10)
        assert info.value.argument == "prompt" and info.value.value == [0, 4, 10]
        assert str(info.value) == (
            "invalid prompt=[0, 4, 10]: token id 10 (at index 2) is outside the model's"
            " vocabulary [0, 10)"
        )

    def test_empty(self):
        """Empty sequences are accepted unless the caller forbids them."""
        assert len(check_token_ids([])) == 0
        with pytest.raises(InvalidInput):
            check_token_ids([], allow_empty=False)

    @pytest.mark.parametrize("kind", [list, tuple])
    def test_long_prompts_are_checked_alike(self, kind):
        """Past 64 ids only the places holding 0 or 1 are looked at for bools: a
        bool anywhere is still refused, ints 0 and 1 are not, and the vocabulary
        bound holds."""
        ids = [(i * 7) % 5 for i in range(300)]  # plenty of 0s and 1s
        assert list(check_token_ids(kind(ids), vocab_size=5)) == ids
        for where, flag in ((0, False), (150, True), (299, True)):
            flagged = ids[:where] + [flag] + ids[where + 1 :]
            with pytest.raises(InvalidInput, match="bools"):
                check_token_ids(kind(flagged))
        with pytest.raises(InvalidInput, match=r"token id 5 \(at index 300\)"):
            check_token_ids(kind(ids + [5]), vocab_size=5)


class TestTokenIdArrays:
    """1-D integer arrays (NumPy, MLX) are token ids; other arrays are refused."""

    @pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint16, np.uint32, np.uint64])
    def test_numpy_integer_arrays_accepted(self, dtype):
        """Every NumPy integer dtype converts to the same array('I')."""
        ids = check_token_ids(np.array([7, 0, 3], dtype=dtype))
        assert ids.typecode == "I" and list(ids) == [7, 0, 3]

    @pytest.mark.parametrize("dtype", ["int32", "int64", "uint32", "int16"])
    def test_mlx_integer_arrays_accepted(self, dtype):
        """An MLX 1-D integer array converts like a list of its ids."""
        import mlx.core as mx

        assert list(check_token_ids(mx.array([7, 0, 3], dtype=getattr(mx, dtype)))) == [7, 0, 3]

    def test_an_empty_integer_array_is_empty(self):
        """An empty integer array is an empty sequence: allowed unless forbidden."""
        assert len(check_token_ids(np.array([], dtype=np.int64))) == 0
        with pytest.raises(InvalidInput, match="at least one token"):
            check_token_ids(np.array([], dtype=np.int64), allow_empty=False)

    def test_vocab_bound_names_the_id(self):
        """An array id beyond the vocabulary is named with its index."""
        with pytest.raises(InvalidInput, match=r"token id 12 \(at index 1\)"):
            check_token_ids(np.array([1, 12, 13]), argument="prompt", vocab_size=10)

    @pytest.mark.parametrize(
        ("bad", "reason"),
        [
            (np.array([[1, 2], [3, 4]]), "1-D array of token ids, not 2-D"),
            (np.array(5), "not 0-D"),
            (np.array([1.0, 2.0]), "integer token ids, not float64"),
            (np.array([True, False]), "integer token ids, not bool"),
            (np.array([1, -2]), r"token id -2 \(at index 1\) is not in \[0, 2\*\*32\)"),
            (np.array([2**32], dtype=np.int64), r"token id 4294967296 \(at index 0\)"),
        ],
    )
    def test_other_numpy_arrays_refused(self, bad, reason):
        """2-D, 0-D, float, bool and out-of-range arrays are InvalidInput saying why, on one line."""
        with pytest.raises(InvalidInput, match=reason) as info:
            check_token_ids(bad, argument="prompt")
        assert "\n" not in str(info.value)

    @pytest.mark.parametrize("dtype", ["float32", "bool_", "bfloat16"])
    def test_other_mlx_arrays_refused(self, dtype):
        """MLX float, bool and bfloat16 arrays are refused, and so is a 2-D one."""
        import mlx.core as mx

        with pytest.raises(InvalidInput, match="must"):
            check_token_ids(mx.array([1, 0], dtype=getattr(mx, dtype)))
        with pytest.raises(InvalidInput, match="not 2-D"):
            check_token_ids(mx.array([[1, 0]]))

    @pytest.mark.parametrize("bad", [{1, 2}, {1: 2}, (i for i in range(3))])
    def test_unordered_or_one_shot_collections_refused(self, bad):
        """A set, a dict or a generator is not a token sequence: refused, not guessed at."""
        with pytest.raises(InvalidInput, match="sequence of int token ids"):
            check_token_ids(bad)
