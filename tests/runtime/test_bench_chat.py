"""``scripts/bench_chat.py`` runs: a tiny chat workload with shared prefixes on and off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mlxkv.default_model import DEFAULT_MODEL, ensure_model

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_chat.py"


def test_bench_chat_runs_both_methods_and_reports(model_dir: Path, tmp_path: Path):
    """One round: a table with both methods and their ratio, every run in the
    JSON, and both methods serving the same requests."""
    ensure_model(DEFAULT_MODEL, model_dir)
    out = tmp_path / "chat.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "1", "--requests", "4", "--concurrency", "2",
         "--max-tokens", "4", "--prompt-tokens", "64", "--user-tokens", "8", "--json", str(out)],
        env={**os.environ, "MLXKV_CACHE_DIR": str(model_dir)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "| shared |" in done.stdout and "| copies |" in done.stdout and "shared / copies" in done.stdout
    report = json.loads(out.read_text())
    assert sorted(r["method"] for r in report["runs"]) == ["copies", "shared"]
    for run in report["runs"]:
        assert run["generated_tokens"] == 4 * 4 and run["tokens_per_s"] > 0 and run["reused_tokens"] > 0
    assert report["summary"]["ratio"] > 0
