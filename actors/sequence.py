"""One request as the compute actor sees it: its tokens, its cache, where it stands.

A :class:`Sequence` is owned by the compute actor. Its scheduling fields are
read and written on the event-loop thread, between jobs; its MLX fields
(``cache``, ``snapshots``, the runner's ``inputs``) are touched only by the
job that runs on the MLX thread, while the actor waits for that job. So the
two threads never touch a sequence at the same time.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from typing import Any, Optional

from mlxkv.actors.sampling import Sampler

__all__ = ["Phase", "Sequence", "plan_chunks"]


class Phase(enum.Enum):
    """Where a sequence stands."""

    QUEUED = "queued"  #: accepted, no model call yet
    PREFILLING = "prefilling"  #: some prompt chunks computed
    DECODING = "decoding"  #: in a decode batch
    FINISHED = "finished"  #: done, cancelled or failed; no more work


class Sequence:
    """A request's compute state.

    Invariants:
        - ``num_computed`` tokens are in the request's KV (its own ``cache``
          while prefilling, its row of a decode batch while decoding);
        - while decoding, the KV holds exactly ``prompt + generated``, and
          ``len(generated) <= max_tokens``;
        - ``num_published`` full blocks have been handed out as payloads, and
          they were computed by this sequence (or rebuilt from its prefix).
    """

    __slots__ = (
        "request_id",
        "prompt",
        "prefix",
        "sampler",
        "max_tokens",
        "stop_tokens",
        "block_size",
        "keep_logits",
        "emit",
        "publish",
        "phase",
        "cache",
        "inputs",
        "num_cached",
        "num_computed",
        "chunk_ends",
        "num_published",
        "num_held",
        "namespace",
        "generated",
        "snapshots",
        "cold_fallback",
        "reused_last_cache",
        "cancelled",
        "final",
    )

    def __init__(
        self,
        *,
        request_id: str,
        prompt: tuple[int, ...],
        prefix: tuple[Any, ...],
        sampler: Optional[Sampler],
        max_tokens: int,
        stop_tokens: frozenset[int],
        block_size: int,
        keep_logits: bool,
        emit: Callable[[Any], bool],
        publish: Optional[Callable[[Any], bool]] = None,
        inputs: Any = None,
        num_held: int = 0,
        namespace: Hashable = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        #: Block payloads of the cached prefix, dropped once the cache is built.
        self.prefix = prefix
        self.sampler = sampler
        self.max_tokens = max_tokens
        self.stop_tokens = stop_tokens
        self.block_size = block_size
        self.keep_logits = keep_logits
        #: Hands an event to the request's stream; False once nobody listens.
        self.emit = emit
        #: Hands what is to be cached (blocks, image features) to whoever
        #: stores it: its own stream, or the event stream.
        self.publish = emit if publish is None else publish
        self.phase = Phase.QUEUED
        self.cache: Optional[list[Any]] = None
        #: What the model runner prepared for this request (its own business).
        self.inputs = inputs
        self.num_cached = 0
        self.num_computed = 0
        self.chunk_ends: list[int] = []
        self.num_published = 0
        #: Leading full blocks the request holds already (never published again).
        self.num_held = num_held
        #: What the request's blocks are keyed under beside its tokens (cache
        #: salt, images): requests of one namespace may share all their KV.
        self.namespace = namespace
        self.generated: list[int] = []
        #: position -> recurrent-layer states after that many tokens (hybrid models).
        self.snapshots: dict[int, tuple[Optional[tuple[Any, ...]], ...]] = {}
        self.cold_fallback = False
        #: Its cache was the last finished request's, cut back to the prefix
        #: (see :meth:`CacheRunner.keep`), instead of rebuilt from payloads.
        self.reused_last_cache = False
        self.cancelled = False
        #: The final event, once decided, sent when the request leaves its batch.
        self.final: Any = None

    @property
    def num_tokens(self) -> int:
        """Tokens in the KV once decoding: the prompt and every generated token."""
        return len(self.prompt) + len(self.generated)

    def tokens(self, start: int, stop: int) -> tuple[int, ...]:
        """Positions ``[start, stop)`` of the prompt followed by the generated
        tokens, without copying the rest of either."""
        prompt = self.prompt
        if stop <= len(prompt):
            return prompt[start:stop]
        answer = self.generated[max(0, start - len(prompt)) : stop - len(prompt)]
        return prompt[start:] + tuple(answer)

    def __repr__(self) -> str:
        return f"Sequence({self.request_id!r}, {self.phase.value}, {self.num_computed} computed)"


def plan_chunks(start: int, total: int, chunk: int, boundary: Optional[int] = None) -> list[int]:
    """Where each prefill job of positions ``[start, total)`` ends.

    Chunks end on multiples of ``chunk`` (absolute positions, so a warm and a
    cold prefill of one prompt cut it alike) and, if ``boundary`` is given,
    on every multiple of it too (block ends, where a hybrid model's
    recurrent state must be snapshotted). The last prompt token is run on
    its own inside the last job, so the output head runs on one position
    only.

    Args:
        start: first position to run (tokens before it are cached).
        total: one past the last prompt position; ``> start``.
        chunk: tokens per chunk, ``> 0``.
        boundary: a stride at which jobs must also end, if any.

    Returns:
        Increasing job ends; the last one is ``total``.
    """
    ends: list[int] = []
    position = start
    last = total - 1
    while position < last:
        end = min((position // chunk + 1) * chunk, last)
        if boundary is not None:
            end = min(end, (position // boundary + 1) * boundary)
        ends.append(end)
        position = end
    if ends:
        ends[-1] = total
    else:
        ends.append(total)
    return ends
