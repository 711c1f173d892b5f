"""``scripts/bench_gc.py`` runs: garbage-collector pauses with ``freeze_gc`` on and off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mlxkv.default_model import DEFAULT_MODEL, ensure_model

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_gc.py"


def test_bench_gc_runs_both_settings_and_reports(model_dir: Path, tmp_path: Path):
    """One round: a table with both settings and their ratios, every run in the
    JSON; a forced full collection is shorter with the heap frozen."""
    ensure_model(DEFAULT_MODEL, model_dir)
    out = tmp_path / "gc.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "1", "--requests", "4", "--json", str(out)],
        env={**os.environ, "MLXKV_CACHE_DIR": str(model_dir)}, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "| on |" in done.stdout and "| off |" in done.stdout and "on / off" in done.stdout
    report = json.loads(out.read_text())
    runs = {r["method"]: r for r in report["runs"]}
    assert sorted(runs) == ["off", "on"]
    for run in runs.values():
        assert run["tokens_per_s"] > 0 and run["full_collections"] >= 0
    # A full collection visits the model's and the libraries' objects only
    # when they are not frozen: several times longer (65-99 ms against ~2.5).
    assert runs["on"]["forced_collection_ms"] < runs["off"]["forced_collection_ms"]
