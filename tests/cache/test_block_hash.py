"""Parent-chained block hashing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlxkv.cache import InvalidInput, compute_block_hash, hash_block_chain
from mlxkv.cache.block_hash import ChainKeys

tokens = st.lists(st.integers(0, 2**32 - 1), max_size=300)


class TestHashBlockChain:
    @given(tokens, st.integers(1, 40))
    def test_matches_blockwise_compute(self, token_ids, block_size):
        """The one-pass chain equals hashing each full block after its parent."""
        chain = hash_block_chain(token_ids, block_size, extra_keys=("salt",))
        parent = None
        for i, h in enumerate(chain):
            block = token_ids[i * block_size : (i + 1) * block_size]
            parent = compute_block_hash(parent, block, ("salt",) if i == 0 else None)
            assert h == parent
        assert len(chain) == len(token_ids) // block_size

    @given(tokens, st.integers(1, 16), st.integers(1, 40))
    def test_late_keys_match_blockwise_compute(self, token_ids, block_size, late_block):
        """Late keys are the extra keys of their block, and of no other."""
        chain = hash_block_chain(
            token_ids, block_size, extra_keys=("salt",), late_keys=("images",), late_block=late_block
        )
        parent = None
        for i, h in enumerate(chain):
            block = token_ids[i * block_size : (i + 1) * block_size]
            keys = ("salt",) if i == 0 else ("images",) if i == late_block else None
            parent = compute_block_hash(parent, block, keys)
            assert h == parent

    @given(tokens, st.integers(1, 16))
    def test_extension_continues_chain(self, token_ids, block_size):
        """Hashing a tail from the last parent gives the rest of the full chain."""
        full = hash_block_chain(token_ids, block_size, extra_keys=(7,))
        k = len(full) // 2
        head = full[:k]
        tail = hash_block_chain(
            token_ids[k * block_size :], block_size, parent_hash=head[-1] if head else None,
            extra_keys=None if head else (7,),
        )
        assert head + tail == full

    def test_position_matters(self):
        """The same block content after different parents hashes differently."""
        a = hash_block_chain([1, 2, 3, 4], 2)
        b = hash_block_chain([3, 4, 3, 4], 2)
        assert a[1] != b[1]

    def test_extra_keys_namespace_every_block(self):
        """Different salts share no block hash, even for identical tokens."""
        a = hash_block_chain(list(range(8)), 2, extra_keys=("tenant-a",))
        b = hash_block_chain(list(range(8)), 2, extra_keys=("tenant-b",))
        assert not set(a) & set(b)

    def test_late_keys_namespace_from_their_block_on(self):
        """Late keys leave the blocks before theirs alone and change theirs and every later one."""
        tokens = list(range(12))
        plain = hash_block_chain(tokens, 2, extra_keys=("salt",))
        late = hash_block_chain(tokens, 2, extra_keys=("salt",), late_keys=("images",), late_block=3)
        assert late[:3] == plain[:3]
        assert not set(late[3:]) & set(plain)
        # Counted from the call's first block when extending a chain.
        tail = hash_block_chain(tokens[6:], 2, parent_hash=late[2], late_keys=("images",), late_block=0)
        assert tail == late[3:]
        # Negative or past the end: no block takes them.
        assert hash_block_chain(tokens, 2, late_keys=("images",), late_block=-1) == hash_block_chain(tokens, 2)
        assert hash_block_chain(tokens, 2, late_keys=("images",), late_block=6) == hash_block_chain(tokens, 2)

    def test_types_kept_apart(self):
        """Extra keys '1' and 1 are different namespaces."""
        assert compute_block_hash(None, [1], ("1",)) != compute_block_hash(None, [1], (1,))

    @pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["a"]])
    def test_bad_tokens_rejected(self, bad):
        """Token ids outside [0, 2**32) are refused with InvalidInput."""
        with pytest.raises(InvalidInput):
            hash_block_chain(bad, 1)

    @pytest.mark.parametrize("size", [0, -3, 2.0])
    def test_bad_block_size_rejected(self, size):
        """A block size that is not a positive int is refused."""
        with pytest.raises(InvalidInput):
            hash_block_chain([1, 2], size)


class TestChainKeys:
    def test_nothing_given_is_the_empty_namespace(self):
        """No salt, images or extra keys: the plain chain."""
        assert ChainKeys.derive() == ChainKeys()
        assert ChainKeys().hash_chain(list(range(8)), 4) == hash_block_chain(list(range(8)), 4)

    def test_order_of_the_first_keys(self):
        """The salt comes first, then the caller's extra keys, then images of the whole chain."""
        keys = ChainKeys.derive(cache_salt="s", images_key="k", extra_keys=("lora",))
        assert keys == ChainKeys((("salt", "s"), "lora", ("images", "k")))

    @pytest.mark.parametrize("start, block", [(None, 0), (0, 0), (3, 0), (4, 1), (9, 2)])
    def test_images_enter_at_the_block_of_their_first_token(self, start, block):
        """Images start at the block holding their first token; at block 0 they are first keys."""
        keys = ChainKeys.derive(cache_salt="s", images_key="k", images_start=start, block_size=4)
        if block == 0:
            assert keys == ChainKeys((("salt", "s"), ("images", "k")))
        else:
            assert keys == ChainKeys((("salt", "s"),), (("images", "k"),), block)

    @given(tokens, st.integers(1, 8), st.integers(0, 12), st.integers(0, 6))
    def test_a_continued_chain_equals_the_whole(self, token_ids, block_size, late_block, split):
        """Hashing from block ``split`` on with its parent gives the whole chain's tail."""
        keys = ChainKeys((("salt", "s"),), (("images", "k"),) if late_block else (), late_block)
        whole = keys.hash_chain(token_ids, block_size)
        split = min(split, len(whole))
        parent = whole[split - 1] if split else None
        tail = keys.hash_chain(
            token_ids[split * block_size :], block_size, start_block=split, parent_hash=parent
        )
        assert whole[split:] == tail

    def test_namespace_separates_salts_and_images(self):
        """The namespace bytes differ with the salt or the images, and agree otherwise."""
        a = ChainKeys.derive(cache_salt="a", images_key="k").namespace()
        assert a == ChainKeys.derive(cache_salt="a", images_key="k").namespace()
        assert a != ChainKeys.derive(cache_salt="b", images_key="k").namespace()
        assert a != ChainKeys.derive(cache_salt="a", images_key="j").namespace()
        assert a != ChainKeys.derive(images_key="k").namespace()
