"""Generation: one request end to end, over the cache actors and the compute actor.

:meth:`CacheRuntime.generate <mlxkv.runtime.CacheRuntime.generate>` returns a
:class:`Generation`, an async iterator of :class:`GeneratedToken` records that
ends with one :class:`GenerationReport`. Its flow:

1. prepare the prompt with the model's preparer, on the caller's side: a
   text prompt is tokenized; images are looked up in the image cache by
   digest (their cached features are all the model needs) or decoded and
   processed on a worker thread;
2. fetch the prompt, sharing what others compute: take every cached full
   block of it; if the blocks right after them are being computed by another
   request, wait for them to be published and take them too; claim the rest
   (see :mod:`mlxkv.actors.prefix_index`);
3. hand the compute actor the prompt and the leading reconstructable
   payloads, stopping before the block that holds the last prompt token
   (that token must be computed: its logits give the first token; a cached
   block holding it is held, so it is not stored again, but recomputed). A
   hybrid model's chain ends at the last block with a recurrent snapshot,
   and every block it publishes has one. The compute actor rebuilds the
   prefix, prefills the rest in chunks and decodes in its batch
   (:mod:`mlxkv.actors.compute`);
4. meanwhile a :class:`~mlxkv.storer.RequestStorer`, in a task of its own,
   stores each chunk's new full blocks as soon as they are published (so
   that requests waiting for them go on at once, however slowly this
   request's consumer takes its tokens), the images' features if the
   encoder ran, and the answer's blocks as the request finishes (so that
   the next turn of a conversation, prompt + answer + new text, reuses
   them); it drops the remaining claims once the prompt's blocks are out
   (or a store fails), so that no one waits in vain;
5. stream tokens through a per-request detokenizer; stop at an
   end-of-sequence token or ``max_tokens``; the report follows once the
   storer is done;
6. on every exit -- normal, error, cancellation, or the consumer closing the
   iterator early -- cancel the compute request, wait for the storer, and
   release the request's blocks (which drops its claims: waiters take
   over), shielded.

Storing is best effort: a pool too small for the new blocks (``OutOfBlocks``)
or KV that cannot be sliced exactly (a wrapped sliding window) only means the
blocks are not cached; generation goes on. Both are counted in the runtime's
statistics and reported as warnings, as is a cached prefix that could not be
rebuilt (then the whole prompt is computed).

Only the awaits on actors count as calls in flight (so ``async with`` exit
waits for them); a generation parked at a ``yield`` does not keep the runtime
open. ``images=`` also namespaces the request's blocks from the one that
holds the first image token on: two requests share those only with the same
images, in the same order, and the blocks before them with any request (a
text model refuses images).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import anyio
import anyio.lowlevel
import attrs

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
from mlxkv.actors.model_runner import ModelInfo, PreparedPrompt, PromptPreparer
from mlxkv.actors.request import RequestSpec
from mlxkv.actors.sampling import Sampling
from mlxkv.cache import kv_state
from mlxkv.cache.errors import InvalidInput, counted
from mlxkv.cache.token_ids import check_token_ids
from mlxkv.images import KeyedImages, describe, key_images
from mlxkv.storer import RequestStorer

if TYPE_CHECKING:
    from mlxkv.runtime import CacheRuntime

__all__ = ["GeneratedToken", "Generation", "GenerationReport", "Record"]

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
    """

    index: int
    token: int
    text: str


@attrs.frozen(kw_only=True)
class GenerationReport:
    """The last record of a generation: what it cost and what it reused.

    Attributes:
        request_id: the request.
        prompt_tokens: tokens in the prompt.
        cached_tokens: prompt tokens not computed: taken from cached blocks
            or from the last finished generation's cache.
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
        prompt_logits: logits at the last prompt position (the first token
            is sampled from them), an evaluated MLX array; for parity checks.
        prompt_ids: the prompt's token ids as the model saw them (a text
            prompt tokenized, image pad tokens included): the next turn of
            a conversation is ``prompt_ids + tokens + new text``.
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


#: What a :class:`Generation` yields.
Record = Union[GeneratedToken, GenerationReport]


@attrs.frozen
class _PromptComputed:
    """The prompt is computed (internal: the Generation takes it in, unyielded)."""

    num_cached: int


class Generation:
    """One ``generate`` call: an async iterator of records, closed with :meth:`aclose`.

    Use it as ``async with rt.generate(...) as stream: async for record in
    stream: ...`` (or ``contextlib.aclosing``), so that leaving the loop
    early releases the request at once.

    Owns: the request's async generator, and the report once it is made.

    Invariants:
        - after :meth:`aclose`, or after the report was yielded, the request
          holds no block and has no compute cache.
    """

    def __init__(self, records: AsyncGenerator[Union[Record, _PromptComputed], None]) -> None:
        self._records = records
        self.report: Optional[GenerationReport] = None
        #: Prompt tokens not computed (the report's ``cached_tokens``), known
        #: from the first token on, so also for a generation closed early.
        self.cached_tokens: Optional[int] = None

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Record:
        record = await self._records.__anext__()
        if isinstance(record, _PromptComputed):
            self.cached_tokens = record.num_cached
            record = await self._records.__anext__()
        if isinstance(record, GenerationReport):
            self.report = record
        return record

    async def aclose(self) -> None:
        """Stop generating and release everything the request holds (shielded)."""
        await self._records.aclose()

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """A validated ``generate`` call (internal)."""

    request_id: str
    prompt: Union[str, tuple[int, ...]]
    max_tokens: int
    sampling: Sampling
    images: Optional[Sequence[Any]]
    cache_salt: Optional[str]


def make_request(
    prompt: Union[str, Sequence[int]],
    *,
    max_tokens: int,
    sampling: Sampling,
    images: Optional[Sequence[Any]],
    cache_salt: Optional[str],
    request_id: Optional[str],
    info: ModelInfo,
) -> GenerationRequest:
    """Check a ``generate`` call's arguments before anything is sent.

    Raises:
        InvalidInput: an empty or out-of-vocabulary prompt, ``max_tokens``
            below 1, a token-id prompt that with ``max_tokens`` exceeds the
            model's context, images for a model that does not take them, or
            a bad request id.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidInput("max_tokens", max_tokens, "must be an int >= 1")
    if request_id is None:
        request_id = f"gen-{next(_ids)}"
    elif not isinstance(request_id, str) or not request_id:
        raise InvalidInput("request_id", request_id, "must be a non-empty str or None")
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
            check_token_ids(
                prompt, argument="prompt", vocab_size=info.vocab_size, allow_empty=False
            )
        )
        _check_context(prompt, len(checked), max_tokens, info)
    return GenerationRequest(
        request_id=request_id,
        prompt=checked,
        max_tokens=max_tokens,
        sampling=sampling,
        images=images,
        cache_salt=cache_salt,
    )


async def run_generation(
    runtime: CacheRuntime, compute: ComputeHandle, info: ModelInfo, request: GenerationRequest
) -> AsyncGenerator[Union[Record, _PromptComputed], None]:
    """The body of a :class:`Generation` (see the module docstring for the flow)."""
    started = time.perf_counter()
    block_size = runtime.config.block_size
    request_id = request.request_id
    counts = runtime._generation_counts
    log = _LOG.bind(request_id=request_id)
    fetched = live = done = False
    storer: Optional[RequestStorer] = None
    prompt: tuple[int, ...] = ()
    generated: list[int] = []
    counts["started"] += 1
    try:
        with runtime._call():
            preparer = runtime._preparer
            assert preparer is not None, "a runtime with a model has its preparer"
            images_key = None
            if request.images:
                keyed = await key_images(request.images, runtime._pixel_memo, for_model=True)
                assert keyed is not None, "make_request keeps only a non-empty list"
                images_key = keyed.digest
                entry = await runtime._images.lookup(
                    images_key, cache_salt=request.cache_salt, request_id=request_id
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
            else:
                prepared = preparer.prepare(request.prompt)
            prompt = prepared.tokens
            if not prompt:
                raise InvalidInput("prompt", request.prompt, "encodes to no tokens")
            prompt_ids = check_token_ids(prompt)  # once: every later check passes it through
            if isinstance(request.prompt, str):
                _check_context(request.prompt, len(prompt), request.max_tokens, info)
            _check_pool(runtime, len(prompt), log)
            detokenizer = preparer.new_detokenizer()
            fetch = await runtime._fetch(
                request_id,
                prompt_ids,
                images_key=images_key,
                images_start=prepared.image_start,
                cache_salt=request.cache_salt,
                share=runtime.config.share_in_flight,
            )
            fetched = True
            held = len(fetch.grants)
            # The last prompt token is computed, whatever is cached: its
            # logits give the first token.
            usable = min(
                kv_state.num_reconstructable_blocks(fetch.payloads), (len(prompt) - 1) // block_size
            )
            needed = events_needed(len(prompt), request.max_tokens, block_size, info.prefill_chunk)
            events_in, events = anyio.create_memory_object_stream[Event](needed)
            to_cache_in, to_cache = anyio.create_memory_object_stream[Event](needed)
            starting = RequestStorer(
                runtime,
                request_id,
                prompt_ids,
                held=held,
                images_key=images_key,
                cache_salt=request.cache_salt,
                num_image_tokens=prepared.num_image_tokens,
                log=log,
            )
            runtime._start_task(starting.run, to_cache)
            storer = starting
            inputs = prepared.inputs
            try:
                # From here on the compute actor owns (and closes) ``events_in``
                # and ``to_cache_in``.
                spec = RequestSpec(
                    request_id=request_id,
                    prompt=prompt,
                    prefix=fetch.payloads[:usable],
                    sampling=request.sampling,
                    max_tokens=request.max_tokens,
                    block_size=block_size,
                    held_blocks=held,
                    namespace=(request.cache_salt, images_key),
                    inputs=inputs,
                )
                await compute.start(spec, events=events_in, to_cache=to_cache_in)
            except BaseException:
                events_in.close()
                to_cache_in.close()
                events.close()
                raise
            live = True
        first_token_at = finished_at = time.perf_counter()
        prefilled: Optional[Prefilled] = None
        finish: Literal["stop", "length"] = "length"
        with events:
            while True:
                with runtime._call():
                    try:
                        event = await events.receive()
                    except anyio.EndOfStream:
                        # The compute actor stopped (crashed, or the runtime
                        # closed): ``_call`` says which, with the crash.
                        raise compute.failed() from None
                if isinstance(event, Prefilled):
                    prefilled = event
                    first_token_at = time.perf_counter()
                    if event.cold_fallback:
                        counts["cold_fallbacks"] += 1
                    # For the Generation alone (it yields on at once).
                    yield _PromptComputed(num_cached=event.num_cached)
                elif isinstance(event, Token):
                    for token in event.tokens:
                        # Each token is a cancellation point, as if received alone.
                        await anyio.lowlevel.checkpoint_if_cancelled()
                        generated.append(token)
                        detokenizer.add_token(token)
                        if len(generated) >= request.max_tokens:
                            detokenizer.finalize()
                        yield GeneratedToken(
                            index=len(generated) - 1, token=token, text=detokenizer.last_segment
                        )
                elif isinstance(event, Finished):
                    finish = event.reason
                    finished_at = time.perf_counter()
                    break
                else:
                    assert isinstance(event, Failed), f"unexpected event {event!r}"
                    raise event.error
        await storer.done.wait()  # the compute actor ended its stream with Finished
        if storer.error is not None:
            raise storer.error
        done = True
        if finish == "stop":
            detokenizer.finalize()
        assert prefilled is not None, "a request finished without its prompt"
        decode_time = finished_at - first_token_at
        report = GenerationReport(
            request_id=request_id,
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
            prompt_ids=prompt,
        )
        counts["finished"] += 1
        if runtime.config.trace:
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
    except BaseException:
        if not done:
            counts["stopped"] += 1
        raise
    finally:
        with anyio.CancelScope(shield=True):
            if live and not done:
                try:
                    await compute.cancel(request_id)
                except ActorFailed:
                    pass  # the compute actor is gone, and every request with it
            if storer is not None:
                # Its stream ends with the compute request (or the actor).
                await storer.done.wait()
            if fetched:
                await runtime._abandon(request_id)


def _prepare_with_pixels(preparer: PromptPreparer, prompt: Any, images: KeyedImages) -> PreparedPrompt:
    """Runs on a worker thread: the images' pictures (decoding those keyed from
    memory) through the processor, then freed here."""
    return preparer.prepare(prompt, images.take_pictures())


def _check_pool(runtime: CacheRuntime, num_prompt: int, log: EventLog) -> None:
    """Warn (once per request) when the prompt alone outgrows the block pool."""
    blocks = num_prompt // runtime.config.block_size
    if blocks > runtime._num_blocks:
        runtime._generation_counts["prompts_over_pool"] += 1
        log.warning(
            "generation.prompt_exceeds_pool",
            prompt_blocks=blocks,
            pool_blocks=runtime._num_blocks,
            detail="the prompt cannot be cached whole; raise kv_memory or max_blocks",
        )


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
