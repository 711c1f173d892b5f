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
        """With a vocabulary size, an id at or above it is refused, naming the argument."""
        assert list(check_token_ids([0, 9], vocab_size=10)) == [0, 9]
        with pytest.raises(InvalidInput) as info:
            check_token_ids([0, 10], argument="prompt", vocab_size=10)
        assert info.value.argument == "prompt"

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
        with pytest.raises(InvalidInput) as info:
            check_token_ids(kind(ids + [5]), vocab_size=5)
        assert info.value.value == 5
