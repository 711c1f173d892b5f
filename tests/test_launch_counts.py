"""What the measuring scripts count as a CUDA step's launches
(``scripts/fused_calls.py``'s ``graph_ops``), checked on graphs whose
launches MLX's CUDA source fixes. No GPU here: the count is what the
benchmarks report for one."""

from __future__ import annotations

from functools import partial

import mlx.core as mx

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
