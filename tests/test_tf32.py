"""The CPU's emulation of a GPU's float32 products (``tests/tf32.py``), and
the suite's comparisons of two paths under it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import tf32
from device_arithmetic import EMULATED_TF32, ON_CPU

ROOT = Path(__file__).resolve().parents[1]


class TestRounding:
    def test_to_the_nearest_value_with_ten_mantissa_bits(self):
        """Halfway values go to the even neighbour; the rest to the nearest."""
        x = mx.array([1.0, 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-12, 1 + 2**-11 + 2**-20, -3.14159, float("inf")])
        want = [1.0, 1.0, 1 + 2**-9, 1.0, 1 + 2**-10, -3.140625, float("inf")]
        assert np.array(tf32.tf32(x)).tolist() == want

    def test_within_half_a_unit_and_other_dtypes_untouched(self):
        """Each value moves by at most half a TF32 unit, 2^-11 of it; bfloat16 and integers stay."""
        x = mx.random.normal((4096,), key=mx.random.key(0))
        assert (mx.abs(tf32.tf32(x) - x) <= mx.abs(x) * 2**-11).all().item()
        assert not mx.array_equal(tf32.tf32(x), x).item()
        for other in (x.astype(mx.bfloat16), mx.arange(5)):
            assert tf32.tf32(other) is other

    def test_another_order_moves_the_last_bits_by_shape(self):
        """Results move by at most seven ulps, in a pattern fixed by the
        shapes; a sum no order rounds (an integer) stays."""
        x = mx.random.normal((4096,), key=mx.random.key(0))
        one, again, other = tf32.reordered(x, (1, 2)), tf32.reordered(x, (1, 2)), tf32.reordered(x, (2, 2))
        assert mx.array_equal(one, again).item() and not mx.array_equal(one, other).item()
        assert (mx.abs(one - x) <= mx.abs(x) * 7 * 2**-23).all().item() and not mx.array_equal(one, x).item()
        integers = mx.arange(-8, 9).astype(mx.float32)
        assert mx.array_equal(tf32.reordered(integers, (3,)), integers).item()

    def test_every_product_rounds_its_inputs_until_undone(self):
        """``@``, ``mx.matmul`` and ``mx.addmm`` take rounded inputs, their
        results reordered, while installed; fused attention runs as CUDA's
        fallback (a prefill, a head of 16) or, a query a row over a head of
        64, as its float32 vector kernel; undone, the exact products come back."""
        a, b, c = (mx.random.normal((8, 8), key=mx.random.key(k)) for k in (1, 2, 3))
        ra, rb = tf32.tf32(a), tf32.tf32(b)
        exact = [a @ b, mx.matmul(a, b), mx.addmm(c, a, b)]
        want = [tf32.reordered(ra @ rb, (8, 8), (8, 8))] * 2 + [tf32.reordered(mx.addmm(c, ra, rb), (8, 8), (8, 8))]
        q, k, v = (mx.random.normal((1, 4, 6, 16), key=mx.random.key(s)) for s in (4, 5, 6))
        q1, k1, v1 = (mx.random.normal((2, 2, n, 64), key=mx.random.key(s)) for s, n in ((7, 1), (8, 5), (9, 5)))
        fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
        vector = mx.fast.scaled_dot_product_attention(q1, k1, v1, scale=0.125)
        undo = tf32.install()
        try:
            got = [a @ b, mx.matmul(a, b), mx.addmm(c, a, b)]
            fallback = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
            vector_again = mx.fast.scaled_dot_product_attention(q1, k1, v1, scale=0.125)
        finally:
            undo()
        for g, w, e in zip(got, want, exact):
            assert mx.array_equal(g, w).item() and not mx.array_equal(g, e).item()
        assert mx.allclose(fallback, fused, atol=2e-3, rtol=0).item() and not mx.array_equal(fallback, fused).item()
        assert mx.array_equal(vector_again, vector).item()
        assert mx.array_equal(a @ b, exact[0]).item()

    def test_half_precision_products_sum_in_float32_and_round_once(self):
        """A bfloat16 product: its float32 sums, reordered, rounded to bfloat16 once."""
        a, b = (
            mx.random.normal(shape, key=mx.random.key(k)).astype(mx.bfloat16) for k, shape in ((1, (16, 32)), (2, (32, 8)))
        )
        want = tf32.reordered(a.astype(mx.float32) @ b.astype(mx.float32), (16, 32), (32, 8)).astype(mx.bfloat16)
        undo = tf32.install()
        try:
            got = a @ b
        finally:
            undo()
        assert got.dtype == mx.bfloat16 and mx.array_equal(got, want).item()


@pytest.mark.skipif(not ON_CPU or EMULATED_TF32, reason="a GPU's own arithmetic, or the whole suite emulated already")
@pytest.mark.timeout(480)  # three test files in a subprocess: ~110 s alone, more beside the rest of the suite
def test_paths_compared_hold_under_a_gpus_rounding(tmp_path):
    """Where the suite compares two exact paths most (warm against cold,
    batch rows against lone ones, served answers), it holds with the GPU's
    TF32-like products emulated and the GPU's bounds: a tie where greedy
    runs part, a prompt clear of ties where only text is compared."""
    done = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:benchmark", "-p", "no:cacheprovider",
            "tests/runtime/test_generate.py", "tests/actors/test_decode_batch.py", "tests/server/test_app.py",
        ],
        cwd=ROOT, env={**os.environ, "MLXKV_TEST_TF32": "1", "MLXKV_CACHE_DIR": str(tmp_path)},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
