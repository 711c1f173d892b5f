"""What every shared-prefix attention way lays a step out with: rows' spans,
masks, padding, and the work kept for a step's layers and a batch's steps."""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxkv.actors.attention_layout import (
    as_bias,
    is_additive,
    joined,
    leading,
    per_layout,
    per_step,
    positions_in,
    round_up,
    spans,
    suffix_mask,
    with_padded_queries,
    zeros,
)


def _segment(rows: list[int], lengths: list[int], size: int = 64) -> tuple[list[int], Any, Any, list[int]]:
    prefix = mx.zeros((1, 2, size, 4))
    return rows, prefix, prefix, lengths


class TestSpans:
    def test_rows_see_their_part_of_the_prefixes_laid_end_to_end(self):
        """Each segment's longest part is laid after the one before; a row's
        span starts where its segment does and is as long as its own part;
        a row in no segment sees nothing."""
        longests, low, high = spans(5, [_segment([3, 0], [40, 64]), _segment([1], [10])])
        assert longests == (64, 10)
        assert low == (0, 64, 0, 0, 0) and high == (64, 74, 0, 40, 0)

    def test_positions_in_an_order_with_empty_places(self):
        """Each row's place in an order; an empty place (-1) is no row's."""
        assert positions_in([2, 0, 1]) == [1, 2, 0]
        assert positions_in([1, -1, 0, -1], rows=2) == [2, 0]


class TestMasks:
    def test_a_causal_suffix_mask_sees_its_own_past(self):
        """``"causal"``: the last ``L`` of ``S`` positions each see the ones up
        to themselves; ``width`` past ``S`` is hidden; None sees everything."""
        mask = np.array(suffix_mask("causal", 2, 2, 4, width=6))
        assert mask.shape == (2, 1, 2, 6)
        assert mask[0, 0].tolist() == [[True, True, True, False, False, False], [True] * 4 + [False] * 2]
        assert np.array(suffix_mask(None, 1, 1, 3)).all()

    def test_a_boolean_mask_becomes_an_additive_one_in_the_dtype(self):
        """Visible 0, hidden -inf, in the queries' dtype; only such an array
        counts as additive."""
        visible = mx.array([[True, False]])
        bias = as_bias(visible, mx.bfloat16)
        assert bias.dtype == mx.bfloat16 and bias.tolist() == [[0.0, -float("inf")]]
        assert is_additive(bias) and not is_additive(visible) and not is_additive("causal") and not is_additive(None)

    def test_a_padded_query_sees_the_first_key_only(self):
        """Every query must see a key: a padded one sees the first."""
        visible = mx.array([[False, True, True]])
        padded = np.array(with_padded_queries(visible, 2, axis=0))
        assert padded.tolist() == [[False, True, True], [True, False, False], [True, False, False]]


class TestKeys:
    def test_leading_cuts_or_pads_with_zeros(self):
        """The first ``width`` positions; zeros past what there is; the array
        itself at its own width."""
        array = mx.arange(12, dtype=mx.float32).reshape(1, 1, 6, 2)
        assert leading(array, 6) is array
        assert leading(array, 2).tolist() == [[[[0.0, 1.0], [2.0, 3.0]]]]
        assert np.array(leading(array, 8))[0, 0, 6:].tolist() == [[0.0, 0.0], [0.0, 0.0]]

    def test_joined_leaves_out_empty_parts_and_copies_no_lone_one(self):
        """Parts laid end to end along the positions; a lone non-empty part is
        itself; zeros are a broadcast scalar in the dtype given."""
        part = mx.ones((1, 2, 3, 4))
        empty = zeros(part, (1, 2, 0, 4))
        assert joined([empty, part, empty]) is part
        both = joined([part, zeros(part, (1, 2, 5, 4))])
        assert both.shape == (1, 2, 8, 4) and both.dtype == part.dtype
        assert np.array(both)[:, :, 3:].sum() == 0

    @pytest.mark.parametrize("n, quantum, up", [(0, 32, 0), (1, 32, 32), (32, 32, 32), (257, 256, 512)])
    def test_round_up(self, n, quantum, up):
        """``n`` rounded up to a multiple of ``quantum``."""
        assert round_up(n, quantum) == up


class TestKept:
    def test_a_layout_is_made_once_while_the_rows_see_the_same(self):
        """Made again when the rows, the parts they see or the extra key
        change; another way's layout does not displace it."""
        made: list[int] = []

        def make() -> object:
            made.append(1)
            return object()

        first = per_layout("test-a", 3, [_segment([0, 2], [40, 64])], None, make)
        assert per_layout("test-a", 3, [_segment([0, 2], [40, 64])], None, make) is first
        per_layout("test-b", 3, [_segment([0, 2], [40, 64])], None, make)
        assert per_layout("test-a", 3, [_segment([0, 2], [40, 64])], None, make) is first
        assert len(made) == 2
        for changed in (
            (3, [_segment([0, 2], [41, 64])], None),
            (3, [_segment([2, 0], [40, 64])], None),
            (4, [_segment([0, 2], [40, 64])], None),
            (3, [_segment([0, 2], [40, 64])], "bfloat16"),
        ):
            assert per_layout("test-a", *changed, make) is not first
        assert len(made) == 6

    def test_a_steps_work_is_kept_for_the_same_mask_object_and_slot(self):
        """The same key and the same mask object give what was built; an equal
        mask that is another object builds again; slots keep their own."""
        mask = mx.array([True, False])
        built = per_step(("k",), mask, lambda: "mask work")
        assert per_step(("k",), mask, lambda: "again") == "mask work"
        assert per_step(("k",), mask, lambda: "kernel work", slot="kernel") == "kernel work"
        assert per_step(("k",), mask, lambda: "again") is built
        assert per_step(("k",), mx.array([True, False]), lambda: "another mask") == "another mask"
        assert per_step(("other",), None, lambda: "no mask") == "no mask"

    def test_each_thread_keeps_its_own(self):
        """What one thread keeps is not another's (the MLX thread's work is
        never displaced by a test's or a benchmark's thread)."""
        per_step(("t",), None, lambda: "main")
        seen: list[str] = []
        thread = threading.Thread(target=lambda: seen.append(per_step(("t",), None, lambda: "other")))
        thread.start()
        thread.join()
        assert seen == ["other"] and per_step(("t",), None, lambda: "again") == "main"
