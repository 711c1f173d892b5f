"""Tool calls in an answer: cut out of its text as it streams, and parsed.

A model that calls tools writes each call as text between markers of its
family (Qwen's ``<tool_call>`` ... ``</tool_call>``, Mistral's
``[TOOL_CALLS]`` to the end of the answer, ...). mlx-lm knows each family's
markers and parser (``mlx_lm.tool_parsers``) and infers which one a model
uses when it loads the model's tokenizer; :class:`ToolSyntax` is that, as
this server uses it. The rest is the OpenAI API's:

- :class:`CallSplitter` cuts an answer's text, fed in pieces, into its own
  text and its calls' raw texts, whatever pieces it comes in (a marker
  split over two tokens is held back until it is whole or cannot be);
- :meth:`ToolSyntax.calls` turns a call's raw text into
  :class:`~mlxkv.server.request.ToolCall` records, or gives it back as text
  when the parser cannot read it (a call cut short by ``max_tokens``, say):
  nothing the model wrote is dropped.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import attrs

from mlxkv.server.request import ToolCall

__all__ = ["CallSplitter", "RawCall", "ToolSyntax"]


@attrs.frozen
class RawCall:
    """A call's text as the model wrote it, between its markers."""

    text: str


#: What :class:`CallSplitter` gives out: the answer's own text, or a call.
Segment = Union[str, RawCall]


@attrs.frozen(kw_only=True)
class ToolSyntax:
    """How a model writes tool calls.

    Attributes:
        start: the marker a call begins with.
        end: the marker it ends with; empty where a call runs to the end of
            the answer.
        parse: mlx-lm's parser of the model's family: a call's text (between
            the markers) and the request's tools to a ``{"name", "arguments"}``
            mapping (``"id"`` too, where the model wrote one), or a list of them;
            raises ``ValueError`` on text it cannot read.
    """

    start: str
    end: str
    parse: Callable[[str, Any], Any] = attrs.field(repr=False)

    @classmethod
    def of(cls, tokenizer: Any) -> Optional[ToolSyntax]:
        """The syntax of an mlx-lm ``TokenizerWrapper``, or None if mlx-lm
        knows no tool calling for its model."""
        if not getattr(tokenizer, "has_tool_calling", False) or tokenizer.tool_parser is None:
            return None
        return cls(start=tokenizer.tool_call_start, end=tokenizer.tool_call_end or "", parse=tokenizer.tool_parser)

    def splitter(self) -> CallSplitter:
        """A splitter for one answer's text."""
        return CallSplitter(self.start, self.end)

    def calls(self, raw: RawCall, tools: Sequence[Any]) -> Union[tuple[ToolCall, ...], str]:
        """The calls ``raw`` holds, each with an id (the model's, else a fresh
        one), or -- if the parser cannot read it, or it names no function --
        the text the model wrote, markers and all, to send as text."""
        try:
            parsed = self.parse(raw.text, list(tools))
            calls = tuple(_call(each) for each in (parsed if isinstance(parsed, list) else [parsed]))
        except (ValueError, TypeError, KeyError, AttributeError):  # what parsers raise on text they cannot read
            calls = ()
        if not calls:
            return self.start + raw.text + self.end
        return calls


def _call(parsed: Any) -> ToolCall:
    """One parsed call as a record; raises ``ValueError`` on anything but a named call."""
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str) or not parsed["name"]:
        raise ValueError(f"not a call: {parsed!r}")
    arguments = parsed.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    model_id = parsed.get("id")
    return ToolCall(
        id=model_id if isinstance(model_id, str) and model_id else f"call_{uuid.uuid4().hex[:24]}",
        name=parsed["name"],
        arguments=arguments,
    )


class CallSplitter:
    """Cuts an answer's text, fed in pieces, into text and the raw texts of calls.

    Owns: the text fed but not yet given out (at most a marker's length of
    it outside a call; a call's text until its end marker).

    Invariant: the segments given out so far, each call written back between
    its markers, followed by what is held (after the start marker where a
    call is open), are exactly the text fed; how the text was cut into
    pieces changes only when a segment comes out, never what.
    """

    def __init__(self, start: str, end: str) -> None:
        if not start:
            raise ValueError("a call's start marker cannot be empty")
        self._start = start
        self._end = end
        self._held = ""
        self._in_call = False
        self._searched = 0  # characters of a call's held text known to hold no end marker

    def feed(self, text: str) -> list[Segment]:
        """The segments ``text`` completes, in order (text before a call, the call, ...)."""
        self._held += text
        segments: list[Segment] = []
        while True:
            if self._in_call:
                if not self._end:
                    return segments  # the call runs to the end of the answer
                at = self._held.find(self._end, self._searched)
                if at < 0:
                    self._searched = max(0, len(self._held) - len(self._end) + 1)
                    return segments
                segments.append(RawCall(self._held[:at]))
                self._held = self._held[at + len(self._end) :]
                self._in_call = False
                continue
            at = self._held.find(self._start)
            if at < 0:
                keep = _marker_prefix(self._held, self._start)
                if len(self._held) > keep:
                    segments.append(self._held[: len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep :]
                return segments
            if at:
                segments.append(self._held[:at])
            self._held = self._held[at + len(self._start) :]
            self._in_call = True
            self._searched = 0

    def finish(self) -> list[Segment]:
        """At the answer's end, what is held: a call that runs to the end
        (no end marker in this syntax), else text -- a call left open is the
        model's text as written, its start marker included."""
        held, self._held = self._held, ""
        if self._in_call:
            self._in_call = False
            if not self._end:
                return [RawCall(held)]
            held = self._start + held
        return [held] if held else []


def _marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (shorter than it)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0
