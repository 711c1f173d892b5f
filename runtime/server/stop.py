"""Stop strings over streamed text: emit what cannot begin one, stop at the first.

Plain Python, no I/O: :class:`StopMatcher` is fed the text pieces of the
generated tokens and says what may be sent on. It holds back a tail that
could be the start of a stop string (so nothing sent is ever taken back) and,
once a stop string is complete, gives the text before it and stops. As a
stream must, it stops at the first piece that completes a stop string (the
generation ends with that token), cutting at the earliest stop string in the
text so far: a longer one that began earlier but would need the next piece
does not count.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopMatcher"]


class StopMatcher:
    """Finds the earliest of some stop strings in a stream of text pieces.

    Owns: the held-back tail.

    Invariants:
        - every text returned by :meth:`feed` and :meth:`flush`, joined, is
          the fed text (all of it, if no stop string occurs in it), or, after
          the first piece whose text so far holds a stop string, the text
          before the earliest one there;
        - the held tail is shorter than the longest stop string, and is a
          prefix of one of them.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("a stop string must not be empty")
        self._stops = tuple(stops)
        self._held = ""
        #: The stop string found, or None.
        self.stopped_by: str | None = None

    @property
    def stopped(self) -> bool:
        """Whether a stop string was found (feed nothing more)."""
        return self.stopped_by is not None

    def feed(self, piece: str) -> str:
        """Take the next piece; return the text that can be sent now."""
        assert not self.stopped, "fed after a stop string was found"
        if not self._stops:
            return piece
        text = self._held + piece
        found = [(index, stop) for stop in self._stops if (index := text.find(stop)) >= 0]
        if found:
            index, self.stopped_by = min(found)
            self._held = ""
            return text[:index]
        keep = self._partial(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held tail, at the end of the stream (no stop string came)."""
        held, self._held = self._held, ""
        return held

    def _partial(self, text: str) -> int:
        """The length of the longest tail of ``text`` that begins a stop string."""
        for length in range(min(len(text), max(map(len, self._stops)) - 1), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
