"""The compute actor: a scheduler over a model runner, on one MLX thread.

:class:`ComputeActor` owns the model (through a
:class:`~mlxkv.actors.model_runner.ModelRunner`), the MLX thread, and the
compute state of every live request (:class:`~mlxkv.actors.sequence.Sequence`).
It decides what runs next and hands each job to the runner on its MLX thread;
every MLX graph is built and evaluated there, and only evaluated arrays leave.

Messages (each :class:`~mlxkv.actors.actor.Ask` answers with the noun after
the arrow):

- :class:`Generate` (no reply of its own): start a request. Its events --
  :class:`Prefilled`, one :class:`Token` per token (or burst of tokens),
  then :class:`Finished` or :class:`Failed` -- go to the event stream the
  caller passes, sized so that the actor never waits on it. What is to be
  cached goes to a second stream if the caller passes one (else to the
  same): :class:`Published` (payloads of full blocks, as soon as the
  prefill chunk that computed them is evaluated; the final chunk's just
  after its first token, which is not kept waiting for them),
  :class:`PromptPublished` once the prompt's blocks are all out, the
  answer's blocks as the request finishes, and, for a vision-language
  request, :class:`ImagesEncoded` when the vision encoder ran for it (its
  features). Both streams end when the request does.
- :class:`Cancel` (no reply): stop a request; a request whose event stream
  nobody reads any more is cancelled the same way.
- :class:`NewPreparer` -> the model's
  :class:`~mlxkv.actors.model_runner.PromptPreparer` (tokenizer, and image
  processor of a vision-language model), shared with the caller, who runs it
  on its own threads; :class:`Describe` -> :class:`ModelInfo`;
  :class:`Statistics` -> :class:`ComputeStatistics`.

Scheduling. The model runs one job at a time. A request's prompt is computed
in prefill chunks of at most ``prefill_chunk`` tokens (a model with
recurrent layers also ends a chunk at every block end, to snapshot its
state there), from a cache rebuilt out of its cached prefix; then the
request joins the decode batch, where every decoding request advances one
token per model call (continuous batching) until it finishes, is cancelled
or fails; others join and leave between steps without stopping the rest.
Work runs in rounds: the messages waiting when a round begins (a new request
is only queued), one decode step for the whole batch, the first chunk of
every request that arrived in this round, and one chunk of the oldest
unfinished prefill. So a decode step waits for at most one chunk plus the
first chunks of the requests that arrived since the previous step; a prefill
gets a chunk every round, and prefills finish in arrival order (shortest
first among those that fit one chunk). A request waiting for another's
prefix (see :mod:`mlxkv.generation`) is not here at all until that prefix is
published, so it delays nobody.

The last cache. When a request finishes, the runner keeps its cache (one
request's KV, beside the block pool; plain KV layers only). The next request
that shares its first tokens takes it, cut back to what it may use: within
the kept cache's namespace (cache salt and images) every shared token but
the prompt's last, in another namespace only the prefix it brings payloads
for, and only when neither has images. Full blocks it gets that way beyond
the blocks it holds are published. ``keep_last_cache=False`` turns it off.

Failures. A domain error (bad input) is answered as :class:`Failed` and
changes nothing. Every step done for one request fails that request only
(:class:`ComputeFailed`, with the cause): its prefill chunks, publishing its
prompt's or its answer's blocks, keeping its cache, merging its cache into
the decode batch or taking it out, sampling its token, snapshotting its
state; the tokens it was sent before stand, and the requests beside it go
on exactly. A draw that raises after a request's last token (never used)
is no failure. What the rows of a batch share -- its model call, cutting
its batch cache down or extending it -- fails those rows, not the requests
prefilling or decoding elsewhere. If the MLX thread dies or a handler has a
bug, the actor crashes loudly: every waiting caller gets
:class:`~mlxkv.actors.actor.ActorFailed` (with the crash), and every
request's event stream is closed.

Cancellation. Stopping a request drops it from the prefill queue or makes it
leave the batch before the next step; its cache is freed. A job that is
running finishes first (MLX evaluation cannot be interrupted). If the actor
itself is cancelled, it closes every event stream and its shutdown waits,
shielded, for the MLX thread to finish the running job and stop.
"""

from __future__ import annotations

import collections
import traceback
from collections.abc import Callable, Hashable, Sequence as Seq
from typing import Any, Literal, Optional, TypeVar

import anyio
import attrs
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from mlxkv.actors.actor import (
    Actor,
    ActorHandle,
    Ask,
    Message,
    Tell,
)
from mlxkv.actors.decode_batch import BatchBroken, DecodeBatch, Emitted, RowFailed
from mlxkv.actors.mlx_thread import MLXThread, MLXThreadStatistics, MLXThreadStopped
from mlxkv.actors.model_runner import (
    ImageEncoding,
    ModelInfo,
    ModelRunner,
    PromptPreparer,
    TextRunner,
)
from mlxkv.actors.model_source import ModelLoadError, ModelSource
from mlxkv.actors.sampling import GREEDY, Sampling
from mlxkv.actors.sequence import Phase, Sequence, plan_chunks
from mlxkv.cache import kv_state
from mlxkv.cache.errors import CacheError, InvalidInput
from mlxkv.cache.kv_state import BlockPayload
from mlxkv.cache.token_ids import check_token_ids

__all__ = [
    "DEFAULT_DECODE_BURST",
    "DEFAULT_PREFILL_CHUNK",
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
    "Statistics",
    "Token",
    "events_needed",
]

T = TypeVar("T")

#: Request-steps one decode job may run back to back while nothing else
#: waits: ``decode_burst // batch size`` steps, at least one and at most
#: :data:`MAX_BURST_STEPS`. A small batch thus saves the hop between the
#: event loop and the MLX thread on most steps (the hop is about a tenth of
#: a lone request's step on this CPU); a batch of 32, whose step dwarfs the
#: hop, runs one step per job. A message that arrives meanwhile waits for at
#: most that many steps, and tokens reach the consumer in bursts of as many.
DEFAULT_DECODE_BURST = 32

#: The most decode steps one job runs.
MAX_BURST_STEPS = 8

#: Tokens per prefill chunk: 30-150 ms of the default model on a 2-core CPU
#: (more as the context grows), so a decode step waits about that long at
#: most; smaller chunks made a 2k prefill no faster here.
DEFAULT_PREFILL_CHUNK = 256


class ComputeFailed(CacheError):
    """Evaluating a request's model call raised.

    Attributes:
        request_id: the request whose computation failed.
        cause: the exception the model call raised.
    """

    def __init__(self, request_id: Optional[str], cause: BaseException) -> None:
        self.request_id = request_id
        self.cause = cause
        super().__init__(
            f"computing request {request_id!r} failed: {type(cause).__name__}: {cause}"
        )


# -- events: what a request's stream carries ---------------------------------


@attrs.frozen(kw_only=True)
class Published:
    """Full blocks ``[start, start + len(payloads))`` of the request, computed.

    Attributes:
        start: index of the first block.
        payloads: their KV, owned and evaluated; each block of a model with
            recurrent layers carries the state snapshot at its end.
        tokens: the token ids those blocks hold (prompt or answer),
            ``block_size`` per block.
    """

    start: int
    payloads: tuple[BlockPayload, ...] = attrs.field(eq=False, repr=lambda p: f"<{len(p)} blocks>")
    tokens: tuple[int, ...] = attrs.field(default=(), eq=False, repr=False)


@attrs.frozen(kw_only=True)
class PromptPublished:
    """Every full block of the prompt that the request publishes is out.

    Blocks it was asked to compute but could not publish (its KV cannot be
    sliced exactly) will not come: whoever waits for them should stop.
    """


@attrs.frozen(kw_only=True)
class ImagesEncoded:
    """The vision encoder ran for the request's images (before any token).

    Attributes:
        features: its output for all the images, in order (evaluated).
    """

    features: Any = attrs.field(eq=False, repr=False)


@attrs.frozen(kw_only=True)
class Prefilled:
    """The prompt is computed; sent just before the first :class:`Token`.

    Attributes:
        num_cached: prompt tokens not computed: rebuilt from the cached
            prefix, or taken from the last cache.
        cold_fallback: the prefix could not be rebuilt, so the whole prompt
            was computed.
        logits: the logits of the last prompt position (the first token is
            sampled from them), evaluated, ``(vocab,)``.
    """

    num_cached: int
    cold_fallback: bool = False
    logits: Any = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen(kw_only=True)
class Token:
    """The tokens a request generated in one job (one, or a decode burst's).

    Attributes:
        tokens: the token ids, in order.
        logprobs: each token's step log-probabilities ``(vocab,)`` when the
            request asked to keep them (``keep_logits``), else empty.
    """

    tokens: tuple[int, ...]
    logprobs: tuple[Any, ...] = attrs.field(default=(), eq=False, repr=False)


@attrs.frozen(kw_only=True)
class Finished:
    """The request is done.

    Attributes:
        reason: ``"stop"`` (a stop token, not emitted) or ``"length"``.
        num_stored: tokens whose KV the published blocks cover in all.
    """

    reason: Literal["stop", "length"]
    num_stored: int = 0


@attrs.frozen(kw_only=True)
class Failed:
    """The request failed; nothing more follows.

    Attributes:
        error: why (:class:`ComputeFailed`, :class:`InvalidInput`...).
    """

    error: CacheError


#: What a request's event stream carries.
Event = Published | PromptPublished | ImagesEncoded | Prefilled | Token | Finished | Failed


def events_needed(num_prompt: int, max_tokens: int, block_size: int, chunk: int) -> int:
    """How many events a request can receive at most: size its stream so.

    One per prefill job (a published batch of blocks each), the images'
    features, the prompt-published and prefilled marks, one per token, the
    answer's blocks, and the end. Enough for either of a request's two
    streams, or for both on one.
    """
    jobs = -(-num_prompt // min(chunk, block_size)) + 1
    return jobs + max_tokens + 5


@attrs.frozen(kw_only=True)
class ComputeStatistics:
    """A snapshot of the compute actor (its base counters: :meth:`Actor.statistics`).

    Attributes:
        num_live: requests queued, prefilling or decoding.
        num_prefilling: requests with an unfinished prefill (queued ones too).
        num_decoding: requests in the decode batch.
        num_prefill_tokens: prompt tokens run through the model.
        num_cached_tokens: prompt tokens not computed (rebuilt from cached
            blocks, or taken from the last cache).
        num_last_cache_reuses: requests that took the last finished
            request's cache, cut back to what they may use of it, instead
            of rebuilding their prefix from blocks.
        num_prefill_chunks: prefill jobs run.
        num_decode_steps: decode model calls.
        num_decode_rows: request-steps those calls served (their sum of
            batch sizes).
        batched: whether the model decodes requests together (else
            every request decodes at batch size one).
        num_published_blocks: block payloads handed out.
        num_cold_fallbacks: prefixes that could not be rebuilt (the prompt
            was computed in full instead).
        num_unpublishable: requests whose KV could not be sliced into
            blocks exactly (not cached; a wrapped sliding window, say).
        num_model_errors: computations that raised: model calls (one for
            all the rows that shared it) and steps done for one request
            (slicing, keeping, merging, extracting its cache, sampling).
        num_cancelled: requests stopped before they finished.
        num_vision_encoder_runs: requests whose images the vision encoder
            encoded.
        num_vision_encoder_skips: requests with images that did without it
            (cached features, or a cached prefix covering every image token).
        thread: the MLX thread's counters.
    """

    num_live: int
    num_prefilling: int
    num_decoding: int
    num_prefill_tokens: int
    num_cached_tokens: int
    num_last_cache_reuses: int
    num_prefill_chunks: int
    num_decode_steps: int
    num_decode_rows: int
    batched: bool
    num_published_blocks: int
    num_cold_fallbacks: int
    num_unpublishable: int
    num_model_errors: int
    num_cancelled: int
    num_vision_encoder_runs: int
    num_vision_encoder_skips: int
    thread: MLXThreadStatistics

    @property
    def mean_batch_size(self) -> float:
        """Requests served per decode model call, on average (0 before any)."""
        return self.num_decode_rows / self.num_decode_steps if self.num_decode_steps else 0.0


# -- messages ---------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Generate(Tell):
    """Start ``request_id``: rebuild its prefix, prefill the rest, decode.

    Attributes:
        prompt: the whole prompt's token ids (at least one).
        prefix: payloads of the cached blocks ``0..n-1`` to rebuild, in
            order; empty for a cold start. They must leave at least the
            last prompt token to compute.
        sampling: how tokens are sampled.
        max_tokens: the most tokens to generate, >= 1.
        stop_tokens: tokens that end the generation (not emitted); the
            model's end-of-sequence tokens if None.
        block_size: tokens per block of the payloads it publishes.
        keep_logits: attach each token's log-probabilities to its event.
        held_blocks: leading full blocks of the prompt the request holds
            already (cached): they are not published again.
        namespace: what the request's blocks are keyed under beside its
            tokens (cache salt, images); a request may use all the KV the
            last cache shares with it only within its namespace.
        inputs: what the model runner needs beyond the tokens (a
            vision-language prompt's images), as its preparer made them.
        events: where the request's events go; its buffer must hold
            :func:`events_needed` events.
        to_cache: where what is to be cached goes (:class:`Published`,
            :class:`PromptPublished`, :class:`ImagesEncoded`), sized the
            same; None: to ``events``.
    """

    prompt: tuple[int, ...] = attrs.field(converter=tuple, repr=lambda t: f"<{len(t)} tokens>")
    prefix: tuple[BlockPayload, ...] = attrs.field(default=(), converter=tuple, repr=False)
    sampling: Sampling = GREEDY
    max_tokens: int
    stop_tokens: Optional[frozenset[int]] = None
    block_size: int
    keep_logits: bool = False
    held_blocks: int = 0
    namespace: Hashable = None
    inputs: Any = attrs.field(default=None, eq=False, repr=False)
    events: MemoryObjectSendStream[Event] = attrs.field(repr=False, eq=False)
    to_cache: Optional[MemoryObjectSendStream[Event]] = attrs.field(default=None, repr=False, eq=False)

    def trace_fields(self) -> dict[str, int]:
        """The request's size, for tracing."""
        return {"prompt_tokens": len(self.prompt), "prefix_blocks": len(self.prefix)}

    def close_streams(self) -> None:
        """End the request's streams (the actor stopped before handling this)."""
        self.events.close()
        if self.to_cache is not None:
            self.to_cache.close()

    def fail(self, error: CacheError) -> None:
        """Tell the request it failed before it started, and end its streams."""
        _send(self.events, Failed(error=error))
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


# -- what jobs return --------------------------------------------------------


@attrs.frozen
class _PrefillOutcome:
    encoding: Optional[ImageEncoding]
    computed: int
    published: Optional[Published]
    unpublishable: bool
    first_token: Optional[int]
    logits: Any = attrs.field(eq=False)
    logprobs: Any = attrs.field(eq=False)


@attrs.frozen
class _DecodeOutcome:
    batches: list[DecodeBatch]
    emitted: list[Emitted]
    #: rows whose own step raised, each failing alone: as they left (their
    #: cache extracted, sliced or kept), as they joined, as they decoded
    leave_failures: list[RowFailed]
    join_failures: list[RowFailed]
    step_failures: list[RowFailed]
    #: id(sequence) -> the answer's blocks (None if there are none or they
    #: could not be sliced)
    answers: dict[int, Optional[Published]]
    unpublishable: int
    #: batches whose model call or batch-cache change raised, with the error
    broken: list[tuple[DecodeBatch, Exception]]
    #: sizes of the batches that stepped
    steps: list[int]


class ComputeActor(Actor):
    """Schedules requests' prefill chunks and decode steps onto one model runner.

    See the module docstring for the messages, the scheduling policy and its
    bound, failures and cancellation.

    Owns: the :class:`MLXThread`, the model runner (used only on that
    thread), every live :class:`Sequence`, the prefill queue, the decode
    batches, and counters.

    Invariants:
        - every MLX graph is built and evaluated on the MLX thread; events
          and replies hold evaluated arrays only;
        - at most one job is in flight; while it runs, the actor touches no
          sequence's MLX state;
        - a live request is in exactly one of: the prefill queue, the
          joining list, a decode batch;
        - every request gets exactly one final event (:class:`Finished` or
          :class:`Failed`) unless nobody listens any more.
    """

    name = "compute"

    def __init__(
        self,
        runner: Optional[ModelRunner] = None,
        *,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        decode_burst: int = DEFAULT_DECODE_BURST,
        keep_last_cache: bool = True,
        loader: Optional[Callable[[int], ModelRunner]] = None,
        source: Optional[str] = None,
        **options: Any,
    ) -> None:
        """Take a runner, or a loader that makes one on the MLX thread as the actor starts.

        Args:
            runner: a model runner already made (on the MLX thread it will
                run on: see :meth:`loading` for real models).
            prefill_chunk: tokens per prefill chunk, > 0.
            decode_burst: the most request-steps one decode job runs while no
                message or prefill waits (``decode_burst // batch size``
                steps, at least one, at most :data:`MAX_BURST_STEPS`), > 0.
            keep_last_cache: keep the cache of the request that finished
                last (one request's KV, outside the block pool) for the next
                request that shares its first tokens (see the module
                docstring).
            loader: called on the MLX thread with ``prefill_chunk`` to make
                the runner, instead of ``runner``.
            source: what the loader loads, for error messages.
            **options: the :class:`Actor` options.

        Raises:
            InvalidInput: ``prefill_chunk`` is not a positive int, or neither
                or both of ``runner`` and ``loader`` are given.
        """
        if not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool) or prefill_chunk <= 0:
            raise InvalidInput("prefill_chunk", prefill_chunk, "must be a positive int")
        if not isinstance(decode_burst, int) or isinstance(decode_burst, bool) or decode_burst <= 0:
            raise InvalidInput("decode_burst", decode_burst, "must be a positive int")
        if not isinstance(keep_last_cache, bool):
            raise InvalidInput("keep_last_cache", keep_last_cache, "must be a bool")
        if (runner is None) == (loader is None):
            raise InvalidInput("runner", runner, "give a runner or a loader, not both or neither")
        super().__init__(**options)
        self._runner = runner
        self._loader = loader
        self._source = source
        self._chunk = prefill_chunk
        self._burst = decode_burst
        self._keep_last_cache = keep_last_cache
        self._thread = MLXThread(name="mlxkv-compute", log=self._log)
        self._info: Optional[ModelInfo] = None if runner is None else runner.info
        self._live: dict[str, Sequence] = {}
        self._queue: collections.deque[Sequence] = collections.deque()
        self._arrivals: list[Sequence] = []
        self._joining: list[Sequence] = []
        #: id(sequence) -> (sequence, whether its answer is stored)
        self._leaving: dict[int, tuple[Sequence, bool]] = {}
        self._batches: list[DecodeBatch] = []
        self._num_prefill_tokens = 0
        self._num_cached_tokens = 0
        self._num_last_cache_reuses = 0
        self._num_prefill_chunks = 0
        self._num_decode_steps = 0
        self._num_decode_rows = 0
        self._num_published_blocks = 0
        self._num_cold_fallbacks = 0
        self._num_unpublishable = 0
        self._num_model_errors = 0
        self._num_cancelled = 0
        self._num_encoder_runs = 0
        self._num_encoder_skips = 0

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
        return cls(
            loader=lambda chunk: TextRunner(model, tokenizer, prefill_chunk=chunk),
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
            loader=lambda chunk: make(source.path, prefill_chunk=chunk), source=source.path, **kwargs
        )

    # -- running ---------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start the MLX thread (and load the model), then serve until every sender is closed.

        Requests still running when the mailbox closes are finished first.
        On a crash or cancellation every waiting caller's reply stream and
        every request's event stream is closed, every cache dropped, and the
        MLX thread stopped and joined.
        """
        try:
            self._thread.start()
            if self._loader is not None:
                loader, chunk = self._loader, self._chunk
                try:
                    self._runner = await self._thread.submit(lambda: loader(chunk))
                except Exception as error:
                    if isinstance(error, (MLXThreadStopped, ModelLoadError)):
                        raise
                    reason = f"{type(error).__name__}: {error}"
                    raise ModelLoadError(str(self._source), reason) from error
                self._loader = None
                self._info = self._runner.info
            task_status.started()
            await self._serve()
        except BaseException as error:
            self._record_crash(error, None)
            raise
        finally:
            for sequence in list(self._live.values()):
                sequence.emit(None)  # closes its stream
            self._live.clear()
            self._queue.clear()
            self._arrivals.clear()
            self._joining.clear()
            self._leaving.clear()
            self._batches.clear()
            self._fail_pending()
            self._mailbox_out.close()
            with anyio.CancelScope(shield=True):
                await self._thread.aclose()

    def _busy(self) -> bool:
        return bool(self._queue or self._joining or self._leaving or any(self._batches))

    async def _serve(self) -> None:
        """Rounds of work until the mailbox is closed and drained.

        Requests still live then belong to callers that stopped listening
        (the runtime closes the mailbox once no call is in flight): they are
        dropped with the actor, not computed to the end.
        """
        mailbox = self._mailbox_out
        while True:
            if not self._busy():
                try:
                    envelope = await mailbox.receive()
                except anyio.EndOfStream:
                    return
                self._dispatch(envelope)
                continue
            # A round: what was waiting when it began, one decode step, the
            # first chunk of each arrival, one chunk of the oldest prefill.
            waiting = mailbox.statistics()
            if waiting.open_send_streams == 0 and waiting.current_buffer_used == 0:
                return
            for _ in range(waiting.current_buffer_used):
                try:
                    self._dispatch(mailbox.receive_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
            self._drop_unheard()
            if self._joining or self._leaving or any(self._batches):
                # Several steps in one job while nothing else waits: fewer
                # hops between threads; a message waits for at most the burst.
                idle = not (self._queue or mailbox.statistics().current_buffer_used)
                rows = sum(len(batch) for batch in self._batches) + len(self._joining)
                burst = min(MAX_BURST_STEPS, max(1, self._burst // max(1, rows)))
                await self._decode_step(burst if idle else 1)
            arrivals, self._arrivals = self._arrivals, []
            for sequence in arrivals:
                if sequence.phase is Phase.QUEUED:
                    await self._prefill_chunk(sequence)
            oldest = next(
                (s for s in self._queue if s.phase is Phase.PREFILLING and s not in arrivals), None
            )
            if oldest is not None:
                await self._prefill_chunk(oldest)

    # -- messages ----------------------------------------------------------------

    def handle(self, message: Message) -> Any:
        """Handle one message (synchronously: jobs run from the round loop)."""
        match message:
            case Generate():
                return self._start(message)
            case Cancel():
                sequence = self._live.get(message.request_id or "")
                if sequence is not None:
                    self._cancel(sequence)
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

    def _check_tokens(self, tokens: Seq[Any], *, allow_empty: bool = False) -> None:
        vocab = None if self._info is None else self._info.vocab_size
        check_token_ids(tokens, vocab_size=vocab, allow_empty=allow_empty)

    def _start(self, message: Generate) -> None:
        sequence = self._sequence(message)  # a CacheError reaches the caller via Generate.fail
        self._live[sequence.request_id] = sequence
        self._queue.append(sequence)
        self._arrivals.append(sequence)

    def _sequence(self, message: Generate) -> Sequence:
        request_id = message.request_id
        if not isinstance(request_id, str) or not request_id:
            raise InvalidInput("request_id", request_id, "must be a non-empty str")
        if request_id in self._live:
            raise InvalidInput("request_id", request_id, "is generating already")
        self._check_tokens(message.prompt)
        if not message.prompt:
            raise InvalidInput("prompt", message.prompt, "must hold at least one token")
        if not isinstance(message.sampling, Sampling):
            raise InvalidInput("sampling", message.sampling, "must be a Sampling")
        for name, least in (("max_tokens", 1), ("block_size", 1), ("held_blocks", 0)):
            value = getattr(message, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidInput(name, value, f"must be an int >= {least}")
        prefix = message.prefix
        if not all(isinstance(p, BlockPayload) for p in prefix):
            raise InvalidInput("prefix", prefix, "must hold BlockPayloads")
        if prefix and prefix[-1].end >= len(message.prompt):
            raise InvalidInput("prefix", len(prefix), "must leave at least the last prompt token")
        info = self._info
        assert info is not None, "the actor handles messages only once started"
        stop = info.eos_token_ids if message.stop_tokens is None else frozenset(message.stop_tokens)
        events, to_cache = message.events, message.to_cache

        def emit(event: Any) -> bool:
            if event is None:
                message.close_streams()
                return False
            return _send(events, event)

        def publish(event: Any) -> bool:
            return _send(to_cache, event) if to_cache is not None else emit(event)

        return Sequence(
            request_id=request_id,
            prompt=tuple(message.prompt),
            prefix=prefix,
            sampler=message.sampling.make_sampler(),
            max_tokens=message.max_tokens,
            stop_tokens=stop,
            block_size=message.block_size,
            keep_logits=bool(message.keep_logits),
            emit=emit,
            publish=publish,
            inputs=message.inputs,
            num_held=message.held_blocks,
            namespace=message.namespace,
        )

    # -- life of a request ---------------------------------------------------------

    def _cancel(self, sequence: Sequence) -> None:
        """Stop ``sequence`` without a final event (nobody wants it)."""
        if sequence.phase is Phase.FINISHED or sequence.cancelled:
            return
        sequence.cancelled = True
        self._num_cancelled += 1
        if sequence.phase is Phase.DECODING and sequence not in self._joining:
            # Its row leaves the batch before the next step; the request
            # itself is over now.
            self._live.pop(sequence.request_id, None)
            self._leaving[id(sequence)] = (sequence, False)
        else:
            self._forget(sequence)

    def _forget(self, sequence: Sequence) -> None:
        """Remove a request that holds no batch row; its stream is closed."""
        self._live.pop(sequence.request_id, None)
        if sequence in self._queue:
            self._queue.remove(sequence)
        if sequence in self._arrivals:
            self._arrivals.remove(sequence)
        if sequence in self._joining:
            self._joining.remove(sequence)
        sequence.phase = Phase.FINISHED
        sequence.cache = None
        sequence.emit(None)

    def _finish(self, sequence: Sequence, final: Event) -> None:
        sequence.emit(final)
        self._forget(sequence)

    def _drop_unheard(self) -> None:
        """Cancel requests whose event stream nobody reads any more."""
        for sequence in list(self._live.values()):
            if not sequence.emit(_PROBE):
                self._cancel(sequence)

    # -- jobs ------------------------------------------------------------------------

    async def _compute(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the MLX thread; a dead thread crashes the actor."""
        return await self._thread.submit(fn)

    async def _request_job(self, sequence: Sequence, fn: Callable[[], T]) -> Optional[T]:
        """``fn`` (which returns no None) on the MLX thread for one request;
        None if it raised: the request has failed then (:class:`ComputeFailed`)."""
        try:
            return await self._compute(fn)
        except MLXThreadStopped:
            raise
        except Exception as error:
            traceback.clear_frames(error.__traceback__)
            self._num_model_errors += 1
            self._fail(sequence, error)
            return None

    async def _prefill_chunk(self, sequence: Sequence) -> None:
        runner = self._require_runner()
        queued = sequence.phase is Phase.QUEUED

        chunk = self._chunk
        keep_cache = self._keep_last_cache

        def job() -> _PrefillOutcome:
            encoding = None
            if queued:
                # Blocks of the prefix payloads or held by the request are
                # stored; any the last cache gave beyond them are published.
                brought = sequence.prefix[-1].end // sequence.block_size if sequence.prefix else 0
                runner.start(sequence)
                encoding = runner.take_encoding(sequence)
                sequence.num_published = max(
                    min(brought, sequence.num_cached // sequence.block_size), sequence.num_held
                )
                boundary = sequence.block_size if runner.info.has_recurrent else None
                sequence.chunk_ends = plan_chunks(
                    sequence.num_computed, len(sequence.prompt), chunk, boundary
                )
            start = sequence.num_computed
            logits = runner.prefill(sequence, sequence.chunk_ends[0])
            computed = sequence.num_computed - start
            if logits is None:
                published, unpublishable = _publish(runner, sequence, sequence.cache)
                return _PrefillOutcome(encoding, computed, published, unpublishable, None, None, None)
            # The last chunk: its blocks are sliced after the first token is out.
            first, logprobs = _first_token(sequence, logits)
            if keep_cache and (first in sequence.stop_tokens or sequence.max_tokens == 1):
                runner.keep(sequence, sequence.cache)  # the request ends here
            return _PrefillOutcome(encoding, computed, None, False, first, logits, logprobs)

        sequence.phase = Phase.PREFILLING
        outcome = await self._request_job(sequence, job)
        if outcome is None:
            return
        self._num_prefill_chunks += 1
        self._num_prefill_tokens += outcome.computed
        self._count_published(outcome.published, outcome.unpublishable)
        if outcome.encoding is not None:
            self._num_encoder_runs += outcome.encoding.ran
            self._num_encoder_skips += not outcome.encoding.ran
            if outcome.encoding.ran and not sequence.cancelled:
                sequence.publish(ImagesEncoded(features=outcome.encoding.features))
        if queued:
            self._num_cached_tokens += sequence.num_cached
            self._num_last_cache_reuses += sequence.reused_last_cache
            self._num_cold_fallbacks += sequence.cold_fallback
            if sequence.cold_fallback:
                self._log.warning(
                    "prefill.cold_fallback",
                    request_id=sequence.request_id,
                    reason="the cached prefix cannot be rebuilt for this model",
                )
        sequence.chunk_ends.pop(0)
        if sequence.cancelled:
            return
        if outcome.published is not None:
            sequence.publish(outcome.published)
        if outcome.first_token is None:
            return
        self._queue.remove(sequence)
        sequence.emit(
            Prefilled(
                num_cached=sequence.num_cached,
                cold_fallback=sequence.cold_fallback,
                logits=outcome.logits,
            )
        )
        token = outcome.first_token
        stopped = token in sequence.stop_tokens
        if not stopped:
            sequence.generated.append(token)
            sequence.emit(Token(tokens=(token,), logprobs=(outcome.logprobs,) if sequence.keep_logits else ()))
        if not await self._publish_prompt(sequence):
            return
        if stopped or sequence.max_tokens == 1:
            reason: Literal["stop", "length"] = "stop" if stopped else "length"
            stored = max(sequence.num_published, 0) * sequence.block_size
            self._finish(sequence, Finished(reason=reason, num_stored=stored))
            return
        sequence.phase = Phase.DECODING
        self._joining.append(sequence)

    async def _publish_prompt(self, sequence: Sequence) -> bool:
        """Publish the prompt's blocks the last chunk computed (a job of their
        own, after the first token), then :class:`PromptPublished`.

        Returns:
            False if slicing them raised: the request failed.
        """
        runner = self._require_runner()
        cache = sequence.cache
        if 0 <= sequence.num_published < sequence.num_computed // sequence.block_size:
            outcome = await self._request_job(sequence, lambda: _publish(runner, sequence, cache))
            if outcome is None:
                return False
            published, unpublishable = outcome
            self._count_published(published, unpublishable)
            if published is not None:
                sequence.publish(published)
        sequence.publish(PromptPublished())
        return True

    def _count_published(self, published: Optional[Published], unpublishable: bool) -> None:
        if published is not None:
            self._num_published_blocks += len(published.payloads)
        self._num_unpublishable += unpublishable

    async def _decode_step(self, steps: int) -> None:
        """One job: rows leave (finished ones publish their answer), rows join,
        and every batch advances up to ``steps`` tokens (fewer once a row is done).

        A step done for one row (extracting, publishing or keeping its cache,
        merging it in, sampling, snapshotting) that raises fails that request
        alone; a batch whose model call or batch cache change raises fails its
        rows.
        """
        runner = self._require_runner()
        leaving = list(self._leaving.values())
        self._leaving.clear()
        joining, self._joining = self._joining, []
        batches = list(self._batches)
        keep_cache = self._keep_last_cache

        def job() -> _DecodeOutcome:
            answers: dict[int, Optional[Published]] = {}
            faults: list[RowFailed] = []
            join_faults: list[RowFailed] = []
            step_faults: list[RowFailed] = []
            broken: list[tuple[DecodeBatch, Exception]] = []
            unpublishable = 0
            for batch in batches:
                mine = [(s, keep) for s, keep in leaving if s in batch.rows]
                try:
                    caches, failed = batch.leave([s for s, _ in mine], keep=[s for s, keep in mine if keep])
                except BatchBroken as error:
                    broken.append((batch, error.error))
                    continue
                faults.extend(failed)
                for sequence, keep in mine:
                    cache = caches.get(id(sequence))
                    if cache is None:
                        continue
                    try:
                        answer, failed_slice = _publish(runner, sequence, cache, sequence.num_tokens)
                        if keep_cache:
                            runner.keep(sequence, cache)
                    except Exception as error:
                        traceback.clear_frames(error.__traceback__)
                        faults.append(RowFailed(sequence, error))
                        continue
                    answers[id(sequence)] = answer
                    unpublishable += failed_slice
            kept = [batch for batch in batches if len(batch) and all(batch is not b for b, _ in broken)]
            groups: list[tuple[DecodeBatch, list[Sequence]]] = []
            if runner.info.batchable:
                if joining and not kept:
                    kept.append(DecodeBatch(runner))
                if joining:
                    groups.append((kept[0], joining))
            else:
                for sequence in joining:
                    kept.append(DecodeBatch(runner))
                    groups.append((kept[-1], [sequence]))
            for batch, rows in groups:
                try:
                    join_faults.extend(batch.join(rows))
                except BatchBroken as error:
                    broken.append((batch, error.error))
                    join_faults.extend(RowFailed(sequence, error.error) for sequence in rows)
            emitted: list[Emitted] = []
            sizes: list[int] = []
            for batch in kept:
                if not len(batch) or any(batch is b for b, _ in broken):
                    continue
                try:
                    tokens, failed, ran = batch.advance(steps)
                except Exception as error:
                    traceback.clear_frames(error.__traceback__)
                    broken.append((batch, error))
                    continue
                sizes.extend([len(batch)] * ran)
                emitted.extend(tokens)
                step_faults.extend(failed)
            live = [batch for batch in kept if len(batch) and all(batch is not b for b, _ in broken)]
            return _DecodeOutcome(
                live, emitted, faults, join_faults, step_faults, answers, unpublishable, broken, sizes
            )

        outcome = await self._compute(job)
        self._batches = outcome.batches
        self._num_decode_steps += len(outcome.steps)
        self._num_decode_rows += sum(outcome.steps)
        self._num_unpublishable += outcome.unpublishable
        left = {id(failure.sequence): failure for failure in outcome.leave_failures}
        for sequence, keep in leaving:
            fault = left.pop(id(sequence), None)
            if not keep or sequence.cancelled:
                self._forget(sequence)
            elif fault is not None:
                self._num_model_errors += 1
                self._fail(sequence, fault.error)
            else:
                answer = outcome.answers.get(id(sequence))
                self._count_published(answer, False)
                if answer is not None:
                    sequence.publish(answer)
                self._finish(sequence, sequence.final)
        for batch, error in outcome.broken:
            self._num_model_errors += 1
            for sequence in batch.rows:
                if not sequence.cancelled and sequence.phase is not Phase.FINISHED:
                    self._fail(sequence, error)
        for failure in outcome.join_failures:
            sequence = failure.sequence
            if sequence.phase is Phase.FINISHED:
                continue
            if sequence.cancelled:
                self._forget(sequence)
            else:
                self._num_model_errors += 1
                self._fail(sequence, failure.error)
        rows: dict[int, list[Emitted]] = {}
        for item in outcome.emitted:
            rows.setdefault(id(item.sequence), []).append(item)
        for items in rows.values():
            self._emit_tokens(items)
        # Rows whose own decode step raised (and the last row of a batch whose
        # cache could not be taken back out): the tokens they emitted before
        # stand; each fails, and leaves its batch if it is still in one.
        for failure in [*left.values(), *outcome.step_failures]:
            sequence = failure.sequence
            if sequence.phase is Phase.FINISHED or sequence.cancelled or id(sequence) in self._leaving:
                continue
            self._num_model_errors += 1
            if not any(sequence in batch.rows for batch in self._batches):
                self._fail(sequence, failure.error)
                continue
            sequence.emit(Failed(error=ComputeFailed(sequence.request_id, failure.error)))
            sequence.cancelled = True
            self._leaving[id(sequence)] = (sequence, False)

    def _fail(self, sequence: Sequence, error: Exception) -> None:
        """End a request that holds no batch row with :class:`ComputeFailed`."""
        self._finish(sequence, Failed(error=ComputeFailed(sequence.request_id, error)))

    def _emit_tokens(self, items: list[Emitted]) -> None:
        """Send one row's tokens of this job, up to where it is done."""
        sequence = items[0].sequence
        if sequence.cancelled or id(sequence) in self._leaving:
            return
        tokens: list[int] = []
        logprobs: list[Any] = []
        reason: Optional[Literal["stop", "length"]] = None
        for item in items:
            if item.token in sequence.stop_tokens:
                del sequence.generated[item.index :]  # the stop token is not part of the answer
                reason = "stop"
                break
            tokens.append(item.token)
            if sequence.keep_logits:
                logprobs.append(item.logprobs)
            if item.index + 1 >= sequence.max_tokens:
                reason = "length"
                break
        if tokens:
            sequence.emit(Token(tokens=tuple(tokens), logprobs=tuple(logprobs)))
        if reason is not None:
            self._end_decoding(sequence, reason)

    def _end_decoding(self, sequence: Sequence, reason: Literal["stop", "length"]) -> None:
        """Make a finished row leave the batch; its answer is published as it leaves."""
        size = sequence.block_size
        sequence.final = Finished(reason=reason, num_stored=sequence.num_tokens // size * size)
        self._leaving[id(sequence)] = (sequence, True)

    # -- statistics ------------------------------------------------------------------

    def compute_statistics(self) -> ComputeStatistics:
        """A snapshot of the counters, the live requests and the thread."""
        decoding = sum(len(batch) for batch in self._batches) + len(self._joining)
        decoding -= sum(sequence.cancelled for sequence, _ in self._leaving.values())
        return ComputeStatistics(
            num_live=len(self._live),
            num_prefilling=len(self._queue),
            num_decoding=decoding,
            num_prefill_tokens=self._num_prefill_tokens,
            num_cached_tokens=self._num_cached_tokens,
            num_last_cache_reuses=self._num_last_cache_reuses,
            num_prefill_chunks=self._num_prefill_chunks,
            num_decode_steps=self._num_decode_steps,
            num_decode_rows=self._num_decode_rows,
            batched=bool(self._info is not None and self._info.batchable),
            num_published_blocks=self._num_published_blocks,
            num_cold_fallbacks=self._num_cold_fallbacks,
            num_unpublishable=self._num_unpublishable,
            num_model_errors=self._num_model_errors,
            num_cancelled=self._num_cancelled,
            num_vision_encoder_runs=self._num_encoder_runs,
            num_vision_encoder_skips=self._num_encoder_skips,
            thread=self._thread.statistics(),
        )


#: Sent to test whether a stream still has a reader; never delivered.
_PROBE = object()


def _send(events: MemoryObjectSendStream[Any], event: Any) -> bool:
    """Put ``event`` on a request's stream; False if nobody reads it any more.

    ``_PROBE`` only asks the question. The stream is sized by
    :func:`events_needed`, so it is never full.
    """
    if event is _PROBE:
        return events.statistics().open_receive_streams > 0
    try:
        events.send_nowait(event)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        return False
    except anyio.WouldBlock:
        raise AssertionError("a request's event stream is full: it was sized too small") from None
    return True


def _first_token(sequence: Sequence, logits: Any) -> tuple[int, Any]:
    """Runs on the MLX thread: the first token, sampled from the last prompt
    position, and the log-probabilities it was drawn from."""
    import mlx.core as mx

    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    if sequence.sampler is None:
        token = mx.argmax(logprobs)
    else:
        token = sequence.sampler(logprobs[None])[0]
    return int(token.item()), logprobs


def _publish(
    runner: ModelRunner, sequence: Sequence, cache: Any, end: Optional[int] = None
) -> tuple[Optional[Published], bool]:
    """Runs on the MLX thread: the full blocks of ``cache`` not published yet.

    Covers ``end`` tokens (default: all computed). A KV that cannot be
    sliced exactly stops publishing for this request.

    Returns:
        The blocks (None if there are none), and whether slicing failed.
    """
    size = sequence.block_size
    stop = (sequence.num_computed if end is None else end) // size
    start = sequence.num_published
    if start < 0 or stop <= start:
        return None, False
    try:
        payloads = runner.slice_blocks(sequence, cache, start, stop)
    except kv_state.NotReconstructable:
        sequence.num_published = -1  # never again: this KV cannot be cut exactly
        return None, True
    sequence.num_published = stop
    tokens = sequence.tokens(start * size, stop * size)
    return Published(start=start, payloads=payloads, tokens=tokens), False


class ComputeHandle(ActorHandle):
    """Typed calls to a :class:`ComputeActor`; messages stay inside.

    Every call is a cancellation point unless documented otherwise.
    """

    async def generate(
        self,
        request_id: str,
        prompt: Seq[int],
        *,
        events: MemoryObjectSendStream[Event],
        prefix: Seq[BlockPayload] = (),
        sampling: Sampling = GREEDY,
        max_tokens: int,
        block_size: int,
        stop_tokens: Optional[frozenset[int]] = None,
        keep_logits: bool = False,
        held_blocks: int = 0,
        namespace: Hashable = None,
        inputs: Any = None,
        to_cache: Optional[MemoryObjectSendStream[Event]] = None,
    ) -> None:
        """Send :class:`Generate`; the request's events arrive on ``events``
        (what is to be cached on ``to_cache``, if given).

        Raises:
            ActorFailed: the actor is not running.
        """
        await self._ref.tell(
            Generate(
                request_id=request_id,
                prompt=tuple(prompt),
                prefix=tuple(prefix),
                sampling=sampling,
                max_tokens=max_tokens,
                block_size=block_size,
                stop_tokens=stop_tokens,
                keep_logits=keep_logits,
                held_blocks=held_blocks,
                namespace=namespace,
                inputs=inputs,
                events=events,
                to_cache=to_cache,
            )
        )

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
