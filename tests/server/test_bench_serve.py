"""``scripts/bench_serve.py`` runs: a tiny workload against ``mlxkv serve`` alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from mlxkv.actors.model_info import device_name
from mlxkv.default_model import DEFAULT_MODEL, ensure_model

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_serve.py"


@pytest.mark.skipif(find_spec("hypercorn") is None, reason="needs the server extra")
def test_bench_serve_runs_and_reports(model_dir: Path, tmp_path: Path):
    """One round of a small workload: a table on stdout, every measure in the JSON,
    every request's answer recorded, and what served (mlxkv's /health)."""
    ensure_model(DEFAULT_MODEL, model_dir)
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--servers", "mlxkv", "--rounds", "1", "--conversations", "2",
         "--system-prompts", "1", "--system-tokens", "64", "--user-tokens", "8", "--max-tokens", "4",
         "--concurrency", "2", "--warmup", "0", "--json", str(out), "--logs", str(tmp_path / "logs")],
        env={**os.environ, "MLXKV_CACHE_DIR": str(model_dir)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "mlxkv serve" in done.stdout and "TTFT t2 p50/p95 ms" in done.stdout
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert run["generated_tokens"] >= 2 * 2 and run["tokens_per_s"] > 0
    assert run["reused_t2"] > 0 and len(run["outputs"]) == 2
    assert run["compute"].startswith(f"{device_name()}, shared-prefix attention ")
    assert f"computes on {run['compute']}" in done.stderr
    assert set(report["medians"]["mlxkv"]) >= {"tokens_per_s", "ttft_t1_p95_ms", "ttft_t2_p95_ms"}
