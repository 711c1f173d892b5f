"""Generation: one request end to end, over the cache actors and the compute actor.

:meth:`CacheRuntime.generate <mlxkv.runtime.CacheRuntime.generate>` returns a
:class:`Generation`, an async iterator of :class:`GeneratedToken` records that
ends with one :class:`GenerationReport`. Its flow:

1. tokenize a text prompt (compute actor, ``EncodeText``);
2. :meth:`~mlxkv.runtime.CacheRuntime.fetch` the prompt *minus its last
   token*: the longest cached full-block prefix, so that at least one prompt
   token is computed and yields the logits the first token is sampled from;
3. rebuild the prefix from the leading reconstructable payloads (a hybrid
   model's chain ends at the last block with a recurrent snapshot) and
   ``Prefill`` only the rest -- cold if the payloads cannot be rebuilt;
4. store the prompt's new full blocks at once (``DetachBlocks`` then
   ``store``), so that concurrent requests with the same prefix share them
   while this one decodes;
5. decode, one ``DecodeStep`` per token, streaming text through a
   per-request detokenizer; stop at an end-of-sequence token or
   ``max_tokens``;
6. store the full blocks of the generated tokens too, so that the next turn
   of a conversation (prompt + answer + new text) reuses the answer;
7. on every exit -- normal, error, cancellation, or the consumer closing the
   iterator early -- drop the compute cache and release the request's
   blocks, shielded.

Storing is best effort: a pool too small for the new blocks
(``OutOfBlocks``) or a cache that cannot be sliced exactly (a wrapped
sliding window) only means the blocks are not cached; generation goes on.

Only the awaits on actors count as calls in flight (so ``async with`` exit
waits for them); a generation parked at a ``yield`` does not keep the runtime
open. Fairness between concurrent generations is the compute actor's: one
decode step per active request per round (see :mod:`mlxkv.actors.compute`).

Images are keys only for now: ``images=`` namespaces the request's blocks
(two requests share blocks only with the same images, in the same order), but
the text model does not see them; running a vision-language model end to end
comes with a later issue.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import anyio
import attrs
import structlog

from mlxkv.actors.actor import ActorFailed
from mlxkv.actors.compute import ComputeHandle, ModelInfo, Sampling
from mlxkv.cache import kv_state
from mlxkv.cache.errors import InvalidInput, OutOfBlocks
from mlxkv.cache.token_ids import check_token_ids

if TYPE_CHECKING:
    from mlxkv.runtime import CacheRuntime

__all__ = ["GeneratedToken", "Generation", "GenerationReport", "Record"]

_ids = itertools.count()


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
        cached_tokens: prompt tokens taken from cached blocks (not computed).
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


#: What a :class:`Generation` yields.
Record = Union[GeneratedToken, GenerationReport]


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

    def __init__(self, records: AsyncGenerator[Record, None]) -> None:
        self._records = records
        self.report: Optional[GenerationReport] = None

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Record:
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
            model's context, or a bad request id.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidInput("max_tokens", max_tokens, "must be an int >= 1")
    if request_id is None:
        request_id = f"gen-{next(_ids)}"
    elif not isinstance(request_id, str) or not request_id:
        raise InvalidInput("request_id", request_id, "must be a non-empty str or None")
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidInput("prompt", prompt, "must not be empty")
        checked: Union[str, tuple[int, ...]] = prompt
    else:
        if isinstance(prompt, (bytes, bytearray, memoryview)) or not isinstance(prompt, Sequence):
            raise InvalidInput("prompt", prompt, "must be a str or a sequence of token ids")
        checked = tuple(
            check_token_ids(
                prompt, argument="prompt", vocab_size=info.vocab_size, allow_empty=False
            )
        )
        _check_context(len(checked), max_tokens, info)
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
) -> AsyncGenerator[Record, None]:
    """The body of a :class:`Generation` (see the module docstring for the flow)."""
    started = time.perf_counter()
    block_size = runtime.config.block_size
    request_id = request.request_id
    fetched = live = False
    stored_blocks = stored_bytes = 0

    async def store(tokens: Sequence[int], held: int) -> int:
        """Detach and store the full blocks of ``tokens`` past ``held``; best effort."""
        nonlocal stored_blocks, stored_bytes
        full = len(tokens) // block_size
        if full <= held:
            return held
        try:
            with runtime._call():
                payloads = await compute.detach_blocks(request_id, block_size, held, full)
                result = await runtime.store(request_id, tokens[: full * block_size], payloads)
        except (OutOfBlocks, kv_state.NotReconstructable) as error:
            _warn_unstored(runtime, request_id, error)
            return held
        new = result.num_blocks - result.num_reused
        stored_blocks += new
        # Blocks of one model are alike in size; which ones were reused
        # (their payload dropped) does not matter for the count.
        stored_bytes += new * payloads[0].nbytes
        return result.num_held_blocks

    try:
        with runtime._call():
            if isinstance(request.prompt, str):
                prompt = await compute.encode(request.prompt, request_id=request_id)
                if not prompt:
                    raise InvalidInput("prompt", request.prompt, "encodes to no tokens")
                _check_context(len(prompt), request.max_tokens, info)
            else:
                prompt = request.prompt
            detokenizer = await compute.new_detokenizer(request_id=request_id)
            # The last prompt token stays out of the lookup: it must be
            # computed to give the logits the first token is sampled from.
            fetch = await runtime.fetch(
                request_id, prompt[:-1], images=request.images, cache_salt=request.cache_salt
            )
            fetched = True
            payloads = fetch.payloads
            usable = kv_state.num_reconstructable_blocks(payloads)
            try:
                step = await compute.prefill(
                    request_id,
                    prompt[usable * block_size :],
                    prefix=payloads[:usable],
                    sampling=request.sampling,
                    block_size=block_size,
                )
            except kv_state.NotReconstructable as error:
                _warn_unstored(runtime, request_id, error)
                step = await compute.prefill(
                    request_id, prompt, sampling=request.sampling, block_size=block_size
                )
            live = True
        first_token_at = time.perf_counter()
        prompt_logits = step.logits
        cached_tokens = step.num_cached
        held = await store(prompt, len(fetch.grants))

        sequence = list(prompt)  # the tokens in the compute cache
        generated: list[int] = []
        eos = info.eos_token_ids
        finish: Literal["stop", "length"] = "length"
        while True:
            token = step.token
            if token in eos:
                finish = "stop"
                break
            generated.append(token)
            detokenizer.add_token(token)
            last = len(generated) >= request.max_tokens
            if last:
                detokenizer.finalize()
            yield GeneratedToken(
                index=len(generated) - 1, token=token, text=detokenizer.last_segment
            )
            if last:
                break
            with runtime._call():
                step = await compute.decode_step(request_id, token)
            sequence.append(token)
        finished_at = time.perf_counter()
        if finish == "stop":
            detokenizer.finalize()
        await store(sequence, held)

        decode_time = finished_at - first_token_at
        report = GenerationReport(
            request_id=request_id,
            prompt_tokens=len(prompt),
            cached_tokens=cached_tokens,
            generated_tokens=len(generated),
            finish_reason=finish,
            tokens=tuple(generated),
            text=detokenizer.text,
            time_to_first_token=first_token_at - started,
            decode_tokens_per_second=(
                (len(generated) - 1) / decode_time if len(generated) > 1 and decode_time > 0 else 0.0
            ),
            total_time=finished_at - started,
            stored_blocks=stored_blocks,
            stored_bytes=int(stored_bytes),
            prompt_logits=prompt_logits,
        )
        if runtime.config.trace:
            structlog.get_logger("mlxkv").info(
                "generation.finished",
                component="generation",
                request_id=request_id,
                prompt_tokens=report.prompt_tokens,
                cached_tokens=report.cached_tokens,
                generated_tokens=report.generated_tokens,
                finish_reason=finish,
                ttft_ms=round(report.time_to_first_token * 1e3, 3),
                decode_tps=round(report.decode_tokens_per_second, 1),
            )
        yield report
    finally:
        with anyio.CancelScope(shield=True):
            if live:
                try:
                    await compute.drop(request_id)
                except ActorFailed:
                    pass  # the compute actor is gone, and every cache with it
            if fetched:
                await runtime._abandon(request_id)


def _check_context(num_prompt: int, max_tokens: int, info: ModelInfo) -> None:
    """Refuse a request that could outgrow the model's context.

    Raises:
        InvalidInput: prompt plus ``max_tokens`` exceeds ``info.max_context``.
    """
    limit = info.max_context
    if limit is not None and num_prompt + max_tokens > limit:
        raise InvalidInput(
            "max_tokens",
            max_tokens,
            f"the prompt's {num_prompt} tokens plus {max_tokens} new ones exceed the"
            f" model's context of {limit} tokens",
        )


def _warn_unstored(runtime: CacheRuntime, request_id: str, error: BaseException) -> None:
    if runtime.config.trace:
        structlog.get_logger("mlxkv").info(
            "generation.not_cached",
            component="generation",
            request_id=request_id,
            error=f"{type(error).__name__}: {error}",
        )

