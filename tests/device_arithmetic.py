"""How far two float paths may differ on the device the tests run on.

Every tolerance in the tests is first the CPU's: MLX's CPU backend multiplies
float32 in float32, and two exact paths (the cascade and fused attention, a
warm and a cold prefill) agree there within a few ulps. On a GPU a float32
product may be computed with TF32-like inputs (a 10-bit mantissa): on MLX's
CUDA backend, an H200, paths within 2e-6 on the CPU were 4.9e-4 apart (issue
31). So a check names both: the CPU's bound, and the GPU's, set from that
arithmetic -- still far below what a wrong cache moves (a block of another
prompt's KV changes logits by whole units: ``tests/runtime/test_teeth.py``).
The GPU bounds are provisional until a GPU run of the suite confirms them;
``MLXKV_TEST_TF32=1`` runs the suite on the CPU with a GPU's TF32-like
products emulated (``tests/tf32.py``), and the GPU's bounds.
"""

from __future__ import annotations

import os

import mlx.core as mx
import pytest

__all__ = [
    "ATTENTION_ATOL",
    "EMULATED_TF32",
    "EXACT_FLOAT32",
    "LOGITS_ATOL",
    "LOGITS_ATOL_ON_GPU",
    "ON_CPU",
    "needs_quantized_attention",
    "tolerance",
]

#: Whether MLX runs these tests on the CPU.
ON_CPU = mx.default_device().type == mx.DeviceType.cpu
#: Whether the CPU's float32 products round their inputs as a GPU's do (``tests/tf32.py``).
EMULATED_TF32 = ON_CPU and os.environ.get("MLXKV_TEST_TF32") == "1"
#: Whether float32 products are exact float32 ones: the CPU's, not emulating a GPU's.
EXACT_FLOAT32 = ON_CPU and not EMULATED_TF32


def tolerance(cpu: float, *, gpu: float) -> float:
    """``cpu`` where float32 products are exact (:data:`EXACT_FLOAT32`), else ``gpu``."""
    return cpu if EXACT_FLOAT32 else gpu


#: One attention call, two exact float32 paths (the cascade and fused attention, say).
ATTENTION_ATOL = tolerance(2e-6, gpu=2e-3)
#: A float32 model's logits, warm against cold (other chunks, other paths). The
#: least a broken prefix moves a tiny model's last prompt logits is 0.017
#: (``tests/runtime/test_teeth.py`` keeps it above twice the GPU's bound).
LOGITS_ATOL_ON_GPU = 4e-3
LOGITS_ATOL = tolerance(1e-4, gpu=LOGITS_ATOL_ON_GPU)


#: A test of quantized KV on the tiny models: MLX's CUDA backend has no kernel
#: for their heads (measured on an H200: ``[quantized_matmul] No
#: implementation for problem shape: 1x1x32x2 ... bits: 8, group size: 32``;
#: the runtime refuses such a model with ``ModelLoadError``).
needs_quantized_attention = pytest.mark.skipif(
    not ON_CPU, reason="MLX's CUDA backend has no quantized attention kernel for the tiny test models' heads"
)
