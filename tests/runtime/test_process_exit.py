"""A process that used mlxkv exits cleanly on every path: no abort at interpreter exit.

MLX requires every thread that used streams to clear them before it ends
(and the main thread before the process exits); a thread left running at exit
races MLX's teardown and aborts the process (``terminate called without an
active exception``, status 134) now and then. So each case runs many times,
in fresh interpreters, and every run must exit 0 with nothing on stderr.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mlxkv.default_model import DEFAULT_MODEL, ensure_model

RUNS = 6  # per case; two at a time

_PRELUDE = """
import sys, anyio
from mlxkv import CacheRuntime
MODEL = sys.argv[1]
BACKEND = sys.argv[2]
"""

CASES = {
    "break-out-of-stream": """
async def main():
    async with CacheRuntime(model=MODEL) as rt:
        async with rt.generate("hello", max_tokens=50) as stream:
            async for record in stream:
                break
anyio.run(main, backend=BACKEND)
""",
    "cancel-mid-prefill": """
async def main():
    async with CacheRuntime(model=MODEL, block_size=16) as rt:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                async def consume():
                    async with rt.generate(list(range(1, 250)) * 8, max_tokens=8) as stream:
                        async for record in stream:
                            pass
                tg.start_soon(consume)
                # Cancel once the prompt's first chunk is being computed.
                while (await rt.stats()).compute.num_prefill_chunks == 0:
                    await anyio.sleep(0.001)
                scope.cancel()
anyio.run(main, backend=BACKEND)
""",
    "failed-model-load": """
from mlxkv import ModelLoadError
async def main():
    try:
        async with CacheRuntime(model=MODEL + "-broken"):
            pass
    except ModelLoadError:
        pass
    else:
        raise SystemExit("the broken model loaded")
anyio.run(main, backend=BACKEND)
""",
}


@pytest.fixture(scope="module")
def scripts(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> dict[str, Path]:
    """One script file per case, and a model that passes the checks but fails to load."""
    folder = tmp_path_factory.mktemp("exit-cases")
    model = ensure_model(DEFAULT_MODEL, model_dir)
    broken = Path(f"{model}-broken")
    if not broken.exists():
        shutil.copytree(model, broken)
        config = json.loads((broken / "config.json").read_text())
        (broken / "config.json").write_text(json.dumps({**config, "model_type": "nonesuch"}))
    files = {}
    for name, body in CASES.items():
        files[name] = folder / f"{name}.py"
        files[name].write_text(_PRELUDE + body)
    return files


def _run_many(commands: list[list[str]], env: dict[str, str]) -> list[subprocess.CompletedProcess]:
    def run(command: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(run, commands))


def _assert_clean(runs: list[subprocess.CompletedProcess]) -> None:
    failures = [(run.returncode, run.stderr[-400:]) for run in runs if run.returncode or run.stderr]
    assert failures == [], f"{len(failures)} of {len(runs)} runs did not exit cleanly"


class TestCleanExit:
    @pytest.mark.parametrize("case", sorted(CASES))
    def test_every_run_exits_cleanly(self, case: str, scripts: dict[str, Path], model_dir: Path):
        """Many runs of the case, on both backends, all exit 0 with an empty stderr."""
        model = str(ensure_model(DEFAULT_MODEL, model_dir))
        commands = [
            [sys.executable, str(scripts[case]), model, ("asyncio", "trio")[i % 2]]
            for i in range(RUNS)
        ]
        _assert_clean(_run_many(commands, dict(os.environ)))

    def test_mlxkv_run_exits_cleanly(self, model_dir: Path):
        """The main job, run repeatedly on both backends, always exits 0 quietly."""
        ensure_model(DEFAULT_MODEL, model_dir)
        small = ["--requests", "4", "--concurrency", "2", "--max-tokens", "4",
                 "--prompt-tokens", "64", "--user-tokens", "8", "--block-size", "16", "--quiet"]  # fmt: skip
        commands = [
            [sys.executable, "-m", "mlxkv.cli", "run", *small, "--backend", ("asyncio", "trio")[i % 2]]
            for i in range(RUNS // 2)
        ]
        runs = _run_many(commands, {**os.environ, "MLXKV_CACHE_DIR": str(model_dir)})
        _assert_clean(runs)
        assert all("tokens reused" in run.stdout for run in runs)
