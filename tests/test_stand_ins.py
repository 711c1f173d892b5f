"""The measuring scripts' stand-ins for a GPU's kernels (``scripts/stand_ins.py``)
and what ``scripts/bench_memory.py`` says of a round's peak: checked on the
CPU, where they apply."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxkv.actors.plan import Chunk, ChunkDone, Plan, Result

from device_arithmetic import ON_CPU
from script_modules import script_module

pytestmark = pytest.mark.skipif(not ON_CPU, reason="the stand-ins replace the CPU's fallbacks only")


def _attention_inputs(rows: int, queries: int, keys: int):
    q = mx.random.normal((rows, 8, queries, 32)).astype(mx.bfloat16)
    k = mx.random.normal((rows, 2, keys, 32)).astype(mx.bfloat16)
    v = mx.random.normal((rows, 2, keys, 32)).astype(mx.bfloat16)
    mask = mx.arange(keys)[None] <= mx.arange(keys - queries, keys)[:, None]
    mx.eval(q, k, v, mask)
    return q, k, v, mask


def _peak_of_call(q, k, v, mask) -> tuple[int, mx.array]:
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    mx.eval(out)
    return mx.get_peak_memory() - base, out


def test_fused_attention_holds_only_its_output(monkeypatch):
    """The stand-in's call allocates about its output (what a flash kernel
    does); the CPU's fallback, measured the same way, holds the scores."""
    q, k, v, mask = _attention_inputs(4, 256, 1024)
    fallback_peak, want = _peak_of_call(q, k, v, mask)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", mx.fast.scaled_dot_product_attention)
    script_module("stand_ins").fused_attention_memory()
    peak, out = _peak_of_call(q, k, v, mask)
    output = want.nbytes
    assert (out.shape, out.dtype) == (want.shape, want.dtype)
    assert peak <= output + (1 << 16)
    scores = 4 * 8 * 256 * 1024 * 2  # every row's and head's scores, in the inputs' bfloat16
    assert fallback_peak >= scores > 8 * output


def test_fused_attention_stand_in_stays_finite_under_an_additive_mask(monkeypatch):
    """An additive mask's ``-inf`` does not turn the stand-in's output into NaN
    (a model's outputs stay usable numbers)."""
    q, k, v, mask = _attention_inputs(1, 4, 16)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", mx.fast.scaled_dot_product_attention)
    script_module("stand_ins").fused_attention_memory()
    hidden_first = mask & (mx.arange(16) > 0)[None]  # the corner the stand-in reads is -inf
    additive = mx.where(hidden_first, 0.0, -mx.inf).astype(q.dtype)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=additive[None, None])
    assert mx.isfinite(out).all().item()


def test_fast_ops_are_one_operation_each(monkeypatch):
    """``mx.fast.rms_norm`` and ``mx.fast.rope`` become one graph operation
    each (the CPU's fallbacks are chains of them)."""
    graph_ops = script_module("fused_calls").graph_ops
    x, weight = mx.ones((1, 2, 4, 8)), mx.ones((8,))
    mx.eval(x, weight)
    calls = {
        "rms_norm": lambda: mx.fast.rms_norm(x, weight, 1e-5),
        "rope": lambda: mx.fast.rope(x, 8, traditional=False, base=10000.0, scale=1.0, offset=0),
    }
    assert all(graph_ops(call())[1] > 1 for call in calls.values())
    for name in calls:
        monkeypatch.setattr(mx.fast, name, getattr(mx.fast, name))
    script_module("stand_ins").fast_ops()
    assert all(graph_ops(call())[1] == 1 for call in calls.values())


def test_the_kernel_stand_in_serves_the_kernel_way_as_on_cuda(monkeypatch):
    """Off CUDA the kernel is taken as there and checked, and its launch is one
    fused attention call over the suffix buffers, of the queries' shape."""
    from mlxkv.actors import decode_kernel

    for name in ("on_cuda", "self_check", "_kernel", "_CHECKED"):
        monkeypatch.setattr(decode_kernel, name, getattr(decode_kernel, name))
    monkeypatch.setattr(decode_kernel, "_CHECKED", {})
    assert not decode_kernel.usable(mx.float32, 32, 8, 2)
    script_module("stand_ins").kernel()
    assert decode_kernel.on_cuda() and decode_kernel.usable(mx.float32, 32, 8, 2)
    queries = mx.ones((3, 8, 1, 32))
    suffix = mx.ones((3, 2, 16, 32))
    segment = ([0], mx.ones((1, 2, 40, 32)), mx.ones((1, 2, 40, 32)), [40])
    out = decode_kernel.decode_attention(queries, suffix, suffix, 10, [0, 2, 4], 0.125, [segment])
    assert out.shape == queries.shape


def test_a_plan_is_described_by_what_it_ran():
    """``describe_plan`` names a plan's prefill calls (rows, the new tokens of
    the requests it started), joins, leaves and decode steps."""
    describe = script_module("bench_memory").describe_plan
    started = [ChunkDone(request_id=f"r{i}", computed=2080, started=True, num_cached=2048) for i in range(3)]
    plan = Plan(join=("a", "b"), steps=2, prefill=tuple(Chunk(f"r{i}", 2080) for i in range(3)))
    result = Result(chunks=tuple(started), steps=(5, 5), prefill_calls=(3,))
    assert describe(plan, result) == "prefill 3 rows, 96 new tokens, join 2, 2 steps of 5 rows"
    assert describe(Plan(steps=1), Result(steps=(7,))) == "1 steps of 7 rows"
    assert describe(Plan(), Result()) == "publish"


def test_the_peak_is_set_by_the_first_plan_that_reached_it():
    peaks = script_module("bench_memory").PeakByPlan()
    assert peaks.setter() == ""
    peaks.plans = [("prefill", 10), ("join", 30), ("steps", 30), ("steps", 30)]
    assert peaks.setter() == "join"
