"""The README's examples run as written, and its sample report is the command's.

Every ```python block of README.md is a complete script: each runs in a fresh
interpreter, on the session's built-in models (``MLXKV_CACHE_DIR``), with the
hub closed. A ```text block introduced by "It prints:" is the output of the
python block before it, exactly. The vision example needs the vlm extra and
is skipped without it.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import attrs
import pytest

from mlxkv.default_model import DEFAULT_MODEL, ensure_model

README = Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.MULTILINE | re.DOTALL)


@attrs.frozen
class Example:
    """One python block: its section, its code and the output shown after it."""

    section: str
    code: str
    output: Optional[str]


def _examples(text: str) -> list[Example]:
    examples: list[Example] = []
    for match in _FENCE.finditer(text):
        language, body = match.group(1), match.group(2)
        before = text[: match.start()]
        if language == "python":
            section = re.findall(r"^#+ (.+)$", before, re.MULTILINE)[-1]
            examples.append(Example(section, body, None))
        elif language == "text" and before.rstrip().endswith("It prints:") and examples:
            examples[-1] = attrs.evolve(examples[-1], output=body)
    return examples


EXAMPLES = _examples(README.read_text())


def _run(args: list[str], model_dir: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MLXKV_CACHE_DIR": str(model_dir), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=90)


class TestReadmeExamples:
    """Each python block of the README, run as a script."""

    def test_there_are_examples(self):
        """The parser finds the README's examples (generating, images, the tiers, low
        level, the server's openai client) and the outputs the last two show."""
        assert [e.section for e in EXAMPLES] == [
            "Generating",
            "Images",
            "KV that outlives the process: disk and Redis tiers",
            "The low-level API",
            "`mlxkv serve` — an OpenAI-compatible server",
        ]
        assert EXAMPLES[-2].output is not None and EXAMPLES[-1].output is not None

    @pytest.mark.parametrize("example", EXAMPLES, ids=[e.section for e in EXAMPLES])
    def test_example_is_a_complete_script(self, example: Example):
        """It parses as a module (no top-level ``async with``) and has no ``...``
        placeholder."""
        tree = ast.parse(example.code)
        placeholders = [
            node for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value is Ellipsis
        ]
        assert not placeholders, f"{example.section}: a '...' placeholder"

    @pytest.mark.parametrize("example", EXAMPLES, ids=[e.section for e in EXAMPLES])
    def test_example_runs(self, example: Example, model_dir: Path, tmp_path: Path):
        """It exits 0 without a traceback, printing what the README says it prints."""
        ensure_model(DEFAULT_MODEL, model_dir)
        if "default_vlm" in example.code:
            pytest.importorskip("mlx_vlm")
            from mlxkv.default_vlm import DEFAULT_VLM, ensure_vlm

            ensure_vlm(DEFAULT_VLM, model_dir)
        if "from openai import" in example.code:  # it starts mlxkv serve
            pytest.importorskip("hypercorn", reason="needs the server extra")
        script = tmp_path / "example.py"
        script.write_text(example.code)
        done = _run([sys.executable, str(script)], model_dir, tmp_path)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr and "Warning" not in done.stderr, done.stderr
        assert done.stdout.strip()
        if example.output is not None:
            assert done.stdout == example.output


class TestReadmeRunSample:
    """The sample report under ``mlxkv run`` is what the command prints."""

    def test_sample_matches_the_command(self, model_dir: Path, tmp_path: Path):
        """The same rows in the same order, the same figures where they depend on
        neither the clock nor the weights, and no line ending in a space."""
        text = README.read_text()
        section = text[text.index("## `mlxkv run`") :]
        sample = _FENCE.search(section)
        assert sample is not None and sample.group(1) == "text"
        ensure_model(DEFAULT_MODEL, model_dir)
        done = _run([sys.executable, "-m", "mlxkv.cli", "run", "--quiet"], model_dir, tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""
        printed, shown = done.stdout.splitlines(), sample.group(2).splitlines()
        assert all(line == line.rstrip() for line in printed), "a report line ends in a space"

        def rows(lines: list[str]) -> dict[str, str]:
            return dict(re.split(r"\s{2,}", line, maxsplit=1) for line in lines)

        printed_rows, shown_rows = rows(printed), rows(shown)
        assert list(printed_rows) == list(shown_rows)
        for stable in ("prompt tokens", "KV pool"):
            assert printed_rows[stable] == shown_rows[stable]
