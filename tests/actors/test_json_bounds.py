"""Number bounds (``minimum``, ``maximum``, exclusive or not, ``multipleOf``)
against exact fractions: a number is taken exactly when it is within them,
and every prefix a walk reaches can still end within them."""

from __future__ import annotations

import json
import random
import re
from fractions import Fraction

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxkv.actors.json_bounds import NumberBounds
from mlxkv.actors.json_grammar import JsonGrammar

numbers = st.one_of(
    st.integers(-2000, 2000).map(str),
    st.decimals(min_value=-2000, max_value=2000, places=3, allow_nan=False).map(str),
    st.sampled_from(["-0", "0.0", "1e2", "-1.5E-3", "10", "100.", "0.1", "-0.10"]),
)
bound_values = st.one_of(st.none(), st.integers(-150, 150), st.sampled_from([0.5, -0.25, 1.0, 99.9, 1000]))


class TestNumberBounds:
    @given(text=numbers, low=bound_values, high=bound_values, low_open=st.booleans(), high_open=st.booleans(),
           integer=st.booleans(), multiple=st.sampled_from([None, None, 3, 0.5, 0.25, 2.5]))  # fmt: skip
    @settings(max_examples=500, deadline=None)
    def test_a_number_is_taken_exactly_when_within_bounds(
        self, text, low, high, low_open, high_open, integer, multiple
    ):
        schema = {"type": "integer" if integer else "number"}
        if multiple is not None:
            schema["multipleOf"] = multiple
        for key, value, is_open in (("minimum", low, low_open), ("maximum", high, high_open)):
            if value is not None:
                schema[("exclusiveM" + key[1:]) if is_open else key] = value
        try:
            grammar = JsonGrammar(schema)
        except ValueError:
            return  # an empty range; checked elsewhere
        try:
            value = Fraction(text)
        except ValueError:
            value = None
        # A bounded number is written without an exponent; any other as JSON writes it.
        exponent = "" if low is not None or high is not None or multiple else r"([eE][+-]?[0-9]+)?"
        written = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?" + exponent
        inside = re.fullmatch(written, text) is not None and not (integer and re.search("[.eE]", text))
        if inside and low is not None:
            inside = value > Fraction(repr(low)) if low_open else value >= Fraction(repr(low))
        if inside and high is not None:
            inside = value < Fraction(repr(high)) if high_open else value <= Fraction(repr(high))
        if inside and multiple is not None:
            inside = (value / Fraction(repr(multiple))).denominator == 1
        assert grammar.accepts(text.encode()) == inside
        if inside:
            jsonschema.validate(json.loads(text), schema)

    @pytest.mark.parametrize(
        "bounds",
        [(0, False, 1, False), (-5, True, None, False), (None, False, -3, True), (0.25, False, 0.75, True),
         (100, False, 1000, False), (100, False, 150, True)],
    )  # fmt: skip
    @pytest.mark.parametrize("integer", [False, True])
    @pytest.mark.parametrize("multiple", [None, 0.25, 7])
    def test_every_prefix_reached_can_still_end_within_bounds(self, bounds, integer, multiple):
        low, low_open, high, high_open = bounds
        try:
            rule = NumberBounds(low, low_open, high, high_open, integer=integer, multiple=multiple)
        except ValueError:
            assert integer or multiple == 7  # (0.25, 0.75) holds no integer, nor (0, 1] a multiple of 7
            return
        grammar = JsonGrammar({"type": "array", "items": {"type": "integer" if integer else "number"}})
        grammar.root.items.bounds = rule  # the same node, bounded (as the schema's keywords make it)
        rng = random.Random(1)
        for _ in range(100):
            state, text = grammar.read(grammar.start, b"["), b""
            for _ in range(12):
                nexts = [b for b in b"-0123456789." if grammar.step(state, b)]
                ends = grammar.step(state, ord("]"))
                assert nexts or ends, text
                if ends and text and (not nexts or rng.random() < 0.3):
                    break
                byte = rng.choice(nexts)
                state, text = grammar.step(state, byte), text + bytes([byte])
            else:
                continue
            value = Fraction(text.decode())
            assert multiple is None or (value / Fraction(repr(multiple))).denominator == 1
            assert (low is None or value > Fraction(repr(low)) or (value == Fraction(repr(low)) and not low_open))
            assert (high is None or value < Fraction(repr(high)) or (value == Fraction(repr(high)) and not high_open))
