"""Finished requests' caches, each kept for the request that continues it.

A conversation's next turn extends its last turn's prompt and answer, whose
tail no full block holds: without the last turn's cache it recomputes that
tail. A runner therefore keeps its finished requests' caches
(:class:`KeptCaches`, one a runner, on the MLX thread) and starts a request
from the one it may use most of.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence as Seq
from typing import Any, Optional

import attrs

from mlxkv.actors.sequence import SequenceState
from mlxkv.cache import kv_state
from mlxkv.cache.kv_state import BlockPayload
from mlxkv.cache.shared_prefix import SharedPrefixCache, suffix_of

__all__ = ["MAX_KEPT_CACHES", "KeptCache", "KeptCaches"]

#: Finished requests' caches a runner keeps at most (the most recent ones),
#: each for the next request that continues it (a conversation's next turn),
#: and the bytes of KV they may hold together beside the block pool (their
#: own tokens, and each shared prefix they refer to, counted once even where
#: live requests hold it too: an upper bound); the most
#: recent is kept whatever its size (the bytes: ``RunnerConfig.kept_cache_memory``).
#: Concurrent conversations need one each: with one for all, each next turn
#: recomputes the tail of its previous turn that no full block holds.
MAX_KEPT_CACHES = 16


@attrs.frozen
class KeptCache:
    """A finished request's cache and the tokens its KV holds."""

    cache: list[Any] = attrs.field(eq=False, repr=False)
    tokens: tuple[int, ...] = attrs.field(repr=False)
    namespace: Hashable
    #: whether its KV depends on its tokens alone (no images)
    text_only: bool


class KeptCaches:
    """A runner's kept caches, the most recent last.

    Invariants:
        - a kept cache's KV holds exactly its ``tokens`` (and its images,
          if its namespace has any); nothing writes its arrays (payloads
          sliced from it are copies; a request given part of one gets
          arrays of its own);
        - a request uses of one only what it is entitled to (:meth:`take`):
          within the kept cache's namespace (cache salt and images) every
          shared token, else only the prefix it brings payloads for, and
          only if neither has images (then the tokens alone decide the KV);
        - at most :data:`MAX_KEPT_CACHES` are kept, of at most
          ``memory`` bytes together unless only one is.
    """

    def __init__(self, memory: int) -> None:
        self._memory = memory
        self._entries: tuple[KeptCache, ...] = ()

    @property
    def entries(self) -> tuple[KeptCache, ...]:
        """The kept caches, the most recent last."""
        return self._entries

    def keep(self, sequence: SequenceState, cache: list[Any], num_tokens: int, *, text_only: bool) -> None:
        """Keep ``cache`` -- plain KV layers, which cut back exactly, over a
        shared prefix or not -- as its first ``num_tokens`` tokens (only its
        own tokens are held beside a shared prefix's group). It replaces a
        kept cache it extends (its conversation's earlier turn), and the
        oldest go while there are more than :data:`MAX_KEPT_CACHES` or they
        hold more than ``memory`` bytes. ``text_only``: its KV depends on its
        tokens alone."""
        import mlx.core as mx

        tokens = sequence.tokens(0, min(cache[0].offset, num_tokens))
        for layer in cache:
            layer.trim(layer.offset - len(tokens))
            if isinstance(layer, SharedPrefixCache):
                layer.own_suffix()  # a row straight out of a batched prefill views its batch
        # Queued now (not waited for: the executor reads nothing back before
        # its plan's decode step is queued): a row taken out of a batch is a
        # lazy slice of the batch's buffer, which its graph would keep alive
        # for as long as it is kept; scheduled, it no longer holds the graph.
        mx.async_eval([layer.state for layer in cache])
        entry = KeptCache(cache=cache, tokens=tokens, namespace=sequence.namespace, text_only=text_only)
        kept = [
            k for k in self._entries if not (k.namespace == entry.namespace and tokens[: len(k.tokens)] == k.tokens)
        ]
        kept.append(entry)
        while len(kept) > 1 and (len(kept) > MAX_KEPT_CACHES or _kept_bytes(kept) > self._memory):
            kept.pop(0)
        self._entries = tuple(kept)

    def take(
        self, sequence: SequenceState, prefix: tuple[BlockPayload, ...], *, text_only: bool
    ) -> tuple[Optional[list[Any]], int]:
        """The kept cache the request may use most of, cut back to that, and
        that many tokens; or ``(None, 0)`` when none has anything for it
        beyond what ``prefix`` rebuilds. A request that continues a kept
        cache's every token (its conversation's next turn) takes that cache
        (it is no longer kept); one that uses only its first tokens, more of
        them than its blocks hold, gets arrays of its own for them (a copy of
        its own tokens beside a shared prefix), and the cache stays for its
        continuation.

        Within a kept cache's namespace the request uses every token they
        share but the prompt's last (which must run for its logits); in
        another namespace only its payloads' prefix, and only if both are
        text (``text_only``: the request's KV depends on its tokens alone)
        and the payloads line up from token 0 (they are what entitles it).
        """
        floor = prefix[-1].end if prefix else 0
        best, usable = None, 0
        for entry in reversed(self._entries):  # the most recent first: it wins a tie
            length = _usable(entry, sequence, prefix, floor, text_only)
            if length > usable:
                best, usable = entry, length
        whole = best is not None and usable == len(best.tokens)
        # A copy of no more than the blocks give would only stand in for them
        # (and over a shared prefix, with no room to grow in).
        if best is None or usable < floor or (usable == floor and not whole):
            return None, 0
        if whole:
            self._entries = tuple(k for k in self._entries if k is not best)
            cache = best.cache
            if isinstance(cache[0], SharedPrefixCache):
                cache = [layer.cut(usable, sequence.block_size) for layer in cache]
        else:
            room = sequence.room(usable)
            cache = [_copy_of(layer, usable, sequence.block_size, room) for layer in best.cache]
        return cache, usable


def _usable(
    entry: KeptCache, sequence: SequenceState, prefix: tuple[BlockPayload, ...], floor: int, text_only: bool
) -> int:
    """How many of ``entry``'s tokens the request may use (see :meth:`KeptCaches.take`)."""
    shared = _shared_length(entry.tokens, sequence.prompt, len(sequence.prompt) - 1)
    if entry.namespace == sequence.namespace:
        return shared
    if prefix and entry.text_only and text_only and kv_state.num_reconstructable_blocks(prefix) == len(prefix):
        return min(shared, floor)
    return 0


def _kept_bytes(kept: Seq[KeptCache]) -> int:
    """The bytes ``kept`` hold: their own arrays, and each shared prefix they refer to once."""
    groups = {id(layer.group): layer.group for k in kept for layer in k.cache[:1] if getattr(layer, "group", None)}
    own = sum(layer.nbytes for k in kept for layer in k.cache)
    return own + sum(group.nbytes for group in groups.values())


def _copy_of(layer: Any, num_tokens: int, block_size: int, room: int) -> Any:
    """A cache layer of ``layer``'s first ``num_tokens`` tokens, with room
    for ``room`` more where it is plain KV, whose arrays are new ones, so
    that writing it leaves ``layer`` as it was."""
    if isinstance(layer, SharedPrefixCache):
        if num_tokens < layer.num_prefix:
            return layer.cut(num_tokens, block_size)  # a new suffix from the group's arrays
        (suffix,) = suffix_of([layer.suffix], 0, num_tokens - layer.num_prefix, room)
        return SharedPrefixCache(layer.group if layer.num_prefix else None, layer.layer, layer.num_prefix, suffix)
    if type(layer).__name__ == "KVCache":
        return suffix_of([layer], 0, num_tokens, room)[0]
    # Quantized: slices of its arrays (new ones); it grows as it needs.
    copy = type(layer).__new__(type(layer))
    copy.__dict__.update(layer.__dict__)
    copy.keys, copy.values = (tuple(a[..., :num_tokens, :] for a in arrays) for arrays in (layer.keys, layer.values))
    copy.offset = num_tokens
    return copy


def _shared_length(kept: tuple[int, ...], prompt: Seq[int], limit: int) -> int:
    """How many leading tokens ``kept`` and ``prompt`` share, at most ``limit``."""
    prompt = tuple(prompt)
    end = min(len(kept), limit)
    if kept[:end] == prompt[:end]:
        return end  # the usual case: the prompt extends the kept tokens
    low, high = 0, end  # kept[:low] == prompt[:low]; kept[:high] != prompt[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if kept[low:middle] == prompt[low:middle]:
            low = middle
        else:
            high = middle
    return low
