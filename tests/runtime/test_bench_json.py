"""``scripts/bench_json.py`` runs: every method's throughput, and the masks' walks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mlxkv.default_model import DEFAULT_MODEL, ensure_model

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_json.py"


def test_bench_json_runs_every_method_and_times_the_masks(model_dir: Path, tmp_path: Path):
    ensure_model(DEFAULT_MODEL, model_dir)
    out = tmp_path / "json.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "1", "--requests", "2", "--max-tokens", "6", "--prompt-tokens", "16",
         "--vocab", "3000", "--walks", "1", "--json", str(out)],
        env={**os.environ, "MLXKV_CACHE_DIR": str(model_dir)}, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for row in ("| free | warm |", "| json | cold |", "| mixed | warm |", "| inside a string |", "| in a date-time |",
                "| 4,000 integer properties |",
                "json / free"):
        assert row in done.stdout
    report = json.loads(out.read_text())
    runs = report["throughput"]["runs"]
    assert sorted((r["method"], r["masks"]) for r in runs) == [
        (method, masks) for method in ("free", "json", "mixed") for masks in ("cold", "warm")
    ]
    by_method = {(r["method"], r["masks"]): r for r in runs}
    assert by_method["free", "warm"]["allowed_calls"] == 0 and by_method["json", "cold"]["allowed_calls"] > 0
    assert by_method["mixed", "warm"]["free_tokens_per_s"] > 0
    states = report["masks"]["states"]
    assert states["value start"]["allowed"] == 1  # "{" alone
    assert states["inside a string"]["allowed"] > states["after a colon"]["allowed"] > 0
