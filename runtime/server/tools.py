"""Tool calls in an answer: cut out of its text as it streams, and parsed.

A model that calls tools writes each call as text between markers of its
family (Qwen's ``<tool_call>`` ... ``</tool_call>``, Mistral's
``[TOOL_CALLS]`` to the end of the answer, ...). mlx-lm knows each family's
markers and parser (``mlx_lm.tool_parsers``) and infers which one a model
uses when it loads the model's tokenizer; :class:`ToolSyntax` is that, as
this server uses it: its :meth:`~ToolSyntax.splitter` cuts an answer's text
into its own text and its calls' texts (each whole: a call is read only
once it is), and :meth:`~ToolSyntax.calls` turns a call's text into
:class:`~mlxkv.server.request.ToolCall` records, or gives it back as text
when the parser cannot read it (a call cut short by ``max_tokens``, say):
nothing the model wrote is dropped. Where a model writes a call as a JSON
object, :meth:`~ToolSyntax.forced` gives the schema and markers that hold an
answer to one call (``tool_choice`` ``required`` or a function's name).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

import attrs

from mlxkv.errors import InvalidInput
from mlxkv.json_output import JsonText
from mlxkv.server.markers import Inside, MarkedSplitter
from mlxkv.server.request import ToolCall

__all__ = ["ToolSyntax"]


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
        json_body: a call is a JSON object ``{"name", "arguments"}`` between
            the markers (mlx-lm's ``json_tools``: Qwen 2.5 and 3, Hermes...),
            so a call can be forced (:meth:`forced`).
    """

    start: str
    end: str
    parse: Callable[[str, Any], Any] = attrs.field(repr=False)
    json_body: bool = False

    @classmethod
    def of(cls, tokenizer: Any) -> Optional[ToolSyntax]:
        """The syntax of an mlx-lm ``TokenizerWrapper``, or None if mlx-lm
        knows no tool calling for its model."""
        if not getattr(tokenizer, "has_tool_calling", False) or tokenizer.tool_parser is None:
            return None
        parser = tokenizer.tool_parser
        return cls(
            start=tokenizer.tool_call_start, end=tokenizer.tool_call_end or "", parse=parser,
            json_body=getattr(parser, "__module__", None) == _JSON_BODY_PARSER,
        )  # fmt: skip

    def forced(self, tools: Sequence[Mapping[str, Any]], names: Sequence[str]) -> tuple[Any, JsonText]:
        """The JSON schema and markers that hold an answer to one call of a
        function named in ``names`` (its arguments per its ``parameters``),
        written as the template writes one: the start marker and a newline,
        the call, a newline and the end marker.

        Raises:
            InvalidInput: (``tool_choice``) the model does not write calls as JSON.
        """
        if not self.json_body:
            raise InvalidInput(
                "tool_choice", list(names),
                "cannot force a call on this model: only where it writes calls as JSON between markers",
            )  # fmt: skip
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": function.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"],
            }
            for function in (tool["function"] for tool in tools)
            if (name := function["name"]) in names
        ]  # fmt: skip
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return schema, JsonText(before=self.start + "\n", after="\n" + self.end)


    def splitter(self) -> MarkedSplitter:
        """A splitter for one answer's text: its calls come out whole."""
        return MarkedSplitter(self.start, self.end, streamed=False)

    def calls(self, raw: Inside, tools: Sequence[Any]) -> Union[tuple[ToolCall, ...], str]:
        """The calls ``raw`` (a call's text) holds, each with an id (the
        model's, else a fresh one), or -- if the parser cannot read it, or it
        names no function -- the text the model wrote, markers and all, to
        send as text."""
        try:
            parsed = self.parse(raw.text, list(tools))
            calls = tuple(_call(each) for each in (parsed if isinstance(parsed, list) else [parsed]))
        except Exception:  # a parser of another project, on the model's text: whatever it raises, unreadable
            calls = ()
        if not calls:
            return self.start + raw.text + self.end
        return calls


#: The module of mlx-lm's parser of calls written as JSON objects.
_JSON_BODY_PARSER = "mlx_lm.tool_parsers.json_tools"


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
