"""An answer as it may be sent: one generation's pieces, and several answers' in one task.

:class:`Answer` turns one generation's records into the pieces a response
sends: stop strings cut the text (:class:`~mlxkv.server.stop.StopMatcher`),
its reasoning and tool calls are read out of it as the request asks
(:class:`Reading`; :mod:`mlxkv.server.markers`), and every counted token's
log-probabilities come out with a piece. :func:`each_piece` runs several
answers (a request's choices, generating side by side) and hands their
pieces to one task, one at a time.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Optional

import anyio
import attrs

from mlxkv.generation import Generation, GenerationReport
from mlxkv.server.logprobs import LoggedToken
from mlxkv.server.markers import Inside, MarkedSplitter, Segment
from mlxkv.server.reasoning import ReasoningSyntax
from mlxkv.server.request import ToolCall
from mlxkv.server.stop import StopMatcher
from mlxkv.server.tools import ToolSyntax

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["Answer", "Piece", "Prompt", "Reading", "each_piece", "first_failure"]


@attrs.frozen(kw_only=True)
class Prompt:
    """A prompt ready to generate from: its tokens, images, (for chat) text,
    and (for a completion that echoes it) the text its answers begin with."""

    tokens: tuple[int, ...]
    images: tuple[str, ...] = ()
    text: Optional[str] = None
    echo: Optional[str] = None


@attrs.frozen
class Piece:
    """Some of an answer's text as it may be sent, of its reasoning, or
    tool calls it made (``first_call``: the index of the first among the
    answer's calls); and the log-probabilities of the tokens generated since
    the last piece (empty unless asked for)."""

    text: str
    tokens: tuple[LoggedToken, ...] = ()
    calls: tuple[ToolCall, ...] = ()
    first_call: int = 0
    reasoning: str = ""


@attrs.frozen(kw_only=True)
class Reading:
    """What a chat answer reads out of its text: its reasoning (in the
    model's ``reasoning`` syntax; sent unless ``include_reasoning`` is
    false), and its tool calls (in the model's ``calls`` syntax, of the
    ``tools`` offered; with ``one_call``, the answer ends at its first).
    None of either: the text as written."""

    reasoning: Optional[ReasoningSyntax] = None
    include_reasoning: bool = True
    calls: Optional[ToolSyntax] = None
    tools: tuple[Mapping[str, Any], ...] = ()
    one_call: bool = False


class Answer:
    """One generation's text as it may be sent (choice ``index`` of its
    request, over ``prompt``): stop strings cut it, its reasoning and tool
    calls are read out of it (as ``reading`` says), counts kept.

    Owns: the stop matcher, the splitters, the calls made, the counts, and
    the log-probabilities of the tokens whose piece is not out yet; the
    generation is the caller's.
    """

    def __init__(
        self,
        index: int,
        prompt: Prompt,
        generation: Generation,
        stops: Sequence[str],
        on_first_token: Callable[[], None],
        reading: Reading = Reading(),
    ) -> None:
        self.index = index
        self.prompt = prompt
        self.generation = generation
        self.report: Optional[GenerationReport] = None
        self.finish_reason = "length"
        self.num_tokens = 0
        #: Of them, those read inside a reasoning block (from the token that
        #: completes its start marker to the one that completes its end).
        self.reasoning_tokens = 0
        self.calls: list[ToolCall] = []
        self._matcher = StopMatcher(stops)
        self._reading = reading
        self._thoughts = None if reading.reasoning is None else reading.reasoning.splitter(prompt.text or "")
        self._calls = None if reading.calls is None else reading.calls.splitter()
        self._on_first_token = on_first_token
        self._logged: list[LoggedToken] = []
        self._offset = 0  # characters of the generation's text so far

    @property
    def cached_tokens(self) -> int:
        return self.generation.cached_tokens or 0

    @property
    def complete(self) -> bool:
        """Whether the answer is the whole generation (ended by the model or
        ``max_tokens``, not cut by a stop string or at its one call)."""
        return self.report is not None and not self._matcher.stopped and not self._at_its_one_call

    @property
    def _at_its_one_call(self) -> bool:
        """Whether the answer ends here: at its first call, where it may make one (``one_call``)."""
        return self._reading.one_call and bool(self.calls)

    async def pieces(self) -> AsyncIterator[Piece]:
        """The answer in pieces, none empty (of text, of reasoning, of calls,
        or of log-probabilities: a token's come with the first piece after
        it, or with the last); ends at the report or a stop string. Every
        counted token's log-probabilities come out, if asked for."""
        async for record in self.generation:
            if isinstance(record, GenerationReport):
                self.report = record
                pieces = self._out(self._matcher.flush(), end=True)
                self._end(record.finish_reason)
                for piece in pieces:
                    yield piece
                return
            if not self.num_tokens:
                self._on_first_token()
            self.num_tokens += 1
            if record.logprob is not None:
                self._logged.append(LoggedToken(record.logprob, self._offset))
            self._offset += len(record.text)
            thoughts = self._thoughts
            before = None if thoughts is None else (thoughts.inside, thoughts.opened)
            text = self._matcher.feed(record.text)
            pieces = self._out(text, end=self._matcher.stopped)
            if before is not None and (before[0] or thoughts.inside or thoughts.opened > before[1]):
                self.reasoning_tokens += 1
            for piece in pieces:
                yield piece
            if self._matcher.stopped or self._at_its_one_call:
                self._end("stop")
                return

    def _end(self, reason: str) -> None:
        """The answer ended for ``reason``: ended by the model after calling
        tools, it ended for them (OpenAI's ``tool_calls``)."""
        self.finish_reason = "tool_calls" if reason == "stop" and self.calls else reason

    def _out(self, text: str, *, end: bool) -> list[Piece]:
        """The pieces ``text`` makes (its reasoning and calls read out); at
        the ``end``, the splitters' rest too, and a last piece for tokens not
        yet out."""
        pieces = []
        for segment in split_by(self._thoughts, text, end=end):
            if not isinstance(segment, Inside):
                pieces += self._content(split_by(self._calls, segment, end=False))
            elif self._reading.include_reasoning and segment.text and not self._at_its_one_call:
                pieces.append(self._piece(reasoning=segment.text))
        if end and self._calls is not None:
            pieces += self._content(self._calls.finish())
        if self._at_its_one_call:
            end = True  # nothing after the one call is sent
        if end and self._logged:
            pieces.append(self._piece())
        return pieces

    def _content(self, parts: list[Segment]) -> list[Piece]:
        """The pieces of the content's ``parts``: its text, and its calls
        (a call the parser cannot read: the model's text, as written)."""
        pieces = []
        for part in parts:
            if self._at_its_one_call:
                break
            if isinstance(part, Inside):
                assert self._reading.calls is not None
                calls = self._reading.calls.calls(part, self._reading.tools)
                if not isinstance(calls, str):
                    if self._reading.one_call:
                        calls = calls[:1]
                    pieces.append(self._piece(calls=calls))
                    continue
                part = calls
            if part:
                pieces.append(self._piece(part))
        return pieces

    def _piece(self, text: str = "", *, calls: tuple[ToolCall, ...] = (), reasoning: str = "") -> Piece:
        logged, self._logged = tuple(self._logged), []
        first = len(self.calls)
        self.calls.extend(calls)
        return Piece(text, logged, calls, first, reasoning)


def split_by(splitter: Optional[MarkedSplitter], text: str, *, end: bool) -> list[Segment]:
    """``text`` cut by ``splitter`` (and its rest, at the ``end``); by none, as it is."""
    if splitter is None:
        return [text]
    return splitter.feed(text) + (splitter.finish() if end else [])


async def each_piece(
    answers: Sequence[Answer], handle: Callable[[Answer, Optional[Piece]], Awaitable[None]]
) -> None:
    """``handle(answer, piece)`` for every piece of every answer as it comes,
    then ``handle(answer, None)`` as that answer ends, one at a time in this
    task: several answers (generating side by side, in one batch) send their
    pieces over one channel, a task each. The first failure ends them all and
    is raised as itself."""
    if len(answers) == 1:
        await _pieces_of(answers[0], handle)
        return
    pieces_in, pieces = anyio.create_memory_object_stream[tuple[Answer, Optional[Piece]]]()

    async def produce(answer: Answer, out: Any) -> None:
        async def put(answer: Answer, piece: Optional[Piece]) -> None:
            await out.send((answer, piece))

        async with out:
            await _pieces_of(answer, put)

    try:
        async with anyio.create_task_group() as tg:
            async with pieces_in:
                for answer in answers:
                    tg.start_soon(produce, answer, pieces_in.clone())
            async with pieces:
                async for answer, piece in pieces:
                    await handle(answer, piece)
    except BaseExceptionGroup as group:
        failure = first_failure(group)
        if failure is None:
            raise
        raise failure from None


async def _pieces_of(answer: Answer, handle: Callable[[Answer, Optional[Piece]], Awaitable[None]]) -> None:
    async with contextlib.aclosing(answer.pieces()) as pieces:
        async for piece in pieces:
            await handle(answer, piece)
    await handle(answer, None)


def first_failure(group: BaseExceptionGroup) -> Optional[BaseException]:
    """The first exception in a task group's ``group`` (nested groups opened)
    that is not a cancellation, or None if it holds only cancellations."""
    _, failures = group.split(anyio.get_cancelled_exc_class())
    while isinstance(failures, BaseExceptionGroup):
        failures = failures.exceptions[0]
    return failures
