"""``scripts/gpu_check.sh`` and ``scripts/bench_attention.py`` run: a dry run of the GPU check on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx

from mlxkv.actors.prefix_attention import PrefixAttention
from mlxkv.default_model import TINY_LLAMA, ensure_model

from device_arithmetic import ATTENTION_ATOL

ROOT = Path(__file__).resolve().parents[2]


def test_a_quick_dry_run_measures_every_way(model_dir: Path, tmp_path: Path):
    """The check's run, attention, step, prefill, batch and memory steps on the
    tiny model: each step ends with status 0 (the run's report says what
    serves), every way of each shape is timed and counted, and each agrees
    with fused attention over copies (exactly where it is fused itself);
    every mlxkv method's peak memory names the plan that reached it; every
    method's tokens are compared."""
    ensure_model(TINY_LLAMA, model_dir)
    env = {
        **os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "MLXKV_CACHE_DIR": str(model_dir),
        "GPU_CHECK_MODEL": TINY_LLAMA.name, "GPU_CHECK_QUICK": "1",
    }  # fmt: skip
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "run", "attention", "step", "prefill", "batch", "memory"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "log.txt").read_text()
    for step in ("model", "run", "attention", "step", "prefill", "batch", "memory"):
        assert f"== {step}: status 0 in" in log, log
    # What serves on the device, in the run's report.
    assert "; decode compiled in" in json.loads((tmp_path / "run.json").read_text())["compute"]
    results = json.loads((tmp_path / "attention.json").read_text())["results"]
    ways = {r["way"] for r in results}
    assert ways == {"copies", "cascade", "cascade-lazy", "gathered", "stacked", "mixed", "kernel"}
    assert len(results) == 4 * len(ways)
    for r in results:
        assert r["ms"] > 0 and r["ops"] > 0 and r["max_diff"] < ATTENTION_ATOL, r
    step = json.loads((tmp_path / "step.json").read_text())["results"]
    methods = {f"mlxkv, {way.value}" for way in PrefixAttention} | {"mlxkv, copies"}
    assert {r["method"] for r in step} == methods | {f"{m}, as written" for m in methods} | {"mlx-lm"}
    counts = {r["method"]: (r["ops"], r["cuda_kernels"]) for r in step}
    for m in methods:  # the compiled layers' steps are counted as the same operations
        assert counts[m] == counts[f"{m}, as written"], m
    methods |= {"mlx-lm"}
    for r in step:
        assert r["ops"] > 0 and r["non_view_ops"] <= r["ops"] and r["wall_ms"] >= r["build_ms"] > 0, r
        # On CUDA each layer's norms and rotary embedding are one kernel, not
        # a CPU fallback's several (a GPU's graph holds them as one already).
        assert 0 < r["cuda_kernels"] <= r["non_view_ops"], r
        if mx.default_device().type == mx.DeviceType.cpu:
            assert r["cuda_kernels"] < r["non_view_ops"], r
        assert r["evals_per_step"] == (1 if r["method"] == "mlx-lm" else 0), r  # mlxkv's steps never block
    prefill = json.loads((tmp_path / "prefill.json").read_text())
    assert prefill["phase"] == "prefill" and {r["method"] for r in prefill["results"]} == methods
    for r in prefill["results"]:
        assert r["ops"] > 0 and r["wall_ms"] >= r["build_ms"] > 0, r
        # At most one wait a call for its rows' padding (a call per prefill
        # stream: two here) and one for the first tokens' logits, not one a
        # layer; mlx-lm's prefill waits twice.
        assert 1 <= r["working_evals_per_step"] <= 3, r
    batch = json.loads((tmp_path / "batch.json").read_text())
    assert {"mlxkv", "mlxkv, prefix_attention=stacked"} <= set(batch["2x4"])
    # mlx-lm's prefill and the stacked way's every call run several queries a
    # row (cuDNN on CUDA); the CPU's cascade runs no fused call of them.
    shapes = batch["fused_shapes"]
    assert {"batch_generate", "mlxkv, prefix_attention=stacked"} <= set(shapes) <= set(batch["2x4"]), shapes
    assert all(c["calls"] >= c["shapes"] >= 1 for c in shapes.values()), shapes
    # Every method's greedy tokens are the reference's, or part from them at a
    # tie within float noise (a GPU's kernels round otherwise).
    for name, reference in (("batch", "stream_generate"), ("memory", "batch_generate")):
        lines = json.loads((tmp_path / f"{name}.json").read_text())["token_comparison"]
        assert lines and all(reference in line and "apart by more" not in line for line in lines), lines
    memory = json.loads((tmp_path / "memory.json").read_text())["2"]
    mlxkv = {m for m in memory["peak"] if m.startswith("mlxkv")}
    assert {"mlxkv", "mlxkv, compile_decode=false"} <= mlxkv
    assert set(memory["peak_set_by"]) == mlxkv
    assert all(memory["peak_set_by"][m] and memory["peak"][m] > 0 for m in mlxkv), memory



def test_the_default_way_alone(model_dir: Path, tmp_path: Path):
    """With ``GPU_CHECK_WAYS=none`` the batch step measures mlxkv's default
    alone beside mlx-lm (the must-show rows in the least device time), and
    the settings ``GPU_CHECK_ALSO`` names beside it; the json step (named
    only) runs every method of ``bench_json.py``."""
    ensure_model(TINY_LLAMA, model_dir)
    env = {
        **os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "MLXKV_CACHE_DIR": str(model_dir),
        "GPU_CHECK_MODEL": TINY_LLAMA.name, "GPU_CHECK_QUICK": "1", "GPU_CHECK_WAYS": "none",
        "GPU_CHECK_ALSO": "prefill_chunk=64,prefill_budget=128",
    }  # fmt: skip
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "batch", "json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "== batch: status 0 in" in (tmp_path / "log.txt").read_text()
    assert "== json: status 0 in" in (tmp_path / "log.txt").read_text()
    assert {r["method"] for r in json.loads((tmp_path / "json.json").read_text())["throughput"]["runs"]} == {
        "free", "json", "mixed",
    }  # fmt: skip
    methods = set(json.loads((tmp_path / "batch.json").read_text())["2x4"])
    assert {m for m in methods if m.startswith("mlxkv")} == {"mlxkv", "mlxkv, prefill_chunk=64,prefill_budget=128"}
