"""State has one owner: no lock anywhere in actors/ or cache/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "actors").rglob("*.py"), *(ROOT / "cache").rglob("*.py")])

#: Lock-like primitives of threading, asyncio, anyio and trio.
LOCKS = {
    "Lock",
    "RLock",
    "Condition",
    "Semaphore",
    "BoundedSemaphore",
    "CapacityLimiter",
    "StrictFIFOLock",
    "ResourceGuard",
}
MODULES = {"threading", "asyncio", "anyio", "trio", "multiprocessing"}


def lock_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in LOCKS:
            found.append(f"{path.name}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in MODULES:
            found += [
                f"{path.name}:{node.lineno}: from {node.module} import {alias.name}"
                for alias in node.names
                if alias.name in LOCKS
            ]
    return found


class TestNoLocks:
    def test_sources_are_found(self):
        """The scan sees the actor and cache modules."""
        names = {path.name for path in SOURCES}
        assert {"actor.py", "allocator.py", "paged.py"} <= names

    @pytest.mark.parametrize("path", SOURCES, ids=lambda path: f"{path.parent.name}/{path.name}")
    def test_no_lock_is_used(self, path):
        """No module of actors/ or cache/ uses a lock, semaphore or condition."""
        assert lock_uses(path) == []

    def test_the_scan_finds_locks(self, tmp_path):
        """The scanner itself catches the usual spellings."""
        sample = tmp_path / "sample.py"
        sample.write_text(
            "import threading, anyio\nfrom asyncio import Lock\n"
            "a = threading.RLock()\nb = anyio.Semaphore(2)\n"
        )
        assert len(lock_uses(sample)) == 3
