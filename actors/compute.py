"""The compute actor: the model, its tokenizer, and the live KV caches of requests.

:class:`ComputeActor` is the only actor that evaluates MLX. It owns one
:class:`~mlxkv.actors.mlx_thread.MLXThread` and every job it hands that thread
builds *and* evaluates its graphs there, so only evaluated arrays reach the
event loop (and, through replies, other actors).

Messages (each :class:`~mlxkv.actors.actor.Ask` answers with the noun after
the arrow):

- :class:`Prefill` -> :class:`Step`: start a request. Its cache is rebuilt
  from the cached prefix's :class:`~mlxkv.cache.kv_state.BlockPayload`\\ s (with
  room for the suffix) or made cold with the model's own ``make_cache``; the
  uncached suffix is run in chunks; the reply carries the first sampled token
  and the logits of the last prompt token.
- :class:`DecodeStep` -> :class:`Step`: feed one token, sample the next.
- :class:`DetachBlocks` -> ``tuple[BlockPayload, ...]``: evaluated, owned
  copies of the KV of full blocks ``[start, stop)``, ready to store; later
  generation never changes them.
- :class:`Drop` (no reply): forget a request's live cache.
- :class:`EncodeText` / :class:`DecodeText`: the tokenizer, for convenience.
- :class:`NewDetokenizer` -> a fresh streaming detokenizer, owned by the
  caller from then on (text of a generation, token by token, without a
  message per token).
- :class:`Describe` -> :class:`ModelInfo`, :class:`Statistics` ->
  :class:`ComputeStatistics`.

Fairness. The model runs one request at a time (batch size 1): caches stay
plain mlx-lm objects that :mod:`mlxkv.cache.kv_state` slices and rebuilds
exactly, and a cached request computes only its own suffix. Work is cut into
units -- one message, or one prefill chunk of at most ``prefill_chunk``
tokens -- and scheduled in rounds. While no prefill is unfinished the actor
handles its mailbox in FIFO order. Otherwise each round handles the messages
that were waiting when the round began, in FIFO order (a new prefill runs its
first chunk as it is handled), then one more chunk of the oldest unfinished
prefill. A generating request has at most one :class:`DecodeStep` in flight,
so every active request gets exactly one decode step per round: decode steps
of concurrent requests interleave round-robin; a long prefill delays another
request's next token by at most one of its chunks (plus the first chunk of
each prefill that arrived in the same round); and prefills finish in the
order they started. Batching decode steps would need mlx-lm's padded batch caches,
which the block slicer cannot rebuild exactly; on a CPU-bound backend it
would also buy little.

Failures. A domain error (bad input, unknown request, payloads that cannot be
rebuilt) is answered as a value and changes nothing. An exception raised while
evaluating a request's model call is answered as :class:`ComputeFailed`: a
failed :class:`Prefill` leaves nothing behind; a request whose decode step
failed is *poisoned* (its cache may be half written) -- every later
:class:`DecodeStep` or :class:`DetachBlocks` for it answers the same error --
until it is dropped. Other requests are unaffected. If the MLX thread itself
dies, or a handler has a bug, the actor crashes loudly: every pending caller
gets :class:`~mlxkv.actors.actor.ActorFailed`.

Cancellation. A caller cancelled while its message is queued or computing
gets its cancellation at once; the actor finishes the job and, finding the
reply undeliverable, undoes it (a prefill's cache is dropped). An unfinished
prefill whose caller is gone is abandoned before its next chunk. If the actor
itself is cancelled mid-job, the job's result is handed to the thread's
orphan callback, and the actor's shutdown waits (shielded) for the thread to
finish that job and stop.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, TypeVar

import anyio
import attrs
from anyio.abc import TaskStatus

from mlxkv.actors.actor import (
    Actor,
    ActorHandle,
    ActorStatistics,
    Ask,
    Failure,
    Tell,
    _close_reply,
)
from mlxkv.actors.sampling import GREEDY, Sampling
from mlxkv.actors.mlx_thread import MLXThread, MLXThreadStatistics, MLXThreadStopped
from mlxkv.actors.model_source import ModelLoadError
from mlxkv.cache import kv_state
from mlxkv.cache.errors import CacheError, DuplicateRequest, InvalidInput, UnknownRequest
from mlxkv.cache.kv_state import BlockPayload
from mlxkv.cache.token_ids import check_token_ids

__all__ = [
    "DEFAULT_PREFILL_CHUNK",
    "GREEDY",
    "ComputeActor",
    "ComputeFailed",
    "ComputeHandle",
    "ComputeStatistics",
    "DecodeStep",
    "DecodeText",
    "Describe",
    "DetachBlocks",
    "Drop",
    "EncodeText",
    "ModelInfo",
    "NewDetokenizer",
    "Prefill",
    "Sampling",
    "Statistics",
    "Step",
    "plan_chunks",
]

T = TypeVar("T")

#: Tokens per prefill chunk: 30-150 ms of the default model on a 2-core CPU
#: (more as the context grows), so other requests' decode steps wait about
#: that long at most; smaller chunks made a 2k prefill no faster here.
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


@attrs.frozen(kw_only=True)
class Step:
    """Reply to :class:`Prefill` and :class:`DecodeStep`.

    Attributes:
        token: the sampled next token (not yet in the cache: feed it back with
            :class:`DecodeStep`).
        logits: the logits it was sampled from, an evaluated MLX array of
            shape ``(vocab_size,)``, readable on any thread.
        num_tokens: tokens now in the request's cache.
        num_cached: tokens taken from prefix payloads (prefill only, else 0).
    """

    token: int
    logits: Any = attrs.field(eq=False, repr=False)
    num_tokens: int
    num_cached: int = 0


@attrs.frozen(kw_only=True)
class ModelInfo:
    """What callers need to know about the model.

    Attributes:
        vocab_size: token ids are in ``[0, vocab_size)`` (``None`` if the
            model does not say).
        eos_token_ids: tokens that end a generation.
        cache_layers: class names of the model's cache layers, in order.
        has_recurrent: whether some layer keeps recurrent state
            (``ArraysCache``); such a model's stored chain is only
            reconstructable up to a block that carries a state snapshot,
            see :class:`Prefill` ``block_size``.
        prefill_chunk: tokens per prefill chunk.
        max_context: the most tokens a request may hold (prompt and
            answer): the config's ``max_position_embeddings``, or None if
            it does not say.
        kv_bytes_per_token: bytes of KV one token takes across the
            sequence layers (attention keys and values).
        state_bytes: bytes of one snapshot of every recurrent layer's state
            (0 without recurrent layers); a block that ends where a snapshot
            was taken carries one.
    """

    vocab_size: Optional[int]
    eos_token_ids: frozenset[int]
    cache_layers: tuple[str, ...]
    has_recurrent: bool
    prefill_chunk: int
    max_context: Optional[int] = None
    kv_bytes_per_token: int = 0
    state_bytes: int = 0

    def block_bytes(self, block_size: int) -> int:
        """Bytes one stored block of ``block_size`` tokens takes, snapshot included."""
        return block_size * self.kv_bytes_per_token + self.state_bytes


@attrs.frozen(kw_only=True)
class ComputeStatistics:
    """A snapshot of the compute actor.

    The actor's base counters and mailbox are its :meth:`Actor.statistics`.

    Attributes:
        num_live: requests holding a cache (prefilling ones included).
        num_prefilling: requests whose prefill is unfinished.
        num_prefill_tokens: prompt tokens run through the model.
        num_cached_tokens: prompt tokens taken from prefix payloads instead.
        num_prefill_chunks: prefill jobs run.
        num_decode_steps: decode steps run.
        num_detached_blocks: block payloads handed out by DetachBlocks.
        num_model_errors: model calls that raised (answered as ComputeFailed).
        num_abandoned: prefills stopped early because their caller had gone.
        thread: the MLX thread's counters.
    """

    num_live: int
    num_prefilling: int
    num_prefill_tokens: int
    num_cached_tokens: int
    num_prefill_chunks: int
    num_decode_steps: int
    num_detached_blocks: int
    num_model_errors: int
    num_abandoned: int
    thread: MLXThreadStatistics


# -- messages -------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Prefill(Ask[Step]):
    """Start ``request_id``: rebuild its prefix, run the suffix, sample a token.

    Attributes:
        tokens: the uncached suffix; at least one token (keep the prompt's
            last token out of the prefix so that it yields logits).
        prefix: payloads of the cached blocks ``0..n-1``, in order; empty for
            a cold start. Must fit the model's cache layout.
        sampling: how tokens are sampled for this request.
        block_size: for a model with recurrent layers, also split the prefill
            at the prompt's last full-block boundary and keep a snapshot of
            the recurrent state there, so that :class:`DetachBlocks` can make
            that block the reconstructable end of a stored chain. Ignored by
            pure-attention models.
    """

    tokens: tuple[int, ...] = attrs.field(converter=tuple)
    prefix: tuple[BlockPayload, ...] = attrs.field(default=(), converter=tuple)
    sampling: Sampling = GREEDY
    block_size: Optional[int] = None


@attrs.frozen(kw_only=True)
class DecodeStep(Ask[Step]):
    """Feed ``token`` to ``request_id``'s cache and sample the next one."""

    token: int


@attrs.frozen(kw_only=True)
class DetachBlocks(Ask[tuple[BlockPayload, ...]]):
    """Copy out the KV of full blocks ``[start, stop)`` of ``request_id``.

    Every block must lie within the tokens already in the cache. The payloads
    own evaluated copies. For a model with recurrent layers the last payload
    carries the state snapshot only if ``stop * block_size`` is where the
    cache ends or where :class:`Prefill` took its snapshot.
    """

    block_size: int
    start: int
    stop: int


@attrs.frozen(kw_only=True)
class Drop(Tell):
    """Forget ``request_id``'s cache (or stop its unfinished prefill)."""


@attrs.frozen(kw_only=True)
class EncodeText(Ask[tuple[int, ...]]):
    """Token ids of ``text`` under the model's tokenizer."""

    text: str
    add_special_tokens: bool = True


@attrs.frozen(kw_only=True)
class DecodeText(Ask[str]):
    """The text of ``tokens`` under the model's tokenizer."""

    tokens: tuple[int, ...] = attrs.field(converter=tuple)


@attrs.frozen(kw_only=True)
class NewDetokenizer(Ask[Any]):
    """A fresh mlx-lm ``StreamingDetokenizer``; the caller owns it."""


@attrs.frozen(kw_only=True)
class Describe(Ask[ModelInfo]):
    """Report :class:`ModelInfo`."""

    polled = True


@attrs.frozen(kw_only=True)
class Statistics(Ask[ComputeStatistics]):
    """Report :class:`ComputeStatistics`."""

    polled = True


# -- actor-owned state ------------------------------------------------------


class _Request:
    """One live request: its cache and how it samples.

    Owned by the actor; while a job runs, the job uses ``cache`` on the MLX
    thread and the actor does not touch it.
    """

    __slots__ = (
        "request_id",
        "cache",
        "num_tokens",
        "sampler",
        "num_sampled",
        "snapshot",
        "prefill",
        "failure",
    )

    def __init__(self, request_id: str, sampling: Sampling) -> None:
        self.request_id = request_id
        self.cache: Optional[list[Any]] = None
        self.num_tokens = 0
        self.sampler = sampling.make_sampler()
        self.num_sampled = 0
        #: (position, per-layer recurrent state or None) taken during prefill.
        self.snapshot: Optional[tuple[int, tuple[Optional[tuple[Any, ...]], ...]]] = None
        self.prefill: Optional[_PendingPrefill] = None
        self.failure: Optional[ComputeFailed] = None


class _PendingPrefill:
    """A prefill between chunks: where it is and what is left."""

    __slots__ = ("envelope", "tokens", "position", "ends", "snapshot_at", "started")

    def __init__(
        self,
        envelope: Any,
        tokens: tuple[int, ...],
        position: int,
        ends: list[int],
        snapshot_at: Optional[int],
        started: float,
    ) -> None:
        self.envelope = envelope
        self.tokens = tokens  # the whole suffix; it ends at position ends[-1]
        self.position = position  # absolute position of the next token to run
        self.ends = ends  # absolute end of each remaining job; the last is the total
        self.snapshot_at = snapshot_at
        self.started = started


@attrs.frozen
class _Chunk:
    """What one prefill job returns."""

    cache: list[Any] = attrs.field(repr=False)
    step: Optional[Step]
    snapshot: Optional[tuple[Optional[tuple[Any, ...]], ...]] = attrs.field(repr=False)


#: Returned by a handler whose message is answered later (an unfinished prefill).
_LATER = object()


def plan_chunks(start: int, total: int, chunk: int, snapshot_at: Optional[int] = None) -> list[int]:
    """Where each prefill job of positions ``[start, total)`` ends.

    Chunks end on multiples of ``chunk`` (absolute positions, so a warm and a
    cold prefill of one prompt cut it alike), and at ``snapshot_at``. The
    last prompt token is run on its own, as mlx-lm does, so the model's
    output head runs on one position only; it rides in the last job.

    Args:
        start: first position to run (tokens before it are cached).
        total: one past the last prompt position; ``> start``.
        chunk: tokens per chunk, ``> 0``.
        snapshot_at: a position at which a job must end, if any.

    Returns:
        Increasing job ends; the last one is ``total``.
    """
    ends: list[int] = []
    position = start
    last = total - 1
    while position < last:
        end = min((position // chunk + 1) * chunk, last)
        if snapshot_at is not None and position < snapshot_at < end:
            end = snapshot_at
        ends.append(end)
        position = end
    if ends:
        ends[-1] = total
    else:
        ends.append(total)
    return ends


def _layer_key(layer: Any) -> tuple[Any, ...]:
    return (type(layer).__name__, getattr(layer, "max_size", None), getattr(layer, "keep", None))


class ComputeActor(Actor):
    """Owns the model, the tokenizer, the MLX thread and the live request caches.

    The one actor whose handling awaits: each message's MLX work runs on the
    MLX thread while the actor waits, so model evaluation is serialised here.
    See the module docstring for the messages, fairness and failure rules.

    Owns: the model (called only on the MLX thread), the tokenizer (used only
    in handlers), the :class:`MLXThread`, one :class:`_Request` per live
    request (its mlx-lm cache objects, sampler, recurrent-state snapshot,
    unfinished prefill), the queue of unfinished prefills, and counters.

    Invariants:
        - every MLX graph is built and evaluated on the MLX thread; replies
          hold evaluated arrays only;
        - at most one job is in flight; while it runs, only it touches the
          cache it was given;
        - a request is in ``_prefilling`` iff its ``prefill`` is set, and is
          then in ``_requests``; no decode step or detach runs on it;
        - every Ask gets exactly one of: a reply, an undo because its caller
          went away, or a closed reply stream (the caller sees ActorFailed);
        - a request's ``num_tokens`` equals the tokens its cache holds.
    """

    name = "compute"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        **options: Any,
    ) -> None:
        """Take the model; nothing runs until :meth:`run`.

        Args:
            model: an mlx-lm model (``model(tokens, cache=...)`` -> logits),
                weights evaluated.
            tokenizer: its mlx-lm ``TokenizerWrapper``.
            prefill_chunk: tokens per prefill chunk, > 0.
            **options: the :class:`Actor` options (``mailbox_size``, ``trace``,
                ``trace_polls``, ``intercept``).

        Raises:
            InvalidInput: ``prefill_chunk`` is not a positive int.
            ValueError: ``mailbox_size`` is below 1.
        """
        if not isinstance(prefill_chunk, int) or prefill_chunk <= 0:
            raise InvalidInput("prefill_chunk", prefill_chunk, "must be a positive int")
        super().__init__(**options)
        self._model = model
        self._tokenizer = tokenizer
        self._loader: Optional[Callable[[], tuple[Any, Any]]] = None
        self._source: Optional[str] = None
        self._chunk = prefill_chunk
        self._thread = MLXThread(name="mlxkv-compute", log=self._log)
        self._info: Optional[ModelInfo] = None
        self._cold_layout: tuple[tuple[Any, ...], ...] = ()
        self._requests: dict[str, _Request] = {}
        self._prefilling: collections.deque[_Request] = collections.deque()
        self._current: Any = None
        self._num_prefill_tokens = 0
        self._num_cached_tokens = 0
        self._num_prefill_chunks = 0
        self._num_decode_steps = 0
        self._num_detached_blocks = 0
        self._num_model_errors = 0
        self._num_abandoned = 0

    @classmethod
    def loading(cls, path: str, **kwargs: Any) -> ComputeActor:
        """An actor that loads ``path`` with ``mlx_lm.load`` on its MLX thread as it starts.

        Loading there matters for real models: arrays a model builds lazily
        at construction (rotary tables, say) belong to the loading thread's
        stream and could not be evaluated on another thread. A load error
        is raised from :meth:`run` as :class:`ModelLoadError`, before it
        reports started.

        Args:
            path: the model directory.
            **kwargs: passed to the constructor.

        Returns:
            The actor, not running yet.
        """
        actor = cls(None, None, **kwargs)

        def load() -> tuple[Any, Any]:
            from mlx_lm import load

            return load(str(path))

        actor._loader = load
        actor._source = str(path)
        return actor

    @classmethod
    def from_path(cls, path: str, **kwargs: Any) -> ComputeActor:
        """Load an mlx-lm model directory with ``mlx_lm.load`` (blocking).

        Args:
            path: the model directory.
            **kwargs: passed to the constructor.

        Returns:
            The actor, not running yet.
        """
        from mlx_lm import load

        model, tokenizer = load(str(path))
        return cls(model, tokenizer, **kwargs)

    # -- running -----------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start the MLX thread, then serve until every sender is closed.

        Unfinished prefills are completed before it returns. On a crash or
        cancellation every pending caller's reply stream is closed, every
        live cache dropped, and the MLX thread stopped and joined.
        """
        try:
            self._thread.start()
            if self._loader is not None:
                try:
                    self._model, self._tokenizer = await self._thread.submit(self._loader)
                except Exception as error:
                    if isinstance(error, (MLXThreadStopped, ModelLoadError)):
                        raise
                    reason = f"{type(error).__name__}: {error}"
                    raise ModelLoadError(str(self._source), reason) from error
                self._loader = None
            self._info, self._cold_layout = await self._thread.submit(self._describe_model)
            task_status.started()
            await self._serve()
        except BaseException as error:
            self._record_crash(error, self._current)
            raise
        finally:
            if self._current is not None:
                _close_reply(self._current.message)
            for request in self._prefilling:
                assert request.prefill is not None, "a queued prefill lost its state"
                _close_reply(request.prefill.envelope.message)
            self._prefilling.clear()
            self._requests.clear()
            self._fail_pending()
            self._mailbox_out.close()
            with anyio.CancelScope(shield=True):
                await self._thread.aclose()

    async def _serve(self) -> None:
        mailbox = self._mailbox_out
        while True:
            if not self._prefilling:
                try:
                    envelope = await mailbox.receive()
                except anyio.EndOfStream:
                    return
                await self._dispatch(envelope)
                continue
            # A round: what was waiting when it began, then one more chunk.
            for _ in range(mailbox.statistics().current_buffer_used):
                try:
                    envelope = mailbox.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
                await self._dispatch(envelope)
            if self._prefilling:
                await self._continue_prefill(self._prefilling[0])

    async def _dispatch(self, envelope: Any) -> None:
        message = envelope.message
        started = time.perf_counter()
        self._current = envelope
        try:
            if self._intercept is not None:
                self._intercept(self.name, message)
            result = await self._handle(envelope, started)
        except CacheError as error:
            result = Failure(error)
        self._current = None
        if result is not _LATER:
            self._deliver(envelope, result, started)

    async def _handle(self, envelope: Any, started: float) -> Any:
        message = envelope.message
        match message:
            case Prefill():
                return await self._start_prefill(envelope, started)
            case DecodeStep():
                return await self._decode(message)
            case DetachBlocks():
                return await self._detach(message)
            case Drop():
                return self._drop(message)
            case EncodeText():
                if not isinstance(message.text, str):
                    raise InvalidInput("text", message.text, "must be a str")
                encoded = self._tokenizer.encode(
                    message.text, add_special_tokens=message.add_special_tokens
                )
                return tuple(encoded)
            case DecodeText():
                self._check_tokens(message.tokens, allow_empty=True)
                return self._tokenizer.decode(list(message.tokens))
            case NewDetokenizer():
                return self._tokenizer.detokenizer
            case Describe():
                return self._info
            case Statistics():
                return self.compute_statistics()
        return self.handle(message)

    def _apply_undo(self, compensation: Tell) -> None:
        # Handling here may await the MLX thread; a Drop needs no model work.
        self._drop_tell(compensation)

    def undo(self, message: Ask[Any], reply: Any) -> Optional[Tell]:
        """A prefill's reply created a live cache: its undo drops it."""
        if isinstance(message, Prefill) and isinstance(reply, Step):
            return Drop(request_id=message.request_id)
        return None

    def _drop_tell(self, message: Tell) -> None:
        assert isinstance(message, Drop), f"unexpected compensation {message!r}"
        try:
            self._drop(message)
        except UnknownRequest:
            pass  # already gone: nothing left to give back

    # -- MLX jobs ------------------------------------------------------------

    async def _compute(self, fn: Callable[[], T], request_id: Optional[str]) -> T:
        """Run ``fn`` on the MLX thread; a model error becomes ComputeFailed."""
        try:
            return await self._thread.submit(fn, on_orphan=_discard)
        except (CacheError, MLXThreadStopped):
            raise
        except Exception as error:
            self._num_model_errors += 1
            raise ComputeFailed(request_id, error) from error

    def _describe_model(self) -> tuple[ModelInfo, tuple[tuple[Any, ...], ...]]:
        """Runs on the MLX thread: the model's info and its cold cache layout.

        Bytes per token are measured, not computed from the config: one
        token is run through a fresh cache and its buffers are sized.
        """
        import mlx.core as mx
        from mlx_lm.models.cache import ArraysCache, make_prompt_cache

        cold = make_prompt_cache(self._model)
        layout = tuple(_layer_key(layer) for layer in cold)
        self._model(mx.array([[0]]), cache=cold)
        mx.eval([layer.state for layer in cold])
        kv_bytes = state_bytes = 0
        for layer in cold:
            if isinstance(layer, ArraysCache):
                state_bytes += sum(a.nbytes for a in layer.cache if a is not None)
                continue
            for group in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                arrays = group if isinstance(group, (tuple, list)) else (group,)
                kv_bytes += sum(a.nbytes // a.shape[2] for a in arrays if a is not None)
        args = getattr(self._model, "args", None)
        eos = getattr(self._tokenizer, "eos_token_ids", None) or ()
        max_context = getattr(args, "max_position_embeddings", None)
        info = ModelInfo(
            vocab_size=getattr(args, "vocab_size", None),
            eos_token_ids=frozenset(int(t) for t in eos),
            cache_layers=tuple(type(layer).__name__ for layer in cold),
            has_recurrent=any(isinstance(layer, ArraysCache) for layer in cold),
            prefill_chunk=self._chunk,
            max_context=max_context if isinstance(max_context, int) and max_context > 0 else None,
            kv_bytes_per_token=kv_bytes,
            state_bytes=state_bytes,
        )
        return info, layout

    def _new_cache(self, prefix: tuple[BlockPayload, ...], num_new: int) -> list[Any]:
        """Runs on the MLX thread: the request's cache, cold or rebuilt."""
        from mlx_lm.models.cache import make_prompt_cache

        if not prefix:
            return make_prompt_cache(self._model)
        # The model call that follows evaluates the copy in the same graph.
        cache = kv_state.reconstruct(prefix, extra_tokens=num_new, evaluate=False)
        if tuple(_layer_key(layer) for layer in cache) != self._cold_layout:
            raise kv_state.NotReconstructable(
                "the prefix payloads do not match this model's cache layout"
            )
        return cache

    def _run_chunk(
        self,
        request: _Request,
        cache: list[Any],
        tokens: Sequence[int],
        position: int,
        total: int,
        snapshot_at: Optional[int],
    ) -> _Chunk:
        """Runs on the MLX thread: tokens at ``[position, position + len)``.

        The last job of a prefill (``position + len(tokens) == total``) runs
        the final prompt token on its own and samples.
        """
        import mlx.core as mx

        end = position + len(tokens)
        body = tokens if end < total else tokens[:-1]
        snapshot = None
        if body:
            self._model(mx.array(body)[None], cache=cache)
            if end < total or position + len(body) == snapshot_at:
                # The job ends here (or a snapshot is taken): make the cache
                # concrete. Otherwise the final step's eval covers it.
                mx.eval([layer.state for layer in cache])
            if position + len(body) == snapshot_at:
                snapshot = _snapshot(cache)
        step = None
        if end == total:
            step = self._step(request, cache, tokens[-1], total, 0)
            if total == snapshot_at:
                snapshot = _snapshot(cache)
        return _Chunk(cache=cache, step=step, snapshot=snapshot)

    def _step(
        self, request: _Request, cache: list[Any], token: int, num_tokens: int, draw: int
    ) -> Step:
        """Runs on the MLX thread: one token through the model, then sample."""
        import mlx.core as mx

        logits = self._model(mx.array([[token]]), cache=cache)[0, -1]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        sampler = request.sampler
        sampled = mx.argmax(logprobs[None], axis=-1) if sampler is None else sampler(logprobs[None])
        mx.eval(sampled, logits, [layer.state for layer in cache])
        return Step(token=int(sampled.item()), logits=logits, num_tokens=num_tokens)

    def _slice(
        self, request: _Request, block_size: int, start: int, stop: int
    ) -> tuple[BlockPayload, ...]:
        """Runs on the MLX thread: owned copies of blocks ``[start, stop)``."""
        import mlx.core as mx

        assert request.cache is not None, f"request {request.request_id!r} has no cache"
        end = stop * block_size
        payloads = kv_state.slice_blocks(
            request.cache, block_size, range(start, stop), num_tokens=end
        )
        last = payloads[-1]
        snapshot = request.snapshot
        if not last.has_snapshots and snapshot is not None and snapshot[0] == end:
            # The cache has moved on since the prefill's snapshot at this
            # block's end: give the block that state (copied, so the
            # payload owns it).
            arrays = tuple(
                group
                if state is None
                else tuple(None if a is None else mx.array(a) for a in state)
                for group, state in zip(last.arrays, snapshot[1])
            )
            mx.eval([a for group in arrays if group for a in group if a is not None])
            payloads[-1] = attrs.evolve(last, arrays=arrays)
        return tuple(payloads)

    # -- handlers ----------------------------------------------------------

    def _live(self, request_id: Optional[str]) -> _Request:
        if request_id is None:
            raise InvalidInput("request_id", None, "is required")
        request = self._requests.get(request_id)
        if request is None:
            raise UnknownRequest(request_id)
        if request.prefill is not None:
            raise InvalidInput("request_id", request_id, "is still prefilling")
        if request.failure is not None:
            raise ComputeFailed(request_id, request.failure.cause)
        return request

    def _check_tokens(self, tokens: Sequence[Any], *, allow_empty: bool = False) -> None:
        vocab = None if self._info is None else self._info.vocab_size
        check_token_ids(tokens, vocab_size=vocab, allow_empty=allow_empty)

    async def _start_prefill(self, envelope: Any, started: float) -> Any:
        message: Prefill = envelope.message
        request_id = message.request_id
        if request_id is None:
            raise InvalidInput("request_id", None, "is required")
        if request_id in self._requests:
            raise DuplicateRequest(request_id)
        self._check_tokens(message.tokens)
        if not isinstance(message.sampling, Sampling):
            raise InvalidInput("sampling", message.sampling, "must be a Sampling")
        block_size = message.block_size
        if block_size is not None and (not isinstance(block_size, int) or block_size <= 0):
            raise InvalidInput("block_size", block_size, "must be a positive int")
        prefix = message.prefix
        if not all(isinstance(p, BlockPayload) for p in prefix):
            raise InvalidInput("prefix", prefix, "must hold BlockPayloads")
        num_cached = prefix[-1].end if prefix else 0
        total = num_cached + len(message.tokens)
        snapshot_at = None
        assert self._info is not None, "the actor is not running"
        if block_size is not None and self._info.has_recurrent:
            boundary = total // block_size * block_size
            snapshot_at = boundary if boundary > num_cached else None
        ends = plan_chunks(num_cached, total, self._chunk, snapshot_at)

        request = _Request(request_id, message.sampling)
        pending = _PendingPrefill(envelope, message.tokens, num_cached, ends, snapshot_at, started)
        first = ends[0] - num_cached
        tokens = message.tokens[:first]

        def start() -> _Chunk:
            cache = self._new_cache(prefix, len(message.tokens))
            return self._run_chunk(request, cache, tokens, num_cached, total, snapshot_at)

        chunk = await self._compute(start, request_id)
        self._num_cached_tokens += num_cached
        request.cache = chunk.cache
        request.num_tokens = num_cached
        self._requests[request_id] = request
        request.prefill = pending
        return self._after_chunk(request, chunk)

    async def _continue_prefill(self, request: _Request) -> None:
        pending = request.prefill
        assert pending is not None, "a queued request is not prefilling"
        message: Prefill = pending.envelope.message
        if message.reply.statistics().open_receive_streams == 0:
            # The caller is gone: stop here instead of computing the rest.
            self._num_abandoned += 1
            self._forget(request)
            self._deliver(pending.envelope, None, pending.started, abandoned=True)
            return
        offset = pending.position - (pending.ends[-1] - len(pending.tokens))
        tokens = pending.tokens[offset : offset + pending.ends[0] - pending.position]
        cache = request.cache
        assert cache is not None, "a prefilling request lost its cache"
        total, snapshot_at, position = pending.ends[-1], pending.snapshot_at, pending.position
        try:
            chunk = await self._compute(
                lambda: self._run_chunk(request, cache, tokens, position, total, snapshot_at),
                request.request_id,
            )
        except CacheError as error:
            self._forget(request)
            self._deliver(pending.envelope, Failure(error), pending.started)
            return
        result = self._after_chunk(request, chunk)
        if result is not _LATER:
            self._deliver(pending.envelope, result, pending.started)

    def _after_chunk(self, request: _Request, chunk: _Chunk) -> Any:
        """Book a finished prefill job; the reply if it was the last one."""
        pending = request.prefill
        assert pending is not None, "booking a chunk of a request that is not prefilling"
        end = pending.ends.pop(0)
        self._num_prefill_tokens += end - pending.position
        self._num_prefill_chunks += 1
        pending.position = end
        request.num_tokens = end
        if chunk.snapshot is not None:
            request.snapshot = (pending.snapshot_at, chunk.snapshot)  # type: ignore[assignment]
        if chunk.step is None:
            if request not in self._prefilling:
                self._prefilling.append(request)
            return _LATER
        if request in self._prefilling:
            self._prefilling.remove(request)
        request.prefill = None
        request.num_sampled += 1
        return attrs.evolve(chunk.step, num_cached=end - len(pending.tokens))

    def _forget(self, request: _Request) -> None:
        self._requests.pop(request.request_id, None)
        if request in self._prefilling:
            self._prefilling.remove(request)
        request.prefill = None
        request.cache = None

    async def _decode(self, message: DecodeStep) -> Step:
        request = self._live(message.request_id)
        self._check_tokens((message.token,))
        cache = request.cache
        num_tokens = request.num_tokens + 1
        draw = request.num_sampled
        try:
            step = await self._compute(
                lambda: self._step(request, cache, message.token, num_tokens, draw),
                request.request_id,
            )
        except ComputeFailed as error:
            request.failure = error
            raise
        request.num_tokens = num_tokens
        request.num_sampled += 1
        self._num_decode_steps += 1
        return step

    async def _detach(self, message: DetachBlocks) -> tuple[BlockPayload, ...]:
        request = self._live(message.request_id)
        block_size, start, stop = message.block_size, message.start, message.stop
        if not isinstance(block_size, int) or block_size <= 0:
            raise InvalidInput("block_size", block_size, "must be a positive int")
        if not isinstance(start, int) or not isinstance(stop, int) or not 0 <= start < stop:
            raise InvalidInput("start", (start, stop), "need 0 <= start < stop")
        if stop * block_size > request.num_tokens:
            raise InvalidInput(
                "stop",
                stop,
                f"block {stop - 1} is not full: the cache holds {request.num_tokens} tokens",
            )
        payloads = await self._compute(
            lambda: self._slice(request, block_size, start, stop), request.request_id
        )
        self._num_detached_blocks += len(payloads)
        return payloads

    def _drop(self, message: Drop) -> None:
        request_id = message.request_id
        if request_id is None:
            raise InvalidInput("request_id", None, "is required")
        request = self._requests.get(request_id)
        if request is None:
            raise UnknownRequest(request_id)
        pending = request.prefill
        self._forget(request)
        if pending is not None:
            self._deliver(pending.envelope, Failure(UnknownRequest(request_id)), pending.started)

    # -- statistics ------------------------------------------------------------

    def compute_statistics(self) -> ComputeStatistics:
        """A snapshot of the counters, the live requests and the thread."""
        return ComputeStatistics(
            num_live=len(self._requests),
            num_prefilling=len(self._prefilling),
            num_prefill_tokens=self._num_prefill_tokens,
            num_cached_tokens=self._num_cached_tokens,
            num_prefill_chunks=self._num_prefill_chunks,
            num_decode_steps=self._num_decode_steps,
            num_detached_blocks=self._num_detached_blocks,
            num_model_errors=self._num_model_errors,
            num_abandoned=self._num_abandoned,
            thread=self._thread.statistics(),
        )


def _snapshot(cache: list[Any]) -> tuple[Optional[tuple[Any, ...]], ...]:
    """Runs on the MLX thread: owned copies of every recurrent layer's state."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache

    state = tuple(
        tuple(None if a is None else mx.array(a) for a in layer.cache)
        if isinstance(layer, ArraysCache)
        else None
        for layer in cache
    )
    mx.eval([a for group in state if group for a in group if a is not None])
    return state


def _discard(_result: Any) -> None:
    """Orphan callback: a result nobody waits for holds only references; drop them."""


class ComputeHandle(ActorHandle):
    """Typed calls to a :class:`ComputeActor`; messages stay inside.

    Every call is a cancellation point unless documented otherwise.
    """

    async def prefill(
        self,
        request_id: str,
        tokens: Sequence[int],
        *,
        prefix: Sequence[BlockPayload] = (),
        sampling: Sampling = GREEDY,
        block_size: Optional[int] = None,
    ) -> Step:
        """See :class:`Prefill`. On cancellation the request's cache is dropped.

        Raises:
            DuplicateRequest: ``request_id`` is live.
            InvalidInput: bad tokens, sampling or block size.
            NotReconstructable: ``prefix`` cannot be rebuilt for this model.
            ComputeFailed: the model call raised; nothing is left behind.
            UnknownRequest: the request was dropped while prefilling.
            ActorFailed: the actor is not running.
        """
        return await self._ref.ask(
            Prefill,
            request_id=request_id,
            tokens=tuple(tokens),
            prefix=tuple(prefix),
            sampling=sampling,
            block_size=block_size,
        )

    async def decode_step(self, request_id: str, token: int) -> Step:
        """See :class:`DecodeStep`.

        Raises:
            UnknownRequest: no such live request.
            InvalidInput: bad token, or the request is still prefilling.
            ComputeFailed: this or an earlier model call of the request raised.
            ActorFailed: the actor is not running.
        """
        return await self._ref.ask(DecodeStep, request_id=request_id, token=token)

    async def detach_blocks(
        self, request_id: str, block_size: int, start: int, stop: int
    ) -> tuple[BlockPayload, ...]:
        """See :class:`DetachBlocks`.

        Raises:
            UnknownRequest: no such live request.
            InvalidInput: a block out of range or not full yet.
            NotReconstructable: the cache cannot be sliced exactly (a wrapped
                sliding window).
            ComputeFailed: an earlier model call of the request raised.
            ActorFailed: the actor is not running.
        """
        return await self._ref.ask(
            DetachBlocks, request_id=request_id, block_size=block_size, start=start, stop=stop
        )

    async def drop(self, request_id: str) -> None:
        """Send :class:`Drop`; shielded from cancellation.

        Raises:
            ActorFailed: the actor is not running.
        """
        await self._ref.tell_shielded(Drop(request_id=request_id))

    async def encode(
        self, text: str, *, add_special_tokens: bool = True, request_id: Optional[str] = None
    ) -> tuple[int, ...]:
        """See :class:`EncodeText`; ``request_id`` only labels the trace."""
        return await self._ref.ask(
            EncodeText, text=text, add_special_tokens=add_special_tokens, request_id=request_id
        )

    async def decode_text(self, tokens: Sequence[int]) -> str:
        """See :class:`DecodeText`.

        Raises:
            InvalidInput: a token is out of range.
        """
        return await self._ref.ask(DecodeText, tokens=tuple(tokens))

    async def new_detokenizer(self, *, request_id: Optional[str] = None) -> Any:
        """See :class:`NewDetokenizer`; ``request_id`` only labels the trace."""
        return await self._ref.ask(NewDetokenizer, request_id=request_id)

    async def describe(self) -> ModelInfo:
        """See :class:`Describe`."""
        return await self._ref.ask(Describe)

    async def statistics(self) -> ComputeStatistics:
        """See :class:`Statistics`."""
        return await self._ref.ask(Statistics)
