"""What the measuring scripts count as a CUDA step's launches
(``scripts/fused_calls.py``'s ``graph_ops``), checked on graphs whose
launches MLX's CUDA source fixes. No GPU here: the count is what the
benchmarks report for one."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import pytest

from device_arithmetic import EMULATED_TF32
from script_modules import script_module


def test_a_concatenation_is_a_launch_an_input():
    graph_ops = script_module("fused_calls").graph_ops
    a, b = mx.ones((2, 3)), mx.ones((2, 3)) * 2  # Full, Full and a Multiply, evaluated below
    mx.eval(a, b)
    joined = mx.concatenate([a + 1, b, mx.broadcast_to(mx.array(0.0), (2, 4))], axis=1)
    # Add, Concatenate (3 inputs); the broadcast scalar is a view, but its copy in is a launch.
    primitives, non_view, launches = graph_ops(joined)
    assert non_view == 2
    assert launches == 1 + 3


def test_views_launch_nothing_and_a_reshape_is_counted():
    graph_ops = script_module("fused_calls").graph_ops
    a = mx.ones((4, 6))
    mx.eval(a)
    out = (a.T[1:, None] * 2).reshape(-1)
    primitives, non_view, launches = graph_ops(out)
    assert (non_view, launches) == (2, 2)  # Multiply, Reshape
    assert primitives > non_view


def test_a_compiled_function_called_twice_is_two_launches():
    graph_ops = script_module("fused_calls").graph_ops

    @partial(mx.compile, shapeless=True)
    def twice_then_add(x, y):
        return x * 2 + y

    x = mx.ones((3,))
    mx.eval(x)
    out = twice_then_add(twice_then_add(x, x), x)
    assert graph_ops(out)[1:] == (2, 2)


@pytest.mark.skipif(EMULATED_TF32, reason="the emulated TF32 rounding is in every product's graph")
def test_a_products_folds_of_its_rows_launch_nothing():
    """``(B, L, in) @ (in, out)``: MLX folds the rows with a Flatten and an
    Unflatten around the product, reshapes of contiguous rows (views)."""
    graph_ops = script_module("fused_calls").graph_ops
    x, w = mx.ones((2, 3, 4)), mx.ones((4, 5))
    mx.eval(x, w)
    primitives, non_view, launches = graph_ops(x @ w)
    assert primitives == 3 and (non_view, launches) == (1, 1)


def test_a_reshape_copies_only_where_its_input_cannot_be_regrouped():
    """MLX's ``prepare_reshape`` rule, as the scripts read it: a contiguous
    input, or runs of axes that split into the new shape, are viewed; a
    transpose merged across its axes, or a broadcast flattened, is copied."""
    module = script_module("cuda_reshape")
    a = mx.arange(2 * 3 * 4).reshape(2, 3, 4)
    mx.eval(a)
    assert module.reshape_is_view(a, (6, 4))
    assert not module.reshape_is_view(a.transpose(1, 0, 2), (6, 4))
    assert module.reshape_is_view(a.transpose(1, 0, 2), (3, 2, 2, 2))  # splits the last axis only
    assert module.reshape_is_view(a[:, :, :2], (2, 3, 2, 1))
    assert not module.reshape_is_view(a[:, :, :2], (12,))  # the gap between rows
    assert not module.reshape_is_view(mx.broadcast_to(a[:1], (4, 3, 4)), (48,))
    with module.ReshapeViews() as seen:
        a.reshape(6, 4)
        mx.reshape(a.transpose(1, 0, 2), (6, 4))
        a.reshape(2, 3, 4)  # its own shape: no node
    assert (seen.views, seen.copies) == (1, 1)
