"""MarkedSplitter: blocks between markers cut out of text fed in pieces --
whole (a tool call) or streamed (reasoning) -- nothing lost, no marker shown."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from mlxkv.server.markers import Inside, MarkedSplitter


def segments(splitter: MarkedSplitter, pieces: list[str]) -> list[Any]:
    return [segment for piece in pieces for segment in splitter.feed(piece)] + splitter.finish()


def split(splitter: MarkedSplitter, pieces: list[str]) -> list[Any]:
    """Every segment, adjacent texts (and a streamed block's chunks) joined:
    when they come out is the splitter's."""
    joined: list[Any] = []
    for segment in segments(splitter, pieces):
        if joined and isinstance(segment, str) and isinstance(joined[-1], str):
            joined[-1] += segment
        elif joined and splitter._streamed and isinstance(segment, Inside) and isinstance(joined[-1], Inside):
            joined[-1] = Inside(joined[-1].text + segment.text)
        else:
            joined.append(segment)
    return joined


def labelled(parts: list[Any]) -> list[tuple[bool, str]]:
    """Each character given out, and whether it came inside a block."""
    return [(isinstance(p, Inside), c) for p in parts for c in (p.text if isinstance(p, Inside) else p)]


def reference(text: str, start: str, end: str) -> list[tuple[bool, str]]:
    """The characters of ``text`` outside and inside blocks, read whole: a
    block opens at a start marker and ends at the next end marker (or at
    the text's end); markers are not given out."""
    out, at, inside = [], 0, False
    while at < len(text):
        marker = end if inside else start
        found = text.find(marker, at) if marker else -1
        stop = len(text) if found < 0 else found
        out += [(inside, c) for c in text[at:stop]]
        if found < 0:
            break
        at, inside = found + len(marker), not inside
    return out


def written(segments: list[Any], start: str, end: str) -> str:
    return "".join(s if isinstance(s, str) else start + s.text + end for s in segments)


def cut(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted(cuts)
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


#: Texts made of marker fragments, so markers begin, end and break across pieces.
_TEXTS = st.lists(
    st.sampled_from(["<", "<tool", "_call>", "</tool_call>", "<tool_call>", "x", "{}", "/", ">"]), max_size=12
).map("".join)


class TestWholeBlocks:
    """``streamed=False``: a tool call, given out once its end marker is seen."""

    def test_blocks_between_markers(self):
        segments = split(MarkedSplitter("<c>", "</c>", streamed=False), ["a<c>1</c>b<", "c>2</", "c>", "<c"])
        assert segments == ["a", Inside("1"), "b", Inside("2"), "<c"]

    def test_a_block_left_open_is_text(self):
        """Cut short (``max_tokens``), a call is the model's text, its start marker included."""
        assert split(MarkedSplitter("<c>", "</c>", streamed=False), ["a<c>", "{1"]) == ["a<c>{1"]

    def test_without_an_end_marker_a_block_runs_to_the_end(self):
        assert split(MarkedSplitter("[T]", "", streamed=False), ["ok [", "T]x", "y"]) == ["ok ", Inside("xy")]

    def test_a_block_comes_out_only_whole(self):
        splitter = MarkedSplitter("<c>", "</c>", streamed=False)
        assert splitter.feed("<c>{1") == [] and splitter.feed("}</") == [] and splitter.feed("c>") == [Inside("{1}")]

    def test_nothing_is_held_that_cannot_begin_a_marker(self):
        splitter = MarkedSplitter("<c>", "</c>", streamed=False)
        assert splitter.feed("ab<") == ["ab"]
        assert splitter.feed("x") == ["<x"]


class TestStreamedBlocks:
    """``streamed=True``: reasoning, given out as it comes."""

    def test_a_block_streams_holding_only_what_could_end_it(self):
        splitter = MarkedSplitter("<think>", "</think>", streamed=True)
        assert splitter.feed("<think>wei") == [Inside("wei")]
        assert splitter.feed("gh </th") == [Inside("gh ")]
        assert splitter.feed("ink>So") == ["So"]

    def test_opened_by_the_prompt(self):
        """A prompt that opened the block: the text is inside it from the start."""
        opened = MarkedSplitter("<t>", "</t>", streamed=True, inside=True)
        assert split(opened, ["hm</", "t>ok"]) == [Inside("hm"), "ok"]

    def test_left_open_it_is_still_inside(self):
        assert split(MarkedSplitter("<t>", "</t>", streamed=True), ["a<t>h", "m</"]) == ["a", Inside("hm</")]


@given(_TEXTS, st.lists(st.integers(0, 100), max_size=6), st.booleans())
def test_any_cut_gives_the_same_text_in_the_same_places(text: str, cuts: list[int], streamed: bool):
    """However the text is cut into pieces, every character comes out once,
    in order, inside a block or not as a reading of the whole text says;
    whole blocks, written back between their markers, are the text (one left
    open is text, its start marker included) -- with an end marker or none."""
    pieces = cut(text, [c % (len(text) + 1) for c in cuts])
    for end in ("</tool_call>", ""):
        given_out = segments(MarkedSplitter("<tool_call>", end, streamed=streamed), pieces)
        assert labelled(given_out) == labelled(segments(MarkedSplitter("<tool_call>", end, streamed=streamed), [text]))
        if streamed:
            assert labelled(given_out) == reference(text, "<tool_call>", end)
        else:
            whole_blocks = split(MarkedSplitter("<tool_call>", end, streamed=False), pieces)
            assert written(whole_blocks, "<tool_call>", end) == text
