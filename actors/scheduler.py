"""The compute path's scheduler: every request's state, and what runs next.

Plain Python: no anyio, no MLX. The compute actor feeds it requests
(:meth:`Scheduler.add`) and cancellations (:meth:`Scheduler.cancel`), asks it
for the next :class:`Plan` (:meth:`Scheduler.schedule`), has the executor run
that plan on the MLX thread, and hands the executor's :class:`Result` back
(:meth:`Scheduler.update`), which turns it into the events each request's
streams get. Tests drive it with hand-built results, no model at all.

A request's life (:class:`RequestStatus`): ``WAITING`` until its first prefill
chunk, ``PREFILLING`` while chunks remain, ``JOINING`` once the last chunk
sampled its first token (its prompt's last blocks are published and it
joins the decode batch in the next plan), ``DECODING`` in the batch,
``LEAVING`` once it has ended but the executor still holds its cache (the
next plan takes its row out: publishing its answer's blocks and keeping its
cache if it finished, dropping it if it was cancelled), ``FINISHED``.
Whether and why a request ends is decided in one place, :meth:`Scheduler._end`:
its length, a stop token, a cancellation or a failure. (The rule for a token,
:func:`~mlxkv.actors.request.stop_reason`, is also read by a decode batch, to
cut a burst of steps short at a row's last token; it ends nothing: the
request leaves the batch when a plan says so.)

Plans. Each plan first does what earlier plans left: slice the blocks of
the prompts whose last chunk ran (``publish``; a chunk that is not its
prompt's last publishes its own blocks right after it runs, so that
requests waiting for them go on at once; the last one's wait for the next
plan, so the first token goes out first), take out the requests that ended (``leave``),
and merge the requests whose prompt is done into the batch (``join``). Then
it either decodes -- every row of the batch advances ``steps`` tokens, up to
:data:`MAX_BURST_STEPS` while nothing else waits (no prefill, no message,
no blocks to publish) -- or prefills -- one chunk
each for up to ``prefill_batch`` requests, in arrival order, while their
chunks cost at most ``prefill_budget`` (:func:`chunk_cost`: tokens, with
their attention over long contexts counted too; the oldest always gets its
chunk) -- a budget only while some row decodes: with none, no step waits
behind the plan, and it takes ``prefill_batch`` requests' chunks whatever
they cost (a wave arriving together prefills in one model call, as
mlx-lm's ``BatchGenerator`` prefills its waiting prompts), up to the first
request that will not decode (one token), whose chunk keeps the budget.
While both have work, decode and prefill plans alternate -- except
in a refill: while more requests wait for their first token (queued or
prefilling) than there are rows to decode, a prefill plan follows a
prefill plan, up to ``decode_wait`` in a row, and those plans share one
budget of ``decode_wait * prefill_budget``: a plan takes of it what its
chunks cost (up to ``prefill_batch`` requests), so the waiting prefill
together, not a chunk a plan between partial decode steps, and the batch
decodes once the budget is spent. A decode step then would hold up more
first tokens than it serves, and each partial step is a model call the
batch makes again once the refill has joined (as mlx-lm's
``BatchGenerator`` prefills every waiting prompt before it decodes, and
TGI pauses decoding while the waiting outnumber the running).

Fairness bound: between two decode plans run at most ``decode_wait``
prefill plans (one where as many rows decode as requests wait), of cost at
most ``max(decode_wait * prefill_budget, the first one's oldest chunk's)``
together while rows decode, and a plan where no more requests wait than
decode at most ``max(prefill_budget, cost of its oldest chunk)`` -- so at
most ``max(prefill_budget, prefill_chunk + 1)`` new tokens (a chunk that
reaches the prompt's last token takes it along); between two prefill plans
at most one decode plan, of at most :data:`MAX_BURST_STEPS` steps.
Requests prefill in arrival order.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, Literal, Optional

import attrs

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
)
from mlxkv.actors.compute_config import SchedulingConfig
from mlxkv.actors.plan import Blocks, Chunk, ChunkDone, Emitted, Leave, Plan, Result, Slice
from mlxkv.actors.request import (
    RequestSpec,
    blocks_out_at_start,
    next_chunk_end,
    prompt_and_answer,
    stop_reason,
)
from mlxkv.actors.token_logprobs import TokenLogprob
from mlxkv.cache.errors import CacheError

__all__ = [
    "MAX_BURST_STEPS",
    "RequestState",
    "Scheduler",
    "SchedulerStatistics",
    "RequestStatus",
    "chunk_cost",
]

#: The most decode steps one plan runs.
MAX_BURST_STEPS = 8

#: ``Chunk.published`` of a request whose KV cannot be sliced exactly.
_NOT_PUBLISHING = -1


class RequestStatus(enum.Enum):
    """Where a request stands (see the module docstring)."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    JOINING = "joining"
    DECODING = "decoding"
    LEAVING = "leaving"
    FINISHED = "finished"


#: Why a request ended.
Reason = Literal["stop", "length", "cancelled", "failed"]


@attrs.frozen
class _End:
    reason: Reason
    error: Optional[CacheError] = None

    @property
    def completed(self) -> bool:
        """Whether the request got every token it was to get."""
        return self.reason in ("stop", "length")


@attrs.define
class RequestState:
    """One request as the scheduler knows it; written by the scheduler only.

    Invariants:
        - ``num_published <= num_computed // block_size`` once started;
        - ``end`` is set exactly when the status is ``LEAVING`` or
          ``FINISHED`` (a request ends once);
        - ``answer`` holds the tokens sent, a stop token never among them.
    """

    spec: RequestSpec
    status: RequestStatus = RequestStatus.WAITING
    #: prompt tokens the executor did not compute (rebuilt or kept)
    num_cached: int = 0
    #: prompt tokens in the request's KV
    num_computed: int = 0
    #: leading full blocks that are out: held, brought as payloads, or published
    num_published: int = 0
    #: False once its KV could not be sliced exactly: nothing more is published
    publishing: bool = True
    #: :class:`PromptPublished` was sent
    prompt_out: bool = False
    answer: list[int] = attrs.field(factory=list)
    end: Optional[_End] = None

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def num_tokens(self) -> int:
        """Prompt and answer tokens (what the published blocks may cover)."""
        return len(self.spec.prompt) + len(self.answer)

    def tokens(self, start: int, stop: int) -> tuple[int, ...]:
        """Positions ``[start, stop)`` of the prompt followed by the answer."""
        return prompt_and_answer(self.spec.prompt, self.answer, start, stop)


@attrs.frozen(kw_only=True)
class SchedulerStatistics:
    """The scheduler's counters (``stats().compute`` carries them too:
    :class:`~mlxkv.actors.compute.ComputeStatistics`).

    Attributes:
        num_live: requests queued, prefilling or decoding.
        num_prefilling: requests with an unfinished prefill (queued ones too).
        num_decoding: requests in the decode batch.
        num_prefill_tokens: prompt tokens run through the model.
        num_cached_tokens: prompt tokens not computed (rebuilt from cached
            blocks, or taken from a kept cache).
        num_kept_cache_reuses: requests that took a kept cache (a finished
            request's), cut back to what they may use of it, instead of
            rebuilding their prefix from blocks (``num_last_cache_reuses``,
            its old name, still reads it).
        num_prefill_chunks: prefill chunks run (one request's each).
        num_prefill_calls: prefill model calls (a call serves one chunk,
            or several requests' chunks at once).
        num_decode_steps: decode model calls.
        num_decode_rows: request-steps those calls served (their sum of
            batch sizes).
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
        num_shared_prefix_tokens: prompt tokens requests read from a shared
            prefix group (held once for all of them) instead of a copy of
            their own (0 where the model keeps copies: see
            :attr:`~mlxkv.actors.model_info.ModelInfo.shared_prefix`).
    """

    num_live: int
    num_prefilling: int
    num_decoding: int
    num_prefill_tokens: int
    num_cached_tokens: int
    num_kept_cache_reuses: int
    num_prefill_chunks: int
    num_prefill_calls: int
    num_decode_steps: int
    num_decode_rows: int
    num_published_blocks: int
    num_cold_fallbacks: int
    num_unpublishable: int
    num_model_errors: int
    num_cancelled: int
    num_vision_encoder_runs: int
    num_vision_encoder_skips: int
    num_shared_prefix_tokens: int

    @property
    def num_last_cache_reuses(self) -> int:
        """The old name of :attr:`num_kept_cache_reuses`."""
        return self.num_kept_cache_reuses


#: What :meth:`Scheduler.update` and :meth:`Scheduler.cancel` hand out: an
#: event for a request, or ``None``: its streams end now (nothing follows).
Output = tuple[str, Optional[Event]]


def chunk_cost(start: int, end: int, context_unit: int) -> float:
    """What prefilling positions ``[start, end)`` costs, in tokens without
    context: each token's projections and MLP, plus its attention over the
    positions before it, counted as one token per ``context_unit`` of them.
    A budget of such tokens batches many short chunks over short contexts
    (the weights' reads dominate: batching pays) and few over long ones
    (attention dominates: a batch would only make everyone wait for the
    slowest)."""
    tokens = end - start
    return tokens * (1 + (start + tokens / 2) / context_unit)


class Scheduler:
    """Owns every live request's :class:`RequestState`; plans; turns results into events.

    Invariants:
        - every request added gets exactly one end, and then, unless it was
          cancelled, exactly one final event (:class:`Finished` or
          :class:`Failed`) -- and after it, or after a cancellation, the
          ``None`` that ends its streams;
        - the executor holds state for exactly the requests whose status is
          ``PREFILLING``, ``JOINING``, ``DECODING`` or ``LEAVING`` (and for a
          ``WAITING`` one only once a plan with its first chunk has run).
    """

    def __init__(self, config: SchedulingConfig, *, recurrent: bool = False, context_unit: int = 512) -> None:
        """Args:
            config: chunks, budgets and bursts (see :class:`SchedulingConfig`:
                the budget bounds a prefill plan while a row decodes, the
                oldest request's chunk always fitting; in a refill, the plans
                in a row share ``decode_wait`` budgets; with no row decoding,
                only ``prefill_batch`` bounds the chunks of requests that will
                decode: see :meth:`_chunks`).
            recurrent: the model has recurrent layers: chunks also end at
                every block end (where their state is snapshotted).
            context_unit: the context, in tokens, over which a token's
                attention costs as much as the rest of its computation (see
                :func:`chunk_cost`).
        """
        self._chunk = config.prefill_chunk
        self._budget = config.prefill_budget
        self._batch = config.prefill_batch
        self._burst = config.decode_burst
        self._decode_wait = config.decode_wait
        self._recurrent = recurrent
        self._context_unit = context_unit
        self._requests: dict[str, RequestState] = {}
        #: prefill plans since the last decode plan
        self._prefills_in_a_row = 0
        #: the cost of those plans run while rows decode (what they waited behind)
        self._spent = 0.0
        self._counts = dict.fromkeys(attrs.fields_dict(SchedulerStatistics), 0)

    # -- requests ------------------------------------------------------------

    def add(self, spec: RequestSpec) -> None:
        """Queue a request (its id must not be live: the caller checks)."""
        assert spec.request_id not in self._requests, f"{spec.request_id!r} is live already"
        self._requests[spec.request_id] = RequestState(spec=spec)

    def is_live(self, request_id: str) -> bool:
        return request_id in self._requests

    def cancel(self, request_id: str) -> list[Output]:
        """End a request without a final event; unknown or ended ones are ignored.

        Returns:
            What its streams get: only their end.
        """
        state = self._requests.get(request_id)
        if state is None or state.end is not None:
            return []
        self._counts["num_cancelled"] += 1
        return self._end(state, _End("cancelled"))

    def drop_all(self) -> None:
        """Forget every request (the actor is stopping; the executor goes with it)."""
        self._requests.clear()

    def requests(self) -> Iterable[RequestState]:
        """Live requests, in arrival order, to inspect (read only): the compute
        actor never reads them; the scheduler's tests and a debugger do."""
        return self._requests.values()

    # -- the one place a request ends ------------------------------------------

    def _end(self, state: RequestState, end: _End, *, held: Optional[bool] = None) -> list[Output]:
        """Decide that ``state`` ended, once, and why.

        A cancelled request's streams end now, a failed one's after its
        :class:`Failed`. A request the executor still holds leaves in the
        next plan (a completed one publishes its answer and is kept then,
        and gets :class:`Finished` after); one it does not hold is finished
        now.

        Args:
            held: whether the executor holds the request; by default, from
                its status (a failure the executor reports means it let go).
        """
        assert state.end is None, f"{state.request_id!r} ends twice"
        state.end = end
        out: list[Output] = []
        if end.reason == "failed":
            assert end.error is not None
            out.append((state.request_id, Failed(error=end.error)))
        if not end.completed:
            out.append((state.request_id, None))
        if held is None:
            held = state.status is not RequestStatus.WAITING
        if held:
            state.status = RequestStatus.LEAVING
        else:
            out += self._finish(state)
        return out

    def _finish(self, state: RequestState, error: Optional[Exception] = None) -> list[Output]:
        """The executor holds nothing of the request any more: a completed
        one gets its last events (:class:`Failed` instead of
        :class:`Finished` if taking it out raised)."""
        end = state.end
        assert end is not None, "a request finishes once it ended"
        state.status = RequestStatus.FINISHED
        del self._requests[state.request_id]
        if not end.completed:
            return []
        request_id = state.request_id
        if error is not None:
            return [(request_id, Failed(error=ComputeFailed(request_id, error))), (request_id, None)]
        size = state.spec.block_size
        finished = Finished(reason=end.reason, num_stored=state.num_published * size)  # type: ignore[arg-type]
        return [*self._prompt_out(state), (request_id, finished), (request_id, None)]

    def _prompt_out(self, state: RequestState) -> list[Output]:
        """:class:`PromptPublished`, once: the prompt's blocks are all out."""
        if state.prompt_out:
            return []
        state.prompt_out = True
        return [(state.request_id, PromptPublished())]

    def _fail(self, state: RequestState, error: Exception) -> list[Output]:
        """End a request the executor let go of because a step for it raised."""
        failure = error if isinstance(error, CacheError) else ComputeFailed(state.request_id, error)
        return self._end(state, _End("failed", failure), held=False)

    # -- planning --------------------------------------------------------------

    def has_work(self) -> bool:
        """Whether a plan would do anything."""
        return bool(self._requests)

    def schedule(self, *, messages_waiting: bool = False) -> Plan:
        """The next plan (see the module docstring for the policy).

        Args:
            messages_waiting: messages wait for the actor: decode one step
                only, so they are handled soon.
        """
        publish: list[Slice] = []
        leave: list[Leave] = []
        join: list[str] = []
        decoding = prefilling = 0
        for state in self._requests.values():
            status = state.status
            if status is RequestStatus.LEAVING:
                leave.append(self._leave(state))
            elif status is RequestStatus.JOINING:
                publish.extend(self._slices(state))
                join.append(state.request_id)
            elif status is RequestStatus.DECODING:
                decoding += 1
            elif status is RequestStatus.PREFILLING:
                prefilling += 1  # its chunks publish their own blocks
            else:
                prefilling += 1
        rows = decoding + len(join)
        steps = 0
        chunks: tuple[Chunk, ...] = ()
        if prefilling and not rows:
            chunks, _ = self._chunks(wave=True, budget=self._budget, spent=0.0)
            self._spent = 0.0  # no row waits behind it, nor behind what ran before
        elif prefilling and not self._decode_turn(rows, prefilling):
            # A refill (more wait than decode) shares one budget over the
            # prefill plans in a row: decode_wait plans' worth.
            refill = prefilling > rows
            budget = self._decode_wait * self._budget if refill else self._budget
            chunks, self._spent = self._chunks(wave=False, budget=budget, spent=self._spent)
        if chunks:
            self._prefills_in_a_row += 1
        elif rows:
            # Blocks to publish may be awaited by requests that wait for a
            # prefix in flight: then the plan is short (one step).
            idle = not (prefilling or messages_waiting or publish)
            steps = min(MAX_BURST_STEPS, max(1, self._burst // rows)) if idle else 1
            self._prefills_in_a_row = 0
            self._spent = 0.0
        return Plan(publish=tuple(publish), leave=tuple(leave), join=tuple(join), steps=steps, prefill=chunks)

    def _decode_turn(self, rows: int, waiting: int) -> bool:
        """With ``rows`` to decode and ``waiting`` requests to prefill: whether
        this plan decodes (the module docstring's policy)."""
        if self._prefills_in_a_row >= self._decode_wait:
            return True
        return self._prefills_in_a_row > 0 and waiting <= rows

    def _slices(self, state: RequestState) -> list[Slice]:
        stop = state.num_computed // state.spec.block_size
        if state.publishing and stop > state.num_published:
            return [Slice(state.request_id, state.num_published, stop)]
        return []

    def _leave(self, state: RequestState) -> Leave:
        end = state.end
        assert end is not None
        answer = None
        if end.completed and state.publishing:
            stop = state.num_tokens // state.spec.block_size
            if stop > state.num_published:
                answer = (state.num_published, stop)
        return Leave(state.request_id, answer, keep=end.completed, num_tokens=state.num_tokens)

    def _chunks(self, *, wave: bool, budget: float, spent: float) -> tuple[tuple[Chunk, ...], float]:
        """One chunk each for the oldest prefilling requests, within ``budget``
        of which ``spent`` is used already; the chunks and the budget used
        then. The oldest request's chunk always fits unless some is spent
        (then none may fit: the plan decodes instead).

        ``wave``: no row decodes, so no step waits behind this plan: the
        leading requests' chunks run together whatever they cost (batched
        chunks share the weights' reads, and the requests go on to decode
        together, not filling the batch a row at a time). The wave ends at
        a request that will not decode (one token: its first token is its
        whole answer): its chunk and those after it fit the budget, as
        batching it would only make it wait for the others'."""
        chunks: list[Chunk] = []
        used = spent
        for state in self._requests.values():
            if state.status not in (RequestStatus.WAITING, RequestStatus.PREFILLING):
                continue
            spec = state.spec
            start = state.num_computed
            if state.status is RequestStatus.WAITING:
                start = spec.num_prefix_tokens  # at least; a kept cache may give more
            boundary = spec.block_size if self._recurrent else None
            end = next_chunk_end(start, len(spec.prompt), self._chunk, boundary)
            cost = chunk_cost(start, end, self._context_unit)
            wave = wave and spec.max_tokens > 1
            if len(chunks) >= self._batch:
                break
            if (chunks or spent) and used + cost > budget and not wave:
                break
            used += cost
            first = state.status is RequestStatus.WAITING
            published = state.num_published if state.publishing else _NOT_PUBLISHING
            chunks.append(Chunk(state.request_id, end, spec if first else None, published))
        return tuple(chunks), used

    # -- results -----------------------------------------------------------------

    def update(self, plan: Plan, result: Result) -> list[Output]:
        """Apply what the executor did with ``plan``; the events it makes, in order."""
        out: list[Output] = []
        counts = self._counts
        counts["num_model_errors"] += result.num_model_errors
        counts["num_decode_steps"] += len(result.steps)
        counts["num_decode_rows"] += sum(result.steps)
        counts["num_prefill_calls"] += len(result.prefill_calls)
        failed = {failure.request_id: failure.error for failure in result.failures}
        # Failed before it was merged into the batch: it never decoded.
        unjoined = {f.request_id for f in result.failures if f.stage in ("publish", "join")}
        for blocks in result.published:
            out += self._published(blocks)
        for leave in plan.leave:
            state = self._requests[leave.request_id]
            out += self._finish(state, failed.pop(leave.request_id, None))
        for request_id in plan.join:
            state = self._requests.get(request_id)
            if state is None or state.status is not RequestStatus.JOINING:
                continue
            if request_id in unjoined:
                out += self._fail(state, failed.pop(request_id))
            else:
                out += self._prompt_out(state)
                state.status = RequestStatus.DECODING
        out += self._decoded(result.emitted, failed)
        for chunk in result.chunks:
            out += self._chunk_done(chunk)
        for request_id, error in failed.items():
            state = self._requests.get(request_id)
            if state is not None and state.end is None:
                out += self._fail(state, error)
        return out

    def _published(self, blocks: Blocks) -> list[Output]:
        state = self._requests.get(blocks.request_id)
        if state is None:
            return []
        if not blocks.exact:
            state.publishing = False
            self._counts["num_unpublishable"] += 1
            return []
        if not blocks.payloads:
            return []
        size = state.spec.block_size
        stop = blocks.start + len(blocks.payloads)
        state.num_published = stop
        self._counts["num_published_blocks"] += len(blocks.payloads)
        if state.end is not None and state.end.reason == "cancelled":
            return []
        tokens = state.tokens(blocks.start * size, stop * size)
        return [(state.request_id, Published(start=blocks.start, payloads=blocks.payloads, tokens=tokens))]

    def _decoded(self, emitted: tuple[Emitted, ...], failed: dict[str, Exception]) -> list[Output]:
        """Each row's tokens of this plan, up to where it ends."""
        rows: dict[str, list[Emitted]] = {}
        for item in emitted:
            rows.setdefault(item.request_id, []).append(item)
        out: list[Output] = []
        for request_id, items in rows.items():
            state = self._requests.get(request_id)
            if state is None or state.status is not RequestStatus.DECODING:
                continue  # cancelled while the plan ran
            tokens: list[int] = []
            logprobs: list[Any] = []
            records: list[TokenLogprob] = []
            reason = None
            for item in items:
                reason = stop_reason(state.spec, item.token, item.index)
                if reason == "stop":
                    break
                tokens.append(item.token)
                if state.spec.keep_logits:
                    logprobs.append(item.logprobs)
                if item.token_logprob is not None:
                    records.append(item.token_logprob)
                if reason is not None:
                    break
            state.answer.extend(tokens)
            if tokens:
                token = Token(tokens=tuple(tokens), logprobs=tuple(logprobs), token_logprobs=tuple(records))
                out.append((request_id, token))
            error = failed.pop(request_id, None)
            if reason is not None:
                out += self._end(state, _End(reason))
            elif error is not None:
                out += self._fail(state, error)
        return out

    def _chunk_done(self, chunk: ChunkDone) -> list[Output]:
        state = self._requests.get(chunk.request_id)
        if state is None or state.end is not None:
            return []  # cancelled while the plan ran: it leaves in the next one
        out: list[Output] = []
        counts = self._counts
        spec = state.spec
        counts["num_prefill_chunks"] += 1
        counts["num_prefill_tokens"] += chunk.computed - (chunk.num_cached if chunk.started else state.num_computed)
        if chunk.started:
            state.num_cached = chunk.num_cached
            # What the chunk's own blocks published already stays published.
            state.num_published = max(state.num_published, blocks_out_at_start(spec, chunk.num_cached))
            counts["num_cached_tokens"] += chunk.num_cached
            counts["num_kept_cache_reuses"] += chunk.reused_kept_cache
            counts["num_cold_fallbacks"] += chunk.cold_fallback
            counts["num_shared_prefix_tokens"] += chunk.num_shared
            if chunk.encoder_ran is not None:
                counts["num_vision_encoder_runs"] += chunk.encoder_ran
                counts["num_vision_encoder_skips"] += not chunk.encoder_ran
                if chunk.encoder_ran:
                    out.append((spec.request_id, ImagesEncoded(features=chunk.features)))
        state.num_computed = chunk.computed
        state.status = RequestStatus.PREFILLING
        if chunk.first_token is None:
            return out
        token = chunk.first_token
        out.append(
            (
                spec.request_id,
                Prefilled(
                    num_cached=state.num_cached, cold_fallback=chunk.cold_fallback, logits=chunk.logits,
                    prompt_logprobs=chunk.prompt_logprobs,
                ),  # fmt: skip
            )
        )
        reason = stop_reason(spec, token, 0)
        if reason != "stop":
            state.answer.append(token)
            logprobs = (chunk.logprobs,) if spec.keep_logits else ()
            records = () if chunk.token_logprob is None else (chunk.token_logprob,)
            out.append((spec.request_id, Token(tokens=(token,), logprobs=logprobs, token_logprobs=records)))
        if reason is not None:
            return out + self._end(state, _End(reason))
        state.status = RequestStatus.JOINING
        return out

    # -- statistics ----------------------------------------------------------------

    def statistics(self) -> SchedulerStatistics:
        counts = dict(self._counts)
        statuses = [state.status for state in self._requests.values()]
        counts["num_live"] = len(statuses)
        counts["num_prefilling"] = sum(s in (RequestStatus.WAITING, RequestStatus.PREFILLING) for s in statuses)
        counts["num_decoding"] = sum(s in (RequestStatus.JOINING, RequestStatus.DECODING) for s in statuses)
        return SchedulerStatistics(**counts)

