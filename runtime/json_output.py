"""Generations held to a JSON schema: the runtime's grammars and constraints.

:class:`JsonOutputs` belongs to a runtime with a model and is used on the
event loop only. It compiles each schema once (kept by its JSON text, the
most recent :data:`GRAMMARS_KEPT`), reads the model's vocabulary as bytes
once (on a worker thread, when the first schema is asked for: a real
vocabulary takes a fraction of a second), and keeps what every
:class:`~mlxkv.actors.json_constraint.JsonConstraint` finds in one
:class:`~mlxkv.actors.json_constraint.MaskCache`, so that every generation
under the same schema shares what its states allow.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import anyio
import attrs

from mlxkv.actors.json_constraint import JsonConstraint, MaskCache, TokenBytes
from mlxkv.actors.json_grammar import JsonGrammar, SchemaNotSupported
from mlxkv.actors.prompt_preparer import PromptPreparer
from mlxkv.cache.errors import InvalidInput

__all__ = ["GRAMMARS_KEPT", "JSON_OBJECT", "JsonOutputs", "JsonText"]

#: Schemas whose grammar (and constraint) a runtime keeps.
GRAMMARS_KEPT = 32
#: The schema of OpenAI's JSON mode: any JSON object.
JSON_OBJECT: Mapping[str, Any] = {"type": "object"}


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidInput("json_text", value, "markers must be strings")
    return value


def _markers(value: Any) -> Optional[tuple[str, str]]:
    if value is None:
        return None
    if not isinstance(value, tuple) or len(value) != 2 or not all(isinstance(m, str) and m for m in value):
        raise InvalidInput("json_text", value, "reasoning must be a (start, end) pair of non-empty strings")
    return value


@attrs.frozen(kw_only=True)
class JsonText:
    """Where an answer's JSON value sits in its text (``generate``'s ``json_text``).

    Attributes:
        before: text written before the value, as given (a tool call's start marker).
        after: text written after it (its end marker).
        reasoning: a reasoning block's ``(start, end)`` markers: the text may
            begin with one (free text up to its end marker, then up to 16
            whitespace bytes) before the rest; None: it may not.
        reasoning_opened: the prompt opened the block: the text begins inside it.
    """

    before: str = attrs.field(default="", converter=_text)
    after: str = attrs.field(default="", converter=_text)
    reasoning: Optional[tuple[str, str]] = attrs.field(default=None, converter=_markers)
    reasoning_opened: bool = False


class JsonOutputs:
    """A model's JSON grammars and constraints (see the module docstring).

    Invariants: ``_kept`` maps a schema's JSON text (with its
    :class:`JsonText`) to its grammar; the vocabulary's bytes are read at
    most once; every constraint keeps what its states allow in the one
    ``_masks`` (by grammar and state), so constraints of one grammar share it.
    """

    def __init__(self, preparer: PromptPreparer, width: Optional[int], end_tokens: Iterable[int]) -> None:
        self._preparer = preparer
        self._width = width
        self._end_tokens = frozenset(end_tokens)
        self._kept: OrderedDict[str, JsonGrammar] = OrderedDict()
        self._tokens: Optional[TokenBytes] = None
        #: Every constraint's allowed tokens, within one budget.
        self._masks = MaskCache()
        self._reading: Optional[anyio.Event] = None

    def grammar(self, schema: Any, text: Optional[JsonText] = None) -> JsonGrammar:
        """``schema``'s grammar (the value in ``text``), compiled once.

        Raises:
            InvalidInput: a schema that is not JSON or that the grammar does
                not support (the message names the keyword and where), or a
                ``text`` that is not a :class:`JsonText`.
        """
        if text is None:
            text = JsonText()
        if not isinstance(text, JsonText):
            raise InvalidInput("json_text", text, "must be a JsonText")
        try:
            key = json.dumps([schema, attrs.astuple(text)], ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise InvalidInput("json_schema", schema, f"must be JSON: {error}") from None
        grammar = self._kept.get(key)
        if grammar is None:
            try:
                reasoning = None if text.reasoning is None else tuple(m.encode() for m in text.reasoning)
                grammar = JsonGrammar(
                    schema, before=text.before.encode(), after=text.after.encode(), reasoning=reasoning,
                    reasoning_opened=text.reasoning_opened,
                )  # fmt: skip
            except SchemaNotSupported as error:
                raise InvalidInput("json_schema", schema, str(error)) from None
            except RecursionError:
                raise InvalidInput("json_schema", schema, "is nested too deep") from None
            self._kept[key] = grammar
            if len(self._kept) > GRAMMARS_KEPT:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(key)
        return grammar

    async def constraint(self, grammar: JsonGrammar) -> JsonConstraint:
        """``grammar`` over the model's tokens, its masks kept with every other
        constraint's (so a schema's generations share them)."""
        return JsonConstraint(grammar, await self._vocabulary(), self._end_tokens, self._masks)

    async def _vocabulary(self) -> TokenBytes:
        while self._tokens is None:
            if self._reading is not None:
                await self._reading.wait()
                continue
            self._reading = reading = anyio.Event()
            try:
                self._tokens = await anyio.to_thread.run_sync(self._read_vocabulary)
            finally:
                self._reading = None
                reading.set()
        return self._tokens

    def _read_vocabulary(self) -> TokenBytes:
        pieces = self._preparer.token_pieces()
        return TokenBytes(pieces, self._width if self._width is not None else len(pieces))

