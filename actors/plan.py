"""What the scheduler asks the executor to do (:class:`Plan`), and what it did (:class:`Result`).

Immutable values that cross from the event loop to the MLX thread and back:
the :class:`~mlxkv.actors.scheduler.Scheduler` makes plans and reads
results, the :class:`~mlxkv.actors.executor.Executor` does plans and makes
results, and neither imports the other.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs

from mlxkv.actors.request import RequestSpec
from mlxkv.actors.token_logprobs import TokenLogprob

__all__ = [
    "Blocks",
    "Chunk",
    "ChunkDone",
    "Emitted",
    "Leave",
    "Plan",
    "RequestFailure",
    "Result",
    "Slice",
]


# -- plans: what the executor is asked to do -----------------------------------


@attrs.frozen
class Slice:
    """Slice blocks ``[start, stop)`` of a prefilling request's own cache."""

    request_id: str
    start: int
    stop: int


@attrs.frozen
class Leave:
    """Take an ended request out of the executor.

    Attributes:
        request_id: the request.
        answer: blocks ``(start, stop)`` to slice first (the rest of its
            prompt's and its answer's), capped at what its KV holds; None
            to slice nothing.
        keep: keep its cache (one of the kept caches), cut to ``num_tokens``.
        num_tokens: prompt and answer tokens (a fed stop token excluded).
    """

    request_id: str
    answer: Optional[tuple[int, int]]
    keep: bool
    num_tokens: int


@attrs.frozen
class Chunk:
    """Prefill one chunk of a request; unless it is the prompt's last, then
    slice the full blocks it completed beyond the first ``published`` (so
    that requests waiting for them go on at once; the last chunk's wait for
    the next plan: its first token goes first).

    Where a chunk ends is decided in one place: the executor cuts it where
    :func:`~mlxkv.actors.request.next_chunk_end` puts it from what the
    request's KV holds. ``budgeted_end`` is where the scheduler costed it to
    end (the same for every chunk but a request's first, whose start only
    the runner knows: a kept cache may give more than the prefix).

    ``spec`` comes with a request's first chunk (the executor starts it
    then: its cache kept, rebuilt from the prefix or cold; ``published``
    then follows from what is cached: :func:`~mlxkv.actors.request.blocks_out_at_start`).
    """

    request_id: str
    budgeted_end: int
    spec: Optional[RequestSpec] = attrs.field(default=None, eq=False, repr=False)
    published: int = 0


@attrs.frozen(kw_only=True)
class Plan:
    """One job for the executor, done in this order: publish, leave, join,
    prefill (several chunks in one model call where exact), ``steps`` decode
    steps; the prefill's first tokens are read last, with the step queued
    behind them (:class:`~mlxkv.actors.executor.Executor`)."""

    publish: tuple[Slice, ...] = ()
    leave: tuple[Leave, ...] = ()
    join: tuple[str, ...] = ()
    steps: int = 0
    prefill: tuple[Chunk, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.publish or self.leave or self.join or self.steps or self.prefill)


# -- results: what the executor did ---------------------------------------------


@attrs.frozen
class Blocks:
    """Payloads of blocks ``[start, start + len(payloads))`` of a request; no
    payloads and ``exact=False`` if its KV could not be sliced exactly."""

    request_id: str
    start: int
    payloads: tuple[Any, ...] = attrs.field(eq=False, repr=lambda p: f"<{len(p)} blocks>")
    exact: bool = True


@attrs.frozen
class ChunkDone:
    """A prefill chunk ran.

    Attributes:
        request_id: the request.
        computed: prompt tokens in its KV now.
        started: this was its first chunk (the fields below are set).
        num_cached: prompt tokens it did not compute.
        cold_fallback: its prefix could not be rebuilt (computed whole).
        reused_kept_cache: it took a kept cache.
        num_shared: prompt tokens its cache reads from a shared prefix
            group, held once for every request that shares them.
        encoder_ran: its images went through the vision encoder (None
            without images).
        features: the encoder's output to cache, if it ran.
        first_token: sampled after its last chunk (else None).
        logits: the last prompt position's logits ``(vocab,)``.
        logprobs: the log-probabilities the first token was drawn from.
        token_logprob: the first token's log-probability and alternatives,
            if the request asked for them (``top_logprobs``), else None.
        prompt_logprobs: the records of the prompt's tokens but the first,
            in order, if the request asked for them (``prompt_logprobs``),
            else empty.
    """

    request_id: str
    computed: int
    started: bool = False
    num_cached: int = 0
    cold_fallback: bool = False
    reused_kept_cache: bool = False
    num_shared: int = 0
    encoder_ran: Optional[bool] = None
    features: Any = attrs.field(default=None, eq=False, repr=False)
    first_token: Optional[int] = None
    logits: Any = attrs.field(default=None, eq=False, repr=False)
    logprobs: Any = attrs.field(default=None, eq=False, repr=False)
    token_logprob: Optional[TokenLogprob] = None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@attrs.frozen
class Emitted:
    """A token a decode step fed for a request (its answer token ``index``),
    with its step's log-probabilities if the request keeps them, and its
    :class:`~mlxkv.actors.token_logprobs.TokenLogprob` if it asked for one."""

    request_id: str
    index: int
    token: int
    logprobs: Any = attrs.field(default=None, eq=False, repr=False)
    token_logprob: Optional[TokenLogprob] = None


@attrs.frozen
class RequestFailure:
    """A step for the request raised; the executor holds nothing of it any more.

    Attributes:
        request_id: the request.
        error: what raised.
        stage: the piece of the plan it raised in: ``"publish"``,
            ``"leave"``, ``"join"``, ``"decode"`` or ``"prefill"``.
    """

    request_id: str
    error: Exception
    stage: str = "decode"


@attrs.frozen(kw_only=True)
class Result:
    """What the executor did with a :class:`Plan`.

    Attributes:
        published: blocks sliced (by ``publish`` and ``leave``).
        chunks: prefill chunks that ran.
        emitted: tokens the decode steps fed, in step order.
        steps: the batch size of each decode model call.
        failures: requests that failed, each alone.
        num_model_errors: model calls that raised (their rows are among
            ``failures``).
        prefill_calls: the rows of each prefill model call.
    """

    published: tuple[Blocks, ...] = ()
    chunks: tuple[ChunkDone, ...] = ()
    emitted: tuple[Emitted, ...] = ()
    steps: tuple[int, ...] = ()
    failures: tuple[RequestFailure, ...] = ()
    num_model_errors: int = 0
    prefill_calls: tuple[int, ...] = ()
