"""StopMatcher: stop strings found across pieces, nothing sent taken back."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mlxkv.server.stop import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    """Feed ``pieces`` until a stop; what was emitted (flushed at the end) and whether it stopped."""
    matcher = StopMatcher(stops)
    out = []
    for piece in pieces:
        out.append(matcher.feed(piece))
        if matcher.stopped:
            return out, True
    out.append(matcher.flush())
    return out, False


class TestStopMatcher:
    """The text before the first stop string, in pieces as soon as they are safe."""

    def test_stop_across_pieces(self):
        """A stop string split over pieces is found; its start was held back, not sent."""
        out, stopped = run(["END"], ["abc E", "N", "D tail"])
        assert stopped and out == ["abc ", "", ""]

    def test_held_tail_is_released(self):
        """A tail that only looked like a stop string's start is sent once it cannot be."""
        matcher = StopMatcher(["END"])
        assert matcher.feed("abcE") == "abc"
        assert matcher.feed("x") == "Ex"
        assert matcher.feed("EN") == ""
        assert matcher.flush() == "EN" and not matcher.stopped

    def test_earliest_of_several(self):
        """Of several stop strings, the one that occurs first wins."""
        matcher = StopMatcher(["world", "lo w"])
        assert matcher.feed("hello world") == "hel" and matcher.stopped_by == "lo w"

    def test_no_stops_pass_through(self):
        """Without stop strings every piece goes through at once."""
        assert run([], ["a", "", "b"]) == (["a", "", "b", ""], False)

    def test_the_first_stop_completed_wins(self):
        """A stop string completed by a piece ends the text, even if a longer one that
        began earlier would have completed with the next piece (as a stream must)."""
        assert run(["E", "DED"], ["DDE", "D"]) == (["DD"], True)
        assert run(["E", "DED"], ["DDED"]) == (["D"], True)

    @given(
        text=st.text(alphabet="abEND", max_size=40),
        cuts=st.lists(st.integers(0, 40), max_size=8),
        stops=st.lists(st.text(alphabet="abEND", min_size=1, max_size=4), min_size=1, max_size=3),
    )
    def test_matches_a_search_after_each_piece(self, text: str, cuts: list[int], stops: list[str]):
        """However the text is cut into pieces, what is sent is what a search of the
        text so far after each piece gives: all of it if no stop string occurs, else
        the text before the earliest occurrence found after the first piece that
        completes one."""
        bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        expected, stops_at = text, None
        for end in bounds[1:]:
            found = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
            if found:
                expected, stops_at = text[: min(found)], end
                break
        out, stopped = run(stops, pieces)
        assert stopped == (stops_at is not None)
        assert "".join(out) == expected
