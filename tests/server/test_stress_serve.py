"""``scripts/stress_serve.py`` runs: well-formed load and every attack against a real ``mlxkv serve``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from mlxkv.default_model import DEFAULT_MODEL, ensure_model

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "stress_serve.py"


@pytest.mark.skipif(find_spec("hypercorn") is None, reason="needs the server extra")
def test_stress_serve_keeps_serving(model_dir: Path, tmp_path: Path):
    """A short run: every well-formed request served, every attack answered as
    stated (or ignored, for a closed connection), nothing held at the end, and
    the server still up."""
    ensure_model(DEFAULT_MODEL, model_dir)
    out = tmp_path / "stress.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--duration", "6", "--clients", "2", "--attackers", "3", "--json", str(out)],
        env={**os.environ, "MLXKV_CACHE_DIR": str(model_dir)}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["alive"] and not report["failures"] and sum(report["served"].values()) > 0
    stated = {
        "close": {"0"}, "top_k": {"200"}, "huge_prompt": {"400"}, "withheld": {"408"}, "trickle": {"408"},
        "bad_json": {"400"}, "long_chat": {"400"}, "many_choices": {"400"}, "many_tools": {"400"},
        "hostile_schema": {"200", "400"}, "no_key": {"401"},  # a doubling schema the model may never nest in
    }  # fmt: skip
    for name, counts in report["attacks"].items():
        assert set(counts) <= stated[name], (name, counts)
    assert report["health"]["status"] == "ok" and not any(report["held"].values())
    assert "RSS" in done.stdout
