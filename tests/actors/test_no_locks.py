"""State has one owner: no lock anywhere in the library (actors/, cache/, runtime/).

One exception is allowed, and listed in ``ALLOWED``: the ``mlxkv run``
workload (``runtime/workload.py``) plays the *clients* of the runtime, and
bounds how many requests those clients have in flight with a
``CapacityLimiter`` -- a limit on the runtime's callers, guarding no cache
state; and ``mlxkv serve`` (``runtime/server/app.py``) parses large request
bodies one at a time through one, so what parsing holds is one body's, not
one body's times the requests admitted -- a bound on work, guarding no state.
(``mlxkv serve``'s admission owns its count and queue of waiters and hands
slots over without a lock.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(path for folder in ("actors", "cache", "runtime") for path in (ROOT / folder).rglob("*.py"))

#: module -> lock-like names it may use, and why (see the module docstring).
ALLOWED = {"workload.py": {"CapacityLimiter"}, "app.py": {"CapacityLimiter"}}

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
        """The scan sees the actor, cache and runtime modules."""
        names = {path.name for path in SOURCES}
        assert {"actor.py", "allocator.py", "paged.py", "runtime.py", "generation.py"} <= names

    @pytest.mark.parametrize("path", SOURCES, ids=lambda path: f"{path.parent.name}/{path.name}")
    def test_no_lock_is_used(self, path):
        """No library module uses a lock, semaphore or condition beyond what ALLOWED lists."""
        allowed = ALLOWED.get(path.name, set())
        assert [use for use in lock_uses(path) if use.rsplit(".", 1)[-1] not in allowed] == []

    def test_the_allowance_is_still_needed(self):
        """Every allowance is used; one that is not should be removed."""
        for name, allowed in ALLOWED.items():
            path = next(path for path in SOURCES if path.name == name)
            assert {use.rsplit(".", 1)[-1] for use in lock_uses(path)} == allowed

    def test_the_scan_finds_locks(self, tmp_path):
        """The scanner itself catches the usual spellings."""
        sample = tmp_path / "sample.py"
        sample.write_text(
            "import threading, anyio\nfrom asyncio import Lock\n"
            "a = threading.RLock()\nb = anyio.Semaphore(2)\n"
        )
        assert len(lock_uses(sample)) == 3
