"""String rules (``pattern``, ``minLength``/``maxLength``, held formats)
against the definitions: Python's ``re`` for the patterns (for the syntax
both read alike), ``len`` for lengths, Python's own parsers for the formats;
and liveness: from every state a rule reaches, some text still completes it
(number bounds: ``test_json_bounds.py``).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import random
import re
import uuid

import jsonschema
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxkv.actors.json_grammar import FORMATS, JsonGrammar
from mlxkv.actors.json_pattern import StringRule, utf8_sequences

from json_walks import walked_texts

ALPHABET = 'ab-_ 9Z.\n\t"\\é中😀'

# Patterns Python reads as ECMAScript does (with re.ASCII, over ALPHABET).
PATTERNS = [
    "a", "^a", "a$", "^a$", "^$", "ab|b", "^(ab|b)+$", "^a*b?$", "^[a-z]{2,3}$", "^[^a-z]*$", "^\\d+(\\.\\d+)?$",
    "^\\w+$", "^\\W*$", "\\s", "^\\S+$", "^.{2}$", "^[\\s\\S]*中", "😀{2}", "^(?:a|(b))[.-]?$", "^(?<x>a)b*?$",
    "^a{2,}$", "^a{0,2}b{1}$", "^[-a]+$", "^[a-]+$", "^[\\]\"\\\\]+$", "^\\u4e2d$", "^\\x61+$", "^[é-😀]+$",
    "^a|b$", "^\\.$", "^\\\\$", "^[^\\n]*$", "{", "^\\t\\n$",
]  # fmt: skip


def python_pattern(pattern: str) -> str:
    """``$`` ends the text in ECMAScript (in Python it also matches before a
    final newline); a group's name is written ``(?P<name>`` in Python."""
    return re.sub(r"(?<!\\)((?:\\\\)*)\$(?=$|\|)", r"\1\\Z", pattern).replace("(?<", "(?P<")


texts = st.text(alphabet=ALPHABET, max_size=8)


class TestUtf8:
    @given(st.integers(0, 0x10FFFF), st.integers(0, 3000))
    @settings(max_examples=200, deadline=None)
    def test_sequences_encode_exactly_the_range(self, low, width):
        high = min(low + width, 0x10FFFF)
        expected = {chr(c).encode() for c in range(low, high + 1) if not 0xD800 <= c <= 0xDFFF}
        got = set()
        for sequence in utf8_sequences(low, high):
            encoded = [b""]
            for byte_low, byte_high in sequence:
                encoded = [e + bytes([b]) for e in encoded for b in range(byte_low, byte_high + 1)]
            got.update(encoded)
        assert got == expected

    def test_every_code_point_once(self):
        total = 0
        for sequence in utf8_sequences(0, 0x10FFFF):
            count = 1
            for byte_low, byte_high in sequence:
                count *= byte_high - byte_low + 1
            total += count
        assert total == 0x110000 - 0x800  # no surrogates


class TestPatterns:
    @pytest.mark.parametrize("pattern", PATTERNS)
    @given(text=texts)
    @settings(max_examples=60, deadline=None)
    def test_a_pattern_matches_as_ecmascript_does(self, pattern, text):
        expected = re.search(python_pattern(pattern), text, re.ASCII) is not None
        assert StringRule(pattern).matches(text) == expected

    def test_a_brace_that_is_no_repetition_is_itself(self):
        rule = StringRule("^a{,2}$")  # ECMAScript: not a repetition (Python's re reads {0,2})
        assert rule.matches("a{,2}") and not rule.matches("aa")

    def test_dot_leaves_out_every_line_terminator(self):
        rule = StringRule("^.$")
        assert [rule.matches(c) for c in "a\n\r\u2028\u2029\u0085"] == [True, False, False, False, False, True]

    def test_space_is_ecmascripts(self):
        rule = StringRule("^\\s+$")
        assert rule.matches(" \t\n\v\f\r\u00a0\u2003\u3000\ufeff") and not rule.matches("\x1c")

    @pytest.mark.parametrize("pattern", [None, "^[a-c]*$", "^(ab)+", "é"])
    @given(text=texts, low=st.integers(0, 4), span=st.one_of(st.none(), st.integers(0, 4)))
    @settings(max_examples=60, deadline=None)
    def test_lengths_are_code_points(self, pattern, text, low, span):
        high = None if span is None else low + span
        try:
            rule = StringRule(pattern, low, high)
        except ValueError:  # nothing satisfies both: checked below
            assert not any(
                StringRule(pattern).matches(t) and low <= len(t) <= (high if high is not None else 99)
                for t in ("", "a", "ab", "abab", "éé", "ababab", "abcabc")
            )
            return
        matched = pattern is None or re.search(python_pattern(pattern), text) is not None
        assert rule.matches(text) == (matched and low <= len(text) and (high is None or len(text) <= high))

    @pytest.mark.parametrize(
        ("pattern", "low", "high"),
        [("^a+b$", 0, None), ("^(ab|c)*$", 3, 5), (None, 2, 3), ("^[é😀]{2,5}$", 3, None), ("x", 0, 4)],
    )
    def test_every_state_reached_can_still_end(self, pattern, low, high):
        """Breadth first from the start over every byte: each state reached
        reaches a complete one (searched a few bytes deep)."""
        rule = StringRule(pattern, low, high)
        frontier, seen = [rule.start], {rule.start}
        for _ in range(6):
            following = []
            for state in frontier:
                assert _completes(rule, state, 16), state
                for byte in range(256):
                    after = rule.step(state, byte)
                    if after is not None and after not in seen:
                        seen.add(after)
                        following.append(after)
            frontier = following[:200]


def _completes(rule: StringRule, state, depth: int) -> bool:
    if rule.complete(state):
        return True
    if depth == 0:
        return False
    return any(
        _completes(rule, after, depth - 1)
        for after in {rule.step(state, byte) for byte in b"abcx\xc3\xa9\xf0\x9f\x98\x80"} - {None}
    )


class TestStringsInJson:
    """A ruled string's JSON text: its escapes written as json.dumps writes
    them, its characters read by the rule."""

    @pytest.mark.parametrize("pattern", ["^[a-z\\s]*$", '^[^"]*$', "^.{0,3}$", "中", '"\\\\'])
    @given(text=texts)
    @settings(max_examples=60, deadline=None)
    def test_written_with_or_without_escapes(self, pattern, text):
        grammar = JsonGrammar({"type": "string", "pattern": pattern, "maxLength": 6})
        expected = re.search(python_pattern(pattern), text, re.ASCII) is not None and len(text) <= 6
        for written in (json.dumps(text), json.dumps(text, ensure_ascii=False)):
            assert grammar.accepts(written.encode()) == expected, written

    def test_escapes_that_write_nothing_it_takes_are_refused_at_once(self):
        grammar = JsonGrammar({"type": "string", "pattern": "^[a-c]+$"})
        start = grammar.read(grammar.start, b'"')
        assert grammar.read(start, b"\\u006")  # u+0060-u+006f holds a-c
        assert not grammar.read(start, b"\\u007")
        assert not grammar.read(start, b"\\n")
        assert grammar.accepts(b'"\\u0061b"')
        assert not grammar.read(start, b"\\ud8")  # a pair writes past U+FFFF: no a-c there
        assert not grammar.read(start, b"\x01")  # control bytes are never raw

    def test_a_surrogate_pair_writes_one_character(self):
        grammar = JsonGrammar({"type": "string", "pattern": "^.$"})
        assert grammar.accepts(b'"\\ud83d\\ude00"') and grammar.accepts('"😀"'.encode())
        assert not grammar.accepts(b'"\\ud83d"') and not grammar.accepts(b'"\\ude00"')
        assert not grammar.accepts(b'"\\ud83d\\u0041"') and not grammar.accepts(b'"\\ud83d\\ud83d"')
        emoji = JsonGrammar({"type": "string", "pattern": "^[😀-😂]$"})
        start = emoji.read(emoji.start, b'"')
        assert emoji.read(start, b"\\ud83d\\ude0") and not emoji.read(start, b"\\ud83d\\ude1")
        assert not emoji.read(start, b"\\ud83c")

    @pytest.mark.parametrize(
        ("name", "good", "bad"),
        [
            ("date", ["2024-02-29", "2000-02-29", "0001-01-01", "1999-12-31"],
             ["1900-02-29", "2023-02-29", "2024-04-31", "2024-13-01", "0000-01-01", "24-01-01", "2024-1-01"]),
            ("time", ["23:59:59Z", "00:00:00.123456+05:30", "12:00:00-00:00"],
             ["24:00:00Z", "12:00:00", "12:00:60Z", "12:00:00.1234567Z", "12:00:00+24:00"]),
            ("date-time", ["2024-02-29T12:30:00Z", "1999-12-31T23:59:59.5+01:00"],
             ["2024-02-29 12:30:00Z", "2024-02-29T12:30:00", "2024-02-30T12:30:00Z"]),
            ("uuid", [str(uuid.UUID(int=7)), "A987FBC9-4BED-3078-CF07-9141BA07C9F3"],
             ["a987fbc94bed3078cf079141ba07c9f3", "a987fbc9-4bed-3078-cf07-9141ba07c9f",
              "g987fbc9-4bed-3078-cf07-9141ba07c9f3"]),
            ("ipv4", ["0.0.0.0", "255.255.255.255", "10.2.30.4"], ["256.0.0.1", "01.2.3.4", "1.2.3", "1.2.3.4.5"]),
            ("duration", ["P1D", "PT2H30M", "P1Y2M3DT4H5M6S", "P3W", "PT0S", "P1M"],
             ["P", "PT", "P1H", "P1DT", "P1W2D", "PT1S2M", "1D", "P-1D"]),
        ],
    )  # fmt: skip
    def test_formats_are_held(self, name, good, bad):
        assert JsonGrammar({"type": "string", "format": [name]}).accepts(b'"x"')  # no format's name: an annotation
        grammar = JsonGrammar({"type": "string", "format": name})
        for text in good:
            assert grammar.accepts(json.dumps(text).encode()), text
        for text in bad:
            assert not grammar.accepts(json.dumps(text).encode()), text

    @given(st.dates(), st.times(), st.timezones())
    @settings(max_examples=200, deadline=None)
    def test_what_python_writes_is_taken_and_what_is_taken_python_reads(self, day, time, zone):
        moment = datetime.datetime.combine(day, time, tzinfo=zone)
        if moment.utcoffset() is None or moment.utcoffset().seconds % 60:
            return
        text = moment.isoformat()
        assert JsonGrammar({"format": "date-time", "type": "string"}).accepts(json.dumps(text).encode()), text
        assert JsonGrammar({"format": "date", "type": "string"}).accepts(json.dumps(day.isoformat()).encode())

    @pytest.mark.parametrize("name", sorted(FORMATS))
    def test_random_texts_of_a_format_are_ones_python_reads(self, name):
        rule = StringRule(FORMATS[name])
        read = {
            "date": datetime.date.fromisoformat,
            "time": lambda t: datetime.time.fromisoformat(t.replace("Z", "+00:00")),
            "date-time": lambda t: datetime.datetime.fromisoformat(t.replace("Z", "+00:00")),
            "uuid": uuid.UUID,
            "ipv4": ipaddress.IPv4Address,
            "duration": pydantic.TypeAdapter(datetime.timedelta).validate_python,
        }[name]
        rng = random.Random(0)
        for _ in range(200):
            read(_random_text(rule, rng))


def _random_text(rule: StringRule, rng: random.Random) -> str:
    """A random walk to a whole text the rule takes (over ASCII)."""
    state, text = rule.start, b""
    while True:
        nexts = [(byte, after) for byte in range(0x20, 0x7F) if (after := rule.step(state, byte)) is not None]
        if rule.complete(state) and (not nexts or rng.random() < 0.2):
            return text.decode()
        byte, state = rng.choice(nexts)
        text += bytes([byte])


SCHEMA = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
        "name": {"type": "string", "minLength": 1, "maxLength": 5},
        "day": {"type": "string", "format": "date"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 12},
        "level": {"enum": ["low", "high", 3, 40], "maxLength": 3, "maximum": 10},
    },
    "required": ["code", "name", "day", "score", "count"],
}


class TestInSchemas:
    def test_random_walks_end_in_values_the_schema_allows(self):
        """The liveness walk of the grammar's tests, over a schema whose
        every field is ruled or bounded; each whole text jsonschema reads
        as valid (and its date as a date)."""
        grammar = JsonGrammar(SCHEMA)
        finished = 0
        for text in walked_texts(grammar, random.Random(2), 40, 400, stop=1.0, close=0.5):
            finished += 1
            value = json.loads(text)
            jsonschema.validate(value, SCHEMA)
            datetime.date.fromisoformat(value["day"])
            assert value.get("level", "low") in ("low", 3)
        assert finished >= 30

    def test_an_enum_keeps_the_values_its_other_keywords_allow(self):
        grammar = JsonGrammar(SCHEMA["properties"]["level"])
        assert [grammar.accepts(json.dumps(v).encode()) for v in ("low", "high", 3, 40)] == [True, False, True, False]


def _regexes(depth: int = 2) -> st.SearchStrategy:
    """Random patterns of the syntax ECMAScript and Python (``re.ASCII``) read alike over ALPHABET."""
    atom = st.sampled_from(["a", "b", "-", "é", "中", "\\.", "\\d", "\\w", "\\s", "\\W", ".", "[ab]", "[^a]",
                            "[a-c9]", "[\\d-]", "[^\\s]", "\\u4e2d", "\\x61"])  # fmt: skip
    if depth:
        inner = _regexes(depth - 1)
        atom = atom | inner.map(lambda p: f"({p})") | inner.map(lambda p: f"(?:{p})")
    quantifier = st.sampled_from(["", "", "*", "+", "?", "{2}", "{1,2}", "{0,}", "*?", "+?"])
    piece = st.builds(lambda a, q: a + q, atom, quantifier)
    branch = st.lists(piece, min_size=1, max_size=3).map("".join)
    return st.lists(branch, min_size=1, max_size=2).map("|".join)


# One level of groups: deeper ones can make Python's backtracking ``re`` (the oracle) take minutes.
anchored = st.builds(lambda start, body, end: start + body + end, st.sampled_from(["", "^"]), _regexes(1),
                     st.sampled_from(["", "$"]))  # fmt: skip


class TestRandomPatterns:
    @given(anchored, st.lists(texts, min_size=4, max_size=4))
    @settings(max_examples=300, deadline=None)
    def test_a_random_pattern_matches_as_ecmascript_does(self, pattern, samples):
        rule = StringRule(pattern)
        for text in samples:
            expected = re.search(python_pattern(pattern), text, re.ASCII) is not None
            assert rule.matches(text) == expected, (pattern, text)
