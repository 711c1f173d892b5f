"""One generation request as it travels to the compute path, and the rules
both sides of that path apply to it.

A :class:`RequestSpec` is made once, by whoever starts the request
(generation, or a test through :class:`~mlxkv.actors.compute.ComputeHandle`),
and never changes: the scheduler reads its scheduling fields, the executor
its MLX ones (the prefix payloads, the runner's inputs, the sampler). The
pure functions here are the rules both apply -- where a prefill chunk ends,
and whether a token ends a request -- written once so the two cannot drift.

No anyio, no MLX: payloads and runner inputs are carried opaquely.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Literal, Optional

import attrs

from mlxkv.actors.json_constraint import JsonConstraint
from mlxkv.actors.penalties import NO_PENALTIES, Penalties
from mlxkv.actors.sampling import GREEDY, Sampling
from mlxkv.actors.token_logprobs import MAX_TOP_LOGPROBS
from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.token_ids import check_token_ids
from mlxkv.cache.validators import int_at_least

__all__ = [
    "RequestSpec",
    "blocks_out_at_start",
    "next_chunk_end",
    "prompt_and_answer",
    "stop_reason",
    "top_logprobs_checked",
]


def _request_id(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidInput("request_id", value, "must be a non-empty str")


def _sampling(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, Sampling):
        raise InvalidInput("sampling", value, "must be a Sampling")


def top_logprobs_checked(value: Any, argument: str = "top_logprobs") -> Optional[int]:
    """``value`` as a request's ``top_logprobs``: None (no log-probabilities)
    or how many alternatives each token comes with, 0 to ``MAX_TOP_LOGPROBS``.

    Raises:
        InvalidInput: anything else, naming ``argument``.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidInput(argument, value, f"must be None or an int in [0, {MAX_TOP_LOGPROBS}]")
    return value


def _prompt(value: Any) -> tuple[int, ...]:
    return tuple(check_token_ids(value, argument="prompt", allow_empty=False))


@attrs.frozen(kw_only=True)
class RequestSpec:
    """What to compute for one request, checked as it is made (so that the
    compute actor, like every actor, takes its messages checked).

    Attributes:
        request_id: the request, unique among live ones.
        prompt: the whole prompt's token ids (at least one).
        prefix: payloads of the cached blocks ``0..n-1`` to rebuild, in
            order; empty for a cold start. They leave at least the last
            prompt token to compute.
        sampling: how tokens are sampled.
        penalties: what is added to the logits before each draw.
        max_tokens: the most tokens to generate, >= 1.
        stop_tokens: tokens that end the generation (not emitted); None
            until the compute actor puts the model's end-of-sequence tokens.
        block_size: tokens per block of the payloads it publishes.
        keep_logits: attach each token's log-probabilities to its event.
        top_logprobs: attach each token's
            :class:`~mlxkv.actors.token_logprobs.TokenLogprob` with this many
            alternatives (0 to ``MAX_TOP_LOGPROBS``), or None: none.
        prompt_logprobs: attach to the prompt's ``Prefilled`` event the
            records of its tokens but the first (each from the logits of
            the position before it) with this many alternatives, or None:
            none. Such a request computes its whole prompt: it is given no
            prefix (and takes no kept cache), and prefills alone.
        held_blocks: leading full blocks of the prompt the request holds
            already (cached): they are not published again.
        namespace: what the request's blocks are keyed under beside its
            tokens (cache salt, images).
        inputs: what the model runner needs beyond the tokens (a
            vision-language prompt's images), as its preparer made them.
        constraint: the JSON grammar its answer is held to (each draw only
            among the tokens it allows), or None.
    """

    request_id: str = attrs.field(validator=_request_id)
    prompt: tuple[int, ...] = attrs.field(converter=_prompt, repr=lambda t: f"<{len(t)} tokens>")
    prefix: tuple[Any, ...] = attrs.field(default=(), converter=tuple, eq=False, repr=lambda p: f"<{len(p)} blocks>")
    sampling: Sampling = attrs.field(default=GREEDY, validator=_sampling)
    penalties: Penalties = attrs.field(default=NO_PENALTIES, validator=attrs.validators.instance_of(Penalties))
    max_tokens: int = attrs.field(validator=int_at_least(1))
    stop_tokens: Optional[frozenset[int]] = None
    block_size: int = attrs.field(validator=int_at_least(1))
    keep_logits: bool = False
    top_logprobs: Optional[int] = attrs.field(default=None, converter=top_logprobs_checked)
    prompt_logprobs: Optional[int] = attrs.field(
        default=None, converter=lambda value: top_logprobs_checked(value, "prompt_logprobs")
    )
    held_blocks: int = attrs.field(default=0, validator=int_at_least(0))
    namespace: Hashable = None
    inputs: Any = attrs.field(default=None, eq=False, repr=False)
    constraint: Optional[JsonConstraint] = attrs.field(default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if not self.prefix:
            return
        if self.prompt_logprobs is not None:
            raise InvalidInput(
                "prefix", len(self.prefix), "must be empty where the prompt's log-probabilities are asked for"
            )
        end = getattr(self.prefix[-1], "end", None)
        if type(end) is not int:
            raise InvalidInput("prefix", self.prefix, "must hold block payloads (each with its end)")
        if end >= len(self.prompt):
            raise InvalidInput("prefix", len(self.prefix), "must leave at least the last prompt token")

    @property
    def num_prefix_tokens(self) -> int:
        """Prompt tokens the prefix payloads cover."""
        return self.prefix[-1].end if self.prefix else 0


def blocks_out_at_start(spec: RequestSpec, num_cached: int) -> int:
    """Leading full blocks of a request that are out once it started with
    ``num_cached`` prompt tokens: those it holds, and those of its prefix
    payloads it used (the blocks a kept cache gave beyond them are not:
    they are published like computed ones)."""
    size = spec.block_size
    return max(min(spec.num_prefix_tokens // size, num_cached // size), spec.held_blocks)


def prompt_and_answer(
    prompt: tuple[int, ...], answer: list[int], start: int, stop: int
) -> tuple[int, ...]:
    """Positions ``[start, stop)`` of ``prompt`` followed by ``answer``,
    without building their whole concatenation."""
    if stop <= len(prompt):
        return prompt[start:stop]
    return prompt[start:] + tuple(answer[max(0, start - len(prompt)) : stop - len(prompt)])


def stop_reason(spec: RequestSpec, token: int, index: int) -> Optional[Literal["stop", "length"]]:
    """Whether answer token ``index`` (from 0), ``token``, ends the request.

    Returns:
        ``"stop"`` for a stop token (which is not part of the answer),
        ``"length"`` for the ``max_tokens``-th token, else None.
    """
    if spec.stop_tokens is not None and token in spec.stop_tokens:
        return "stop"
    if index + 1 >= spec.max_tokens:
        return "length"
    return None


def next_chunk_end(start: int, total: int, chunk: int, boundary: Optional[int] = None) -> int:
    """Where the prefill job that begins at position ``start`` ends.

    Jobs end on multiples of ``chunk`` (absolute positions, so a warm and a
    cold prefill of one prompt cut it alike) and, if ``boundary`` is given,
    on every multiple of it too (block ends, where a hybrid model's
    recurrent state must be snapshotted). The last prompt token is run on
    its own inside the last job (so the output head runs on one position
    only): a job that would end on it, or at it, ends at ``total``.

    Args:
        start: first position to run (tokens before it are cached).
        total: one past the last prompt position; ``> start``.
        chunk: tokens per chunk, ``> 0``.
        boundary: a stride at which jobs must also end, if any.
    """
    last = total - 1
    if start >= last:
        return total
    end = min((start // chunk + 1) * chunk, last)
    if boundary is not None:
        end = min(end, (start // boundary + 1) * boundary)
    return total if end >= last else end
