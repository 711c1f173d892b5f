"""Generations held to a JSON schema: the runtime's grammars and constraints.

:class:`JsonOutputs` belongs to a runtime with a model and is used on the
event loop only. It compiles each schema once (kept by its JSON text, the
most recent :data:`GRAMMARS_KEPT`), reads the model's vocabulary as bytes
once (on a worker thread, when the first schema is asked for: a real
vocabulary takes a fraction of a second), and gives each grammar one
:class:`~mlxkv.actors.json_constraint.JsonConstraint`, so that every
generation under the same schema shares what its states allow.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import anyio

from mlxkv.actors.json_constraint import JsonConstraint, TokenBytes
from mlxkv.actors.json_grammar import JsonGrammar, SchemaNotSupported
from mlxkv.actors.prompt_preparer import PromptPreparer
from mlxkv.cache.errors import InvalidInput

__all__ = ["GRAMMARS_KEPT", "JsonOutputs", "JSON_OBJECT"]

#: Schemas whose grammar (and constraint) a runtime keeps.
GRAMMARS_KEPT = 32
#: The schema of OpenAI's JSON mode: any JSON object.
JSON_OBJECT: Mapping[str, Any] = {"type": "object"}


class JsonOutputs:
    """A model's JSON grammars and constraints (see the module docstring).

    Invariants: ``_kept`` maps a schema's JSON text (with its markers) to its grammar and that
    grammar's one constraint (None until a generation asks for it); the
    vocabulary's bytes are read at most once.
    """

    def __init__(self, preparer: PromptPreparer, width: Optional[int], end_tokens: Iterable[int]) -> None:
        self._preparer = preparer
        self._width = width
        self._end_tokens = frozenset(end_tokens)
        self._kept: OrderedDict[str, list[Any]] = OrderedDict()
        self._tokens: Optional[TokenBytes] = None
        self._reading: Optional[anyio.Event] = None

    def grammar(self, schema: Any, markers: tuple[str, str] = ("", "")) -> JsonGrammar:
        """``schema``'s grammar (the value written between ``markers``), compiled once.

        Raises:
            InvalidInput: a schema that is not JSON or that the grammar does
                not support (the message names the keyword and where), or
                markers that are not two strings.
        """
        if not (isinstance(markers, tuple) and len(markers) == 2 and all(isinstance(m, str) for m in markers)):
            raise InvalidInput("json_markers", markers, "must be a (before, after) pair of strings")
        try:
            key = json.dumps([schema, markers], ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise InvalidInput("json_schema", _short(schema), f"must be JSON: {error}") from None
        kept = self._kept.get(key)
        if kept is None:
            try:
                before, after = (marker.encode() for marker in markers)
                kept = [JsonGrammar(schema, before=before, after=after), None]
            except SchemaNotSupported as error:
                raise InvalidInput("json_schema", _short(schema), str(error)) from None
            except RecursionError:
                raise InvalidInput("json_schema", _short(schema), "is nested too deep") from None
            self._kept[key] = kept
            if len(self._kept) > GRAMMARS_KEPT:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(key)
        return kept[0]

    async def constraint(self, grammar: JsonGrammar) -> JsonConstraint:
        """The constraint of ``grammar`` (one made by :meth:`grammar`) over the model's tokens."""
        tokens = await self._vocabulary()
        for kept in self._kept.values():
            if kept[0] is grammar:
                if kept[1] is None:
                    kept[1] = JsonConstraint(grammar, tokens, self._end_tokens)
                return kept[1]
        # Its schema left the kept ones meanwhile: a constraint of its own.
        return JsonConstraint(grammar, tokens, self._end_tokens)

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


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
