"""One live request's MLX-side state, as the executor and the model runners see it.

A :class:`Sequence` belongs to the executor: it is made, read and written on
the MLX thread only (the scheduler keeps its own
:class:`~mlxkv.actors.scheduler.RequestState` on the event loop). It holds
the request's :class:`~mlxkv.actors.request.RequestSpec`, its cache while
it prefills (a decode batch holds it while it decodes), the tokens its KV
holds beyond the prompt, and what the runner keeps for it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Optional

from mlxkv.actors.request import RequestSpec, prompt_and_answer
from mlxkv.actors.sampling import Sampler

__all__ = ["Sequence"]


class Sequence:
    """A request's MLX-side state.

    Invariants:
        - ``num_computed`` prompt tokens are in the request's KV (its own
          ``cache`` while prefilling, its row of a decode batch while
          decoding);
        - while decoding, the KV holds the prompt and ``generated`` but
          its last token, which the next step feeds (a row that just
          joined: its first token, sampled by the prefill);
        - the snapshots are of its recurrent layers at block ends.
    """

    __slots__ = (
        "spec",
        "sampler",
        "cache",
        "inputs",
        "num_cached",
        "num_computed",
        "generated",
        "snapshots",
        "cold_fallback",
        "reused_last_cache",
        "num_shared",
    )

    def __init__(self, spec: RequestSpec) -> None:
        self.spec = spec
        self.sampler: Optional[Sampler] = spec.sampling.make_sampler()
        self.cache: Optional[list[Any]] = None
        #: What the model runner prepared for this request (its own business).
        self.inputs: Any = spec.inputs
        self.num_cached = 0
        self.num_computed = 0
        #: Answer tokens sampled (each fed to the model once it is decoded).
        self.generated: list[int] = []
        #: position -> recurrent-layer states after that many tokens (hybrid models).
        self.snapshots: dict[int, tuple[Optional[tuple[Any, ...]], ...]] = {}
        self.cold_fallback = False
        #: Its cache was the last finished request's, cut back to the prefix
        #: (see :meth:`CacheRunner.keep`), instead of rebuilt from payloads.
        self.reused_last_cache = False
        #: Prompt tokens its cache reads from a shared prefix group (not a copy).
        self.num_shared = 0

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.spec.prompt

    @property
    def prefix(self) -> tuple[Any, ...]:
        return self.spec.prefix

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def namespace(self) -> Hashable:
        return self.spec.namespace

    @property
    def keep_logits(self) -> bool:
        return self.spec.keep_logits

    @property
    def num_tokens(self) -> int:
        """Tokens in the KV once decoding: the prompt and every generated token."""
        return len(self.spec.prompt) + len(self.generated)

    def tokens(self, start: int, stop: int) -> tuple[int, ...]:
        """Positions ``[start, stop)`` of the prompt followed by the generated tokens."""
        return prompt_and_answer(self.spec.prompt, self.generated, start, stop)

    def __repr__(self) -> str:
        return f"Sequence({self.request_id!r}, {self.num_computed} computed)"
