"""The compute actor: a thin shell over the scheduler and the executor.

:class:`ComputeActor` receives requests and cancellations (its mailbox),
keeps them in a :class:`~mlxkv.actors.scheduler.Scheduler` (every request's
state, and the policy of what runs next), has an
:class:`~mlxkv.actors.executor.Executor` run each of the scheduler's plans
on its :class:`~mlxkv.actors.mlx_thread.MLXThread` (every MLX object lives
there), hands the executor's result back to the scheduler, and sends the
events that come out to each request's streams. Between plans it handles
the messages that arrived (:meth:`Actor.work`).

Messages (each :class:`~mlxkv.actors.actor.Ask` answers with the noun after
the arrow):

- :class:`Generate` (no reply of its own): start a request (its
  :class:`~mlxkv.actors.request.RequestSpec`). Its events --
  :class:`Prefilled`, one :class:`Token` per plan that produced tokens
  for it, then :class:`Finished` or :class:`Failed` -- go to the event
  stream the caller passes, sized so that the actor never waits on it
  (:func:`events_needed`). What is to be cached goes to a second stream
  if the caller passes one (else to the same): :class:`Published` (full
  blocks as soon as the chunk that computed them is done; the last
  chunk's just after its first token, which is not kept waiting for
  them), :class:`PromptPublished` once the prompt's blocks are all out,
  the answer's blocks as the request finishes, and, for a
  vision-language request, :class:`ImagesEncoded` when the vision
  encoder ran for it. Both streams end when the request does.
- :class:`Cancel` (no reply): stop a request; a request whose event stream
  nobody reads any more is cancelled the same way.
- :class:`NewPreparer` -> the model's
  :class:`~mlxkv.actors.prompt_preparer.PromptPreparer` (tokenizer, and image
  processor of a vision-language model), shared with the caller, who runs it
  on its own threads; :class:`Describe` -> :class:`ModelInfo`;
  :class:`Statistics` -> :class:`ComputeStatistics`.

Scheduling, batching and the fairness bound: :mod:`mlxkv.actors.scheduler`.
What runs where, and how one request's failure stays its own:
:mod:`mlxkv.actors.executor`.

The kept caches. When a request finishes, the runner keeps its cache
(beside the block pool; plain KV layers only), the most recent ones up to
:data:`~mlxkv.actors.kept_caches.MAX_KEPT_CACHES` and
``RunnerConfig.kept_cache_memory`` bytes. A later request takes
the one it shares most of its first tokens with, cut back to what it may
use: within the kept cache's namespace (cache salt and images) every shared
token but the prompt's last, in another namespace only the prefix it brings
payloads for, and only when neither has images; it takes the cache itself
if it continues all of it (a conversation's next turn), else a copy of what
it uses (the cache stays for its continuation). Full blocks it gets that
way beyond the blocks it holds are published. ``keep_caches=False``
turns it off.

Failures. Messages arrive checked, as every actor's do (a
:class:`~mlxkv.actors.request.RequestSpec` checks its fields as it is made);
what depends on the actor's own state and model -- an id that is live
already, payloads not of this model, and a token beyond the model's
vocabulary (the runtime refuses it first; checked again here because it
would reach the embedding on the MLX thread) -- is answered as
:class:`Failed` and changes nothing. Every step done for one request fails that request only
(:class:`ComputeFailed`, with the cause); the tokens it was sent before
stand, and the requests beside it go on exactly. What the rows of a batch
share -- its model call, cutting its batch cache down or extending it --
fails those rows. If the MLX thread dies or the actor has a bug, it
crashes loudly: every waiting caller gets
:class:`~mlxkv.actors.actor.ActorFailed` (with the crash), and every
request's streams are closed.

Cancellation. Stopping a request ends its streams at once; its cache is
dropped by the next plan. A plan that is running finishes first (MLX
evaluation cannot be interrupted). If the actor itself is cancelled, it
closes every stream and its shutdown waits, shielded, for the MLX thread to
finish the running plan and stop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import anyio
import attrs
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from mlxkv.actors.actor import Actor, ActorHandle, Ask, Message, Tell
from mlxkv.actors.compute_config import RunnerConfig, SchedulingConfig
from mlxkv.actors.events import (
    ComputeFailed,
    Event,
    Failed,
    Finished,
    ImagesEncoded,
    Prefilled,
    PromptPublished,
    Published,
    Token,
    events_needed,
    goes_to_cache,
)
from mlxkv.actors.executor import Executor
from mlxkv.actors.mlx_thread import MLXThread, MLXThreadStatistics, MLXThreadStopped
from mlxkv.actors.model_info import ModelInfo
from mlxkv.actors.model_runner import ModelRunner, TextRunner
from mlxkv.actors.prompt_preparer import PromptPreparer
from mlxkv.actors.model_source import ModelLoadError, ModelSource
from mlxkv.actors.request import RequestSpec
from mlxkv.actors.plan import Plan, Result
from mlxkv.actors.scheduler import MAX_BURST_STEPS, Output, Scheduler, SchedulerStatistics
from mlxkv.cache.errors import CacheError, InvalidInput
from mlxkv.cache.kv_state import BlockPayload
from mlxkv.cache.token_ids import check_token_ids

__all__ = [
    "MAX_BURST_STEPS",
    "Cancel",
    "ComputeActor",
    "ComputeFailed",
    "ComputeHandle",
    "ComputeStatistics",
    "Describe",
    "Event",
    "Failed",
    "Finished",
    "Generate",
    "ImagesEncoded",
    "NewPreparer",
    "Prefilled",
    "PromptPublished",
    "Published",
    "RequestSpec",
    "RunnerConfig",
    "SchedulingConfig",
    "Statistics",
    "Token",
    "events_needed",
]


@attrs.frozen(kw_only=True)
class ComputeStatistics(SchedulerStatistics):
    """A snapshot of the compute actor (its base counters: :meth:`Actor.statistics`):
    the scheduler's counters (:class:`~mlxkv.actors.scheduler.SchedulerStatistics`)
    and the model's and thread's.

    Attributes:
        batched: whether the model decodes requests together (else
            every request decodes at batch size one).
        thread: the MLX thread's counters.
    """

    batched: bool
    thread: MLXThreadStatistics

    @property
    def mean_prefill_batch(self) -> float:
        """Requests' chunks served per prefill model call, on average (0 before any)."""
        return self.num_prefill_chunks / self.num_prefill_calls if self.num_prefill_calls else 0.0

    @property
    def mean_batch_size(self) -> float:
        """Requests served per decode model call, on average (0 before any)."""
        return self.num_decode_rows / self.num_decode_steps if self.num_decode_steps else 0.0


# -- messages ---------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Generate(Tell):
    """Start ``spec``'s request: rebuild its prefix, prefill the rest, decode.

    Attributes:
        spec: the request (its ``request_id`` is this message's; its
            ``stop_tokens`` empty means the model's end-of-sequence tokens).
        events: where the request's events go; its buffer must hold
            :func:`events_needed` events.
        to_cache: where what is to be cached goes (:class:`Published`,
            :class:`PromptPublished`, :class:`ImagesEncoded`), sized the
            same; None: to ``events``.
    """

    spec: RequestSpec
    events: MemoryObjectSendStream[Event] = attrs.field(repr=False, eq=False)
    to_cache: Optional[MemoryObjectSendStream[Event]] = attrs.field(default=None, repr=False, eq=False)

    def trace_fields(self) -> dict[str, int]:
        """The request's size, for tracing."""
        return {"prompt_tokens": len(self.spec.prompt), "prefix_blocks": len(self.spec.prefix)}

    def close_streams(self) -> None:
        """End the request's streams (the actor stopped before handling this)."""
        self.events.close()
        if self.to_cache is not None:
            self.to_cache.close()

    def fail(self, error: CacheError) -> None:
        """Tell the request it failed before it started, and end its streams."""
        try:
            self.events.send_nowait(Failed(error=error))
        except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        self.close_streams()


@attrs.frozen(kw_only=True)
class Cancel(Tell):
    """Stop ``request_id`` (unknown or finished ids are ignored)."""


@attrs.frozen(kw_only=True)
class NewPreparer(Ask[PromptPreparer]):
    """The model's prompt preparer; the caller uses it on its own threads."""

    polled = True


@attrs.frozen(kw_only=True)
class Describe(Ask[ModelInfo]):
    """Report :class:`ModelInfo`."""

    polled = True


@attrs.frozen(kw_only=True)
class Statistics(Ask[ComputeStatistics]):
    """Report :class:`ComputeStatistics`."""

    polled = True


@attrs.frozen
class _Streams:
    events: MemoryObjectSendStream[Event]
    to_cache: Optional[MemoryObjectSendStream[Event]]

    def send(self, event: Event) -> bool:
        """Put ``event`` on its stream; False if nobody reads it any more."""
        stream = self.to_cache if self.to_cache is not None and goes_to_cache(event) else self.events
        try:
            stream.send_nowait(event)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False
        except anyio.WouldBlock:
            raise AssertionError("a request's event stream is full: it was sized too small") from None
        return True

    def heard(self) -> bool:
        return self.events.statistics().open_receive_streams > 0

    def close(self) -> None:
        self.events.close()
        if self.to_cache is not None:
            self.to_cache.close()


class ComputeActor(Actor):
    """Mailbox -> scheduler -> executor (on the MLX thread) -> events.

    Owns: the :class:`MLXThread`, the :class:`Scheduler` (used on the event
    loop only), the :class:`Executor` (used on the MLX thread only), and
    every live request's streams.

    Invariants:
        - at most one plan is in flight, and messages are handled only
          between plans, so the scheduler sees each result before the next
          message;
        - every live request has its streams here until the scheduler ends
          them (an output of ``None``).
    """

    name = "compute"

    def __init__(
        self,
        runner: Optional[ModelRunner] = None,
        *,
        scheduling: SchedulingConfig = SchedulingConfig(),
        runner_config: RunnerConfig = RunnerConfig(),
        loader: Optional[Callable[[RunnerConfig], ModelRunner]] = None,
        source: Optional[str] = None,
        **options: Any,
    ) -> None:
        """Take a runner, or a loader that makes one on the MLX thread as the actor starts.

        Args:
            runner: a model runner already made (on the MLX thread it will
                run on: see :meth:`loading` for real models).
            scheduling: how plans are cut (:class:`SchedulingConfig`).
            runner_config: what the loader makes the runner with
                (:class:`RunnerConfig`); a runner handed in has its own.
            loader: called on the MLX thread with ``runner_config`` to make
                the runner, instead of ``runner``.
            source: what the loader loads, for error messages.
            **options: the :class:`Actor` options.

        Raises:
            InvalidInput: a configuration of the wrong type, or neither or
                both of ``runner`` and ``loader`` given.
        """
        if not isinstance(scheduling, SchedulingConfig):
            raise InvalidInput("scheduling", scheduling, "must be a SchedulingConfig")
        if not isinstance(runner_config, RunnerConfig):
            raise InvalidInput("runner_config", runner_config, "must be a RunnerConfig")
        if (runner is None) == (loader is None):
            raise InvalidInput("runner", runner, "give a runner or a loader, not both or neither")
        super().__init__(**options)
        self._runner = runner
        self._loader = loader
        self._source = source
        self._scheduling = scheduling
        self._runner_config = runner_config
        self._thread = MLXThread(name="mlxkv-compute", log=self._log)
        self._info: Optional[ModelInfo] = None if runner is None else runner.info
        self._scheduler: Optional[Scheduler] = None
        self._executor: Optional[Executor] = None
        self._streams: dict[str, _Streams] = {}
        #: the last plan's events, sent once the next plan runs
        self._pending: list[tuple[_Streams, Optional[Event]]] = []

    @classmethod
    def with_model(cls, model: Any, tokenizer: Any, **kwargs: Any) -> ComputeActor:
        """An actor over an mlx-lm model object already loaded (its weights evaluated).

        The runner is made on the MLX thread as the actor starts. Prefer
        :meth:`loading` for a model on disk.

        Args:
            model: the mlx-lm model.
            tokenizer: its ``TokenizerWrapper``.
            **kwargs: passed to the constructor.
        """
        def make(config: RunnerConfig) -> ModelRunner:
            return TextRunner(model, tokenizer, config)

        return cls(
            loader=make,
            source=type(model).__module__,
            **kwargs,
        )

    @classmethod
    def loading(cls, source: ModelSource, **kwargs: Any) -> ComputeActor:
        """An actor that loads the model ``source`` names on its MLX thread as it starts:
        a vision-language model with mlx-vlm, anything else with mlx-lm.

        Loading there matters for real models: arrays a model builds lazily
        at construction (rotary tables, say) belong to the loading thread's
        stream and could not be evaluated on another thread. A load error
        is raised from :meth:`run` as :class:`ModelLoadError`, before it
        reports started.

        Args:
            source: the checked model directory or repo id.
            **kwargs: passed to the constructor.
        """
        if source.kind == "vision":
            from mlxkv.actors.vision_runner import VisionRunner

            make: Callable[..., ModelRunner] = VisionRunner.load
        else:
            make = TextRunner.load
        return cls(
            loader=lambda config: make(source.path, config),
            source=source.path,
            **kwargs,
        )

    # -- running ---------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start the MLX thread (and load the model), then serve until every sender is closed.

        Requests still live then belong to callers that stopped listening
        (the runtime closes the mailbox once no call is in flight): they
        are dropped with the actor, not computed to the end. On a crash or
        cancellation every waiting caller's reply stream and every
        request's streams are closed, and the MLX thread is stopped and
        joined.
        """
        try:
            self._thread.start()
            if self._loader is not None:
                loader, config = self._loader, self._runner_config
                try:
                    self._runner = await self._thread.submit(lambda: loader(config))
                except Exception as error:
                    if isinstance(error, (MLXThreadStopped, ModelLoadError)):
                        raise
                    reason = f"{type(error).__name__}: {error}"
                    raise ModelLoadError(str(self._source), reason) from error
                self._loader = None
                self._info = self._runner.info
            runner = self._require_runner()
            self._scheduler = Scheduler(
                self._scheduling, recurrent=runner.info.has_recurrent, context_unit=runner.info.context_unit
            )
            self._executor = Executor(runner, prefill_chunk=self._scheduling.prefill_chunk)
            await super().run(task_status=task_status)
        except BaseException as error:
            self._record_crash(error, None)
            raise
        finally:
            for streams in self._streams.values():
                streams.close()
            for streams, _ in self._pending:
                streams.close()
            self._streams.clear()
            self._pending.clear()
            if self._scheduler is not None:
                self._scheduler.drop_all()
            self._executor = None
            self._fail_pending()
            self._mailbox_out.close()
            with anyio.CancelScope(shield=True):
                await self._thread.aclose()

    def has_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_work()

    async def work(self) -> None:
        """One plan: scheduled and started on the MLX thread; the previous
        plan's events sent while it runs (the MLX thread never waits for the
        consumers); its result applied."""
        scheduler, executor = self._scheduler, self._executor
        assert scheduler is not None and executor is not None, "the actor works once started"
        for request_id, streams in list(self._streams.items()):
            if not streams.heard():
                self._send(scheduler.cancel(request_id))
        if not scheduler.has_work():
            self._flush()
            return
        plan = scheduler.schedule(messages_waiting=self.messages_waiting())
        job = self._thread.queue(lambda: executor.run(plan))
        self._flush()
        result = await self._thread.result(job)
        self._warn(plan, result)
        self._send(scheduler.update(plan, result), later=scheduler.has_work())

    def _send(self, outputs: list[Output], *, later: bool = False) -> None:
        """Route each output to its request's streams (its end closes them);
        with ``later``, deliver them when the next plan has started."""
        for request_id, event in outputs:
            streams = self._streams.get(request_id)
            if streams is None:
                continue
            if event is None:
                del self._streams[request_id]
            if later:
                self._pending.append((streams, event))
            elif event is None:
                streams.close()
            else:
                streams.send(event)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for streams, event in pending:
            if event is None:
                streams.close()
            else:
                streams.send(event)

    def _warn(self, plan: Plan, result: Result) -> None:
        for chunk in result.chunks:
            if chunk.cold_fallback:
                self._log.warning(
                    "prefill.cold_fallback",
                    request_id=chunk.request_id,
                    reason="the cached prefix cannot be rebuilt for this model",
                )

    # -- messages ----------------------------------------------------------------

    def handle(self, message: Message) -> Any:
        """Handle one message (synchronously: plans run between messages)."""
        match message:
            case Generate():
                return self._start(message)
            case Cancel():
                if self._scheduler is not None:
                    self._send(self._scheduler.cancel(message.request_id or ""))
                return None
            case NewPreparer():
                return self._require_runner().preparer()
            case Describe():
                return self._info
            case Statistics():
                return self.compute_statistics()
        return super().handle(message)

    def _require_runner(self) -> ModelRunner:
        assert self._runner is not None, "the compute actor handles messages only once started"
        return self._runner

    def _start(self, message: Generate) -> None:
        scheduler = self._scheduler
        assert scheduler is not None, "the actor handles messages only once started"
        spec = self._checked(message)  # a CacheError reaches the caller via Generate.fail
        self._streams[spec.request_id] = _Streams(message.events, message.to_cache)
        scheduler.add(spec)

    def _checked(self, message: Generate) -> RequestSpec:
        """The message's spec (checked as it was made: :class:`RequestSpec`)
        against the live requests and the model, with the model's stop tokens
        if it gives none (generation gives them: no spec is made again)."""
        spec = message.spec
        if not isinstance(spec, RequestSpec):
            raise InvalidInput("spec", spec, "must be a RequestSpec")
        assert self._scheduler is not None and self._info is not None
        if self._scheduler.is_live(spec.request_id):
            raise InvalidInput("request_id", spec.request_id, "is generating already")
        vocab_size = self._info.vocab_size
        if vocab_size is not None and max(spec.prompt) >= vocab_size:
            check_token_ids(spec.prompt, argument="prompt", vocab_size=vocab_size)  # names the token
        if not all(isinstance(p, BlockPayload) for p in spec.prefix):
            raise InvalidInput("prefix", spec.prefix, "must hold this model's BlockPayloads")
        if spec.stop_tokens is None:
            spec = attrs.evolve(spec, stop_tokens=self._info.eos_token_ids)
        return spec

    # -- statistics ------------------------------------------------------------------

    def compute_statistics(self) -> ComputeStatistics:
        """A snapshot of the counters, the live requests and the thread."""
        assert self._scheduler is not None, "the actor reports statistics once started"
        counts = attrs.asdict(self._scheduler.statistics())
        return ComputeStatistics(
            **counts,
            batched=bool(self._info is not None and self._info.batchable),
            thread=self._thread.statistics(),
        )


class ComputeHandle(ActorHandle):
    """Typed calls to a :class:`ComputeActor`; messages stay inside.

    Every call is a cancellation point unless documented otherwise.
    """

    async def start(
        self,
        spec: RequestSpec,
        *,
        events: MemoryObjectSendStream[Event],
        to_cache: Optional[MemoryObjectSendStream[Event]] = None,
    ) -> None:
        """Send :class:`Generate`; the request's events arrive on ``events``
        (what is to be cached on ``to_cache``, if given).

        Raises:
            ActorFailed: the actor is not running.
        """
        await self._ref.tell(Generate(request_id=spec.request_id, spec=spec, events=events, to_cache=to_cache))

    async def cancel(self, request_id: str) -> None:
        """Send :class:`Cancel`; shielded from cancellation.

        Raises:
            ActorFailed: the actor is not running.
        """
        await self._ref.tell_shielded(Cancel(request_id=request_id))

    async def preparer(self) -> PromptPreparer:
        """See :class:`NewPreparer`."""
        return await self._ref.ask(NewPreparer)

    async def describe(self) -> ModelInfo:
        """See :class:`Describe`."""
        return await self._ref.ask(Describe)

    async def statistics(self) -> ComputeStatistics:
        """See :class:`Statistics`."""
        return await self._ref.ask(Statistics)
