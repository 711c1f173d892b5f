"""``scripts/bench_chat.py`` runs: a tiny chat workload with shared prefixes on and off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mlxkv.default_model import DEFAULT_MODEL, ensure_model

from script_modules import script_module

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
    # Greedy on the float32 model: both methods' answers are the same tokens.
    assert report["summary"]["token_comparison"] == ["greedy tokens: every method's equal to copies' (1 run)"]
    assert "every method's equal to copies'" in done.stdout


def test_answers_are_compared_where_their_prompts_are_the_same(model_dir: Path, capsys):
    """A second turn whose prompt differs between the methods (its first
    turn's answer parted) is counted, not compared; an answer that takes the
    model's worst token is warned of, by its row and token."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    path = str(ensure_model(DEFAULT_MODEL, model_dir))
    model, _ = load(path)
    prompt = tuple(range(40, 72))
    greedy = [int(token) for token, _ in generate_step(mx.array(prompt), model, max_tokens=4)]
    worst = mx.argmin(model(mx.array([*prompt, *greedy[:2]])[None])[0, -1]).item()
    copies = {"c0-t0": (prompt, tuple(greedy)), "c0-t1": (prompt + (1,), tuple(greedy))}
    shared = {"c0-t0": (prompt, tuple(greedy[:2]) + (worst,) + tuple(greedy[3:])), "c0-t1": (prompt + (2,), ())}
    lines = script_module("bench_chat").compare_answers(path, {(0, "copies"): copies, (0, "shared"): shared}, 1)
    assert lines[0].startswith("shared (chat): tokens differ from copies' in 1 of 1 rows, 1 apart by more")
    assert "row 0 at token 2" in lines[0]
    assert lines[1] == "requests not compared (their prompts differ: an earlier turn's answer parted): 1"
    assert "warning: shared (chat)" in capsys.readouterr().err
