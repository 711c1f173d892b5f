"""The JSON grammar: what it reads against JSON itself and against schemas.

Soundness: every text it takes whole is JSON (``json.loads``) the schema
allows; completeness: JSON written by ``json.dumps`` (compact or indented)
that the schema allows is taken; liveness: from every state its bytes reach,
some byte goes on or the value is whole (a constrained generation never
runs out of tokens).
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxkv.actors.json_grammar import (
    MAX_DEPTH, MAX_LENGTH, MAX_SCHEMA_PARTS, MAX_WAYS, MAX_WHITESPACE, GrammarTooAmbiguous, JsonGrammar,
    SchemaNotSupported,
)  # fmt: skip

from json_walks import walked_texts

ANY = JsonGrammar({})
OBJECT = JsonGrammar({"type": "object"})

PERSON = {
    "type": "object",
    "title": "Person",
    "properties": {
        "name": {"type": "string", "description": "who"},
        "age": {"type": "integer"},
        "height": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 2},
        "pet": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/Pet"}]},
        "email": {"type": "string", "format": "email"},
    },
    "required": ["name", "age"],
    "$defs": {"Pet": {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]}},
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=12,
)


class TestAgainstJson:
    @given(json_values)
    @settings(max_examples=300, deadline=None)
    def test_any_value_written_by_json_dumps_is_taken(self, value):
        for text in (json.dumps(value), json.dumps(value, ensure_ascii=False), json.dumps(value, indent=2)):
            assert ANY.accepts(text.encode()), text
        assert OBJECT.accepts(json.dumps(value).encode()) == isinstance(value, dict)

    @given(json_values, st.data())
    @settings(max_examples=300, deadline=None)
    def test_what_it_takes_is_json(self, value, data):
        """A byte inserted, dropped or replaced: whenever the grammar still
        takes the text, JSON reads it (and reads the same as it is)."""
        text = bytearray(json.dumps(value, ensure_ascii=False).encode())
        at = data.draw(st.integers(0, len(text)))
        how = data.draw(st.sampled_from(["insert", "drop", "replace"]))
        byte = data.draw(st.sampled_from(list(b'{}[]",:.-+eE0123456789 \n\\tfnul') + [0x80, 0xC3, 0x1F]))
        if how == "insert":
            text[at:at] = bytes([byte])
        elif at < len(text):
            text[at : at + 1] = b"" if how == "drop" else bytes([byte])
        if ANY.accepts(bytes(text)):
            json.loads(bytes(text).decode("utf-8"))

    @pytest.mark.parametrize(
        "text",
        [b"", b"{", b'{"a":1,}', b"[1,]", b"01", b"1.", b"-", b".5", b"1e", b'"\x01"', b'"\\x"', b'"\\u12"',
         b"tru", b"nul", b'{"a" 1}', b'{1:2}', b"[1 2]", b'"\xc3"', b'"\xc0\x80"', b'"\xed\xa0\x80"', b'"\xf5"',
         b"{} ", b" \r{}", b"1 "],
    )  # fmt: skip
    def test_not_json_or_not_whole_is_refused(self, text):
        assert not ANY.accepts(text)

    def test_a_top_level_number_is_whole_and_may_grow(self):
        state = ANY.read(ANY.start, b"12")
        assert ANY.complete(state) and ANY.step(state, ord("3"))

    def test_whitespace_is_bounded(self):
        gap = b"\n" + b" " * MAX_WHITESPACE
        assert ANY.accepts(b"[" + gap + b"1" + gap + b"]")
        assert not ANY.accepts(b"[" + gap + b" 1]")
        assert not ANY.accepts(b"[\n\n1]")
        assert not ANY.accepts(b"[ \n" + b" " * MAX_WHITESPACE + b"1]")  # spaces before the newline count too

    def test_nesting_is_bounded(self):
        assert ANY.accepts(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH)
        assert not ANY.accepts(b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1))


class TestSchemas:
    @pytest.mark.parametrize(
        "value",
        [
            {"name": "x", "age": 3},
            {"name": "é\n", "age": -40, "height": 1.5e3, "tags": ["a"], "pet": None},
            {"name": "", "age": 0, "tags": ["c", "a"], "pet": {"kind": "cat"}, "email": "not checked"},
        ],
    )
    def test_values_it_allows_are_taken(self, value):
        grammar = JsonGrammar(PERSON)
        assert grammar.accepts(json.dumps(value).encode())
        assert grammar.accepts(json.dumps(value, indent=2).encode())

    @pytest.mark.parametrize(
        "value",
        [
            {"name": "x"},  # a required key missing
            {"age": 3, "name": "x"},  # out of order
            {"name": "x", "age": 3.5},  # not an integer
            {"name": "x", "age": "3"},
            {"name": "x", "age": 3, "other": 1},  # not a property
            {"name": "x", "age": 3, "tags": []},  # minItems
            {"name": "x", "age": 3, "tags": ["a", "b", "c"]},  # maxItems
            {"name": "x", "age": 3, "tags": ["d"]},  # not in the enum
            {"name": "x", "age": 3, "pet": {"kind": "dog"}},  # not the const
            {"name": "x", "age": 3, "pet": {}},
            ["x", 3],
        ],
    )
    def test_values_it_does_not_allow_are_refused(self, value):
        assert not JsonGrammar(PERSON).accepts(json.dumps(value).encode())

    def test_recursive_definitions(self):
        children = {"type": "array", "items": {"$ref": "#/$defs/Node"}}
        node = {"type": "object", "properties": {"children": children}, "required": ["children"]}
        tree = {"$defs": {"Node": node}, "$ref": "#/$defs/Node"}
        grammar = JsonGrammar(tree)
        assert grammar.accepts(b'{"children":[{"children":[]},{"children":[{"children":[]}]}]}')
        assert not grammar.accepts(b'{"children":[{}]}')

    def test_unique_items_of_a_finite_set(self):
        """Pydantic's ``set[Literal[...]]``: each item once (``1`` and ``1.0``
        one value, ``true`` another); a prefix that leads only to items
        written already is refused at once (the state stays live)."""
        grammar = JsonGrammar({"type": "array", "items": {"enum": ["a", "ab", "b", 1, 1.0, True]}, "uniqueItems": True})
        cases = (([], True), (["a", "ab", "b"], True), (["a", "a"], False), ([1, True], True), ([1, 1], False))
        for value, taken in cases:
            assert grammar.accepts(json.dumps(value).encode()) == taken, value
        assert not grammar.accepts(b"[1,1.0]")
        state = grammar.read(grammar.start, b'["a","b",')
        assert grammar.read(state, b'"a') and not grammar.read(state, b'"b')  # "ab" is still to come; "b" is done
        assert not grammar.read(grammar.start, b'["a","ab","b",1,true,')  # nothing left to write

    @pytest.mark.parametrize(
        ("schema", "taken", "refused"),
        [
            # Pydantic's tuple[int, str]
            ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "minItems": 2, "maxItems": 2},
             [[1, "a"]], [[1], [1, "a", 2], ["a", 1], []]),
            ({"prefixItems": [{"type": "integer"}], "items": False}, [[], [3]], [[3, 4], ["x"]]),
            ({"prefixItems": [{"type": "boolean"}], "items": {"type": "null"}, "minItems": 1},
             [[True], [False, None, None]], [[], [None], [True, 1]]),
            ({"prefixItems": [{"const": 1}, {"const": 2}], "minItems": 1}, [[1], [1, 2], [1, 2, "any"]], [[2], [1, 3]]),
            # Pydantic's dict[Literal["a", "b"], int]
            ({"type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"enum": ["a", "b"]}},
             [{}, {"a": 1}, {"b": 2, "a": 1}], [{"c": 1}, {"a": "1"}]),
            # Pydantic's dict[Annotated[str, StringConstraints(pattern="^x")], int]
            ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, [{}, {"x": 1, "xy": 2}],
             [{"y": 1}, {"x": None}]),
            # Pydantic's Annotated[dict[str, int], Field(max_length=2)]
            ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
             [{}, {"a": 1, "b": 2}], [{"a": 1, "b": 2, "c": 3}]),
            ({"propertyNames": {"maxLength": 2}, "maxProperties": 0}, [{}], [{"a": 1}]),
        ],
    )  # fmt: skip
    def test_tuples_and_keys_of_open_objects(self, schema, taken, refused):
        grammar = JsonGrammar(schema)
        for value in taken:
            assert grammar.accepts(json.dumps(value).encode()), value
        for value in refused:
            assert not grammar.accepts(json.dumps(value).encode()), value

    def test_open_and_closed_objects(self):
        assert JsonGrammar({"type": "object", "additionalProperties": {"type": "integer"}}).accepts(b'{"a":1,"b":2}')
        assert not JsonGrammar({"type": "object", "additionalProperties": {"type": "integer"}}).accepts(b'{"a":"1"}')
        closed = JsonGrammar({"type": "object", "additionalProperties": False})
        assert closed.accepts(b"{}") and not closed.accepts(b'{"a":1}')

    @pytest.mark.parametrize(
        ("schema", "said"),
        [
            ({"not": {"type": "integer"}}, "'not'"),
            ({"type": "integer", "multipleOf": 0}, "above 0"),
            ({"type": "integer", "multipleOf": 4, "minimum": 1, "maximum": 3}, "a multiple"),
            ({"type": "object", "minProperties": 1}, "'minProperties'"),
            ({"properties": {"a": {}}, "propertyNames": {"maxLength": 1}}, "held only without properties"),
            ({"patternProperties": {"^a": {}, "^b": {}}}, "one pattern"),
            ({"propertyNames": {"type": "integer"}}, "allows no string"),
            ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems is held only"),
            ({"prefixItems": [{"const": 1}], "items": {"const": 2}, "uniqueItems": True}, "uniqueItems is held only"),
            ({"items": {"enum": [1, 1.0, 2]}, "uniqueItems": True, "minItems": 3}, "distinct values"),
            ({"items": {"enum": [1]}, "uniqueItems": "yes"}, "true or false"),
            ({"type": "string", "pattern": "a(?=b)"}, "lookaround"),
            ({"type": "string", "pattern": "(a)\\1"}, "backreference"),
            ({"type": "string", "pattern": "\\bword"}, "word boundar"),
            ({"type": "string", "pattern": "a^b"}, "'\\^'"),
            ({"type": "string", "pattern": "[a-"}, "unclosed"),
            ({"type": "string", "pattern": "[z-a]"}, "out of order"),
            ({"type": "string", "pattern": "a{3,2}"}, "out of order"),
            ({"type": "string", "pattern": "*a"}, "nothing to repeat"),
            ({"type": "string", "pattern": "[0-9]{5000}"}, "positions"),
            ({"type": "string", "pattern": "^[a-z]{0,2000}$", "maxLength": 3000}, "too large to hold"),
            ({"properties": {k: {"pattern": f"^[{k}]{{0,3000}}$"} for k in "abc"}}, "patterns need more than"),
            ({"type": "string", "pattern": 5}, "must be a string"),
            ({"type": "string", "pattern": "^a$", "minLength": 2}, "no string"),
            ({"type": "string", "minLength": 3, "maxLength": 2}, "maxLength is below"),
            ({"type": "string", "maxLength": MAX_LENGTH + 1}, "lengths above"),
            ({"type": "integer", "minimum": 1.5, "maximum": 1.9}, "no number"),
            ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "no number"),
            ({"type": "number", "minimum": "1"}, "finite number"),
            ({"type": "string", "enum": ["ab", "c"], "minLength": 3}, "no value of its enum"),
            ({"type": "date"}, "'date'"),
            ({"enum": []}, "non-empty"),
            ({"items": {"enum": [float("inf")]}, "uniqueItems": True}, "must be JSON"),
            ({"const": {1, 2}}, "must be JSON"),
            ({"$ref": "#/$defs/Nope"}, "names no definition"),
            ({"$ref": "http://example.com/schema"}, "must be"),
            ({"type": "object", "required": ["a"]}, "need properties"),
            ({"properties": {"a": {}}, "required": ["b"]}, "'b'"),
            ({"allOf": [{}, {}]}, "allOf"),
            ({"type": "array", "minItems": 3, "maxItems": 2}, "maxItems"),
            ({"prefixItems": [{}], "items": False, "minItems": 2}, "beyond prefixItems"),
            (False, "must be an object"),
            ({"properties": {"a": 5}}, "schema.a must be an object"),
        ],
    )
    def test_what_it_cannot_hold_text_to_is_refused(self, schema, said):
        with pytest.raises(SchemaNotSupported, match=said):
            JsonGrammar(schema)


def _one_key(value: int) -> dict:
    return {"type": "object", "properties": {"a": {"const": value}}, "required": ["a"]}


class TestBounds:
    """What one byte may cost is bounded: the schema's size, the readings at once."""

    def test_an_enum_of_many_values_is_read_as_one_way(self):
        """An enum's values, however many, are one reading (a range of them
        sorted), also where one is a prefix of another."""
        values = [f"v{i}" for i in range(3000)] + [1, 12, 123, True, None]
        grammar = JsonGrammar({"enum": values})
        for value in (*values[:5], "v2999", 1, 12, 123, True, None):
            assert grammar.accepts(json.dumps(value).encode()), value
        for text in (b'"v3000"', b'"v"', b"2", b"1234", b"false", b'"v1'):
            assert not grammar.accepts(text)
        assert len(grammar.read(grammar.start, b'"v1')) == 1
        assert grammar.complete(grammar.read(grammar.start, b"12")) and grammar.read(grammar.start, b"123")

    def test_many_optional_keys_are_read_as_one_way(self):
        """The keys that may come next, however many, are one reading too."""
        many = {"type": "object", "properties": {f"key{i}": {"type": "integer"} for i in range(1000)}}
        grammar = JsonGrammar(many)
        assert len(grammar.read(grammar.start, b'{"key')) == 1
        assert grammar.accepts(b'{"key5":1,"key999":2}') and grammar.accepts(b'{"key1":1,"key10":2,"key100":3}')
        assert not grammar.accepts(b'{"key10":1,"key1":2}')  # in their order
        assert not grammar.accepts(b'{"key1000":1}')

    def test_a_schema_too_large_is_refused(self):
        with pytest.raises(SchemaNotSupported, match="more than"):
            JsonGrammar({"enum": list(range(MAX_SCHEMA_PARTS + 1))})
        wide = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(MAX_SCHEMA_PARTS)}}
        with pytest.raises(SchemaNotSupported, match="more than"):
            JsonGrammar(wide)
        JsonGrammar({"enum": list(range(MAX_SCHEMA_PARTS - 1))})  # just within

    def test_alternatives_too_alike_fail_as_the_text_reveals_them(self):
        """Alike alternatives are read side by side until the text tells
        them apart; past ``MAX_WAYS`` readings at once the read fails --
        at once for many alike strings, at a depth for arrays that recurse
        two ways."""
        alike = JsonGrammar({"anyOf": [_one_key(i) for i in range(MAX_WAYS + 1)]})
        with pytest.raises(GrammarTooAmbiguous):
            alike.read(alike.start, b"{")
        assert JsonGrammar({"anyOf": [_one_key(i) for i in range(MAX_WAYS)]}).accepts(b'{"a":7}')
        twice = JsonGrammar({"anyOf": [{"type": "array", "items": {"$ref": "#"}}] * 2})
        assert twice.accepts(b"[[[]]]")
        with pytest.raises(GrammarTooAmbiguous):
            twice.read(twice.start, b"[" * 12)


class TestAround:
    """Text before and after the value, and a reasoning block before it all."""

    def test_markers_are_written_as_given(self):
        grammar = JsonGrammar({"type": "object"}, before=b"<tool_call>\n", after=b"\n</tool_call>")
        assert grammar.accepts(b'<tool_call>\n{"a":1}\n</tool_call>')
        for text in (b"{}", b"<tool_call>\n{}", b"<tool_call>{}\n</tool_call>", b"<tool_call>\n{}\n</tool_call>\n"):
            assert not grammar.accepts(text)
        number = JsonGrammar({"type": "number"}, before=b"<", after=b">")
        assert number.accepts(b"<12>") and not number.complete(number.read(number.start, b"<12"))

    @pytest.mark.parametrize(
        ("text", "opened", "taken"),
        [
            (b"{}", False, True),
            (b"<think>a < </th </thin</think>\n\n{}", False, True),
            (b"<think>\xff\x00 any bytes</think>{}", False, True),
            (b"<think>done</think>", False, False),  # the value is still to come
            (b"<think>x</think>" + b" " * (MAX_WHITESPACE + 1) + b"{}", False, False),
            (b"x<think></think>{}", False, False),
            (b"{}", True, False),  # inside a block: it must end first
            (b"still thinking</think>\n{}", True, True),
            (b"<</think>{}", True, True),
            (b"</think>{}</think>", True, False),
        ],
    )
    def test_a_reasoning_block_comes_first(self, text, opened, taken):
        grammar = JsonGrammar({"type": "object"}, reasoning=(b"<think>", b"</think>"), reasoning_opened=opened)
        assert grammar.accepts(text) == taken

    def test_the_block_is_free_text_up_to_its_marker(self):
        grammar = JsonGrammar({"type": "object"}, reasoning=(b"<think>", b"</think>"), reasoning_opened=True)
        state = grammar.read(grammar.start, b"some text")
        assert grammar.in_free_text(state) == (b"</think>", 0)
        assert grammar.in_free_text(grammar.read(state, b"a</th")) == (b"</think>", 4)  # part of the marker written
        assert grammar.in_free_text(grammar.read(state, b"</think>")) is None
        assert grammar.read(grammar.after_free_text(state), b"{}") and grammar.complete(
            grammar.read(grammar.after_free_text(state), b"\n{}")
        )


class TestLiveness:
    @pytest.mark.parametrize(
        "schema",
        [
            {}, {"type": "object"}, PERSON,
            {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 3},
            {"prefixItems": [{"type": "string"}, {"enum": [1, 2]}], "items": {"type": "boolean"}, "minItems": 3},
            {"type": "array", "items": {"enum": ["x", "xy", "y", 1, 1.0, True]}, "uniqueItems": True, "minItems": 1},
            {"items": {"type": ["boolean", "null"]}, "uniqueItems": True, "maxItems": 2},
        ],
    )
    def test_every_state_reached_goes_on_or_is_whole(self, schema):
        """Random walks over the bytes each state allows: none gets stuck,
        and every walk that ends where the value is whole is JSON the
        schema allows (checked against the schema's own reading too)."""
        grammar = JsonGrammar(schema)
        finished = 0
        for text in walked_texts(grammar, random.Random(0), 60, 300):
            finished += 1
            value = json.loads(text.decode("utf-8"))
            assert grammar.accepts(text)
            jsonschema.validate(value, schema)
            if schema is PERSON:
                assert list(value)[:2] == ["name", "age"]
        assert finished >= 20


def schemas(depth: int = 2) -> st.SearchStrategy:
    """Random schemas of the subset, strings ruled and numbers bounded now and then."""
    string = st.fixed_dictionaries(
        {"type": st.just("string")},
        optional={
            "pattern": st.sampled_from(["^[a-c]*$", "^x|y$", "b", "^(ab)+$", "^[^a]{1,3}$"]),
            "minLength": st.integers(0, 2), "maxLength": st.integers(2, 5),
            "format": st.sampled_from(["date", "uuid", "email"]),
        },
    )  # fmt: skip
    number = st.fixed_dictionaries(
        {"type": st.sampled_from(["number", "integer"])},
        optional={
            "minimum": st.sampled_from([-3, 0, 0.5, 10]), "maximum": st.sampled_from([1, 2.5, 12, 100]),
            "exclusiveMinimum": st.sampled_from([-1, 0]), "exclusiveMaximum": st.sampled_from([5, 200]),
            "multipleOf": st.sampled_from([2, 0.5, 3]),
        },
    )  # fmt: skip
    leaf = st.one_of(
        string, number, st.just({"type": "boolean"}), st.just({"type": "null"}), st.just({}),
        st.builds(lambda v: {"enum": v}, st.lists(st.sampled_from(["a", "b", 1, 2.0, None, True]), min_size=1)),
    )  # fmt: skip
    if depth == 0:
        return leaf
    child = schemas(depth - 1)
    array = st.fixed_dictionaries(
        {"type": st.just("array"), "items": child},
        optional={
            "minItems": st.integers(0, 2), "maxItems": st.integers(2, 4),
            "prefixItems": st.lists(child, min_size=1, max_size=2),
        },
    )  # fmt: skip
    unique = st.builds(
        lambda values, low: {"type": "array", "items": {"enum": values}, "uniqueItems": True, "minItems": low},
        st.lists(st.sampled_from(["a", "ab", 1, 1.0, True, None]), min_size=1), st.integers(0, 1),
    )  # fmt: skip
    record = st.builds(
        lambda properties, required: {
            "type": "object", "properties": properties, "required": [k for k in properties if k in required],
        },
        st.dictionaries(st.sampled_from(["a", "b", "ab"]), child, max_size=3), st.sets(st.sampled_from(["a", "b"])),
    )  # fmt: skip
    mapping = st.fixed_dictionaries(
        {"type": st.just("object"), "additionalProperties": child},
        optional={
            "propertyNames": st.sampled_from([{"enum": ["a", "b"]}, {"pattern": "^[ab]+$", "maxLength": 2}]),
            "maxProperties": st.integers(0, 2),
        },
    )  # fmt: skip
    patterned = st.builds(lambda value: {"type": "object", "patternProperties": {"^k": value}}, child)
    alternatives = st.builds(lambda parts: {"anyOf": parts}, st.lists(child, min_size=1, max_size=3))
    return st.one_of(leaf, array, unique, record, mapping, patterned, alternatives)


class TestRandomSchemas:
    @given(schemas(), st.integers(0, 2**16))
    @settings(max_examples=150, deadline=None)
    def test_every_walk_goes_on_and_ends_in_a_value_the_schema_allows(self, schema, seed):
        """Over random schemas of the subset: no state reached is stuck,
        and every whole text is JSON the reference validator takes (the
        formats it does not check aside)."""
        try:
            grammar = JsonGrammar(schema)
        except SchemaNotSupported:
            return  # a schema no value satisfies (bounds, lengths and patterns at odds)
        for text in walked_texts(grammar, random.Random(seed), 8, 200, stop=0.5, close=0.5):
            jsonschema.validate(json.loads(text.decode("utf-8")), schema)
