"""The actor base: mailbox, atomic handling, replies, undo, crashes."""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator
from typing import Any, Optional

import anyio
import attrs
import pytest
from structlog.testing import capture_logs

from mlxkv.actors.actor import Actor, ActorFailed, Ask, Message, Tell
from mlxkv.cache.errors import InvalidInput

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup


@contextlib.contextmanager
def raises_in_group(kind: type, match: str) -> Iterator[None]:
    """Expect a task group to raise a group holding exactly one ``kind`` error."""
    try:
        yield
    except BaseExceptionGroup as group:
        assert len(group.exceptions) == 1, group
        error = group.exceptions[0]
        assert isinstance(error, kind) and match in str(error), group
    else:
        pytest.fail(f"no {kind.__name__} was raised")


@attrs.frozen(kw_only=True)
class Take(Ask[int]):
    amount: int


@attrs.frozen(kw_only=True)
class Give(Tell):
    amount: int


@attrs.frozen(kw_only=True)
class Get(Ask[int]):
    pass


@attrs.frozen(kw_only=True)
class Boom(Ask[None]):
    pass


class CounterActor(Actor):
    """Owns one counter; ``Take`` grants units that ``Give`` returns."""

    name = "counter"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.taken = 0

    def handle(self, message: Message) -> Any:
        match message:
            case Take():
                if message.amount < 0:
                    raise InvalidInput("amount", message.amount, "must be >= 0")
                self.taken += message.amount
                return message.amount
            case Give():
                if message.amount > self.taken:
                    raise InvalidInput("amount", message.amount, "more than taken")
                self.taken -= message.amount
                return None
            case Get():
                return self.taken
            case Boom():
                raise RuntimeError("boom")
        return super().handle(message)

    def undo(self, message: Ask[Any], reply: Any) -> Optional[Tell]:
        if isinstance(message, Take):
            return Give(amount=reply, request_id=message.request_id)
        return None


class TestAsk:
    async def test_reply_is_the_handlers_return_value(self, running):
        """An Ask returns what the handler returned, in mailbox order."""
        actor = CounterActor()
        async with running(actor) as ref:
            assert await ref.ask(Take, amount=3) == 3
            assert await ref.ask(Take, amount=4) == 4
            assert await ref.ask(Get) == 7

    async def test_domain_error_is_raised_in_the_caller(self, running):
        """A CacheError from the handler is re-raised in the caller; the actor lives on."""
        actor = CounterActor()
        async with running(actor) as ref:
            with pytest.raises(InvalidInput, match="amount"):
                await ref.ask(Take, amount=-1)
            assert await ref.ask(Get) == 0
        assert actor.statistics().num_failed == 1

    async def test_tells_are_handled_in_order(self, running):
        """Tells need no reply and are handled before a later Ask."""
        actor = CounterActor()
        async with running(actor) as ref:
            await ref.ask(Take, amount=5)
            await ref.tell(Give(amount=2))
            await ref.tell_shielded(Give(amount=1))
            assert await ref.ask(Get) == 2

    async def test_failed_tell_is_logged(self, running):
        """A Tell whose handler fails is reported as a warning, not lost silently."""
        actor = CounterActor()
        with capture_logs() as logs:
            async with running(actor) as ref:
                await ref.tell(Give(amount=9, request_id="r1"))
                await ref.ask(Get)
        failed = [log for log in logs if log["event"] == "message.failed"]
        assert failed and failed[0]["log_level"] == "warning"
        assert failed[0]["request_id"] == "r1" and failed[0]["actor"] == "counter"

    async def test_bad_message_fields_leak_no_stream(self, running):
        """A message that rejects its fields raises TypeError and closes both reply ends."""
        actor = CounterActor()
        async with running(actor) as ref:
            with pytest.raises(TypeError):
                await ref.ask(Take, nonsense=1)
            gc.collect()  # an unclosed stream would warn (an error here)

    async def test_intercept_error_is_the_handlers(self, running):
        """A CacheError raised by the intercept hook is answered like the handler's."""

        def intercept(actor: str, message: Message) -> None:
            if isinstance(message, Take):
                raise InvalidInput("amount", message.amount, "intercepted")

        actor = CounterActor(intercept=intercept)
        async with running(actor) as ref:
            with pytest.raises(InvalidInput, match="intercepted"):
                await ref.ask(Take, amount=1)
            assert await ref.ask(Get) == 0

    async def test_loop_ends_when_every_sender_is_closed(self):
        """run() returns once the actor and all its refs are closed and the mailbox drained."""
        actor = CounterActor()
        ref = actor.ref()
        clone = ref.clone()
        actor.close()
        async with anyio.create_task_group() as tg:
            await tg.start(actor.run)
            await clone.tell(Give(amount=0))
            clone.close()
            ref.close()
        assert actor.statistics().num_handled == 1
        with pytest.raises(ActorFailed):
            await ref.tell(Give(amount=0))


class TestCancellation:
    async def test_caller_gone_before_handling_is_undone_by_the_actor(self):
        """A caller cancelled while its Ask is queued makes the actor undo the reply."""
        actor = CounterActor()
        ref = actor.ref()
        actor.close()
        scopes: list[anyio.CancelScope] = []

        async def caller() -> None:
            with anyio.CancelScope() as scope:
                scopes.append(scope)
                await ref.ask(Take, amount=5)

        async with anyio.create_task_group() as tg:
            tg.start_soon(caller)
            await anyio.wait_all_tasks_blocked()
            assert actor.mailbox_statistics().current_buffer_used == 1
            scopes[0].cancel()
            await anyio.wait_all_tasks_blocked()
            await tg.start(actor.run)
            assert await ref.ask(Get) == 0
            ref.close()
        assert scopes[0].cancelled_caught
        assert actor.statistics().num_undone == 1

    async def test_reply_landing_after_cancel_is_undone_by_the_caller(self, running):
        """A reply buffered just after the caller was cancelled is given back by the caller."""
        scopes: list[anyio.CancelScope] = []

        def intercept(name: str, message: Message) -> None:
            if isinstance(message, Take):
                scopes[0].cancel()  # the caller is cancelled while the actor handles

        actor = CounterActor(intercept=intercept)
        async with running(actor) as ref:
            with anyio.CancelScope() as scope:
                scopes.append(scope)
                await ref.ask(Take, amount=5)
            assert scope.cancelled_caught
            assert await ref.ask(Get) == 0
        assert actor.taken == 0
        assert actor.statistics().num_undone == 0  # the caller did it

    async def test_failure_reply_needs_no_undo(self, running):
        """A cancelled caller whose reply is a failure sends no compensation."""
        scopes: list[anyio.CancelScope] = []

        def intercept(name: str, message: Message) -> None:
            if isinstance(message, Take):
                scopes[0].cancel()

        actor = CounterActor(intercept=intercept)
        async with running(actor) as ref:
            with anyio.CancelScope() as scope:
                scopes.append(scope)
                await ref.ask(Take, amount=-1)
            assert await ref.ask(Get) == 0
        assert actor.statistics().num_handled == 2


class TestMailbox:
    async def test_full_mailbox_makes_senders_wait(self):
        """Beyond mailbox_size queued messages, senders wait; none is lost."""
        actor = CounterActor(mailbox_size=2)
        ref = actor.ref()
        actor.close()
        async with anyio.create_task_group() as tg:
            for _ in range(7):
                tg.start_soon(ref.tell, Give(amount=0))
            await anyio.wait_all_tasks_blocked()
            mailbox = actor.statistics().mailbox
            assert mailbox.current_buffer_used == 2
            assert mailbox.max_buffer_size == 2
            assert mailbox.tasks_waiting_send == 5
            await tg.start(actor.run)
            await anyio.wait_all_tasks_blocked()
            ref.close()
        assert actor.statistics().num_handled == 7

    async def test_rejects_an_empty_mailbox(self):
        """mailbox_size must be at least 1."""
        with pytest.raises(ValueError):
            CounterActor(mailbox_size=0)


class TestCrash:
    async def test_pending_callers_get_actor_failed(self):
        """A crash fails the current, queued and waiting callers; run() raises the cause."""
        actor = CounterActor(mailbox_size=2)
        ref = actor.ref()
        spare = actor.ref()
        actor.close()
        outcomes: list[BaseException] = []

        async def call(message_type: type, **fields: Any) -> None:
            try:
                await ref.ask(message_type, **fields)
            except ActorFailed as error:
                outcomes.append(error)

        async with anyio.create_task_group() as callers:
            callers.start_soon(call, Boom)
            await anyio.wait_all_tasks_blocked()
            for _ in range(4):  # one more queued, three waiting for room
                callers.start_soon(call, Get)
            await anyio.wait_all_tasks_blocked()
            assert actor.mailbox_statistics().tasks_waiting_send == 3
            with raises_in_group(RuntimeError, "boom"):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(actor.run)
        ref.close()
        assert len(outcomes) == 5
        assert all(isinstance(error.cause, RuntimeError) for error in outcomes)
        with spare, pytest.raises(ActorFailed, match="crashed: RuntimeError: boom"):
            await spare.tell(Give(amount=0))

    async def test_crash_is_logged(self):
        """A crash emits an error event naming the actor and the message."""
        actor = CounterActor()
        ref = actor.ref()
        actor.close()
        with capture_logs() as logs:
            with raises_in_group(RuntimeError, "boom"):
                async with anyio.create_task_group() as tg:
                    await tg.start(actor.run)
                    with pytest.raises(ActorFailed):
                        await ref.ask(Boom)
        ref.close()
        crashed = [log for log in logs if log["event"] == "actor.crashed"]
        assert crashed == [
            {
                "event": "actor.crashed",
                "actor": "counter",
                "message": "Boom",
                "error": "RuntimeError: boom",
                "log_level": "error",
            }
        ]

    async def test_discard_fails_queued_callers(self):
        """An actor discarded before it ran fails what was queued for it."""
        actor = CounterActor()
        ref = actor.ref()
        outcomes: list[BaseException] = []

        async def call() -> None:
            try:
                await ref.ask(Get)
            except ActorFailed as error:
                outcomes.append(error)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await anyio.wait_all_tasks_blocked()
            actor.discard()
        ref.close()
        assert len(outcomes) == 1


class TestTrace:
    async def test_one_event_per_message(self, running):
        """With tracing on, each handled message yields one info event with timings."""
        actor = CounterActor(trace=True)
        with capture_logs() as logs:
            async with running(actor) as ref:
                await ref.ask(Take, amount=1, request_id="r7")
                await ref.tell(Give(amount=1, request_id="r7"))
                await ref.ask(Get)
        handled = [log for log in logs if log["event"] == "message.handled"]
        assert [(log["message"], log["request_id"]) for log in handled] == [
            ("Take", "r7"),
            ("Give", "r7"),
            ("Get", None),
        ]
        assert all(log["log_level"] == "info" and log["actor"] == "counter" for log in handled)
        assert all(log["queued_ms"] >= 0 and log["handling_ms"] >= 0 for log in handled)

    async def test_silent_without_tracing(self, running):
        """With tracing off, handling messages emits nothing."""
        actor = CounterActor()
        with capture_logs() as logs:
            async with running(actor) as ref:
                await ref.ask(Take, amount=1)
        assert logs == []
