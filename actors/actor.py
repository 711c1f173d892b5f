"""The actor base: one owner per piece of state, driven by typed messages.

An actor holds one synchronous ``mlxkv.cache`` object and a bounded mailbox
(an anyio memory object stream). Its loop's only ``await`` is receiving the
next message; every handler is synchronous, so each message is handled
atomically and no lock is needed.

Messages are frozen ``attrs`` classes. A :class:`Tell` expects no reply. An
:class:`Ask` carries a one-shot reply stream that the caller created (buffer
of one, so the actor's ``send_nowait`` never blocks). Domain errors
(:class:`~mlxkv.cache.errors.CacheError`) travel back as values and are
re-raised in the caller; any other exception is a bug and crashes the actor,
which closes every pending caller's reply stream so that no one hangs.

Cancellation: a caller cancelled while waiting closes its reply stream; the
actor then finds the reply undeliverable and undoes it itself
(:meth:`Actor.undo`). If the reply was delivered just before the caller was
cancelled, the caller finds it with ``receive_nowait`` and sends the same undo
message, shielded from the cancellation. Either way the state the reply
granted (blocks, references) is given back exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar, Generic, Optional, TypeVar, Union

import anyio
import attrs
from anyio.abc import TaskStatus
from anyio.streams.memory import (
    MemoryObjectReceiveStream,
    MemoryObjectSendStream,
    MemoryObjectStreamStatistics,
)

from mlxkv.actors.event_log import EventLog
from mlxkv.cache.errors import CacheError

__all__ = [
    "Actor",
    "ActorFailed",
    "ActorHandle",
    "ActorRef",
    "ActorStatistics",
    "Ask",
    "ErrorReply",
    "Intercept",
    "Message",
    "Tell",
]

R = TypeVar("R")


class ActorFailed(CacheError):
    """The actor that should answer has stopped (closed, crashed or cancelled).

    Attributes:
        actor: the actor's name.
        cause: the exception that crashed the actor, if it crashed.
    """

    def __init__(self, actor: str, cause: Optional[BaseException] = None) -> None:
        self.actor = actor
        self.cause = cause
        detail = "" if cause is None else f" (crashed: {type(cause).__name__}: {cause})"
        super().__init__(f"actor {actor!r} is not running{detail}")


@attrs.frozen(kw_only=True)
class Tell:
    """A message that expects no reply.

    ``polled`` marks a message type that only asks for information
    (statistics, invariant checks, descriptions), which callers may send
    often: tracing leaves it out unless asked. A Tell that carries a stream
    its sender reads defines ``fail(error)`` (tell the sender the message
    failed) and ``close_streams()`` (the actor stopped before handling it).
    """

    polled: ClassVar[bool] = False

    request_id: Optional[str] = None


@attrs.frozen(kw_only=True)
class Ask(Generic[R]):
    """A message whose handler's return value (of type ``R``) is sent back.

    ``polled``: as for :class:`Tell`.
    """

    polled: ClassVar[bool] = False

    request_id: Optional[str] = None
    reply: MemoryObjectSendStream[Any] = attrs.field(repr=False, eq=False)


#: Anything an actor's mailbox carries.
Message = Union[Tell, Ask[Any]]

#: Called with ``(actor name, message)`` before each message is handled; what
#: it raises counts as raised by the handler (a CacheError is answered, any
#: other exception crashes the actor). For tests and fault injection.
Intercept = Callable[[str, Message], None]


@attrs.frozen
class ErrorReply:
    """A domain error travelling back to the caller as a value (the handler's
    answer when it raised a CacheError; the caller raises it again)."""

    error: CacheError


@attrs.frozen
class _Envelope:
    message: Message
    enqueued_at: float


@attrs.frozen(kw_only=True)
class ActorStatistics:
    """What an actor has done, and how full its mailbox is.

    Attributes:
        name: the actor's name.
        num_handled: messages handled (answered or not).
        num_failed: messages answered with a domain error.
        num_undone: replies given back by the actor because the caller had
            gone (the caller gives back the others itself).
        mailbox: anyio's statistics of the mailbox: ``current_buffer_used``
            never exceeds ``max_buffer_size``; senders beyond it wait
            (``tasks_waiting_send``).
    """

    name: str
    num_handled: int
    num_failed: int
    num_undone: int
    mailbox: MemoryObjectStreamStatistics


class Actor:
    """Base class: a bounded mailbox and a loop that handles one message at a time.

    Subclasses implement :meth:`handle` (synchronous) and, where a reply
    grants something, :meth:`undo`.

    Owns: its mailbox's receiving end, the state subclasses add, and the
    exception that crashed it (``None`` while it runs or after a clean stop).

    Invariants:
        - state owned by the actor is touched only inside :meth:`handle`;
        - every :class:`Ask` that enters the mailbox gets exactly one of: a
          reply, a closed reply stream (the caller sees :class:`ActorFailed`),
          or an undo because the caller went away;
        - the mailbox holds at most ``mailbox_size`` messages; further senders
          wait.
    """

    name: ClassVar[str] = "actor"

    def __init__(
        self,
        *,
        mailbox_size: int = 64,
        trace: bool = False,
        trace_polls: bool = False,
        intercept: Optional[Intercept] = None,
    ) -> None:
        """Create the mailbox; nothing runs until :meth:`run`.

        Args:
            mailbox_size: messages the mailbox buffers before senders wait.
            trace: emit one ``message.handled`` event per message (polled
                messages only with ``trace_polls``), with what the message
                did (:meth:`outcome`).
            trace_polls: also trace polled messages (statistics, checks).
            intercept: see :data:`Intercept`.

        Raises:
            ValueError: ``mailbox_size`` is below 1.
        """
        if mailbox_size < 1:
            raise ValueError("mailbox_size must be at least 1")
        self._mailbox_in, self._mailbox_out = anyio.create_memory_object_stream[_Envelope](
            mailbox_size
        )
        # Decided once here, not per message: with tracing off no event is built.
        self._log = EventLog(actor=self.name)
        self._trace = self._log if trace else None
        self._trace_polls = trace_polls
        self._intercept = intercept
        self._cause: Optional[BaseException] = None
        self.num_handled = 0
        self.num_failed = 0
        self.num_undone = 0

    # -- to implement -----------------------------------------------------

    def handle(self, message: Message) -> Any:
        """Apply ``message`` to the owned state; return the reply for an Ask.

        Raises:
            CacheError: a domain error, sent back to the caller; the handler
                must not have changed any state when it raises one.
        """
        raise TypeError(f"{self.name} cannot handle {type(message).__name__}")

    def has_work(self) -> bool:
        """Whether the actor has work to do beyond handling messages (see
        :meth:`work`). By default it has none."""
        return False

    async def work(self) -> None:
        """Do one piece of the actor's own work; the loop calls it between
        messages while :meth:`has_work` says so, after handling every
        message already waiting. It may await (the only await besides
        receiving); messages wait meanwhile. What it raises crashes the
        actor as a handler's bug would.
        """

    def messages_waiting(self) -> bool:
        """Whether messages wait in the mailbox (for :meth:`work` to keep short)."""
        return self._mailbox_out.statistics().current_buffer_used > 0

    def undo(self, message: Ask[Any], reply: Any) -> Optional[Tell]:
        """The message that gives back what ``reply`` granted, if anything.

        Must be pure: it is also called in the caller's task, for a reply that
        reached the caller after it was cancelled.
        """
        return None

    def outcome(self, message: Message, result: Any) -> dict[str, Any]:
        """What handling ``message`` did, as trace fields (``granted=3``).

        By default the fields of the message's and the result's
        ``trace_fields()``, where they have one; actors override it for
        replies that are plain values.
        """
        fields: dict[str, Any] = {}
        for source in (message, result):
            summary = getattr(source, "trace_fields", None)
            if summary is not None:
                fields.update(summary())
        return fields

    # -- running -----------------------------------------------------------

    def ref(self) -> ActorRef:
        """A handle for sending messages to this actor; close it when done.

        The loop ends once this actor is closed, every ref is closed and the
        mailbox is drained.
        """
        return ActorRef(self.name, self._mailbox_in.clone(), self.undo, self._crash_cause)

    def close(self) -> None:
        """Close the actor's own sending end; refs already handed out stay open."""
        self._mailbox_in.close()

    def discard(self) -> None:
        """Close both ends of the mailbox of an actor that will never run."""
        self._mailbox_in.close()
        self._fail_pending()
        self._mailbox_out.close()

    def _crash_cause(self) -> Optional[BaseException]:
        return self._cause

    def statistics(self) -> ActorStatistics:
        """A snapshot of the counters and the mailbox."""
        return ActorStatistics(
            name=self.name,
            num_handled=self.num_handled,
            num_failed=self.num_failed,
            num_undone=self.num_undone,
            mailbox=self._mailbox_out.statistics(),
        )

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Handle messages (and :meth:`work` between them) until every sender
        is closed; then return. Work left then is dropped: nobody can ask
        for its results any more.

        If a handler raises anything but a CacheError, the exception
        propagates (crashing the task group) after every pending caller's
        reply stream has been closed and the mailbox refuses new messages.
        """
        mailbox = self._mailbox_out
        receive_nowait = mailbox.receive_nowait
        current: Optional[_Envelope] = None
        try:
            task_status.started()
            while True:
                if self.has_work():
                    # What waits now is handled first, then one piece of work.
                    waiting = mailbox.statistics()
                    if waiting.open_send_streams == 0 and waiting.current_buffer_used == 0:
                        break  # nobody can ask for the rest of the work any more
                    for _ in range(waiting.current_buffer_used):
                        try:
                            current = receive_nowait()
                        except (anyio.WouldBlock, anyio.EndOfStream):
                            break
                        self._dispatch(current)
                        current = None
                    if self.has_work():
                        await self.work()
                    continue
                # Messages already queued are handled back to back; the loop
                # waits (and lets others run) only when the mailbox is empty.
                try:
                    current = receive_nowait()
                except anyio.WouldBlock:
                    try:
                        current = await mailbox.receive()
                    except anyio.EndOfStream:
                        break
                except anyio.EndOfStream:
                    break
                self._dispatch(current)
                current = None
        except BaseException as error:
            self._record_crash(error, current)
            raise
        finally:
            if current is not None:
                _close_reply(current.message)
            # Fail what is still queued *before* closing: once the receiving
            # end is closed, receive_nowait can no longer reach the buffer and
            # those callers would wait forever.
            self._fail_pending()
            mailbox.close()

    def _dispatch(self, envelope: _Envelope) -> None:
        started = time.perf_counter()
        try:
            if self._intercept is not None:
                self._intercept(self.name, envelope.message)
            result: Any = self.handle(envelope.message)
        except CacheError as error:
            result = ErrorReply(error)
        self._deliver(envelope, result, started)

    def _deliver(
        self, envelope: _Envelope, result: Any, started: float, *, abandoned: bool = False
    ) -> None:
        """Answer, or undo, one handled message; count it and trace it.

        Args:
            envelope: the handled message.
            result: the handler's return value, or a :class:`ErrorReply`.
            started: ``perf_counter()`` when handling began.
            abandoned: the caller is known to be gone (its reply is undone
                by the subclass already); nothing is sent.
        """
        message = envelope.message
        if isinstance(result, ErrorReply):
            self.num_failed += 1
        self.num_handled += 1
        undone = False
        if isinstance(message, Ask):
            try:
                if abandoned:
                    raise anyio.BrokenResourceError
                message.reply.send_nowait(result)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                # The caller was cancelled before we answered: give it back here.
                if abandoned:
                    undone = True
                elif not isinstance(result, ErrorReply):
                    compensation = self.undo(message, result)
                    if compensation is not None:
                        self._apply_undo(compensation)
                        undone = True
                self.num_undone += undone
            finally:
                message.reply.close()
        elif isinstance(result, ErrorReply):
            fail = getattr(message, "fail", None)
            if fail is not None:
                fail(result.error)  # the Tell carries a stream its sender reads
            else:
                # Nobody waits for this Tell's outcome: it must not vanish.
                self._log.warning(
                    "message.failed",
                    message=type(message).__name__,
                    request_id=message.request_id,
                    error=f"{type(result.error).__name__}: {result.error}",
                )
        if self._trace is not None and (self._trace_polls or not message.polled):
            done = time.perf_counter()
            failed = isinstance(result, ErrorReply)
            self._trace.info(
                "message.handled",
                message=type(message).__name__,
                request_id=message.request_id,
                queued_ms=round((started - envelope.enqueued_at) * 1e3, 4),
                handling_ms=round((done - started) * 1e3, 4),
                error=type(result.error).__name__ if failed else None,
                undone=undone,
                **({} if failed else self.outcome(message, result)),
            )

    def _apply_undo(self, compensation: Tell) -> None:
        """Apply the undo of a reply whose caller is gone (synchronously, here)."""
        self.handle(compensation)

    def _record_crash(self, error: BaseException, current: Optional[_Envelope]) -> None:
        """Remember why the loop stopped, unless it was a plain cancellation.

        A domain error can escape only from starting (a model that does not
        load): it is its caller's to report, not logged as a crash.
        """
        if isinstance(error, anyio.get_cancelled_exc_class()):
            return
        self._cause = error
        if isinstance(error, CacheError):
            return
        self._log.error(
            "actor.crashed",
            message=None if current is None else type(current.message).__name__,
            error=f"{type(error).__name__}: {error}",
        )

    def _fail_pending(self) -> None:
        """Close the reply stream of every message still queued or being sent."""
        while True:
            try:
                envelope = self._mailbox_out.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return
            _close_reply(envelope.message)

    def mailbox_statistics(self) -> MemoryObjectStreamStatistics:
        """anyio's statistics of the mailbox (buffer use, waiting senders)."""
        return self._mailbox_out.statistics()


def _close_reply(message: Message) -> None:
    """Close whatever the sender of ``message`` waits on: an Ask's reply
    stream, or the streams a Tell carries (``close_streams()``)."""
    if isinstance(message, Ask):
        message.reply.close()
    else:
        close = getattr(message, "close_streams", None)
        if close is not None:
            close()


class ActorRef:
    """The sending side of an actor's mailbox, as used by handles.

    Sending waits while the mailbox is full (back-pressure) and is a
    cancellation point; replies are re-raised if they are failures. A ref is
    a resource: close it (or use it as a context manager) when done, or the
    actor never sees the end of its mailbox.

    Owns: one clone of the mailbox's sending end.

    Invariants:
        - every reply an :meth:`ask` receives is either returned to its
          caller or given back (the actor's undo message, sent shielded);
        - both ends of an ask's reply stream are closed when the ask ends.
    """

    def __init__(
        self,
        name: str,
        mailbox: MemoryObjectSendStream[_Envelope],
        undo: Callable[[Ask[Any], Any], Optional[Tell]],
        crash_cause: Callable[[], Optional[BaseException]] = lambda: None,
    ) -> None:
        self.name = name
        self._mailbox = mailbox
        self._undo = undo
        self._crash_cause = crash_cause

    def clone(self) -> ActorRef:
        """Another ref to the same actor, closed independently.

        Raises:
            ActorFailed: this ref is closed.
        """
        try:
            mailbox = self._mailbox.clone()
        except anyio.ClosedResourceError:
            raise ActorFailed(self.name) from None
        return ActorRef(self.name, mailbox, self._undo, self._crash_cause)

    def close(self) -> None:
        """Stop sending through this ref; idempotent."""
        self._mailbox.close()

    def __enter__(self) -> ActorRef:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def statistics(self) -> MemoryObjectStreamStatistics:
        """anyio's statistics of the actor's mailbox."""
        return self._mailbox.statistics()

    def failed(self) -> ActorFailed:
        """The error for a caller the actor stopped answering: names it, and
        carries the crash that stopped it, if one did."""
        return ActorFailed(self.name, self._crash_cause())

    async def tell(self, message: Tell) -> None:
        """Send a message that expects no reply; a cancellation point.

        Raises:
            ActorFailed: the actor is not running, or this ref is closed.
        """
        try:
            await self._mailbox.send(_Envelope(message, time.perf_counter()))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise self.failed() from None

    async def tell_shielded(self, message: Tell) -> None:
        """:meth:`tell`, immune to the caller's cancellation (for releases).

        Waits only while the mailbox is full.

        Raises:
            ActorFailed: the actor is not running, or this ref is closed.
        """
        with anyio.CancelScope(shield=True):
            await self._post(message)

    async def _post(self, message: Message) -> None:
        """Enqueue ``message``, waiting only while the mailbox is full."""
        envelope = _Envelope(message, time.perf_counter())
        try:
            try:
                self._mailbox.send_nowait(envelope)
            except anyio.WouldBlock:
                await self._mailbox.send(envelope)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise self.failed() from None

    async def ask(self, message_type: type[Ask[R]], /, **fields: Any) -> R:
        """Send ``message_type(**fields, reply=...)`` and wait for the reply.

        If the caller is cancelled at any point, whatever the reply granted is
        given back: by the actor if it had not answered yet, else from here.

        Returns:
            The handler's return value.

        Raises:
            CacheError: the domain error the handler raised.
            ActorFailed: the actor stopped before answering.
        """
        reply_in, reply_out = anyio.create_memory_object_stream[Any](1)
        # Both ends are closed on every path, including a message type that
        # rejects ``fields``.
        with reply_in, reply_out:
            message = message_type(reply=reply_in, **fields)
            try:
                # No checkpoint of its own when the mailbox has room: the
                # wait for the reply below is the call's cancellation point.
                await self._post(message)
                try:
                    result = await reply_out.receive()
                except anyio.EndOfStream:
                    raise self.failed() from None
            except BaseException:
                await self._give_back_late_reply(message, reply_out)
                raise
        if isinstance(result, ErrorReply):
            raise result.error
        return result

    async def _give_back_late_reply(
        self, message: Ask[Any], reply_out: MemoryObjectReceiveStream[Any]
    ) -> None:
        """Undo a reply that landed just before the caller stopped waiting."""
        try:
            late = reply_out.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            # No reply yet: closing ``reply_out`` (with no await in between)
            # makes the actor undo it.
            return
        if isinstance(late, ErrorReply):
            return
        compensation = self._undo(message, late)
        if compensation is not None:
            try:
                await self.tell_shielded(compensation)
            except ActorFailed:
                pass  # the actor is gone, and with it the state to give back


class ActorHandle:
    """Base of the typed handles: holds one :class:`ActorRef`.

    Subclasses add one method per message; messages never reach users.
    """

    def __init__(self, ref: ActorRef) -> None:
        self._ref = ref

    def close(self) -> None:
        """Close the underlying ref."""
        self._ref.close()

    def failed(self) -> ActorFailed:
        """See :meth:`ActorRef.failed`: for a caller whose stream from the
        actor ended without its last word."""
        return self._ref.failed()

    def mailbox_statistics(self) -> MemoryObjectStreamStatistics:
        """anyio's statistics of the actor's mailbox."""
        return self._ref.statistics()
