"""The measuring scripts' helper modules (``scripts/``), imported by tests that
check what they count."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def script_module(name: str) -> Any:
    """``scripts/<name>.py`` as a module (one per name and process: the
    scripts import each other by name)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
