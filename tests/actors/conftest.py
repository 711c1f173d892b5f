"""Every async test of the actor layer runs on asyncio and on trio."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from mlxkv.actors.actor import Actor, ActorRef


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The anyio backend of the test: asyncio, then trio."""
    return request.param


@contextlib.asynccontextmanager
async def _running(actor: Actor) -> AsyncIterator[ActorRef]:
    async with anyio.create_task_group() as tg:
        ref = actor.ref()
        actor.close()
        await tg.start(actor.run)
        try:
            yield ref
        finally:
            ref.close()


@pytest.fixture
def running():
    """``async with running(actor) as ref``: the actor runs until the block ends."""
    return _running


@pytest.fixture
def sampler_draws(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many rows each draw of a request's sampler was given, in order."""
    from mlxkv.actors.sampling import _Draw

    seen: list[int] = []
    honest = _Draw.__call__

    def counted(self: _Draw, logprobs: Any) -> Any:
        seen.append(logprobs.shape[0])
        return honest(self, logprobs)

    monkeypatch.setattr(_Draw, "__call__", counted)
    return seen
