"""Every async test of the runtime runs on asyncio and on trio."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The anyio backend of the test: asyncio, then trio."""
    return request.param
