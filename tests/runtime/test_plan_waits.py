"""``scripts/plan_waits.py``: where the host waits for the device while mlxkv serves."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mlxkv.default_model import DEFAULT_MODEL, ensure_model

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "plan_waits.py"


def test_no_decode_plan_waits_for_the_device_before_its_step(model_dir: Path):
    """`mlxkv run`'s workload on the built-in model: no decode plan evaluates
    anything before its step is queued (the blocks it publishes, the caches
    it keeps, the rows it lets go are queued and read after the step), and
    every kind of plan was run and counted."""
    ensure_model(DEFAULT_MODEL, model_dir)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--requests", "16"],
        env={**os.environ, "MLXKV_CACHE_DIR": str(model_dir)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("decode", "prefill", "other"):
            rows[cells[0]] = cells[1:]
    plans, evals, waited = rows["decode"]
    assert int(plans) > 0 and int(rows["prefill"][0]) > 0
    assert (evals, waited) == ("0", "0")
