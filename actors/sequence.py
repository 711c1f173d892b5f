"""One live request's MLX-side state, as the executor and the model runners see it.

A :class:`SequenceState` belongs to the executor: it is made, read and written on
the MLX thread only (the scheduler keeps its own
:class:`~mlxkv.actors.scheduler.RequestState` on the event loop). It holds
the request's :class:`~mlxkv.actors.request.RequestSpec`, its cache while
it prefills (a decode batch holds it while it decodes), the tokens its KV
holds beyond the prompt, and what the runner keeps for it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Optional

from mlxkv.actors.json_constraint import ConstrainedRow
from mlxkv.actors.penalties import LogitsAdjuster
from mlxkv.actors.token_logprobs import Picks
from mlxkv.actors.request import RequestSpec, prompt_and_answer
from mlxkv.actors.sampling import Sampler

__all__ = ["SequenceState"]


class SequenceState:
    """A request's MLX-side state.

    Every field is written here, by the transitions below, each of which
    keeps the invariants; everything else reads them.

    Invariants:
        - ``num_computed`` prompt tokens are in the request's KV (its own
          ``cache`` while prefilling, its row of a decode batch while
          decoding), and it only grows, from ``num_cached``, up to the
          prompt's length;
        - while decoding, the KV holds the prompt and ``generated`` but
          its last token, which the next step feeds (a row that just
          joined: its first token, sampled by the prefill);
        - the snapshots are of its recurrent layers at block ends.
    """

    __slots__ = (
        "spec",
        "sampler",
        "adjuster",
        "constraint",
        "prompt_picks",
        "cache",
        "prepared",
        "num_cached",
        "num_computed",
        "generated",
        "snapshots",
        "cold_fallback",
        "reused_kept_cache",
        "num_shared",
    )

    def __init__(self, spec: RequestSpec) -> None:
        self.spec = spec
        self.sampler: Optional[Sampler] = spec.sampling.make_sampler()
        #: Its penalties' state, or None where it asked for none.
        self.adjuster = LogitsAdjuster(spec.penalties, spec.prompt) if spec.penalties.active else None
        #: Its place in the JSON grammar it is held to, or None.
        self.constraint = ConstrainedRow(spec.constraint) if spec.constraint is not None else None
        #: The records of the prompt tokens computed so far, queued, by
        #: position (where ``prompt_logprobs`` asks for them).
        self.prompt_picks: list[Picks] = []
        self.cache: Optional[list[Any]] = None
        #: What the model runner made of the request for itself (its own business).
        self.prepared: Any = None
        self.num_cached = 0
        self.num_computed = 0
        #: Answer tokens sampled (each fed to the model once it is decoded).
        self.generated: list[int] = []
        #: position -> recurrent-layer states after that many tokens (hybrid models).
        self.snapshots: dict[int, tuple[Optional[tuple[Any, ...]], ...]] = {}
        #: Its prefix could not be rebuilt: it computed the whole prompt.
        self.cold_fallback = False
        #: Its cache was a kept one (see :meth:`CacheRunner.keep`), cut back
        #: to what it may use, instead of rebuilt from payloads.
        self.reused_kept_cache = False
        #: Prompt tokens its cache reads from a shared prefix group (not a copy).
        self.num_shared = 0

    # -- transitions ---------------------------------------------------------------

    def start(
        self,
        cache: list[Any],
        num_cached: int,
        *,
        cold_fallback: bool = False,
        reused_kept_cache: bool = False,
        num_shared: int = 0,
    ) -> None:
        """Its cache, given by the runner before its first chunk, holding its
        first ``num_cached`` prompt tokens (not computed by it)."""
        assert self.cache is None and not self.num_computed, f"{self!r} starts once"
        assert 0 <= num_cached < len(self.spec.prompt), "the last prompt token always runs"
        self.cache = cache
        self.num_cached = self.num_computed = num_cached
        self.cold_fallback = cold_fallback
        self.reused_kept_cache = reused_kept_cache
        self.num_shared = num_shared

    def prepare(self, prepared: Any) -> None:
        """Keep what the runner made of the request for itself."""
        self.prepared = prepared

    def computed(self, position: int) -> None:
        """The prompt's tokens up to ``position`` are in its KV now."""
        assert self.num_computed <= position <= len(self.spec.prompt), (self, position)
        self.num_computed = position

    def replace_cache(self, cache: list[Any]) -> None:
        """Its own cache is ``cache`` now (the same KV, other arrays: a row
        taken out of a batched prefill)."""
        assert self.cache is not None, f"{self!r} holds no cache of its own"
        self.cache = cache

    def give_up_cache(self) -> Optional[list[Any]]:
        """Its own cache, which it no longer holds (merged into a decode
        batch, kept, or dropped), or None if it held none."""
        cache, self.cache = self.cache, None
        return cache

    def emitted(self, token: int) -> None:
        """``token`` is its next answer token."""
        self.generated.append(token)

    def picked_prompt(self, picks: Picks) -> None:
        """The records of the prompt tokens a chunk computed, queued (where
        ``prompt_logprobs`` asks for them)."""
        assert self.spec.prompt_logprobs is not None, f"{self!r} asked for no prompt records"
        self.prompt_picks.append(picks)

    def take_prompt_picks(self) -> list[Picks]:
        """The prompt's records queued so far, which it no longer holds."""
        picks, self.prompt_picks = self.prompt_picks, []
        return picks

    def snapshot(self, position: int, state: tuple[Optional[tuple[Any, ...]], ...]) -> None:
        """Its recurrent layers' ``state`` after ``position`` tokens (a block end)."""
        assert position % self.spec.block_size == 0, (self, position)
        self.snapshots[position] = state

    # -- reading -----------------------------------------------------------------

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
    def top_logprobs(self) -> Optional[int]:
        return self.spec.top_logprobs

    @property
    def num_tokens(self) -> int:
        """Tokens in the KV once decoding: the prompt and every generated token."""
        return len(self.spec.prompt) + len(self.generated)

    def tokens(self, start: int, stop: int) -> tuple[int, ...]:
        """Positions ``[start, stop)`` of the prompt followed by the generated tokens."""
        return prompt_and_answer(self.spec.prompt, self.generated, start, stop)

    def room(self, num_tokens: int) -> int:
        """Tokens a cache of this request's first ``num_tokens`` may still
        take: the rest of its prompt and its answer (one buffer for all of
        them: no regrowth)."""
        return len(self.spec.prompt) - num_tokens + self.spec.max_tokens

    def __repr__(self) -> str:
        return f"SequenceState({self.request_id!r}, {self.num_computed} computed)"
