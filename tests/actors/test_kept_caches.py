"""A runner's kept caches: what a request may take of one, what it gets, and
what stays kept. Real mlx-lm ``KVCache`` layers whose keys are their tokens'
ids, so that a cache's KV says which tokens it holds."""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache

from mlxkv.actors import kept_caches
from mlxkv.actors.kept_caches import KeptCaches
from mlxkv.actors.request import RequestSpec
from mlxkv.actors.sequence import SequenceState
from mlxkv.cache import kv_state

BS = 4
LAYERS = 2
ROOMY = 1 << 30


def _cache(tokens: tuple[int, ...]) -> list[Any]:
    """A cache whose KV at each position is its token's id (values: the id + 0.5)."""
    cache = [KVCache() for _ in range(LAYERS)]
    keys = mx.broadcast_to(mx.array(tokens, dtype=mx.float32).reshape(1, 1, -1, 1), (1, 2, len(tokens), 4))
    for layer in cache:
        layer.update_and_fetch(keys, keys + 0.5)
    return cache


def _held(cache: list[Any]) -> list[tuple[int, ...]]:
    """The tokens each layer's keys and values say it holds."""
    held = []
    for layer in cache:
        keys, values = (a[..., : layer.offset, :] for a in (layer.keys, layer.values))
        held.append(tuple(int(k) for k in keys[0, 0, :, 0].tolist()))
        assert (values - keys == 0.5).all().item()
    return held


def _sequence(prompt: tuple[int, ...], namespace: Any = None, prefix: tuple[Any, ...] = ()) -> SequenceState:
    spec = RequestSpec(
        request_id="r", prompt=prompt, prefix=prefix, max_tokens=4, block_size=BS, namespace=namespace
    )
    return SequenceState(spec)


def _finished(kept: KeptCaches, prompt: tuple[int, ...], answer: tuple[int, ...] = (), namespace: Any = None,
              text_only: bool = True) -> None:
    """A request of ``prompt`` that generated ``answer`` (its cache holding both) finishes and is kept."""
    sequence = _sequence(prompt, namespace)
    for token in answer:
        sequence.emitted(token)
    kept.keep(sequence, _cache(prompt + answer), len(prompt) + len(answer), text_only=text_only)


def _payloads(tokens: tuple[int, ...]) -> tuple[Any, ...]:
    return tuple(kv_state.slice_blocks(_cache(tokens), BS))


def _take(kept: KeptCaches, prompt: tuple[int, ...], namespace: Any = None, prefix: tuple[Any, ...] = (),
          text_only: bool = True) -> tuple[Optional[list[Any]], int]:
    return kept.take(_sequence(prompt, namespace, prefix), prefix, text_only=text_only)


TURN = tuple(range(10, 20))
ANSWER = (90, 91)


class TestTake:
    def test_nothing_kept_gives_nothing(self):
        """An empty keep gives no cache."""
        assert _take(KeptCaches(ROOMY), TURN + (1,)) == (None, 0)

    def test_the_next_turn_takes_the_whole_cache(self):
        """A prompt that continues a kept cache's every token (its prompt and
        its answer) takes that very cache, which is no longer kept."""
        kept = KeptCaches(ROOMY)
        _finished(kept, TURN, ANSWER)
        entry = kept.entries[-1]
        cache, usable = _take(kept, TURN + ANSWER + (5, 6, 7))
        assert cache is entry.cache and usable == len(TURN + ANSWER)
        assert _held(cache) == [TURN + ANSWER] * LAYERS
        assert kept.entries == ()

    def test_a_partial_use_gets_a_copy_and_the_cache_stays(self):
        """A prompt that shares only the first tokens gets arrays of its own
        for them: writing them leaves the kept cache as it was."""
        kept = KeptCaches(ROOMY)
        _finished(kept, TURN, ANSWER)
        entry = kept.entries[-1]
        cache, usable = _take(kept, TURN[:7] + (1, 2, 3))
        assert usable == 7 and _held(cache) == [TURN[:7]] * LAYERS
        for layer in cache:
            layer.update_and_fetch(*(mx.full((1, 2, 1, 4), v) for v in (-1.0, -0.5)))
        assert kept.entries == (entry,)
        assert _held(entry.cache) == [TURN + ANSWER] * LAYERS

    def test_the_prompts_last_token_always_runs(self):
        """The same prompt again uses all of it but its last token (which must
        run for its logits): a copy, the cache stays."""
        kept = KeptCaches(ROOMY)
        _finished(kept, TURN)
        cache, usable = _take(kept, TURN)
        assert usable == len(TURN) - 1 and _held(cache) == [TURN[:-1]] * LAYERS
        assert len(kept.entries) == 1

    def test_the_most_recent_wins_a_tie(self):
        """Of two kept caches that give a request as much, the most recent serves it."""
        kept = KeptCaches(ROOMY)
        _finished(kept, TURN[:6] + (1, 1))
        _finished(kept, TURN[:6] + (2, 2))
        cache, usable = _take(kept, TURN[:6] + (3, 3))
        assert usable == 6
        cache, usable = _take(kept, TURN[:6] + (2, 2, 4))
        assert usable == 8 and kept.entries[0].tokens == TURN[:6] + (1, 1)

    def test_no_more_than_the_blocks_give(self):
        """A kept cache that gives only what the request's payloads rebuild
        (or less) is not used: a copy would only stand in for the blocks; one
        token more is."""
        kept = KeptCaches(ROOMY)
        _finished(kept, TURN[:9] + (7,))
        prefix = _payloads(TURN[:8])
        assert _take(kept, TURN[:8] + (1, 2), prefix=prefix) == (None, 0)  # shares the blocks' 8
        assert _take(kept, TURN[:6] + (1, 2, 3), prefix=prefix) == (None, 0)  # shares 6 of their 8
        cache, usable = _take(kept, TURN + (1,), prefix=prefix)  # 9: one more than the blocks
        assert usable == 9 and _held(cache) == [TURN[:9]] * LAYERS

    @pytest.mark.parametrize(
        "text_only, brings_payloads, takes",
        [(True, True, True), (False, True, False), (True, False, False)],
        ids=["text with payloads", "images", "no payloads"],
    )
    def test_another_namespace_takes_only_what_its_payloads_entitle_it_to(self, text_only, brings_payloads, takes):
        """Under another namespace a request may use a kept cache only as far
        as the payloads it brings reach, and only where both are text."""
        kept = KeptCaches(ROOMY)
        _finished(kept, TURN[:8], namespace="a")
        prefix = _payloads(TURN[:8]) if brings_payloads else ()
        cache, usable = _take(kept, TURN, namespace="b", prefix=prefix, text_only=text_only)
        assert (usable, cache is not None) == ((8, True) if takes else (0, False))
        # A cache of more than the payloads under another namespace: never beyond them.
        _finished(kept, TURN, namespace="a")
        assert _take(kept, TURN + (1,), namespace="b", prefix=_payloads(TURN[:8])) == (None, 0)


class TestKeep:
    def test_a_later_turn_replaces_the_turn_it_extends(self):
        """A kept cache extended by a finished request (its conversation's
        next turn) goes; one of another namespace or other tokens stays."""
        kept = KeptCaches(ROOMY)
        _finished(kept, TURN)
        _finished(kept, TURN, namespace="salted")
        _finished(kept, TURN[:5] + (1,))
        _finished(kept, TURN, ANSWER)
        assert [(e.tokens, e.namespace) for e in kept.entries] == [
            (TURN, "salted"), (TURN[:5] + (1,), None), (TURN + ANSWER, None)
        ]

    def test_kept_as_its_first_tokens(self):
        """A cache that holds a fed token beyond ``num_tokens`` (a stop token) is cut back to them."""
        kept = KeptCaches(ROOMY)
        sequence = _sequence(TURN)
        sequence.emitted(90)
        kept.keep(sequence, _cache(TURN + (90,)), len(TURN), text_only=True)
        assert kept.entries[-1].tokens == TURN and _held(kept.entries[-1].cache) == [TURN] * LAYERS

    def test_at_most_max_kept_caches(self, monkeypatch):
        """Beyond :data:`MAX_KEPT_CACHES` the oldest go."""
        monkeypatch.setattr(kept_caches, "MAX_KEPT_CACHES", 2)
        kept = KeptCaches(ROOMY)
        for first in (1, 2, 3):
            _finished(kept, (first,) + TURN)
        assert [e.tokens[0] for e in kept.entries] == [2, 3]

    def test_the_memory_bound_keeps_the_most_recent_whatever_its_size(self):
        """Past ``memory`` bytes the oldest go, but the last one stays."""
        one = sum(layer.nbytes for layer in _cache(TURN))
        kept = KeptCaches(2 * one)
        for first in (1, 2, 3):
            _finished(kept, (first,) + TURN[1:])
        assert [e.tokens[0] for e in kept.entries] == [2, 3]
        tight = KeptCaches(1)
        _finished(tight, TURN)
        _finished(tight, (1,) + TURN[1:])
        assert [e.tokens[0] for e in tight.entries] == [1]


_TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=9).map(tuple)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), _TOKENS, st.sampled_from([None, "salt"])),
        min_size=1,
        max_size=8,
    )
)
def test_what_a_request_takes_holds_its_own_first_tokens(steps):
    """Over any run of finished and starting requests (a three-token
    alphabet, two namespaces, at most three kept): a request takes tokens of
    its own namespace only, never its prompt's last, and the cache it gets
    holds exactly its prompt's first ``usable`` tokens; at most
    :data:`MAX_KEPT_CACHES` are kept, each holding exactly its tokens."""
    kept = KeptCaches(ROOMY)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kept_caches, "MAX_KEPT_CACHES", 3)
        for finishes, tokens, namespace in steps:
            if finishes:
                _finished(kept, tokens, namespace=namespace)
                continue
            before = {id(e): e for e in kept.entries}
            cache, usable = _take(kept, tokens, namespace=namespace)
            assert usable < len(tokens)
            if cache is None:
                assert usable == 0
                continue
            assert usable > 0 and _held(cache) == [tokens[:usable]] * LAYERS
            gone = [e for key, e in before.items() if key not in {id(k) for k in kept.entries}]
            assert all(e.namespace == namespace for e in gone)
            assert not gone or (gone[0].cache is cache and len(gone[0].tokens) == usable)
        assert len(kept.entries) <= 3
        for entry in kept.entries:
            assert _held(entry.cache) == [entry.tokens] * LAYERS
