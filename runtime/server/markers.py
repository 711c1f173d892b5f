"""Text between markers, cut out of an answer as it streams.

A model marks parts of its answer with markers of its family: a tool call
(``<tool_call>`` ... ``</tool_call>``; Mistral's ``[TOOL_CALLS]`` runs to
the end of the answer), its reasoning (``<think>`` ... ``</think>``).
:class:`MarkedSplitter` cuts an answer's text, fed in the pieces the tokens
make, into the text outside such blocks and the text inside them, whatever
the pieces: a marker split over two tokens is held back until it is whole
or cannot be, so no marker ever shows in what comes out.
"""

from __future__ import annotations

from typing import Union

import attrs

__all__ = ["Inside", "MarkedSplitter", "Segment"]


@attrs.frozen
class Inside:
    """Text inside a block, as the model wrote it between the markers: a
    whole block, or (where blocks stream) as much of one as is sure."""

    text: str


#: What a splitter gives out: text outside blocks (a string), or inside one.
Segment = Union[str, Inside]


class MarkedSplitter:
    """Cuts text fed in pieces at a start and an end marker.

    A block's text comes out whole at its end marker (``streamed=False``:
    a tool call, read only once whole) or as it comes (``streamed=True``:
    reasoning, shown as it is written), holding back only a tail that could
    begin the end marker. ``inside`` starts the text in a block (a prompt
    that opened one: a template that begins the answer's reasoning).

    Owns: the text fed but not yet given out (outside a block, at most a
    marker's length of it; inside one, a whole block's text or a marker's
    length).

    Invariant: the segments given out so far, each block written back
    between its markers, followed by what is held, are exactly the text fed
    (after the start marker where a block was opened by the prompt); how the
    text was cut into pieces changes only when a segment comes out, never
    what (a streamed block's chunks joined).
    """

    def __init__(self, start: str, end: str, *, streamed: bool, inside: bool = False) -> None:
        if not start:
            raise ValueError("a block's start marker cannot be empty")
        self._start = start
        self._end = end
        self._streamed = streamed
        self._held = ""
        self._inside = inside
        self._searched = 0  # characters of a whole block's held text known to hold no end marker
        #: Blocks the text fed has opened (its start markers found).
        self.opened = 0

    @property
    def inside(self) -> bool:
        """Whether the text fed so far ends inside a block (its start marker whole)."""
        return self._inside

    def feed(self, text: str) -> list[Segment]:
        """The segments ``text`` completes, in order."""
        self._held += text
        segments: list[Segment] = []
        while True:
            if self._inside:
                at = self._held.find(self._end, self._searched) if self._end else -1
                if at < 0:
                    if self._streamed:
                        sure = len(self._held) - _marker_prefix(self._held, self._end)
                        if sure:
                            segments.append(Inside(self._held[:sure]))
                            self._held = self._held[sure:]
                    elif self._end:
                        self._searched = max(0, len(self._held) - len(self._end) + 1)
                    return segments
                if at or not self._streamed:
                    segments.append(Inside(self._held[:at]))
                self._held = self._held[at + len(self._end) :]
                self._inside = False
                continue
            at = self._held.find(self._start)
            if at < 0:
                sure = len(self._held) - _marker_prefix(self._held, self._start)
                if sure:
                    segments.append(self._held[:sure])
                    self._held = self._held[sure:]
                return segments
            if at:
                segments.append(self._held[:at])
            self._held = self._held[at + len(self._start) :]
            self._inside = True
            self.opened += 1
            self._searched = 0

    def finish(self) -> list[Segment]:
        """At the text's end, what is held. A block left open is inside text
        where blocks stream, or where the syntax has no end marker (the block
        runs to the end); otherwise -- a call cut short -- it is the model's
        text as written, its start marker included."""
        held, self._held = self._held, ""
        if self._inside:
            self._inside = False
            if self._streamed or not self._end:
                return [Inside(held)] if held or not self._streamed else []
            held = self._start + held
        return [held] if held else []


def _marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (shorter than it)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0
