"""Fixtures of the tier tests: both anyio backends (the real ``redis-server``
fixture, ``redis_server``, is in the root conftest: the runtime's tests use it too)."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The anyio backend of the test: asyncio, then trio."""
    return request.param
