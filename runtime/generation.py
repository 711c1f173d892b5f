"""Generation: one request end to end, as one object over the cache client and the compute actor.

:meth:`CacheRuntime.generate <mlxkv.runtime.CacheRuntime.generate>` checks its
arguments (once: :meth:`GenerationRequest.checked`) and returns a
:class:`Generation`, an async iterator of :class:`GeneratedToken` records that
ends with one :class:`GenerationReport`. Its one :class:`Status` says where it
is; each step moves it forward:

1. ``PREPARING`` -- prepare the prompt with the model's preparer, on the
   caller's side: a text prompt is tokenized; images are keyed
   (:func:`mlxkv.images.key_images`) and looked up in the image cache by
   their key (their cached features are all the model needs) or decoded and
   processed on a worker thread;
2. ``FETCHED`` -- the request holds every cached full block of its prompt
   (:meth:`CacheClient.fetch <mlxkv.client.CacheClient.fetch>` with ``wait``:
   if the blocks right after them are being computed by another request, it
   waits for them and takes them too, and claims the rest; see
   :mod:`mlxkv.actors.prefix_index`);
3. ``COMPUTING`` -- the compute actor has one frozen
   :class:`~mlxkv.actors.request.RequestSpec`: the prompt and the leading
   reconstructable payloads, stopping before the block that holds the last
   prompt token (that token must be computed: its logits give the first
   token; a cached block holding it is held, so it is not stored again, but
   recomputed). A hybrid model's chain ends at the last block with a
   recurrent snapshot, and every block it publishes has one. The compute
   actor rebuilds the prefix, prefills the rest in chunks and decodes in its
   batch (:mod:`mlxkv.actors.compute`). Meanwhile a
   :class:`~mlxkv.storer.RequestStorer`, in a task of its own, stores each
   chunk's new full blocks as soon as they are published (so that requests
   waiting for them go on at once, however slowly this request's consumer
   takes its tokens), the images' features if the encoder ran, and the
   answer's blocks as the request finishes (so that the next turn of a
   conversation, prompt + answer + new text, reuses them); it drops the
   remaining claims once the prompt's blocks are out (or a store fails), so
   that no one waits in vain. Tokens stream through a per-request
   detokenizer until an end-of-sequence token or ``max_tokens``;
4. ``FINISHED`` -- the storer is done and the request's blocks are released
   before the report is handed out: after the report, the request holds
   nothing. ``STOPPED`` -- it ended otherwise (an error, cancellation, or the
   consumer closing the iterator early): the compute request is cancelled,
   the storer awaited and the blocks released (which drops the claims:
   waiters take over), shielded.

Storing is best effort: a pool too small for the new blocks (the storer then
keeps the leading blocks that fit, one store) or KV that cannot be sliced
exactly (a wrapped sliding window) only means blocks are not cached;
generation goes on. Both are counted in :class:`GenerationStatistics` and
reported as warnings, as is a cached prefix that could not be rebuilt (then
the whole prompt is computed). Only generations count there, on the event
loop: :class:`GenerationCounters` has one writer, this module.

Only the awaits on actors count as calls in flight (so ``async with`` exit
waits for them); a generation parked at a ``yield`` does not keep the runtime
open. ``images=`` also namespaces the request's blocks from the one that
holds the first image token on: two requests share those only with the same
images, in the same order, and the blocks before them with any request (a
text model refuses images).
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any, Literal, Optional, Union

import anyio
import anyio.lowlevel
import anyio.to_thread
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream

from mlxkv.actors.actor import ActorFailed
from mlxkv.actors.compute import (
    ComputeHandle,
    Event,
    Failed,
    Finished,
    Prefilled,
    Token,
    events_needed,
)
from mlxkv.actors.event_log import EventLog
from mlxkv.actors.json_grammar import JsonGrammar
from mlxkv.actors.model_info import ModelInfo
from mlxkv.actors.prompt_preparer import PreparedPrompt, PromptPreparer
from mlxkv.actors.prefix_index import RequestId
from mlxkv.actors.penalties import NO_PENALTIES, Penalties
from mlxkv.actors.request import RequestSpec, top_logprobs_checked
from mlxkv.actors.sampling import Sampling
from mlxkv.actors.token_logprobs import TokenLogprob
from mlxkv.cache import kv_state
from mlxkv.cache.block_hash import ChainKeys
from mlxkv.cache.errors import InvalidInput, counted
from mlxkv.cache.token_ids import TokenIds, check_token_ids
from mlxkv.client import CacheClient, FetchResult
from mlxkv.gate import Gate
from mlxkv.images import KeyedImages, describe, freed_pictures
from mlxkv.json_output import JsonOutputs
from mlxkv.storer import RequestStorer

__all__ = [
    "GeneratedToken",
    "Generation",
    "GenerationContext",
    "GenerationCounters",
    "GenerationReport",
    "GenerationRequest",
    "GenerationStatistics",
    "Record",
    "Status",
]

_ids = itertools.count()
_LOG = EventLog(component="generation")


@attrs.frozen(kw_only=True)
class GeneratedToken:
    """One generated token.

    Attributes:
        index: its position among the generated tokens, from 0.
        token: the token id.
        text: the text this token completes; ``""`` while a multi-byte
            character is still incomplete (the concatenated pieces equal
            the report's ``text``).
        logprob: its log-probability and the most likely tokens at its step
            (:class:`~mlxkv.actors.token_logprobs.TokenLogprob`), if the
            request asked for them (``logprobs``), else None.
    """

    index: int
    token: int
    text: str
    logprob: Optional[TokenLogprob] = None


@attrs.frozen(kw_only=True)
class GenerationReport:
    """The last record of a generation: what it cost and what it reused.

    Attributes:
        request_id: the request.
        prompt_tokens: tokens in the prompt.
        cached_tokens: prompt tokens not computed: taken from cached blocks
            or from a kept cache (a finished generation's).
        generated_tokens: tokens generated (an end-of-sequence token excluded).
        finish_reason: ``"stop"`` (end-of-sequence token) or ``"length"``
            (``max_tokens`` reached).
        tokens: the generated token ids.
        text: their text.
        time_to_first_token: seconds from the start to the first token.
        decode_tokens_per_second: generated tokens after the first, per
            second of decoding (0.0 with fewer than two tokens).
        total_time: seconds from the start to the end of generation.
        stored_blocks: new blocks this request computed and stored.
        stored_bytes: bytes of KV those blocks hold.
        prompt_logits: logits at the last prompt position (the first token is
            sampled from them), an evaluated MLX array; for parity checks.
        prompt_ids: the prompt's token ids as the model saw them (a text
            prompt tokenized, image pad tokens included): the next turn of
            a conversation is ``prompt_ids + tokens + new text``.
        prompt_logprobs: where ``prompt_logprobs`` asked for them, a record
            for each of ``prompt_ids`` but the first (from the logits of the
            position before it); else empty.
    """

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    finish_reason: Literal["stop", "length"]
    tokens: tuple[int, ...] = attrs.field(repr=False)
    text: str = attrs.field(repr=False)
    time_to_first_token: float
    decode_tokens_per_second: float
    total_time: float
    stored_blocks: int
    stored_bytes: int
    prompt_logits: Any = attrs.field(default=None, eq=False, repr=False)
    prompt_ids: tuple[int, ...] = attrs.field(default=(), repr=False)
    prompt_logprobs: tuple[TokenLogprob, ...] = attrs.field(default=(), repr=False)


#: What a :class:`Generation` yields.
Record = Union[GeneratedToken, GenerationReport]


@attrs.frozen(kw_only=True)
class GenerationStatistics:
    """What ``generate`` calls did.

    Attributes:
        num_started: generations that began.
        num_finished: generations that ended with their report.
        num_stopped: generations that ended otherwise (cancelled, failed,
            closed early by their consumer).
        num_blocks_not_stored: computed blocks not cached because the pool
            had no room (``OutOfBlocks``); each case is also a warning.
        num_requests_not_stored: generations that stopped storing because
            the pool had no room (one warning each).
        num_cold_fallbacks: cached prefixes that could not be rebuilt, so
            the whole prompt was computed; each is also a warning.
        num_prompts_over_pool: prompts whose full blocks alone outnumber the
            pool; each is also a warning.
    """

    num_started: int = 0
    num_finished: int = 0
    num_stopped: int = 0
    num_blocks_not_stored: int = 0
    num_requests_not_stored: int = 0
    num_cold_fallbacks: int = 0
    num_prompts_over_pool: int = 0


@attrs.define(kw_only=True)
class GenerationCounters:
    """The running counts behind :class:`GenerationStatistics` (same fields).

    One per runtime; written by :class:`Generation` only, on the event loop.
    """

    num_started: int = 0
    num_finished: int = 0
    num_stopped: int = 0
    num_blocks_not_stored: int = 0
    num_requests_not_stored: int = 0
    num_cold_fallbacks: int = 0
    num_prompts_over_pool: int = 0

    def statistics(self) -> GenerationStatistics:
        """A snapshot."""
        return GenerationStatistics(**attrs.asdict(self))


class Status(enum.Enum):
    """Where a :class:`Generation` is; it only moves forward."""

    #: Made; nothing was sent.
    NEW = "new"
    #: Keying images and preparing the prompt; holds nothing.
    PREPARING = "preparing"
    #: Holds the prompt's cached blocks (and claims what it will compute).
    FETCHED = "fetched"
    #: The compute actor computes it; its storer stores what is published.
    COMPUTING = "computing"
    #: The report was made; holds nothing.
    FINISHED = "finished"
    #: Ended otherwise (an error, cancellation, closed early); holds nothing.
    STOPPED = "stopped"


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """A ``generate`` call's arguments, checked (:meth:`checked`: the only check).

    Attributes:
        request_id: the request (a fresh ``gen-N`` unless one was given).
        prompt: text, or the token ids.
        max_tokens: the most tokens to generate, >= 1.
        sampling: how tokens are sampled.
        images: the images, in order (a non-empty tuple), or None.
        cache_salt: the tenant namespace, or None.
        logprobs: how many alternatives each token's log-probability comes
            with (0 to ``MAX_TOP_LOGPROBS``), or None: no log-probabilities.
        penalties: what is added to the logits before each draw.
        prompt_logprobs: alternatives for each prompt token's record (0 to
            ``MAX_TOP_LOGPROBS``), or None: no records of the prompt.
        grammar: the JSON grammar the answer is held to, or None.
    """

    request_id: RequestId
    prompt: Union[str, tuple[int, ...]]
    max_tokens: int
    sampling: Sampling
    images: Optional[tuple[Any, ...]]
    cache_salt: Optional[str]
    logprobs: Optional[int] = None
    penalties: Penalties = NO_PENALTIES
    prompt_logprobs: Optional[int] = None
    grammar: Optional[JsonGrammar] = attrs.field(default=None, eq=False, repr=False)

    @classmethod
    def checked(
        cls,
        prompt: Union[str, Sequence[int]],
        *,
        max_tokens: int,
        sampling: Sampling,
        images: Optional[Sequence[Any]],
        cache_salt: Optional[str],
        request_id: Optional[str],
        info: ModelInfo,
        logprobs: Optional[int] = None,
        penalties: Penalties = NO_PENALTIES,
        prompt_logprobs: Optional[int] = None,
        grammar: Optional[JsonGrammar] = None,
    ) -> GenerationRequest:
        """Check a ``generate`` call's arguments before anything is sent.

        Raises:
            InvalidInput: an empty or out-of-vocabulary prompt, ``max_tokens``
                below 1, a token-id prompt that with ``max_tokens`` exceeds the
                model's context, images for a model that does not take them, a
                salt that is not a str, a bad request id, ``logprobs`` or
                ``prompt_logprobs`` not None or an int in ``[0,
                MAX_TOP_LOGPROBS]``, or a bias on a token past the vocabulary.
        """
        logprobs = top_logprobs_checked(logprobs, "logprobs")
        prompt_logprobs = top_logprobs_checked(prompt_logprobs, "prompt_logprobs")
        penalties.check_vocabulary(info.vocab_size)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidInput("max_tokens", max_tokens, "must be an int >= 1")
        if request_id is None:
            request_id = f"gen-{next(_ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidInput("request_id", request_id, "must be a non-empty str or None")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidInput("cache_salt", cache_salt, "must be a str or None")
        if images is not None:
            if isinstance(images, (str, bytes, bytearray, memoryview)) or not isinstance(images, Sequence):
                raise InvalidInput("images", describe(images), "must be a list of images (put one image in a list)")
            if images and not info.takes_images:
                raise InvalidInput(
                    "images", counted(len(images), "image"), "this model does not take images (load a vision-language model)"
                )
            images = tuple(images) or None
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidInput("prompt", prompt, "must not be empty")
            checked: Union[str, tuple[int, ...]] = prompt
        else:
            # Converted once (a list, a tuple, a 1-D NumPy or MLX int array...).
            checked = tuple(
                check_token_ids(prompt, argument="prompt", vocab_size=info.vocab_size, allow_empty=False)
            )
            _check_context(prompt, len(checked), max_tokens, info)
        return cls(
            request_id=RequestId(request_id),
            prompt=checked,
            max_tokens=max_tokens,
            sampling=sampling,
            images=images,
            cache_salt=cache_salt,
            logprobs=logprobs,
            penalties=penalties,
            prompt_logprobs=prompt_logprobs,
            grammar=grammar,
        )


@attrs.frozen(kw_only=True)
class GenerationContext:
    """What every generation of one runtime works with, fixed when it starts.

    Attributes:
        client: the cache client.
        gate: the runtime's calls (in flight, refused once it stops).
        compute: the compute actor.
        model: what the loaded model is.
        preparer: its prompt preparer (tokenizer, image processor).
        block_size: tokens per block.
        pool_blocks: usable blocks in the pool.
        share_in_flight: wait for prefix blocks others compute.
        trace: emit one ``generation.finished`` event per generation.
        counters: the runtime's generation counts.
        json_outputs: the model's JSON grammars and constraints.
    """

    client: CacheClient
    gate: Gate
    compute: ComputeHandle
    model: ModelInfo
    preparer: PromptPreparer
    block_size: int
    pool_blocks: int
    share_in_flight: bool
    trace: bool
    counters: GenerationCounters
    json_outputs: JsonOutputs


class Generation:
    """One ``generate`` call: an async iterator of records, closed with :meth:`aclose`.

    Use it as ``async with rt.generate(...) as stream: async for record in
    stream: ...`` (or ``contextlib.aclosing``), so that leaving the loop
    early releases the request at once.

    Owns: its run (:class:`_Run`: the checked request, the one
    :attr:`status`, the storer while it computes, :attr:`cached_tokens` once
    the prompt is computed, the report once it is made) and the async
    generator that runs the steps. The run is an object of its own so that
    the generator's frame does not hold the Generation: one dropped without
    :meth:`aclose` is finalized at once (and releases its blocks), not at the
    next garbage collection.

    Invariants:
        - :attr:`status` only moves forward; the request holds blocks only
          while it is ``FETCHED`` or ``COMPUTING``;
        - once the report is handed out (``FINISHED``), or after
          :meth:`aclose` (``STOPPED``), the request holds no block and has no
          compute cache;
        - the runtime's counters count it once as started and once as
          finished or stopped.
    """

    def __init__(self, request: GenerationRequest, context: GenerationContext) -> None:
        self._run = _Run(request, context)
        self._records = self._run.records()

    @property
    def request(self) -> GenerationRequest:
        """The checked request."""
        return self._run.request

    @property
    def status(self) -> Status:
        """Where the generation is."""
        return self._run.status

    @property
    def report(self) -> Optional[GenerationReport]:
        """The report, once it is handed out."""
        return self._run.report

    @property
    def cached_tokens(self) -> Optional[int]:
        """Prompt tokens not computed (the report's ``cached_tokens``), known
        from the first token on, so also for a generation closed early."""
        return self._run.cached_tokens

    @property
    def prompt_logprobs(self) -> tuple[TokenLogprob, ...]:
        """Where ``prompt_logprobs`` asked for them, the records of the
        prompt's tokens but the first (the report's ``prompt_logprobs``),
        known from the first token on; else empty."""
        return self._run.prompt_logprobs

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Record:
        return await self._records.__anext__()

    async def aclose(self) -> None:
        """Stop generating and release everything the request holds (shielded)."""
        await self._records.aclose()

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class _Run:
    """A :class:`Generation`'s steps and its state (one status field).

    Owns: the checked request, :attr:`status`, the storer (while it
    computes), ``cached_tokens`` and the report.
    """

    def __init__(self, request: GenerationRequest, context: GenerationContext) -> None:
        self.request = request
        self.status = Status.NEW
        self.report: Optional[GenerationReport] = None
        self.cached_tokens: Optional[int] = None
        self.prompt_logprobs: tuple[TokenLogprob, ...] = ()
        self._context = context
        self._storer: Optional[RequestStorer] = None

    # -- the steps -----------------------------------------------------------------

    async def records(self) -> AsyncGenerator[Record, None]:
        """The steps, in order (see the module docstring)."""
        context, request = self._context, self.request
        started = time.perf_counter()
        context.counters.num_started += 1
        log = _LOG.bind(request_id=request.request_id)
        generated: list[int] = []
        try:
            with context.gate.call():
                self.status = Status.PREPARING
                prepared, images_key = await self._prepare()
                prompt = prepared.tokens
                if not prompt:
                    raise InvalidInput("prompt", request.prompt, "encodes to no tokens")
                prompt_ids = check_token_ids(prompt)  # the prompt as the model sees it, once
                if isinstance(request.prompt, str):
                    _check_context(request.prompt, len(prompt), request.max_tokens, context.model)
                self._check_pool(len(prompt), log)
                detokenizer = context.preparer.new_detokenizer()
                keys = ChainKeys.derive(
                    cache_salt=request.cache_salt,
                    images_key=images_key,
                    images_start=prepared.image_start,
                    block_size=context.block_size,
                )
                fetch = await context.client.fetch(
                    request.request_id, prompt_ids, keys, wait=context.share_in_flight
                )
                self.status = Status.FETCHED
                events = await self._start(prompt, prompt_ids, fetch, prepared, images_key, log)
                self.status = Status.COMPUTING
            first_token_at = finished_at = time.perf_counter()
            prefilled: Optional[Prefilled] = None
            finish: Literal["stop", "length"] = "length"
            with events:
                while True:
                    with context.gate.call():
                        try:
                            event = await events.receive()
                        except anyio.EndOfStream:
                            # The compute actor stopped (crashed, or the runtime
                            # closed): the gate says which, with the crash.
                            raise context.compute.failed() from None
                        if isinstance(event, Prefilled):
                            prefilled = event
                            self.cached_tokens = event.num_cached
                            self.prompt_logprobs = event.prompt_logprobs
                            first_token_at = time.perf_counter()
                            if event.cold_fallback:
                                context.counters.num_cold_fallbacks += 1
                            continue
                    if isinstance(event, Token):
                        records = event.token_logprobs or itertools.repeat(None)
                        for token, record in zip(event.tokens, records):
                            # Each token is a cancellation point, as if received alone.
                            await anyio.lowlevel.checkpoint_if_cancelled()
                            generated.append(token)
                            detokenizer.add_token(token)
                            if len(generated) >= request.max_tokens:
                                detokenizer.finalize()
                            yield GeneratedToken(
                                index=len(generated) - 1, token=token, text=detokenizer.last_segment, logprob=record
                            )
                    elif isinstance(event, Finished):
                        finish = event.reason
                        finished_at = time.perf_counter()
                        break
                    else:
                        assert isinstance(event, Failed), f"unexpected event {event!r}"
                        raise event.error
            storer = self._storer
            assert storer is not None, "a computing request has its storer"
            await storer.done.wait()  # the compute actor ended its stream with Finished
            if storer.error is not None:
                raise storer.error
            if finish == "stop":
                detokenizer.finalize()
            assert prefilled is not None, "a request finished without its prompt"
            decode_time = finished_at - first_token_at
            report = GenerationReport(
                request_id=request.request_id,
                prompt_tokens=len(prompt),
                cached_tokens=prefilled.num_cached,
                generated_tokens=len(generated),
                finish_reason=finish,
                tokens=tuple(generated),
                text=detokenizer.text,
                time_to_first_token=first_token_at - started,
                decode_tokens_per_second=(
                    (len(generated) - 1) / decode_time if len(generated) > 1 and decode_time > 0 else 0.0
                ),
                total_time=finished_at - started,
                stored_blocks=storer.stored_blocks,
                stored_bytes=int(storer.stored_bytes),
                prompt_logits=prefilled.logits,
                prompt_logprobs=prefilled.prompt_logprobs,
                prompt_ids=tuple(prompt),
            )
            await self._end(Status.FINISHED)
            self.report = report
            if context.trace:
                log.info(
                    "generation.finished",
                    prompt_tokens=report.prompt_tokens,
                    cached_tokens=report.cached_tokens,
                    generated_tokens=report.generated_tokens,
                    finish_reason=finish,
                    ttft_ms=round(report.time_to_first_token * 1e3, 3),
                    decode_tps=round(report.decode_tokens_per_second, 1),
                )
            yield report
        finally:
            await self._end(Status.STOPPED)

    async def _prepare(self) -> tuple[PreparedPrompt, Optional[str]]:
        """The prompt as the model takes it, and its images' key (None without)."""
        context, request = self._context, self.request
        preparer = context.preparer
        if not request.images:
            if isinstance(request.prompt, str):  # tokenizing text can take seconds: off the loop
                return await anyio.to_thread.run_sync(preparer.prepare, request.prompt), None
            return preparer.prepare(request.prompt), None
        keyed = await context.client.key_images(request.images, for_model=True)
        assert keyed is not None, "a checked request has a non-empty list of images"
        entry = await context.client.lookup_images(
            keyed.digest, cache_salt=request.cache_salt, request_id=request.request_id
        )
        if entry is not None:
            # Seen before: their encoding (and grid) is all the model needs.
            prepared = preparer.prepare(request.prompt, encoded=entry.vision_embeddings)
            if keyed.num_decoded:
                await anyio.to_thread.run_sync(keyed.release)  # freeing pictures takes ms
        else:
            # Decoding pixels and processing them run off the loop.
            prepared = await anyio.to_thread.run_sync(
                _prepare_with_pixels, preparer, request.prompt, keyed
            )
        return prepared, keyed.digest

    async def _start(
        self,
        prompt: tuple[int, ...],
        prompt_ids: TokenIds,
        fetch: FetchResult,
        prepared: PreparedPrompt,
        images_key: Optional[str],
        log: EventLog,
    ) -> MemoryObjectReceiveStream[Event]:
        """Start the storer, then hand the compute actor the request; its events."""
        context, request = self._context, self.request
        block_size = context.block_size
        held = len(fetch.grants)
        constraint = None
        if request.grammar is not None:
            constraint = await context.json_outputs.constraint(request.grammar)
        # The last prompt token is computed, whatever is cached: its logits
        # give the first token.
        usable = min(
            kv_state.num_reconstructable_blocks(fetch.payloads), (len(prompt) - 1) // block_size
        )
        if request.prompt_logprobs is not None:
            usable = 0  # every prompt position's logits are asked for: computed whole
        needed = events_needed(len(prompt), request.max_tokens, block_size)
        events_in, events = anyio.create_memory_object_stream[Event](needed)
        to_cache_in, to_cache = anyio.create_memory_object_stream[Event](needed)
        storer = RequestStorer(
            context.client,
            context.gate,
            request.request_id,
            prompt_ids,
            held=held,
            block_size=block_size,
            images_key=images_key,
            cache_salt=request.cache_salt,
            num_image_tokens=prepared.num_image_tokens,
            log=log,
        )
        context.gate.start_soon(storer.run, to_cache)
        self._storer = storer
        try:
            # From here on the compute actor owns (and closes) ``events_in``
            # and ``to_cache_in``.
            spec = RequestSpec(
                request_id=request.request_id,
                prompt=prompt,
                prefix=fetch.payloads[:usable],
                sampling=request.sampling,
                penalties=request.penalties,
                max_tokens=request.max_tokens,
                # Given here, so that the actor does not make the spec again
                # (and check its prompt again) to fill them in.
                stop_tokens=context.model.eos_token_ids,
                block_size=block_size,
                held_blocks=held,
                top_logprobs=request.logprobs,
                prompt_logprobs=request.prompt_logprobs,
                namespace=(request.cache_salt, images_key),
                inputs=prepared.inputs,
                constraint=constraint,
            )
            await context.compute.start(spec, events=events_in, to_cache=to_cache_in)
        except BaseException:
            events_in.close()
            to_cache_in.close()
            events.close()
            raise
        return events

    async def _end(self, status: Status) -> None:
        """Leave the request holding nothing and count how it ended (shielded;
        a second call does nothing): cancel its compute request if it still
        computes, wait for its storer, release its blocks."""
        reached = self.status
        if reached is Status.FINISHED or reached is Status.STOPPED:
            return
        context = self._context
        with anyio.CancelScope(shield=True):
            if reached is Status.COMPUTING and status is Status.STOPPED:
                try:
                    await context.compute.cancel(self.request.request_id)
                except ActorFailed:
                    pass  # the compute actor is gone, and every request with it
            storer = self._storer
            if storer is not None:
                # Its stream ends with the compute request (or the actor).
                await storer.done.wait()
                context.counters.num_blocks_not_stored += storer.num_not_stored
                context.counters.num_requests_not_stored += storer.gave_up
            if reached is Status.FETCHED or reached is Status.COMPUTING:
                await context.client.abandon(self.request.request_id)
        self.status = status
        if status is Status.FINISHED:
            context.counters.num_finished += 1
        else:
            context.counters.num_stopped += 1

    def _check_pool(self, num_prompt: int, log: EventLog) -> None:
        """Warn (once per request) when the prompt alone outgrows the block pool."""
        context = self._context
        blocks = num_prompt // context.block_size
        if blocks > context.pool_blocks:
            context.counters.num_prompts_over_pool += 1
            log.warning(
                "generation.prompt_exceeds_pool",
                prompt_blocks=blocks,
                pool_blocks=context.pool_blocks,
                detail="the prompt cannot be cached whole; raise kv_memory or max_blocks",
            )


def _prepare_with_pixels(preparer: PromptPreparer, prompt: Any, images: KeyedImages) -> PreparedPrompt:
    """Runs on a worker thread: the images' pictures (decoding those keyed from
    memory) through the processor, then freed here."""
    try:
        return preparer.prepare(prompt, images.take_pictures())
    finally:
        freed_pictures(images.num_pixels)


def _check_context(prompt: Any, num_prompt: int, max_tokens: int, info: ModelInfo) -> None:
    """Refuse a request that could outgrow the model's context, blaming what does.

    A prompt that alone fills the context is the prompt's fault; one that
    leaves too little room for ``max_tokens`` new tokens is ``max_tokens``'s.

    Raises:
        InvalidInput: prompt plus ``max_tokens`` exceeds ``info.max_context``.
    """
    limit = info.max_context
    if limit is None or num_prompt + max_tokens <= limit:
        return
    if num_prompt >= limit:
        raise InvalidInput(
            "prompt",
            prompt,
            f"its {num_prompt} tokens leave no room in the model's context of {limit} tokens"
            f" (for max_tokens={max_tokens} new ones)",
        )
    raise InvalidInput(
        "max_tokens",
        max_tokens,
        f"the prompt's {num_prompt} tokens leave room for {limit - num_prompt} new ones in"
        f" the model's context of {limit} tokens",
    )
