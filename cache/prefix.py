"""Whole-prompt prefix cache: a token trie with LRU eviction (seed API).

:class:`PrefixCacheManager` keeps complete mlx-lm prompt caches -- one list of
per-layer cache objects per stored token sequence -- and answers, for a new
prompt, which stored cache lets it skip the most prefill:

- *exact*: the prompt itself is stored;
- *longer*: a stored sequence extends the prompt; its cache is trimmed back to
  the prompt's length (only if every layer is trimmable);
- *shorter*: the longest stored sequence that is a prefix of the prompt; the
  caller prefills the rest.

Stored caches are owned by the manager. A cache goes in as a snapshot and comes
out as a copy, so a caller that keeps decoding into what it stored, or into
what it fetched, can never change an entry. The copies are cheap: deep-copying
an ``mx.array`` makes a new handle on the same (immutable) buffer, so no KV
data moves; mlx-lm's in-place writes (``keys[..., a:b, :] = ...``) rebind only
the handle they are made through.
"""

from __future__ import annotations

import copy
import functools
import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from mlxkv.cache.block_prefix import BlockAwarePrefixCache, BlockCacheEntry
from mlxkv.cache.errors import InvalidInput, InvariantViolation
from mlxkv.cache.model_key import model_key
from mlxkv.cache.token_ids import check_token_ids

__all__ = [
    "BlockAwarePrefixCache",
    "BlockCacheEntry",
    "CacheEntry",
    "PrefixCacheManager",
    "PrefixCacheStats",
]

logger = logging.getLogger(__name__)


@dataclass
class CacheEntry:
    """One stored prompt cache.

    Attributes:
        prompt_cache: the per-layer mlx-lm cache objects (owned by the manager).
        count: how many times this token sequence was stored.
    """

    prompt_cache: List[Any]
    count: int


@dataclass
class PrefixCacheStats:
    """Counters of a :class:`PrefixCacheManager`.

    Attributes:
        hits: fetches that returned a cache (exact, longer or shorter match).
        misses: fetches that returned nothing.
        tokens_saved: prompt tokens covered by returned caches.
        total_queries: all fetches.
        evictions: entries dropped to respect ``max_entries``.
    """

    hits: int = 0
    misses: int = 0
    tokens_saved: int = 0
    total_queries: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of queries that hit; ``0.0`` before the first query."""
        if self.total_queries == 0:
            return 0.0
        return self.hits / self.total_queries

    def to_dict(self) -> Dict[str, Any]:
        """Return the counters and the hit rate under the seed's keys."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "tokens_saved": self.tokens_saved,
            "total_queries": self.total_queries,
            "evictions": self.evictions,
        }


class _Node:
    """One trie position; the tokens on the path from the root spell its key.

    ``nearest`` is the node holding an entry, within this node's subtree (the
    node included), with the smallest ``(depth, seq)``: the stored sequence
    that extends this prefix least, oldest first on ties. It makes a "longer"
    lookup O(1) once the prompt has been walked.
    """

    __slots__ = ("token", "parent", "depth", "children", "entry", "seq", "nearest")

    def __init__(self, token: int, parent: Optional[_Node], depth: int) -> None:
        self.token = token
        self.parent = parent
        self.depth = depth
        self.children: Dict[int, _Node] = {}
        self.entry: Optional[CacheEntry] = None
        self.seq = -1
        self.nearest: Optional[_Node] = None

    def rank(self) -> Tuple[int, int]:
        return (self.depth, self.seq)


class _Match(NamedTuple):
    exact: Optional[_Node]
    shorter: Optional[_Node]
    longer: Optional[_Node]


def _copy_prompt_cache(prompt_cache: Sequence[Any]) -> List[Any]:
    # deepcopy gives every layer object, list and array handle its own
    # identity while sharing the evaluated buffers: O(layers), no KV copy.
    return copy.deepcopy(list(prompt_cache))


class PrefixCacheManager:
    """LRU cache of whole prompt caches, looked up by token prefix.

    Owns a token trie whose nodes hold :class:`CacheEntry` objects, the LRU
    order of those entries and the statistics. A lookup walks the prompt once
    (O(len(tokens))); storing is O(len(tokens)); evicting the least recently
    used entry is O(1) to find and O(len(its tokens) + branches off its path)
    to unlink (ancestors that pointed at it look at their children again).

    Invariants:
        - ``len(self)`` equals the number of trie nodes holding an entry, and
          every such node is in the LRU order exactly once.
        - Every non-root node with no entry has at least one child: there are
          no dead branches.
        - Every node's ``nearest`` is the entry node of its subtree with the
          smallest ``(depth, seq)`` (``None`` only for an empty root).
        - ``len(self) <= max_size`` between calls.
        - No stored cache object is reachable from outside: stores snapshot,
          fetches copy.

    Args:
        model: the model whose caches are stored (kept for reference and
            :attr:`model_key`; one manager serves one model, so nothing is
            looked up by it).
        max_entries: how many sequences to keep before evicting the least
            recently used one.

    Raises:
        InvalidInput: ``max_entries`` is not a positive int.
    """

    def __init__(self, model: Any, max_entries: int = 100) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries <= 0:
            raise InvalidInput("max_entries", max_entries, "must be a positive int")
        self.model = model
        self.max_size = max_entries
        self.stats = PrefixCacheStats()
        self._root = _Node(-1, None, 0)
        # Keys are entry nodes (hashed by identity); first = least recently used.
        self._lru: OrderedDict[_Node, None] = OrderedDict()
        self._next_seq = 0

    @functools.cached_property
    def model_key(self) -> Optional[str]:
        """A stable key of :attr:`model` (see :func:`~mlxkv.cache.model_key.model_key`).

        The seed's is ``id(model)``, which a later model can inherit once this
        one is garbage-collected. Computed on first read.
        """
        return model_key(self.model)

    def _match(self, key: array) -> _Match:
        node = self._root
        deepest: Optional[_Node] = None
        for tok in key:
            if node.entry is not None:
                deepest = node
            child = node.children.get(tok)
            if child is None:
                return _Match(None, deepest, None)
            node = child
        if node.entry is not None:
            return _Match(node, None, None)
        # No entry here, so ``nearest`` is a strict descendant (or None at root).
        return _Match(None, deepest, node.nearest)

    def _find(self, tokens: Sequence[int]) -> Optional[_Node]:
        node: Optional[_Node] = self._root
        for tok in tokens:
            node = node.children.get(tok)
            if node is None:
                return None
        return node

    @staticmethod
    def _tokens_of(node: _Node) -> List[int]:
        path = []
        while node.parent is not None:
            path.append(node.token)
            node = node.parent
        path.reverse()
        return path

    def _search(
        self, tokens: List[int]
    ) -> Tuple[Optional[List[int]], Optional[List[int]], Optional[List[int]], int]:
        """Find the stored sequences related to ``tokens``.

        Args:
            tokens: the query.

        Returns:
            ``(exact, shorter, longer, common_prefix_len)``: ``exact`` is
            ``tokens`` if stored; otherwise ``shorter`` is the longest stored
            strict prefix of ``tokens`` and ``longer`` the shortest stored
            sequence that ``tokens`` is a strict prefix of (oldest on ties),
            each ``None`` if there is none; ``common_prefix_len`` is
            ``len(tokens)`` when ``longer`` is set, else ``0``.

        Raises:
            InvalidInput: a token id is not an int in ``[0, 2**32)``.
        """
        key = check_token_ids(tokens)
        match = self._match(key)
        if match.exact is not None:
            return key.tolist(), None, None, 0
        shorter = self._tokens_of(match.shorter) if match.shorter is not None else None
        if match.longer is None:
            return None, shorter, None, 0
        return None, shorter, self._tokens_of(match.longer), len(key)

    def fetch_cache(self, tokens: List[int]) -> Tuple[Optional[List[Any]], List[int]]:
        """Find the stored cache that covers the most of ``tokens``.

        Preference: exact match, then a longer entry trimmed to
        ``len(tokens)`` (if all its layers are trimmable), then the longest
        stored prefix. The returned cache is a private copy.

        Args:
            tokens: the prompt's token ids.

        Returns:
            ``(cache, remaining_tokens)``: on an exact or longer match the
            cache covers all of ``tokens`` and ``remaining_tokens`` is ``[]``;
            on a shorter match it is the uncovered tail; on a miss
            ``(None, tokens)`` (as a new list).

        Raises:
            InvalidInput: ``tokens`` is empty or holds something other than
                ints in ``[0, 2**32)``. Nothing is counted then.
        """
        key = check_token_ids(tokens)
        if not key:
            raise InvalidInput("tokens", tokens, "must not be empty")
        match = self._match(key)
        self.stats.total_queries += 1

        if match.exact is not None:
            return self._hit(match.exact, len(key), "exact"), []

        if match.longer is not None:
            stored = match.longer.entry.prompt_cache
            if self._can_trim_cache(stored):
                cache = self._hit(match.longer, len(key), "longer")
                return self._trim_cache(cache, match.longer.depth - len(key)), []

        if match.shorter is not None:
            covered = match.shorter.depth
            return self._hit(match.shorter, covered, "shorter"), key[covered:].tolist()

        self.stats.misses += 1
        logger.debug("prefix cache miss: tokens=%d", len(key))
        return None, key.tolist()

    def _hit(self, node: _Node, covered: int, kind: str) -> List[Any]:
        self.stats.hits += 1
        self.stats.tokens_saved += covered
        self._lru.move_to_end(node)
        logger.debug("prefix cache %s hit: stored=%d covered=%d", kind, node.depth, covered)
        return _copy_prompt_cache(node.entry.prompt_cache)

    def store_cache(self, tokens: List[int], prompt_cache: List[Any]) -> None:
        """Store a snapshot of ``prompt_cache`` as the cache of ``tokens``.

        Storing a sequence that is already stored keeps the first cache,
        counts the store and marks the entry most recently used. Storing may
        evict the least recently used entry.

        Args:
            tokens: the token ids the cache was computed for; empty means
                nothing to store (the seed's no-op).
            prompt_cache: the per-layer cache objects; the caller keeps its
                own, which may go on changing.

        Raises:
            InvalidInput: a token id is not an int in ``[0, 2**32)``, or
                ``prompt_cache`` is not a list or tuple.
        """
        key = check_token_ids(tokens)
        if not key:
            return
        if not isinstance(prompt_cache, (list, tuple)):
            raise InvalidInput("prompt_cache", prompt_cache, "must be a list of per-layer caches")

        node = self._find(key)
        if node is not None and node.entry is not None:
            node.entry.count += 1
            self._lru.move_to_end(node)
            return

        entry = CacheEntry(_copy_prompt_cache(prompt_cache), 1)
        node = self._root
        for tok in key:
            child = node.children.get(tok)
            if child is None:
                child = _Node(tok, node, node.depth + 1)
                node.children[tok] = child
            node = child
        self._attach(node, entry)
        logger.debug("prefix cache stored: tokens=%d entries=%d", len(key), len(self._lru))

        while len(self._lru) > self.max_size:
            self._evict_lru()

    def _attach(self, node: _Node, entry: CacheEntry) -> None:
        node.entry = entry
        node.seq = self._next_seq
        self._next_seq += 1
        self._lru[node] = None
        rank = node.rank()
        walker: Optional[_Node] = node
        while walker is not None:
            best = walker.nearest
            # Every ancestor's subtree contains this one, so its best is at
            # least as good: once a node keeps its best, all above keep theirs.
            if best is not None and best.rank() <= rank:
                break
            walker.nearest = node
            walker = walker.parent

    def _detach(self, node: _Node) -> None:
        node.entry = None
        node.seq = -1
        del self._lru[node]
        walker: Optional[_Node] = node
        # Only ancestors whose best was ``node`` change; that set is a chain
        # from ``node`` upwards, since a best is also the best of every
        # subtree on its way up.
        while walker is not None and walker.nearest is node:
            parent = walker.parent
            if walker.entry is None and not walker.children and parent is not None:
                del parent.children[walker.token]
                walker.parent = None
                walker.nearest = None
            else:
                walker.nearest = self._nearest_below(walker)
            walker = parent

    @staticmethod
    def _nearest_below(node: _Node) -> Optional[_Node]:
        if node.entry is not None:
            return node
        best: Optional[_Node] = None
        for child in node.children.values():
            candidate = child.nearest
            if candidate is not None and (best is None or candidate.rank() < best.rank()):
                best = candidate
        return best

    def _get_cache_entry(self, tokens: List[int]) -> Optional[CacheEntry]:
        """Return the entry stored for exactly ``tokens``, or ``None``.

        The entry is the stored one, not a copy: this is an internal helper.
        """
        node = self._find(tokens)
        return None if node is None else node.entry

    def _touch_lru(self, tokens_tuple: tuple) -> None:
        """Mark the entry of ``tokens_tuple`` most recently used (no-op if absent)."""
        node = self._find(tokens_tuple)
        if node is not None and node.entry is not None:
            self._lru.move_to_end(node)

    def _evict_lru(self) -> None:
        """Drop the least recently used entry and count an eviction (no-op if empty)."""
        if not self._lru:
            return
        node = next(iter(self._lru))
        logger.debug("prefix cache evicted: tokens=%d", node.depth)
        self._detach(node)
        self.stats.evictions += 1

    def _delete_cache(self, tokens: List[int]) -> None:
        """Drop the entry of exactly ``tokens`` and its dead branch (no-op if absent).

        Not counted as an eviction.
        """
        node = self._find(tokens)
        if node is not None and node.entry is not None:
            self._detach(node)

    def _can_trim_cache(self, prompt_cache: List[Any]) -> bool:
        """Tell whether every layer of ``prompt_cache`` can be trimmed.

        A layer is trimmable if its ``is_trimmable()`` says so (mlx-lm's rule:
        e.g. a ``RotatingKVCache`` only until it wraps); a layer without
        ``is_trimmable`` is trusted if it has ``trim``. An empty cache is not
        trimmable.
        """
        if not prompt_cache:
            return False
        for layer in prompt_cache:
            flag = getattr(layer, "is_trimmable", None)
            if callable(flag):
                flag = flag()
            if flag is not None and not flag:
                logger.debug("prefix cache: %s is not trimmable", type(layer).__name__)
                return False
            if not callable(getattr(layer, "trim", None)):
                return False
        return True

    def _trim_cache(self, prompt_cache: List[Any], num_tokens: int) -> List[Any]:
        """Remove the last ``num_tokens`` positions from every layer, in place.

        Nothing is trimmed if ``num_tokens <= 0`` or any layer is not
        trimmable (a stack is never trimmed partially).

        Returns:
            ``prompt_cache`` itself.
        """
        if num_tokens <= 0 or not self._can_trim_cache(prompt_cache):
            return prompt_cache
        for layer in prompt_cache:
            layer.trim(num_tokens)
        return prompt_cache

    def get_stats(self) -> Dict[str, Any]:
        """Return the statistics under the seed's keys (see :class:`PrefixCacheStats`)."""
        return self.stats.to_dict()

    def reset_stats(self) -> None:
        """Zero every counter."""
        self.stats = PrefixCacheStats()

    def clear(self) -> None:
        """Drop every entry and zero the statistics."""
        self._root = _Node(-1, None, 0)
        self._lru.clear()
        self.reset_stats()

    def __len__(self) -> int:
        """Return the number of stored sequences."""
        return len(self._lru)

    def check_invariants(self) -> None:
        """Verify the class invariants by walking the whole trie (for tests).

        The checks are explicit raises, not ``assert``: they also run under
        ``python -O``.

        Raises:
            InvariantViolation: naming the first broken invariant.
        """
        if len(self._lru) > self.max_size:
            raise InvariantViolation(f"{len(self._lru)} entries, max_size is {self.max_size}")
        if self._root.parent is not None or self._root.entry is not None:
            raise InvariantViolation("the root has a parent or an entry")
        entries = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            where = f"node at depth {node.depth}"
            if node.entry is not None:
                entries += 1
                if node not in self._lru:
                    raise InvariantViolation(f"{where}: entry missing from the LRU order")
                if node.seq < 0:
                    raise InvariantViolation(f"{where}: entry without a sequence number")
            if node is not self._root:
                if node.parent.children.get(node.token) is not node:
                    raise InvariantViolation(f"{where}: broken parent link")
                if node.depth != node.parent.depth + 1:
                    raise InvariantViolation(f"{where}: depth is not its parent's + 1")
                if node.entry is None and not node.children:
                    raise InvariantViolation(f"{where}: dead branch (no entry, no child)")
            if node.nearest is not self._nearest_below(node):
                raise InvariantViolation(f"{where}: stale nearest")
            stack.extend(node.children.values())
        if entries != len(self._lru):
            raise InvariantViolation(
                f"the LRU order holds {len(self._lru)} nodes, the trie {entries} entries"
            )
