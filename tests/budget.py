"""Hypothesis budgets: CI's, scaled by the active profile.

A test that sets its own ``max_examples`` asks :func:`examples` for it, so
that a larger profile scales every test alike: ``pytest
--hypothesis-profile=deep`` runs ten times CI's examples (the profiles are
registered in ``tests/conftest.py``).
"""

from __future__ import annotations

from hypothesis import settings

__all__ = ["examples"]


def examples(ci: int) -> int:
    """``ci`` examples under the default profile (100 examples), scaled with the active one."""
    return max(1, ci * settings.default.max_examples // 100)
