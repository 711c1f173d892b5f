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
from device_arithmetic import EMULATED_TF32

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

    def test_every_product_rounds_its_inputs_until_undone(self):
        """``@``, ``mx.matmul``, ``mx.addmm`` and fused attention take rounded
        inputs while installed; undone, the exact products come back."""
        a, b, c = (mx.random.normal((8, 8), key=mx.random.key(k)) for k in (1, 2, 3))
        q, k, v = (m.reshape(1, 1, 8, 8) for m in (a, b, c))
        exact = [a @ b, mx.matmul(a, b), mx.addmm(c, a, b), mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0)]
        rounded = [tf32.tf32(m) for m in (a, b, c)]
        ra, rb, rc = rounded
        want = [ra @ rb, ra @ rb, mx.addmm(c, ra, rb),
                mx.fast.scaled_dot_product_attention(*(m.reshape(1, 1, 8, 8) for m in rounded), scale=1.0)]
        undo = tf32.install()
        try:
            got = [a @ b, mx.matmul(a, b), mx.addmm(c, a, b), mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0)]
        finally:
            undo()
        for g, w, e in zip(got, want, exact):
            assert mx.array_equal(g, w).item() and not mx.array_equal(g, e).item()
        assert mx.array_equal(a @ b, exact[0]).item()


@pytest.mark.skipif(EMULATED_TF32, reason="the whole suite runs emulated already")
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
