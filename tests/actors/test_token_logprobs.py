"""A token's log-probability and alternatives, picked on the device (:mod:`mlxkv.actors.token_logprobs`)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxkv.actors.request import RequestSpec
from mlxkv.actors.token_logprobs import MAX_TOP_LOGPROBS, TokenLogprob, pick
from mlxkv.cache.errors import InvalidInput


def _log_softmax(rows: int, vocab: int, seed: int) -> np.ndarray:
    logits = np.random.default_rng(seed).normal(size=(rows, vocab)).astype(np.float32)
    # Some ties, which the records order by token id.
    logits[:, 1::7] = logits[:, :1]
    return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))


def _assert_record(record: TokenLogprob, row: np.ndarray, token: int, width: int) -> None:
    """``record`` is ``token``'s, with ``width`` of the most likely tokens of
    ``row`` (which of the tokens tied at the last place: any), most likely
    first, ties by id."""
    assert (record.token, record.logprob) == (token, float(row[token]))
    best = sorted(row.tolist(), reverse=True)[:width]
    assert [value for _, value in record.top] == best
    assert all(float(row[t]) == value for t, value in record.top)
    assert len({t for t, _ in record.top}) == width
    assert list(record.top) == sorted(record.top, key=lambda pair: (-pair[1], pair[0]))


def _read(logprobs: np.ndarray, tokens: list[int], widths: list) -> dict:
    picks = pick(mx.array(logprobs), mx.array(tokens, dtype=mx.uint32), widths, [f"r{i}" for i in range(len(widths))])
    if picks is None:
        return {}
    mx.eval(picks.arrays)
    return picks.read()


class TestPick:
    @settings(max_examples=60, deadline=None)
    @given(
        st.integers(1, 6).flatmap(
            lambda rows: st.tuples(
                st.just(rows),
                st.integers(1, 40),
                st.lists(st.one_of(st.none(), st.integers(0, MAX_TOP_LOGPROBS)), min_size=rows, max_size=rows),
                st.integers(0, 2**16),
            )
        )
    )
    def test_each_asking_row_gets_its_token_and_the_most_likely_ones(self, case):
        """Every row that asks gets its drawn token's log-probability and its
        ``k`` most likely tokens (most likely first, ties by id; fewer only for
        a vocabulary that small), whatever the others ask; no other row gets a
        record."""
        rows, vocab, widths, seed = case
        logprobs = _log_softmax(rows, vocab, seed)
        tokens = [int(t) for t in np.random.default_rng(seed + 1).integers(0, vocab, size=rows)]
        records = _read(logprobs, tokens, widths)
        assert set(records) == {f"r{i}" for i, width in enumerate(widths) if width is not None}
        for i, width in enumerate(widths):
            if width is not None:
                _assert_record(records[f"r{i}"], logprobs[i], tokens[i], min(width, vocab))

    def test_no_row_asking_queues_nothing(self):
        assert pick(mx.zeros((3, 5)), mx.zeros((3,), dtype=mx.uint32), [None] * 3, ["a", "b", "c"]) is None

    def test_half_precision_reads_as_floats(self):
        """A bfloat16 model's log-probabilities are read as Python floats."""
        logprobs = _log_softmax(2, 9, seed=3)
        picks = pick(mx.array(logprobs).astype(mx.bfloat16), mx.array([4, 0], dtype=mx.uint32), [2, 0], ["a", "b"])
        assert picks is not None
        mx.eval(picks.arrays)
        record = picks.read()["a"]
        assert record.token == 4 and isinstance(record.logprob, float)
        assert record.logprob == pytest.approx(float(logprobs[0, 4]), abs=0.05)
        assert [token for token, _ in record.top] == [int(i) for i in np.argsort(-logprobs[0], kind="stable")[:2]]
        assert picks.read()["b"].top == ()

    def test_read_once(self):
        """The records are read from the arrays once, whoever asks."""
        picks = pick(mx.array(_log_softmax(1, 4, seed=0)), mx.array([1], dtype=mx.uint32), [1], ["a"])
        assert picks is not None
        mx.eval(picks.arrays)
        assert picks.read() is picks.read()


class TestRequest:
    @pytest.mark.parametrize("value", [-1, MAX_TOP_LOGPROBS + 1, True, 1.5, "3"])
    def test_a_bad_width_is_refused(self, value):
        with pytest.raises(InvalidInput, match="top_logprobs"):
            RequestSpec(request_id="r", prompt=[1, 2], max_tokens=1, block_size=4, top_logprobs=value)

    @pytest.mark.parametrize("value", [None, 0, MAX_TOP_LOGPROBS])
    def test_a_good_width_is_taken(self, value):
        spec = RequestSpec(request_id="r", prompt=[1, 2], max_tokens=1, block_size=4, top_logprobs=value)
        assert spec.top_logprobs == value

    def test_a_prompts_records_need_the_whole_prompt_computed(self):
        """A request asking for its prompt's records is given no prefix to rebuild."""
        spec = RequestSpec(request_id="r", prompt=[1, 2, 3], max_tokens=1, block_size=2, prompt_logprobs=0)
        assert spec.prompt_logprobs == 0
        with pytest.raises(InvalidInput, match="must be empty"):
            RequestSpec(
                request_id="r", prompt=[1, 2, 3], max_tokens=1, block_size=2, prompt_logprobs=0, prefix=(_Block(2),)
            )


class _Block:
    """A prefix payload as RequestSpec sees one: where it ends."""

    def __init__(self, end: int) -> None:
        self.end = end
