"""Tool calls: cut out of an answer as it streams (:class:`CallSplitter`),
parsed with mlx-lm's parser of the model's syntax (:class:`ToolSyntax`),
and an answer's pieces carrying them (``_Answer``), text and log-probabilities
kept whole. The served paths are in ``test_app.py``'s ``TestTools``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("starlette")

from mlx_lm.tool_parsers import json_tools, mistral  # noqa: E402

from mlxkv.actors.token_logprobs import TokenLogprob  # noqa: E402
from mlxkv.generation import GeneratedToken, GenerationReport  # noqa: E402
from mlxkv.server.app import _Answer, _Prompt  # noqa: E402
from mlxkv.server.request import ToolCall  # noqa: E402
from mlxkv.server.tools import CallSplitter, RawCall, ToolSyntax  # noqa: E402

JSON_TOOLS, MISTRAL = (
    ToolSyntax(start=module.tool_call_start, end=module.tool_call_end, parse=module.parse_tool_call)
    for module in (json_tools, mistral)
)


def split(splitter: CallSplitter, pieces: list[str]) -> list[Any]:
    """Every segment, adjacent texts joined (when a text comes out is the splitter's)."""
    segments = [segment for piece in pieces for segment in splitter.feed(piece)] + splitter.finish()
    joined: list[Any] = []
    for segment in segments:
        if isinstance(segment, str) and joined and isinstance(joined[-1], str):
            joined[-1] += segment
        else:
            joined.append(segment)
    return joined


def written(segments: list[Any], start: str, end: str) -> str:
    return "".join(s if isinstance(s, str) else start + s.text + end for s in segments)


#: Texts made of marker fragments, so markers begin, end and break across pieces.
_TEXTS = st.lists(
    st.sampled_from(["<", "<tool", "_call>", "</tool_call>", "<tool_call>", "x", "{}", "/", ">"]), max_size=12
)


class TestCallSplitter:
    def test_calls_between_markers(self):
        segments = split(CallSplitter("<c>", "</c>"), ["a<c>1</c>b<", "c>2</", "c>", "<c"])
        assert segments == ["a", RawCall("1"), "b", RawCall("2"), "<c"]

    def test_a_call_left_open_is_text(self):
        """Cut short (``max_tokens``), a call is the model's text, its start marker included."""
        assert split(CallSplitter("<c>", "</c>"), ["a<c>", "{1"]) == ["a<c>{1"]

    def test_a_call_without_an_end_marker_runs_to_the_end(self):
        assert split(CallSplitter("[T]", ""), ["ok [", "T]x", "y"]) == ["ok ", RawCall("xy")]

    def test_nothing_is_held_that_cannot_begin_a_marker(self):
        splitter = CallSplitter("<c>", "</c>")
        assert splitter.feed("ab<") == ["ab"]
        assert splitter.feed("x") == ["<x"]

    @given(_TEXTS, st.data())
    def test_any_cut_gives_the_same_segments_and_loses_nothing(self, parts: list[str], data: st.DataObject):
        """However the text is cut into pieces, the segments are the same, and
        written back (each call between its markers) they are the text."""
        text = "".join(parts)
        cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        whole = split(CallSplitter("<tool_call>", "</tool_call>"), [text])
        assert split(CallSplitter("<tool_call>", "</tool_call>"), pieces) == whole
        assert written(whole, "<tool_call>", "</tool_call>") == text
        for end in ("", "</tool_call>"):  # a call running to the end loses nothing either
            assert written(split(CallSplitter("<tool_call>", end), pieces), "<tool_call>", end) == text


class TestToolSyntax:
    def test_a_call_is_parsed_with_an_id(self):
        (call,) = JSON_TOOLS.calls(RawCall('\n{"name": "get", "arguments": {"city": "Zürich"}}\n'), [])
        assert (call.name, json.loads(call.arguments)) == ("get", {"city": "Zürich"})
        assert call.id.startswith("call_") and "Zürich" in call.arguments  # JSON text, not escaped

    def test_several_calls_in_one_and_the_models_ids(self):
        raw = RawCall('[{"name": "a", "arguments": {}, "id": "abc123def"}, {"name": "b", "arguments": {"x": 1}}]')
        calls = MISTRAL.calls(raw, [])
        assert [c.name for c in calls] == ["a", "b"] and calls[0].id == "abc123def"
        assert calls[1].id != calls[0].id and json.loads(calls[1].arguments) == {"x": 1}

    @pytest.mark.parametrize("text", ['{"name": "get", "argu', '{"arguments": {}}', '"just text"', "[1]"])
    def test_an_unreadable_call_is_given_back_as_written(self, text: str):
        """Nothing the model wrote is dropped: what the parser cannot read (or
        names no function) is text, markers and all."""
        assert JSON_TOOLS.calls(RawCall(text), []) == "<tool_call>" + text + "</tool_call>"

    def test_of_a_tokenizer(self, tool_chat_template, chat_template):
        """mlx-lm infers the syntax from the template (json_tools here); the
        built-in model's template takes no tools."""
        syntax = tool_chat_template.tool_syntax
        assert (syntax.start, syntax.end) == ("<tool_call>", "</tool_call>")
        assert chat_template.tool_syntax is None


class _Scripted:
    """Yields ``records`` as a generation would (a stand-in: a model with
    random weights cannot be made to write a call split just so; the served
    path with a real generation is ``test_app.py``'s)."""

    def __init__(self, records: list[Any]) -> None:
        self._records = iter(records)

    def __aiter__(self) -> Any:
        return self

    async def __anext__(self) -> Any:
        try:
            return next(self._records)
        except StopIteration:
            raise StopAsyncIteration from None


def _generation(texts: list[str], finish_reason: str) -> list[Any]:
    tokens = [
        GeneratedToken(index=i, token=i, text=text, logprob=TokenLogprob(i, -0.1 * i)) for i, text in enumerate(texts)
    ]
    report = GenerationReport(
        request_id="r", prompt_tokens=1, cached_tokens=0, generated_tokens=len(tokens), finish_reason=finish_reason,
        tokens=tuple(t.token for t in tokens), text="".join(texts), time_to_first_token=0.0,
        decode_tokens_per_second=0.0, total_time=0.0, stored_blocks=0, stored_bytes=0,
    )  # fmt: skip
    return [*tokens, report]


async def _answer(texts: list[str], finish_reason: str, stops: tuple[str, ...] = ()) -> tuple[list[Any], _Answer]:
    answer = _Answer(
        0, _Prompt(tokens=(1,)), _Scripted(_generation(texts, finish_reason)), stops, lambda: None,  # type: ignore[arg-type]
        syntax=JSON_TOOLS, tools=(),
    )  # fmt: skip
    return [piece async for piece in answer.pieces()], answer


class TestAnswerWithCalls:
    async def test_text_and_calls_in_order_every_token_logged(self):
        texts = [
            "Sure. <tool", '_call>{"name": "a", ', '"arguments": {}}</tool_call><tool_call>{"name": "b"}', "</tool_call>"
        ]
        pieces, answer = await _answer(texts, "stop")
        assert [(p.text, [c.name for c in p.calls], p.first_call) for p in pieces] == [
            ("Sure. ", [], 0), ("", ["a"], 0), ("", ["b"], 1),
        ]  # fmt: skip
        assert [t.record.token for p in pieces for t in p.tokens] == [0, 1, 2, 3]
        assert answer.finish_reason == "tool_calls" and [c.name for c in answer.calls] == ["a", "b"]

    async def test_cut_by_max_tokens_a_call_is_text(self):
        pieces, answer = await _answer(["ok <tool_call>", '{"name": "a", "argu'], "length")
        assert "".join(p.text for p in pieces) == 'ok <tool_call>{"name": "a", "argu'
        assert answer.calls == [] and answer.finish_reason == "length"

    async def test_a_stop_string_after_a_call(self):
        """A stop string ends the answer: a call before it counts, text after it is cut."""
        pieces, answer = await _answer(['<tool_call>{"name": "a"}</tool_call> END', " more"], "length", ("END",))
        assert [p.text for p in pieces] == ["", " "] and answer.finish_reason == "tool_calls"

    async def test_no_calls_is_plain_text(self):
        pieces, answer = await _answer(["a", "b <", "x"], "stop")
        assert "".join(p.text for p in pieces) == "ab <x" and answer.finish_reason == "stop"


def test_a_calls_key_ignores_its_id_and_spacing():
    """A conversation is remembered under its calls' names and arguments as
    canonical JSON: a client that sends them back spaced otherwise, or with
    another id, finds it; other arguments do not."""
    ours = ToolCall(id="call_1", name="get", arguments='{"city": "Paris", "days": 2}')
    assert ours.key() == ToolCall(id="x", name="get", arguments='{"days":2,"city":"Paris"}').key()
    assert ours.key() != ToolCall(id="call_1", name="get", arguments='{"city": "Rome", "days": 2}').key()
    assert ToolCall(id=None, name="f", arguments="not json").key() == "f\x00not json"
