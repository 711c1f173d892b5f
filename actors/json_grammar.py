"""JSON text as a schema allows it, read one byte at a time.

A :class:`JsonGrammar` compiles a JSON Schema (the subset below) into nodes
and reads text against it byte by byte. Its states are immutable and
hashable, so what a state allows next can be cached
(:mod:`mlxkv.actors.json_constraint` masks a model's tokens with it).

A grammar may also hold the text to fixed bytes before and after the value
(a tool call's markers around its JSON), and let it begin with a reasoning
block (free text up to the block's end marker, then whitespace: a reasoning
model thinks before it answers). A state is a frozenset of
*stacks* (tuples of frames, the innermost last):
every way the bytes read so far can go on. A schema's ``anyOf``
alternatives each keep their own stack until a byte rules them out; an
``enum``'s values, and the keys that may come next, are one frame each (a
range of a sorted table of their texts). The empty set is a dead state (the bytes
are no prefix of any allowed text); the empty stack ``()`` is a complete
value.

Invariants:
    - a live state's every stack can be completed: :meth:`JsonGrammar.step`
      never returns a state from which no text leads to a complete value
      (a comma only where a key or item may follow, a key only where one is
      allowed), so a constrained generation never runs out of tokens;
    - the text is the value alone, no whitespace before or after it; a
      number at the top level is complete and may still grow;
    - a state holds at most :data:`MAX_WAYS` stacks (:meth:`JsonGrammar.step`
      raises :class:`GrammarTooAmbiguous` past it), a schema compiles to at
      most :data:`MAX_SCHEMA_PARTS` parts: what one byte costs is bounded;
    - whitespace between tokens is at most one newline and
      :data:`MAX_WHITESPACE` spaces or tabs after it (a gap of JSON written
      with an indent; a model cannot pad forever), containers nest at most
      :data:`MAX_DEPTH` deep.

The subset: ``type`` (a name or a list), ``properties``, ``required``,
``additionalProperties`` (and on an object without ``properties``:
``propertyNames``, ``patternProperties`` of one pattern, whose keys alone
are then written, and ``maxProperties``), ``items`` (a schema, or false: no items past
``prefixItems``), ``prefixItems``, ``minItems``, ``maxItems``,
``uniqueItems`` (over items of finitely many values: an enum's, a const,
booleans, null; the array's frame keeps the values written), ``enum``,
``const``, ``anyOf`` and ``oneOf`` (read as ``anyOf``: that only one
alternative matches is not checked), ``allOf`` of one schema, ``$ref``
to ``#/$defs/...`` or ``#/definitions/...`` (recursion allowed); on
strings ``pattern``, ``minLength``, ``maxLength`` and the formats of
:data:`FORMATS` (:mod:`~mlxkv.actors.json_pattern` holds a string's
characters to them), on numbers ``minimum``, ``maximum``,
``exclusiveMinimum``, ``exclusiveMaximum``, ``multipleOf``
(:mod:`~mlxkv.actors.json_bounds`: a bounded number is written without an
exponent, compared exactly). Annotations (``title``,
``description``, other ``format`` names...) are read and ignored, as the
JSON Schema specification makes ``format`` by default. Any other keyword
is refused (:class:`SchemaNotSupported`): a constraint the text would not
be held to is not silently dropped. A string held to a rule writes a
character past U+FFFF as itself or as a surrogate pair's two escapes,
never a lone surrogate.

Objects with ``properties`` have exactly those keys, in the order given
(each required one present, others optional), as the text of the names
written by ``json.dumps``; an object without ``properties`` takes any
keys (``propertyNames`` allows), each value per ``additionalProperties``
(any JSON value by default).
``enum`` and ``const`` values are written compactly (``json.dumps`` with
no spaces).
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, Optional

from mlxkv.actors.json_bounds import BoundsNotSupported, NumberBounds
from mlxkv.actors.json_pattern import MAX_LEVEL_WORK, MAX_POSITIONS, PatternNotSupported, StringRule

__all__ = [
    "CLOSED", "FORMATS", "MAX_DEPTH", "MAX_LENGTH", "MAX_SCHEMA_PARTS", "MAX_WAYS", "MAX_WHITESPACE",
    "GrammarTooAmbiguous", "JsonGrammar", "SchemaNotSupported", "State", "past_prefix", "string_step",
]  # fmt: skip

#: Spaces or tabs allowed in one gap between tokens (after at most one newline).
MAX_WHITESPACE = 16
#: Containers nested at most this deep.
MAX_DEPTH = 32
#: Ways one text may be read at once (stacks in a state): a schema whose
#: alternatives stay alike past this fails the generation (:class:`GrammarTooAmbiguous`).
MAX_WAYS = 256
#: Compiled subschemas and enum values a schema may have.
MAX_SCHEMA_PARTS = 4096
#: Automaton positions a schema's string rules may have in all (one rule
#: at most :data:`~mlxkv.actors.json_pattern.MAX_POSITIONS`): what compiling
#: them costs is bounded (tens of milliseconds), as is what one byte costs.
MAX_PATTERN_POSITIONS = 2 * MAX_POSITIONS
#: Steps a grammar remembers (cleared when full).
STEPS_KEPT = 65_536

#: A set of stacks (see the module docstring).
State = frozenset

_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "$schema", "$id", "$comment", "format",
        "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "strict", "name",
    }
)  # fmt: skip
_SUPPORTED = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
        "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "pattern", "minLength", "maxLength", "minimum",
        "maximum", "exclusiveMinimum", "exclusiveMaximum", "prefixItems", "uniqueItems", "propertyNames",
        "maxProperties", "patternProperties", "multipleOf",
    }
)  # fmt: skip
_STRING_KEYWORDS = frozenset({"pattern", "minLength", "maxLength"})
_OBJECT_KEYWORDS = frozenset(
    {"properties", "required", "additionalProperties", "propertyNames", "maxProperties", "patternProperties"}
)
_NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
#: The formats a string is held to (as patterns); any other ``format`` is an
#: annotation, read and ignored. RFC 3339's full-date (Gregorian, years
#: 0001-9999, as Python's dates), full-time and date-time (seconds 00-59, up to
#: six digits of fraction), RFC 4122's UUID text, dotted IPv4, RFC 3339's
#: (ISO 8601) duration (parts of up to six digits).
_YEAR = "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DAY = "((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))"
_DATE = f"({_YEAR}-{_DAY}|{_LEAP_YEAR}-02-29)"
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_DURATION_PART = "[0-9]{1,6}"  # Python's timedelta holds up to 999,999,999 days
_DURATION_TIME = "T(nH(nM(nS)?)?|nM(nS)?|nS)".replace("n", _DURATION_PART)
_DURATION_DATE = "(nD|nM(nD)?|nY(nM(nD)?)?)".replace("n", _DURATION_PART)
FORMATS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "uuid": "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    "ipv4": f"^{_OCTET}(\\.{_OCTET}){{3}}$",
    "duration": f"^P({_DURATION_DATE}({_DURATION_TIME})?|{_DURATION_TIME}|{_DURATION_PART}W)$",
}
_SHORT_ESCAPES = {ord('"'): 0x22, ord("\\"): 0x5C, ord("/"): 0x2F, ord("b"): 0x08, ord("f"): 0x0C, ord("n"): 0x0A,
                  ord("r"): 0x0D, ord("t"): 0x09}  # fmt: skip
_WHITESPACE = frozenset(b" \t\n")
_NEWLINE = 1 << 8
#: A gap already full: no whitespace at all (before the top-level value).
_NO_GAP = _NEWLINE + MAX_WHITESPACE
_DIGITS = frozenset(b"0123456789")
#: The parts of a number an integer's text may not have (see :data:`_NUMBER`).
_NOT_INTEGER = frozenset({"dot", "exp"})
#: The longest ``minLength``/``maxLength`` held to (lengths are counted per character).
MAX_LENGTH = 1 << 16
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
_QUOTE, _BACKSLASH = ord('"'), ord("\\")

# A number's states: what each byte class leads to (JSON's grammar), and
# which states end a number.
_NUMBER = {
    "sign": {"zero": "zero", "digit": "int"},
    "zero": {"dot": "dot", "exp": "exp"},
    "int": {"digit": "int", "zero": "int", "dot": "dot", "exp": "exp"},
    "dot": {"digit": "frac", "zero": "frac"},
    "frac": {"digit": "frac", "zero": "frac", "exp": "exp"},
    "exp": {"sign": "exp_sign", "plus": "exp_sign", "digit": "exp_digits", "zero": "exp_digits"},
    "exp_sign": {"digit": "exp_digits", "zero": "exp_digits"},
    "exp_digits": {"digit": "exp_digits", "zero": "exp_digits"},
}
_NUMBER_ENDS = frozenset({"zero", "int", "frac", "exp_digits"})


def _number_class(byte: int) -> Optional[str]:
    if byte == ord("0"):
        return "zero"
    if byte in _DIGITS:
        return "digit"
    return {ord("-"): "sign", ord("+"): "plus", ord("."): "dot", ord("e"): "exp", ord("E"): "exp"}.get(byte)


class SchemaNotSupported(ValueError):
    """A schema this grammar cannot hold text to (the message says where and why)."""


class GrammarTooAmbiguous(ValueError):
    """Text read against a schema whose alternatives stay alike: more than
    :data:`MAX_WAYS` readings at once (which only the text reveals)."""


class _Node:
    """One compiled schema (compared by identity; fields set once, at compile)."""

    __slots__ = ("types", "properties", "required", "additional", "items", "min_items", "max_items", "literals",
                 "alternatives", "key_tables", "string_rule", "bounds", "prefix_items", "unique", "key_names",
                 "max_keys")  # fmt: skip

    def __init__(self) -> None:
        self.types: frozenset[str] = _TYPES
        #: ``(name, the key's JSON text, node)`` in order, or None: any keys.
        self.properties: Optional[tuple[tuple[str, bytes, _Node], ...]] = None
        self.required: frozenset[str] = frozenset()
        #: The values of keys not in ``properties`` (None: no such keys).
        self.additional: Optional[_Node] = None
        #: An open object's keys: what they may be (``propertyNames``; None:
        #: any string) and how many at most (``maxProperties``; None: any).
        self.key_names: Optional[_Node] = None
        self.max_keys: Optional[int] = None
        #: The items after ``prefix_items`` (None: no more).
        self.items: Optional[_Node] = None
        #: The first items' schemas, one each (``prefixItems``).
        self.prefix_items: tuple[_Node, ...] = ()
        #: For ``uniqueItems``: the values an item may be, one text each
        #: (tagged by their index), or None: items may repeat.
        self.unique: Optional[_Table] = None
        self.min_items = 0
        self.max_items: Optional[int] = None
        #: The value's allowed texts (``enum``/``const``), or None.
        self.literals: Optional[_Table] = None
        #: ``anyOf`` alternatives, or None.
        self.alternatives: Optional[tuple[_Node, ...]] = None
        #: The keys that may come next from each property on (made as met).
        self.key_tables: Optional[dict[int, _Table]] = None
        #: What a string's characters may be (``pattern``, lengths, a
        #: ``format`` held to), or None: any.
        self.string_rule: Optional[StringRule] = None
        #: A number's bounds, or None: any number.
        self.bounds: Optional[NumberBounds] = None


def _compact(value: Any) -> bytes:
    """``value``'s JSON text, with no spaces (an enum's value as it is written).

    Raises:
        SchemaNotSupported: a value JSON cannot write (NaN, an infinity, an object).
    """
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError) as error:
        raise SchemaNotSupported(f"enum and const values must be JSON: {error}") from None


class JsonGrammar:
    """A schema's JSON texts, as a byte-level automaton (see the module docstring).

    Immutable once made (its step cache aside, which only memoises
    :meth:`step`), so one grammar serves any number of generations.

    Raises (on construction):
        SchemaNotSupported: a keyword outside the subset, a malformed value,
            a ``$ref`` that names nothing, or a schema that allows no value.
    """

    def __init__(
        self,
        schema: Any,
        *,
        before: bytes = b"",
        after: bytes = b"",
        reasoning: Optional[tuple[bytes, bytes]] = None,
        reasoning_opened: bool = False,
    ) -> None:
        self._root_schema = schema
        self._parts = 0
        self._refs: dict[str, _Node] = {}
        self._rules: dict[tuple, StringRule] = {}
        # What its string rules cost to compile, in all (bounded).
        self._positions = self._level_work = 0
        self._any = _Node()
        self._any.items = self._any
        self._any.additional = self._any
        self.root = self._compile(schema, "schema")
        #: The text is ``before``, the value, ``after`` (a tool call's markers, say).
        self.before, self.after = bytes(before), bytes(after)
        stack: tuple = (("t", self.after),) if self.after else ()
        stack += (("v", self.root, _NO_GAP),)
        if self.before:
            stack += (("l", self.before, 0, -1),)
        #: A reasoning block's markers: the text may begin with one (inside
        #: one, where the prompt opened it), then whitespace, then the rest.
        self.reasoning = reasoning
        stacks = {stack}
        if reasoning is not None:
            start, end = (bytes(marker) for marker in reasoning)
            if not start or not end:
                raise SchemaNotSupported("reasoning markers must not be empty")
            reasoned = stack + (("w", 0), ("f", end, 0))
            stacks = {reasoned} if reasoning_opened else {stack, reasoned + (("l", start, 0, -1),)}
        self.start: State = frozenset(stacks)
        self._steps: dict[tuple[State, int], State] = {}

    # -- compiling -----------------------------------------------------------

    def _counted(self, parts: int, where: str) -> None:
        self._parts += parts
        if self._parts > MAX_SCHEMA_PARTS:
            raise SchemaNotSupported(f"{where}: the schema has more than {MAX_SCHEMA_PARTS} subschemas and enum values")

    def _compile(self, schema: Any, where: str) -> _Node:
        self._counted(1, where)
        if schema is True or (isinstance(schema, Mapping) and not set(schema) - _ANNOTATIONS):
            return self._any
        if not isinstance(schema, Mapping):
            raise SchemaNotSupported(f"{where} must be an object (a schema) or true")
        unknown = sorted(set(schema) - _SUPPORTED - _ANNOTATIONS)
        if unknown:
            raise SchemaNotSupported(f"{where}: keyword {unknown[0]!r} is not supported")
        if "$ref" in schema:
            if set(schema) - _ANNOTATIONS - {"$ref"}:
                raise SchemaNotSupported(f"{where}: $ref with other keywords is not supported")
            return self._ref(schema["$ref"], where)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self._alternatives(schema, key, where)
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1 or set(schema) - _ANNOTATIONS - {"allOf"}:
                raise SchemaNotSupported(f"{where}: allOf is supported with one schema alone")
            return self._compile(parts[0], f"{where}.allOf[0]")
        node = _Node()
        self._types(node, schema, where)
        if "string" in node.types:
            node.string_rule = self._string_rule(schema, where)
        if {"number", "integer"} & node.types and _NUMBER_KEYWORDS & set(schema):
            node.bounds = self._bounds(schema, "number" not in node.types, where)
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaNotSupported(f"{where}: enum must be a non-empty list")
            self._counted(len(values), where)
            texts = {_compact(value) for value in values if _literal_held(node, value)}
            if not texts:
                raise SchemaNotSupported(f"{where}: no value of its enum meets its other keywords")
            node.literals = _Table(sorted((text, -1) for text in texts))
            return node
        if "object" in node.types:
            self._object(node, schema, where)
        if "array" in node.types:
            self._array(node, schema, where)
        return node

    def _types(self, node: _Node, schema: Mapping, where: str) -> None:
        if "type" in schema:
            names = schema["type"]
            names = [names] if isinstance(names, str) else names
            if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
                raise SchemaNotSupported(f"{where}.type must be a type name or a non-empty list of them")
            wrong = [n for n in names if n not in _TYPES]
            if wrong:
                raise SchemaNotSupported(f"{where}.type: {wrong[0]!r} is not a JSON type")
            node.types = frozenset(names)
        elif "enum" in schema or "const" in schema:
            return  # the values say their types; each keyword applies to its own
        elif _OBJECT_KEYWORDS & set(schema):
            node.types = frozenset({"object"})
        elif {"items", "prefixItems", "minItems", "maxItems", "uniqueItems"} & set(schema):
            node.types = frozenset({"array"})
        elif _STRING_KEYWORDS & set(schema):
            node.types = frozenset({"string"})
        elif _NUMBER_KEYWORDS & set(schema):
            node.types = frozenset({"number"})

    def _string_rule(self, schema: Mapping, where: str) -> Optional[StringRule]:
        """What the strings of ``schema`` hold their characters to, or None."""
        named = schema.get("format")
        pattern = schema.get("pattern", FORMATS.get(named) if isinstance(named, str) else None)
        if pattern is None and not {"minLength", "maxLength"} & set(schema):
            return None
        if pattern is not None and not isinstance(pattern, str):
            raise SchemaNotSupported(f"{where}.pattern must be a string")
        low = _count(schema.get("minLength", 0), f"{where}.minLength")
        high = _count(schema["maxLength"], f"{where}.maxLength") if "maxLength" in schema else None
        if max(low, high or 0) > MAX_LENGTH:
            raise SchemaNotSupported(f"{where}: string lengths above {MAX_LENGTH} are not supported")
        if high is not None and high < low:
            raise SchemaNotSupported(f"{where}: maxLength is below minLength")
        key = (pattern, low, high)
        if key not in self._rules:
            try:
                rule = StringRule(pattern, low, high, level_budget=MAX_LEVEL_WORK - self._level_work)
            except PatternNotSupported as error:
                raise SchemaNotSupported(f"{where}: {error}") from None
            self._rules[key] = rule
            self._level_work += rule.level_work
            self._positions += rule.positions
            if self._positions > MAX_PATTERN_POSITIONS:
                raise SchemaNotSupported(
                    f"{where}: the schema's patterns need more than {MAX_PATTERN_POSITIONS} automaton positions"
                )
        return self._rules[key]

    def _bounds(self, schema: Mapping, integer: bool, where: str) -> NumberBounds:
        """The bounds the numbers of ``schema`` are held to (as JSON Schema
        2020-12 writes them, or draft 4's boolean ``exclusiveMinimum``)."""
        ends = []
        for inclusive, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            value, is_open = schema.get(inclusive), False
            other = schema.get(exclusive)
            for name, number in ((inclusive, value), (exclusive, other)):
                if number is not None and not (name == exclusive and isinstance(number, bool)) and not _finite(number):
                    raise SchemaNotSupported(f"{where}.{name} must be a finite number")
            if isinstance(other, bool):
                is_open = other and value is not None
            elif other is not None:
                stricter = value is None or (other >= value if inclusive == "minimum" else other <= value)
                if stricter:
                    value, is_open = other, True
            ends.append((value, is_open))
        (low, low_open), (high, high_open) = ends
        multiple = schema.get("multipleOf")
        if multiple is not None and not _finite(multiple):
            raise SchemaNotSupported(f"{where}.multipleOf must be a finite number")
        try:
            return NumberBounds(low, low_open, high, high_open, integer=integer, multiple=multiple)
        except BoundsNotSupported as error:
            raise SchemaNotSupported(f"{where}: {error}") from None

    def _object(self, node: _Node, schema: Mapping, where: str) -> None:
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
            raise SchemaNotSupported(f"{where}.required must be a list of names")
        additional = schema.get("additionalProperties", True)
        if "properties" in schema:
            if {"propertyNames", "maxProperties", "patternProperties"} & set(schema):
                raise SchemaNotSupported(
                    f"{where}: propertyNames, patternProperties and maxProperties are held only without properties"
                )
            properties = schema["properties"]
            if not isinstance(properties, Mapping):
                raise SchemaNotSupported(f"{where}.properties must be an object")
            missing = [name for name in required if name not in properties]
            if missing:
                raise SchemaNotSupported(f"{where}.required names {missing[0]!r}, not in its properties")
            node.properties = tuple(
                (name, json.dumps(name, ensure_ascii=False).encode(), self._compile(value, f"{where}.{name}"))
                for name, value in properties.items()
            )
            node.required = frozenset(required)
            return
        if required:
            raise SchemaNotSupported(f"{where}: required keys need properties naming them")
        patterned = schema.get("patternProperties")
        if patterned is not None:
            # One pattern: its keys alone are written (a key past it, which
            # additionalProperties would hold, is never needed).
            if not isinstance(patterned, Mapping) or len(patterned) != 1 or "propertyNames" in schema:
                raise SchemaNotSupported(f"{where}: patternProperties is held with one pattern (and no propertyNames)")
            ((pattern, additional),) = patterned.items()
            names = {"type": "string", "pattern": pattern}
        elif additional is False:
            node.properties = ()
            return
        else:
            names = schema.get("propertyNames")
        node.additional = self._compile(additional, f"{where}.additionalProperties")
        if "maxProperties" in schema:
            node.max_keys = _count(schema["maxProperties"], f"{where}.maxProperties")
        if names is not None:
            node.key_names = self._compile(names, f"{where}.propertyNames")
            if not _takes_strings(node.key_names):
                raise SchemaNotSupported(f"{where}.propertyNames allows no string (no key could be written)")

    def _array(self, node: _Node, schema: Mapping, where: str) -> None:
        prefix = schema.get("prefixItems", [])
        if not isinstance(prefix, list):
            raise SchemaNotSupported(f"{where}.prefixItems must be a list of schemas")
        node.prefix_items = tuple(self._compile(part, f"{where}.prefixItems[{i}]") for i, part in enumerate(prefix))
        items = schema.get("items", True)
        node.items = None if items is False else self._compile(items, f"{where}.items")
        node.min_items = _count(schema.get("minItems", 0), f"{where}.minItems")
        if "maxItems" in schema:
            node.max_items = _count(schema["maxItems"], f"{where}.maxItems")
        if node.items is None:  # the prefix's items alone
            node.max_items = min(len(prefix), node.max_items if node.max_items is not None else len(prefix))
        if node.max_items is not None and node.max_items < node.min_items:
            raise SchemaNotSupported(f"{where}: maxItems is below minItems (or items beyond prefixItems are needed)")
        unique = schema.get("uniqueItems", False)
        if not isinstance(unique, bool):
            raise SchemaNotSupported(f"{where}.uniqueItems must be true or false")
        if unique:
            node.unique = _unique_values(node, where)

    def _alternatives(self, schema: Mapping, key: str, where: str) -> _Node:
        parts = schema[key]
        if set(schema) - _ANNOTATIONS - {key}:
            raise SchemaNotSupported(f"{where}: {key} with other keywords is not supported")
        if not isinstance(parts, list) or not parts:
            raise SchemaNotSupported(f"{where}.{key} must be a non-empty list")
        node = _Node()
        node.alternatives = tuple(self._compile(part, f"{where}.{key}[{i}]") for i, part in enumerate(parts))
        return node

    def _ref(self, ref: Any, where: str) -> _Node:
        if ref in self._refs:
            return self._refs[ref]
        if ref == "#":
            target: Any = self._root_schema
        else:
            parts = ref.split("/") if isinstance(ref, str) else []
            if len(parts) != 3 or parts[0] != "#" or parts[1] not in ("$defs", "definitions"):
                raise SchemaNotSupported(f"{where}: $ref {ref!r} must be '#/$defs/NAME' or '#/definitions/NAME'")
            table = self._root_schema.get(parts[1]) if isinstance(self._root_schema, Mapping) else None
            if not isinstance(table, Mapping) or parts[2] not in table:
                raise SchemaNotSupported(f"{where}: $ref {ref!r} names no definition")
            target = table[parts[2]]
        # A placeholder first, so that a definition may refer to itself.
        node = _Node()
        self._refs[ref] = node
        compiled = self._compile(target, ref)
        for slot in _Node.__slots__:
            setattr(node, slot, getattr(compiled, slot))
        if compiled is self._any:
            node.items = node.additional = node
        return node

    # -- reading -------------------------------------------------------------

    def step(self, state: State, byte: int) -> State:
        """The state after ``byte`` (empty: ``byte`` cannot come next)."""
        key = (state, byte)
        found = self._steps.get(key)
        if found is None:
            found = frozenset(after for stack in state for after in self._advance(stack, byte))
            if len(found) > MAX_WAYS:
                raise GrammarTooAmbiguous(
                    f"the text can be read in more than {MAX_WAYS} ways at once: the schema's alternatives"
                    " (anyOf) are too alike"
                )
            if len(self._steps) >= STEPS_KEPT:
                self._steps.clear()
            self._steps[key] = found
        return found

    def read(self, state: State, data: bytes) -> State:
        """The state after ``data`` (empty as soon as a byte cannot come next)."""
        for byte in data:
            state = self.step(state, byte)
            if not state:
                break
        return state

    def complete(self, state: State) -> bool:
        """Whether the text read so far is whole (the value, and the text
        around it): it may end here."""
        return any(not stack or (len(stack) == 1 and _ended_number(stack[0])) for stack in state)

    def in_free_text(self, state: State) -> Optional[tuple[bytes, int]]:
        """Where every way on is in a reasoning block, its end marker and how
        much of it the text ends with (what a token does there depends on
        nothing else); else None."""
        tops = {stack[-1] for stack in state if stack}
        if len(tops) != 1 or not all(state):
            return None
        (top,) = tops
        return (top[1], top[2]) if top[0] == "f" else None

    def after_free_text(self, state: State) -> State:
        """The state once the reasoning block of ``state`` (one
        :meth:`in_free_text` names) has ended with its marker."""
        return frozenset(stack[:-1] for stack in state)

    def in_plain_string(self, state: State) -> bool:
        """Whether every way on is inside a string, between characters: what
        a token does there, up to a quote that ends the string, depends on
        nothing else."""
        return all(stack and stack[-1] == ("s", 0) for stack in state)

    def in_ruled_string(self, state: State) -> Optional[tuple[StringRule, Any]]:
        """Where every way on is inside one string held to a rule, no escape
        begun: the rule and its state (what a token of plain characters
        does there depends on nothing else: each byte goes to the rule);
        else None."""
        tops = {stack[-1] for stack in state if stack}
        if len(tops) != 1 or not all(state):
            return None
        (top,) = tops
        if top[0] != "p" or top[3]:
            return None
        return top[1], top[2]

    def accepts(self, text: bytes) -> bool:
        """Whether ``text`` is, whole, a value the schema allows."""
        return self.complete(self.read(self.start, text))

    # A stack's successors after one byte (each live: see the invariants).
    def _advance(self, stack: tuple, byte: int) -> list[tuple]:
        if not stack:
            return []
        top, rest = stack[-1], stack[:-1]
        kind = top[0]
        if kind == "s":
            return self._string(top[1], rest, byte, stack)
        if kind == "p":
            return self._ruled_string(top, rest, byte)
        if kind == "f":
            _, end, matched = top
            matched = _marker_step(end, matched, byte)
            return [rest] if matched == len(end) else [rest + (("f", end, matched),)]
        if kind == "w":
            if byte in _WHITESPACE and top[1] < MAX_WHITESPACE:
                return [rest + (("w", top[1] + 1),)]
            return self._advance(rest, byte)
        if kind == "v":
            if byte in _WHITESPACE:
                return _spaced(top, rest, byte)
            return self._begin(rest, top[1], byte)
        if kind == "e":
            _, table, low, high, at, used = top
            return self._in_table(rest, table, low, high, at, byte, used)
        if kind == "l":
            _, text, at, tag = top
            if text[at] != byte:
                return []
            if at + 1 == len(text):
                return self._done(rest, tag)
            return [rest + (("l", text, at + 1, tag),)]
        if kind == "n":
            _, where, refused, bounds, text = top
            out = []
            kind_of = _number_class(byte)
            following = _NUMBER[where].get(kind_of) if kind_of else None
            if following is not None and following not in refused:
                out.extend(_number(rest, following, refused, bounds, text + bytes([byte])))
            if _ended_number(top):
                out.extend(after for done in self._done(rest) for after in self._advance(done, byte))
            return out
        if kind == "o":
            return self._in_object(top, rest, byte)
        if kind == "u":
            return self._in_unique_array(top, rest, byte)
        return self._in_array(top, rest, byte)

    def _string(self, escape: Any, rest: tuple, byte: int, stack: tuple) -> list[tuple]:
        after = string_step(escape, byte)
        if after is None:
            return []
        if after is CLOSED:
            return self._done(rest)
        return [stack] if after == escape else [rest + (("s", after),)]

    def _ruled_string(self, top: tuple, rest: tuple, byte: int) -> list[tuple]:
        """Inside a string held to a :class:`StringRule`: its JSON text is
        read here (quote, escapes), its characters by the rule. ``pending``
        is an escape being written (from its backslash), else empty."""
        _, rule, state, pending = top
        if pending or byte == _BACKSLASH:
            return self._in_escape(rule, state, pending + bytes([byte]), rest)
        if byte == _QUOTE:
            return self._done(rest) if rule.complete(state) else []
        if byte < 0x20:
            return []
        after = rule.step(state, byte)
        return [] if after is None else [rest + (("p", rule, after, b""),)]

    def _in_escape(self, rule: StringRule, state: Any, escape: bytes, rest: tuple) -> list[tuple]:
        """An escape in a ruled string after its bytes ``escape``: the
        character it writes read by the rule once whole; until then taken
        while some character it may still write is one the rule takes."""
        code, ranges = _escape_reading(escape)
        if code is None:
            if any(rule.takes_code_point(state, low, high) for low, high in ranges):
                return [rest + (("p", rule, state, escape),)]
            return []
        for byte in chr(code).encode():
            state = rule.step(state, byte)
            if state is None:
                return []
        return [rest + (("p", rule, state, b""),)]

    def _in_table(
        self, rest: tuple, table: _Table, low: int, high: int, at: int, byte: int, used: frozenset = frozenset()
    ) -> list[tuple]:
        """The stacks after ``byte`` where the text is one of
        ``table.texts[low:high]`` (sorted), which share their first ``at``
        bytes, less those whose tags are ``used`` (a unique array's items so
        far): one frame for them all, however many (an enum's values, the
        keys that may come next); a text written whole is done, with its tag."""
        texts, tags = table.texts, table.tags
        if low >= high:
            return []
        prefix = texts[low][:at] + bytes([byte])
        first = bisect.bisect_left(texts, prefix, low, high)
        last = past_prefix(texts, prefix, first, high)
        out = []
        if first < last and len(texts[first]) == at + 1:  # the shortest (sorted first) is whole here
            if tags[first] not in used:
                out.extend(self._done(rest, tags[first]))
            first += 1
        if first < last and (not used or any(tags[i] not in used for i in range(first, last))):
            out.append(rest + (("e", table, first, last, at + 1, used),))
        return out

    def _begin(self, rest: tuple, node: _Node, byte: int) -> list[tuple]:
        """The stacks after a value's first byte, the value per ``node``."""
        if node.alternatives is not None:
            return [stack for part in node.alternatives for stack in self._begin(rest, part, byte)]
        if node.literals is not None:
            return self._in_table(rest, node.literals, 0, len(node.literals.texts), 0, byte)
        types = node.types
        deep = len(rest) >= MAX_DEPTH
        if byte == ord("{") and "object" in types and not deep:
            return [rest + (("o", node, 0, 0, 0),)]
        if byte == ord("[") and "array" in types and not deep:  # unique items: the values written kept
            return [rest + (("a", node, 0, 0, 0) if node.unique is None else ("u", node, 0, frozenset(), 0),)]
        if byte == _QUOTE and "string" in types:
            rule = node.string_rule
            return [rest + (("s", 0),)] if rule is None else [rest + (("p", rule, rule.start, b""),)]
        number, integer = "number" in types, "integer" in types and "number" not in types
        kind_of = _number_class(byte)
        if (number or integer) and kind_of in ("sign", "zero", "digit"):
            where = {"sign": "sign", "zero": "zero", "digit": "int"}[kind_of]
            bounds = node.bounds
            refused = bounds.refused if bounds is not None else _NOT_INTEGER if integer else frozenset()
            return _number(rest, where, refused, bounds, bytes([byte]))
        literal = {ord("t"): ("boolean", b"true"), ord("f"): ("boolean", b"false"), ord("n"): ("null", b"null")}
        if byte in literal and literal[byte][0] in types:
            return [rest + (("l", literal[byte][1], 1, -1),)]
        return []

    def _done(self, rest: tuple, tag: int = -1) -> list[tuple]:
        """The stacks once the value (or key) on top of ``rest`` is finished."""
        if not rest:
            return [()]
        if rest[-1][0] in ("v", "f"):  # the text before the value (or the reasoning), written
            return [rest]
        if rest[-1][0] == "t":  # the value, written: the text after it comes
            return [rest[:-1] + (("l", rest[-1][1], 0, -1),)]
        kind, node, phase, at, _ = rest[-1]
        outer = rest[:-1]
        if kind == "u":  # an item of a unique array: ``at`` the items' tags so far
            return [outer + (("u", node, 4, at | {tag}, 0),)]
        if kind == "o":
            if phase == 5:  # a key: ``tag`` is its property's index (closed objects)
                return [outer + (("o", node, 2, tag if tag >= 0 else at, 0),)]
            # The next property's index (closed), or the keys so far, told apart up to maxProperties (open).
            following = at + 1 if node.properties is not None else min(at + 1, node.max_keys or 0)
            return [outer + (("o", node, 4, following, 0),)]
        return [outer + (("a", node, 4, min(at + 1, _count_cap(node)), 0),)]

    def _in_object(self, top: tuple, rest: tuple, byte: int) -> list[tuple]:
        _, node, phase, at, _ = top
        if byte in _WHITESPACE:
            return _spaced(top, rest, byte)
        if phase in (0, 1):
            if phase == 0 and byte == ord("}") and _may_close(node, at):
                return self._done(rest)
            if byte != _QUOTE:
                return []
            keying = rest + (("o", node, 5, at, 0),)
            if node.properties is None:
                if phase == 0 and node.max_keys == 0:
                    return []
                names = node.key_names
                return [keying + (("s", 0),)] if names is None else self._begin(keying, names, byte)
            table = _key_table(node, at)
            return self._in_table(keying, table, 0, len(table.texts), 0, byte)
        if phase == 2:
            if byte != ord(":"):
                return []
            value = node.properties[at][2] if node.properties is not None else node.additional
            return [rest + (("o", node, 3, at, 0), ("v", value, 0))]
        # phase 4: after a value
        if byte == ord(",") and _key_may_follow(node, at):
            return [rest + (("o", node, 1, at, 0),)]
        if byte == ord("}") and _may_close(node, at):
            return self._done(rest)
        return []

    def _in_array(self, top: tuple, rest: tuple, byte: int) -> list[tuple]:
        _, node, phase, count, _ = top
        if byte in _WHITESPACE:
            return _spaced(top, rest, byte)
        if phase in (0, 1):
            out = []
            if phase == 0 and byte == ord("]") and node.min_items == 0:
                out.extend(self._done(rest))
            if node.max_items is None or count < node.max_items:
                out.extend(self._begin(rest + (("a", node, 3, count, 0),), _item(node, count), byte))
            return out
        # phase 4: after an item
        if byte == ord(",") and (node.max_items is None or count < node.max_items):
            return [rest + (("a", node, 1, count, 0),)]
        if byte == ord("]") and count >= node.min_items:
            return self._done(rest)
        return []


    def _in_unique_array(self, top: tuple, rest: tuple, byte: int) -> list[tuple]:
        """In an array of unique items (``node.unique``): each item one of
        the values not yet written (``used``, their tags)."""
        _, node, phase, used, _ = top
        if byte in _WHITESPACE:
            return _spaced(top, rest, byte)
        table = node.unique
        if phase in (0, 1):
            out = []
            if phase == 0 and byte == ord("]") and node.min_items == 0:
                out.extend(self._done(rest))
            if phase == 1 or _more_unique(node, used):
                out.extend(self._in_table(rest + (("u", node, 3, used, 0),), table, 0, len(table.texts), 0, byte, used))
            return out
        # phase 4: after an item
        if byte == ord(",") and _more_unique(node, used):
            return [rest + (("u", node, 1, used, 0),)]
        if byte == ord("]") and len(used) >= node.min_items:
            return self._done(rest)
        return []


#: :func:`string_step`'s answer to the quote that ends a string.
CLOSED = "closed"


def string_step(escape: Any, byte: int) -> Any:
    """Inside a string at ``escape``, the escape after ``byte``: :data:`CLOSED`
    where it ends the string, None where it cannot come.

    ``escape``: 0 between characters; -1 after a backslash; 1-4 hex digits
    of a ``\\u`` escape still to come; ``(low, high, n)``: a UTF-8
    continuation byte in ``[low, high]`` comes next, then ``n`` more."""
    if escape == 0:
        if byte == _QUOTE:
            return CLOSED
        if byte == _BACKSLASH:
            return -1
        if byte < 0x80:
            return None if byte < 0x20 else 0
        return _utf8_following(byte)
    if isinstance(escape, tuple):
        low, high, more = escape
        if not low <= byte <= high:
            return None
        return (0x80, 0xBF, more - 1) if more else 0
    if escape == -1:
        if byte in _ESCAPES:
            return 0
        return 4 if byte == ord("u") else None
    return escape - 1 if byte in _HEX else None


def _marker_step(marker: bytes, matched: int, byte: int) -> int:
    """How much of ``marker`` the text ends with after ``byte``, where it
    ended with ``matched`` bytes of it (the longest such prefix)."""
    text = marker[:matched] + bytes([byte])
    for length in range(min(len(text), len(marker)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def past_prefix(texts: Sequence[bytes], prefix: bytes, low: int, high: int) -> int:
    """In ``texts[low:high]`` (sorted), the first index from ``low`` whose
    text does not start with ``prefix``, where those before it do."""
    while prefix and prefix[-1] == 0xFF:
        prefix = prefix[:-1]
    if not prefix:
        return high
    return bisect.bisect_left(texts, prefix[:-1] + bytes([prefix[-1] + 1]), low, high)


def _spaced(top: tuple, rest: tuple, byte: int) -> list[tuple]:
    """The stack after whitespace ``byte`` where ``top`` (a frame whose last
    field is its gap: a value's, an object's, an array's) waits for a token."""
    gap = _gap(top[-1], byte)
    return [] if gap is None else [rest + (top[:-1] + (gap,),)]


def _gap(gap: int, byte: int) -> Optional[int]:
    """A gap's whitespace after ``byte`` (None: not allowed): the gap holds
    ``gap % _NEWLINE`` spaces or tabs (at most :data:`MAX_WHITESPACE`), and
    a newline where ``gap >= _NEWLINE``."""
    if byte == ord("\n"):
        return None if gap >= _NEWLINE else gap + _NEWLINE
    return gap + 1 if gap % _NEWLINE < MAX_WHITESPACE else None


def _utf8_following(lead: int) -> Optional[tuple[int, int, int]]:
    """What follows a UTF-8 lead byte: the range of the next byte and how
    many continuation bytes come after it (None: not a lead byte). The ranges
    leave out overlong forms, surrogates and code points past U+10FFFF."""
    if 0xC2 <= lead <= 0xDF:
        return (0x80, 0xBF, 0)
    if 0xE0 <= lead <= 0xEF:
        return (0xA0 if lead == 0xE0 else 0x80, 0x9F if lead == 0xED else 0xBF, 1)
    if 0xF0 <= lead <= 0xF4:
        return (0x90 if lead == 0xF0 else 0x80, 0x8F if lead == 0xF4 else 0xBF, 2)
    return None


def _count_cap(node: _Node) -> int:
    """Where an array's item count stops being told apart: past its bounds
    and its ``prefixItems`` every count reads the same (so states repeat,
    and their masks are reused)."""
    return node.max_items if node.max_items is not None else max(node.min_items, len(node.prefix_items))


def _item(node: _Node, count: int) -> _Node:
    """The schema of an array's item after ``count`` others (one may come there)."""
    return node.prefix_items[count] if count < len(node.prefix_items) else node.items


class _Table:
    """Texts one of which comes next (sorted), each with a tag (a key's
    property index; -1 for an enum's value). Compared by identity."""

    __slots__ = ("texts", "tags")

    def __init__(self, entries: list[tuple[bytes, int]]) -> None:
        self.texts = tuple(text for text, _ in entries)
        self.tags = tuple(tag for _, tag in entries)


def _key_table(node: _Node, at: int) -> _Table:
    """The keys that may come next in an object of ``node``'s from property
    ``at`` on (made once a place)."""
    if node.key_tables is None:
        node.key_tables = {}
    table = node.key_tables.get(at)
    if table is None:
        table = node.key_tables[at] = _Table(sorted((node.properties[j][1], j) for j in _next_keys(node, at)))
    return table


def _next_keys(node: _Node, at: int) -> list[int]:
    """The properties whose key may come next: from ``at`` on, up to and
    including the first required one (a required key is never skipped)."""
    keys = []
    for index in range(at, len(node.properties)):
        keys.append(index)
        if node.properties[index][0] in node.required:
            break
    return keys


def _key_may_follow(node: _Node, at: int) -> bool:
    """Whether another key may come after a value: ``at`` is a closed
    object's property index, an open object's key count (up to ``maxProperties``)."""
    if node.properties is not None:
        return bool(_next_keys(node, at))
    return node.max_keys is None or at < node.max_keys


def _may_close(node: _Node, at: int) -> bool:
    return node.properties is None or not any(name in node.required for name, _, _ in node.properties[at:])


def _ended_number(frame: tuple) -> bool:
    """Whether ``frame`` is a number that may end here (whole, in its bounds)."""
    return frame[0] == "n" and frame[1] in _NUMBER_ENDS and (frame[3] is None or frame[3].holds(frame[4]))


def _number(rest: tuple, where: str, refused: frozenset, bounds: Optional[NumberBounds], text: bytes) -> list[tuple]:
    """The stacks once a number's text is ``text`` (at ``where`` in
    :data:`_NUMBER`): ``("n", where, refused, bounds, text)``, the bounds and
    text kept only while the text's ways on are partly out of bounds."""
    if bounds is not None:
        reach = bounds.reach(text)
        if reach == "none":
            return []
        if reach == "some":
            return [rest + (("n", where, refused, bounds, text),)]
    return [rest + (("n", where, refused, None, b""),)]


def _escape_reading(escape: bytes) -> tuple[Optional[int], list[tuple[int, int]]]:
    """A string escape being written (from its backslash): the code point it
    writes once whole, else None and the code points it may still write
    (none: it cannot go on). A ``\\u`` escape of a surrogate pair's first
    half writes nothing alone: the pair's second escape must follow, and the
    two write one code point past U+FFFF (``\\uD83D\\uDE00``)."""
    if len(escape) == 1:
        return None, [(0, 0x10FFFF)]
    if len(escape) == 2:
        code = _SHORT_ESCAPES.get(escape[1])
        if code is not None:
            return code, []
        return None, [(0, 0x10FFFF)] if escape[1] == ord("u") else []
    if escape[-1] not in _HEX and len(escape) not in (7, 8):
        return None, []
    if len(escape) <= 6:
        shift = 4 * (6 - len(escape))
        low = int(escape[2:], 16) << shift
        high = low | ((1 << shift) - 1)
        if low == high and not 0xD800 <= low <= 0xDBFF:
            return (None, []) if 0xDC00 <= low <= 0xDFFF else (low, [])
        ranges = [(low, high)]  # its surrogates write nothing alone (no UTF-8 text holds them)
        first, last = max(low, 0xD800), min(high, 0xDBFF)
        if first <= last:
            ranges.append((_paired(first, 0xDC00), _paired(last, 0xDFFF)))
        return None, ranges
    if escape[6:8] != b"\\u"[: len(escape) - 6]:
        return None, []
    digits = escape[8:]
    shift = 4 * (4 - len(digits))
    low = max(int(digits or b"0", 16) << shift, 0xDC00)
    high = min((int(digits or b"0", 16) << shift) | ((1 << shift) - 1), 0xDFFF)
    if low > high:
        return None, []
    lead = int(escape[2:6], 16)
    if not shift:
        return _paired(lead, low), []
    return None, [(_paired(lead, low), _paired(lead, high))]


def _paired(lead: int, trail: int) -> int:
    """The code point a surrogate pair writes."""
    return 0x10000 + ((lead - 0xD800) << 10) + (trail - 0xDC00)


def _unique_values(node: _Node, where: str) -> _Table:
    """The values a unique array's items may be (its items finitely many:
    an enum's, a const, booleans, null), one text for each JSON value (``1``
    and ``1.0`` are one), tagged by index."""
    items = node.items
    if node.prefix_items or items is None or items.alternatives is not None:
        texts: Sequence[bytes] = ()
    elif items.literals is not None:
        texts = items.literals.texts
    elif items.types <= {"boolean", "null"}:
        texts = [text for kind, text in (("boolean", b"true"), ("boolean", b"false"), ("null", b"null"))
                 if kind in items.types]  # fmt: skip
    else:
        texts = ()
    if not texts:
        raise SchemaNotSupported(
            f"{where}: uniqueItems is held only over items of an enum, a const, booleans or null (no prefixItems)"
        )
    kept: dict[Any, bytes] = {}
    for text in texts:
        kept.setdefault(_canonical(json.loads(text)), text)
    if node.min_items > len(kept):
        raise SchemaNotSupported(f"{where}: minItems is more than the distinct values its unique items may be")
    return _Table([(text, index) for index, text in enumerate(sorted(kept.values()))])


def _more_unique(node: _Node, used: frozenset) -> bool:
    """Whether a unique array may take another item after ``used``."""
    return (node.max_items is None or len(used) < node.max_items) and len(used) < len(node.unique.texts)


def _canonical(value: Any) -> Any:
    """A JSON value as JSON compares it: numbers by value, objects by their keys and values."""
    if value is None or isinstance(value, bool):
        return ("literal", value)
    if isinstance(value, (int, float)):
        return ("number", Fraction(repr(value)) if isinstance(value, float) else Fraction(value))
    if isinstance(value, str):
        return ("string", value)
    if isinstance(value, list):
        return ("array", tuple(_canonical(item) for item in value))
    return ("object", frozenset((key, _canonical(item)) for key, item in value.items()))


def _takes_strings(node: _Node) -> bool:
    """Whether some string is a value of ``node``."""
    if node.alternatives is not None:
        return any(_takes_strings(part) for part in node.alternatives)
    if node.literals is not None:
        return any(text.startswith(b'"') for text in node.literals.texts)
    return "string" in node.types


def _literal_held(node: _Node, value: Any) -> bool:
    """Whether an ``enum``/``const`` value meets its schema's string rule and number bounds."""
    if isinstance(value, str) and node.string_rule is not None:
        return node.string_rule.matches(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and node.bounds is not None:
        return node.bounds.holds(_compact(value))
    return True


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SchemaNotSupported(f"{where} must be an int >= 0")
    return value

