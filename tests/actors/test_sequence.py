"""A request's MLX-side state changes only through its transitions, each of
which keeps the invariants its docstring states."""

from __future__ import annotations

import pytest

from mlxkv.actors.request import RequestSpec
from mlxkv.actors.sequence import SequenceState

BS = 4


def _sequence(length: int = 10) -> SequenceState:
    spec = RequestSpec(request_id="r", prompt=list(range(length)), max_tokens=4, block_size=BS)
    return SequenceState(spec)


class TestTransitions:
    def test_a_life(self):
        """Started with what is cached, computed up to the prompt's end, its
        cache given up to a batch, then its tokens."""
        sequence = _sequence()
        cache = ["layer"]
        sequence.start(cache, 4, reused_kept_cache=True, num_shared=4)
        assert (sequence.num_cached, sequence.num_computed, sequence.reused_kept_cache) == (4, 4, True)
        sequence.computed(8)
        sequence.snapshot(8, (None,))
        sequence.computed(10)
        assert sequence.give_up_cache() is cache and sequence.cache is None
        sequence.emitted(7)
        assert sequence.generated == [7] and sequence.num_tokens == 11
        assert sequence.tokens(8, 11) == (8, 9, 7)

    @pytest.mark.parametrize(
        "wrong",
        [
            lambda s: s.start(["again"], 0),  # a second start
            lambda s: s.computed(1),  # backwards
            lambda s: s.computed(11),  # past the prompt
            lambda s: s.snapshot(3, (None,)),  # not a block end
        ],
    )
    def test_a_transition_that_would_break_an_invariant_is_refused(self, wrong):
        sequence = _sequence()
        sequence.start(["layer"], 2)
        sequence.computed(4)
        with pytest.raises(AssertionError):
            wrong(sequence)

    def test_the_last_prompt_token_is_never_cached(self):
        with pytest.raises(AssertionError):
            _sequence().start(["layer"], 10)

    def test_a_cache_is_replaced_only_while_held(self):
        sequence = _sequence()
        with pytest.raises(AssertionError):
            sequence.replace_cache(["layer"])
        sequence.start(["layer"], 0)
        sequence.replace_cache(["other"])
        assert sequence.cache == ["other"]

    def test_room_is_the_rest_of_the_prompt_and_the_answer(self):
        """A cache of the first n tokens has room for the prompt's rest and every answer token."""
        sequence = _sequence(10)
        assert [sequence.room(n) for n in (0, 4, 10)] == [14, 10, 4]
