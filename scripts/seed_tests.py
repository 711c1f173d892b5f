"""Run vllm-mlx 0.6.0's own cache tests against ``mlxkv.cache``.

Downloads the vllm-mlx 0.6.0 source distribution from PyPI (nothing of it is
kept in this repository), unpacks its cache tests
(``tests/test_paged_cache.py``, ``test_prefix_cache.py``,
``test_prefix_cache_trim_failclosed.py``, ``test_mllm_cache.py``) and its
``conftest.py`` into a temporary directory, appends to that conftest an
alias of the seed's import paths (``vllm_mlx.paged_cache``,
``vllm_mlx.prefix_cache``, ``vllm_mlx.mllm_cache``) to mlxkv's modules and
drops the tests' Apple-only skips (mlxkv runs on the CPU), then runs pytest
with this interpreter. Prints the pass/fail counts and writes one sorted
``OUTCOME test-id`` line per test to ``--out``, so two checkouts compare
with ``diff``. The failures are where mlxkv differs on purpose (see
``docs/architecture.md``, "Where we differ from the seed on purpose") or
tests of vllm-mlx modules other than its caches.

    .venv/bin/python scripts/seed_tests.py [--out FILE] [--sdist PATH]
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

TESTS = (
    "test_paged_cache.py",
    "test_prefix_cache.py",
    "test_prefix_cache_trim_failclosed.py",
    "test_mllm_cache.py",
)

ALIASES = '''

# --- added by mlxkv's scripts/seed_tests.py: the seed's paths are mlxkv's ---
import sys as _sys
import types as _types

import mlxkv.cache.mllm as _mllm
import mlxkv.cache.paged as _paged
import mlxkv.cache.prefix as _prefix

_package = _types.ModuleType("vllm_mlx")
_package.__path__ = []
_package.paged_cache, _package.prefix_cache, _package.mllm_cache = _paged, _prefix, _mllm
_sys.modules.update(
    {
        "vllm_mlx": _package,
        "vllm_mlx.paged_cache": _paged,
        "vllm_mlx.prefix_cache": _prefix,
        "vllm_mlx.mllm_cache": _mllm,
    }
)


def _apple_only(mark):
    text = repr(mark.args) + repr(mark.kwargs)
    return mark.name == "skipif" and ("darwin" in text or "Apple" in text)


def pytest_itemcollected(item):
    node = item
    while node is not None:
        node.own_markers[:] = [m for m in node.own_markers if not _apple_only(m)]
        node = node.parent
'''


def _download(directory: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "vllm-mlx==0.6.0",
         "-d", str(directory)],
        check=True,
        capture_output=True,
    )
    (sdist,) = directory.glob("vllm_mlx-0.6.0.tar.gz")
    return sdist


def _unpack(sdist: Path, directory: Path) -> Path:
    root = directory / "seed"
    (root / "tests").mkdir(parents=True)
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            name = Path(member.name).name
            if member.name.endswith(f"/tests/{name}") and (name in TESTS or name == "conftest.py"):
                data = archive.extractfile(member)
                assert data is not None
                (root / "tests" / name).write_bytes(data.read())
    with open(root / "tests" / "conftest.py", "a") as conftest:
        conftest.write(ALIASES)
    (root / "pytest.ini").write_text("[pytest]\ntestpaths = tests\naddopts = -p no:cacheprovider -p no:anyio\n")
    return root


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write one 'OUTCOME test-id' line per test here")
    parser.add_argument("--sdist", help="a downloaded vllm_mlx-0.6.0.tar.gz (default: download it)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlxkv-seed-tests-") as temporary:
        directory = Path(temporary)
        sdist = Path(args.sdist) if args.sdist else _download(directory)
        root = _unpack(sdist, directory)
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rA", "--tb=no"], cwd=root, capture_output=True, text=True
        )
    outcomes = sorted(
        match.group(0).split(" - ")[0]
        for match in re.finditer(r"^(PASSED|FAILED|ERROR|SKIPPED) \S+", run.stdout, re.MULTILINE)
    )
    counts = collections.Counter(line.split()[0] for line in outcomes)
    print(", ".join(f"{counts[k]} {k.lower()}" for k in ("PASSED", "FAILED", "ERROR", "SKIPPED") if counts[k]))
    if args.out:
        Path(args.out).write_text("\n".join(outcomes) + "\n")
    return 0 if outcomes else 1


if __name__ == "__main__":
    sys.exit(main())
