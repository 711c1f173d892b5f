"""Penalties and a logit bias: settings checked, and only the rows that ask adjusted
(:mod:`mlxkv.actors.penalties`; against mlx-lm's decoding in ``test_compute.py``)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxkv.actors.penalties import NO_PENALTIES, LogitsAdjuster, Penalties, adjust_rows
from mlxkv.cache.errors import InvalidInput


class TestSettings:
    @pytest.mark.parametrize(
        ("fields", "argument"),
        [
            ({"presence_penalty": 2.5}, "presence_penalty"),
            ({"frequency_penalty": -2.01}, "frequency_penalty"),
            ({"presence_penalty": float("nan")}, "presence_penalty"),
            ({"frequency_penalty": True}, "frequency_penalty"),
            ({"repetition_penalty": 0.0}, "repetition_penalty"),
            ({"repetition_penalty": 2.5}, "repetition_penalty"),
            ({"logit_bias": {"5": 1.0}}, "logit_bias"),
            ({"logit_bias": {-1: 1.0}}, "logit_bias"),
            ({"logit_bias": {5: 100.5}}, "logit_bias"),
            ({"logit_bias": {5: float("inf")}}, "logit_bias"),
            ({"logit_bias": [(5, 1.0), (5, 2.0)]}, "logit_bias"),
            ({"logit_bias": 5}, "logit_bias"),
        ],
    )
    def test_a_bad_setting_is_refused_by_name(self, fields, argument):
        with pytest.raises(InvalidInput) as info:
            Penalties(**fields)
        assert info.value.argument == argument

    def test_what_is_active(self):
        assert not NO_PENALTIES.active and not Penalties(repetition_penalty=1, logit_bias={}).active
        assert all(
            p.active
            for p in (Penalties(presence_penalty=0.1), Penalties(frequency_penalty=-0.1),
                      Penalties(repetition_penalty=1.1), Penalties(logit_bias={3: 0.0}))
        )  # fmt: skip
        assert Penalties(logit_bias={9: 1, 2: -1}).logit_bias == ((2, -1.0), (9, 1.0))

    def test_a_bias_past_the_vocabulary_is_refused(self):
        Penalties(logit_bias={9: 1.0}).check_vocabulary(10)
        with pytest.raises(InvalidInput, match="past the vocabulary of 10"):
            Penalties(logit_bias={10: 1.0}).check_vocabulary(10)


class TestAdjustRows:
    def test_only_the_rows_that_ask_change(self):
        """Rows without an adjuster keep their logits bit for bit; none at all:
        the same array."""
        logits = mx.array(np.random.default_rng(0).normal(size=(3, 12)).astype(np.float32))
        assert adjust_rows(logits, [None, None, None]) is logits
        adjuster = LogitsAdjuster(Penalties(logit_bias={4: 3.0}, presence_penalty=1.0), prompt=[1, 2])
        adjuster.fed(mx.array([6], dtype=mx.uint32))
        out = np.array(adjust_rows(logits, [None, adjuster, None]))
        original = np.array(logits)
        np.testing.assert_array_equal(out[[0, 2]], original[[0, 2]])
        expected = original[1].copy()
        expected[4] += 3.0
        expected[6] -= 1.0
        np.testing.assert_allclose(out[1], expected, rtol=0, atol=1e-6)

    def test_half_precision_logits_stay_half(self):
        logits = mx.zeros((2, 8), dtype=mx.bfloat16)
        adjuster = LogitsAdjuster(Penalties(frequency_penalty=0.5), prompt=[1])
        assert adjust_rows(logits, [adjuster, None]).dtype == mx.bfloat16


def _numpy_rule(row: np.ndarray, penalties: Penalties, prompt: list[int], generated: list[int]) -> np.ndarray:
    """The module docstring's rule, in NumPy."""
    row = row.astype(np.float64).copy()
    for token, bias in penalties.logit_bias:
        row[token] += bias
    seen = sorted(set(prompt) | set(generated))
    r = penalties.repetition_penalty
    row[seen] = np.where(row[seen] > 0, row[seen] / r, row[seen] * r)
    counts = np.bincount(np.array(generated, dtype=np.int64), minlength=row.size)
    return row - penalties.presence_penalty * (counts > 0) - penalties.frequency_penalty * counts


@settings(max_examples=80, deadline=None)
@given(
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
    repetition=st.floats(0.05, 2),
    bias=st.dictionaries(st.integers(0, 15), st.floats(-100, 100), max_size=4),
    prompt=st.lists(st.integers(0, 15), min_size=1, max_size=8),
    generated=st.lists(st.integers(0, 15), max_size=12),
    seed=st.integers(0, 2**16),
)
def test_each_step_follows_the_rule(presence, frequency, repetition, bias, prompt, generated, seed):
    """After any tokens fed (some before the first step, as a prefill's first
    token is), each step's adjusted logits are the rule's over the prompt and
    the tokens fed so far."""
    penalties = Penalties(
        presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition, logit_bias=bias
    )
    adjuster = LogitsAdjuster(penalties, prompt)
    rng = np.random.default_rng(seed)
    fed: list[int] = []
    for step, token in enumerate([None, *generated]):
        if token is not None:
            adjuster.fed(mx.array([token], dtype=mx.uint32))
            fed.append(token)
        if step % 3 == 2 or step == len(generated):
            row = rng.normal(scale=3.0, size=16).astype(np.float32)
            got = np.array(adjuster.adjust(mx.array(row)))
            np.testing.assert_allclose(got, _numpy_rule(row, penalties, prompt, fed), rtol=1e-5, atol=1e-4)
