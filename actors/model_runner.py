"""Model runners: what the compute actor asks of a model family, on the MLX thread.

The compute actor schedules; a :class:`ModelRunner` computes. A runner
prefills a chunk of one request's prompt (or, where the model allows, chunks
of several requests' prompts in one model call), computes one decode step's
logits for a batch of requests, makes, rebuilds, merges and slices caches, and (for
vision-language models) encodes images. Neither the scheduler nor generation
asks which kind of model it is: they only call these methods. Every method
except :attr:`~ModelRunner.info` runs on the compute actor's MLX thread.

:class:`TextRunner` serves mlx-lm models. Its caches are mlx-lm's own
(``KVCache``, ``RotatingKVCache``, ``ArraysCache``...); a decode batch merges
the requests' caches with mlx-lm's batch caches (``BatchKVCache``,
``BatchRotatingKVCache``, ``ArraysCache.merge``), which gave logits
bit-identical to decoding each request alone on the built-in models
(wrapped sliding windows within 1e-6). A layout with another cache class
(say ``QuantizedKVCache``, which mlx-lm cannot batch) decodes at batch size
one.

What a runner says of its model is a :class:`~mlxkv.actors.model_info.ModelInfo`;
its prompts are made ready by a
:class:`~mlxkv.actors.prompt_preparer.PromptPreparer`, off the MLX thread.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence as Seq
from typing import Any, Optional, Protocol

import attrs

from mlxkv.actors.compiled_decode import compile_checked
from mlxkv.actors.compute_config import RunnerConfig
from mlxkv.actors.kept_caches import KeptCaches
from mlxkv.actors.model_info import ModelInfo, device_name
from mlxkv.actors.prompt_preparer import ImageEncoding, PromptPreparer, TextPreparer
from mlxkv.actors.sequence import SequenceState
from mlxkv.actors.token_logprobs import pick_positions
from mlxkv.actors.weight_layout import hold_weights, loading
from mlxkv.cache import kv_state
from mlxkv.cache.errors import InvalidInput
from mlxkv.cache.kv_state import BlockPayload
from mlxkv.cache.tiers.kv_layout import KVLayout
from mlxkv.actors import attention_hook, decode_kernel
from mlxkv.actors.prefill_streams import StreamPool, default_prefill_streams, spread
from mlxkv.actors.prefix_attention import PrefixAttention
from mlxkv.cache.shared_prefix import (
    BatchSharedPrefixCache,
    PrefixGroups,
    SharedPrefixCache,
    suffix_cache,
    suffix_layer,
    suffix_of,
)

__all__ = ["CacheRunner", "ModelRunner", "TextRunner", "cache_tokens"]

#: Cache classes whose per-request caches mlx-lm merges into one exact batch.
_BATCHABLE = frozenset({"KVCache", "RotatingKVCache", "ArraysCache"})

#: Cache classes whose requests' prefill chunks run together exactly.
_BATCH_PREFILL = frozenset({"KVCache", "RotatingKVCache"})
#: Cache classes that cut back exactly to any earlier length (``trim``).
_TRIMMABLE = frozenset({"KVCache", "QuantizedKVCache"})

class ModelRunner(Protocol):
    """One model family's computations, called on the MLX thread only.

    Invariants every implementation keeps:
        - every array it returns or leaves in a sequence belongs to the MLX
          thread's stream; the caller evaluates what leaves the thread;
        - a failure raises before the sequence's state changed, or leaves
          the sequence to be dropped (the scheduler never reuses it).
    """

    @property
    def info(self) -> ModelInfo:
        """The model's :class:`ModelInfo` (readable on any thread once started)."""
        ...

    def preparer(self) -> PromptPreparer:
        """The model's prompt preparer (shared, usable on any thread)."""
        ...

    def start(self, sequence: SequenceState) -> None:
        """Give ``sequence`` its cache: the kept one or one rebuilt from its
        prefix payloads, else cold.

        Sets ``cache``, ``num_cached`` and ``num_computed``; a prefix that
        cannot be rebuilt exactly falls back to a cold cache and sets
        ``cold_fallback``.
        """
        ...

    def keep(self, sequence: SequenceState, cache: list[Any], num_tokens: int) -> None:
        """Keep ``cache``, finished ``sequence``'s, cut to its first
        ``num_tokens`` tokens (a fed stop token is not part of the answer),
        for the next request that shares its first tokens (which then
        computes only the rest); the runner keeps the most recent ones, up
        to :data:`~mlxkv.actors.kept_caches.MAX_KEPT_CACHES`
        (:class:`~mlxkv.actors.kept_caches.KeptCaches`). The caller gives
        up ``cache``.
        """
        ...

    def prefill_batch(self, rows: Seq[tuple[SequenceState, int]]) -> list[Optional[Any]]:
        """Run each row's prompt positions ``[num_computed, end)`` into its own
        cache, ``rows`` being ``(sequence, end)`` pairs: in one model call
        where :attr:`ModelInfo.batch_prefill` says the model allows (else one
        row at a time is given).

        At every block end it passes, a model with recurrent layers records
        their state in the sequence's snapshots. Where ``end`` is the prompt's
        length, the last token runs on its own and the row's logits
        (``(vocab,)``) are returned, lazily; otherwise None. If it raises, it changed
        no row it did not finish (the caller may run each row again alone).
        Nothing is waited for but what taking rows out of a plain batch cache
        reads on the host (mlx-lm's ``extract`` reads its padding): the rows'
        caches are queued (``mx.async_eval``), so the caller can queue more
        work before it reads anything back.
        """
        ...

    def decode(self, inputs: Any, cache: list[Any], rows: Seq[SequenceState], positions: Seq[int]) -> Any:
        """Logits ``(batch, vocab)`` of feeding ``inputs`` (``(batch,)``) to a batch cache.

        ``positions[i]`` is the index of row ``i``'s fed token in its
        sequence (a model whose positions are not indices needs it).
        """
        ...

    def merge(self, caches: Seq[list[Any]]) -> list[Any]:
        """One batch cache holding every given request cache, in order."""
        ...

    def extract(self, cache: list[Any], row: int, *, copy: bool = True) -> list[Any]:
        """A request cache holding ``row`` of a batch cache (``copy=False``: a
        shared prefix's suffixes as views of the batch's, for a cache that is
        copied again soon; see :meth:`BatchSharedPrefixCache.extract`)."""
        ...

    def alone(self, sequence: SequenceState, cache: list[Any]) -> list[Any]:
        """``sequence``'s request cache ``cache`` made ready to decode alone
        (a batch of one row); ``cache`` itself where nothing changes."""
        ...

    def together(self, sequence: SequenceState, cache: list[Any]) -> list[Any]:
        """What :meth:`alone` made of ``sequence``'s cache, ready to merge
        into a batch again; ``cache`` itself where nothing changes."""
        ...

    def snapshot(self, cache: list[Any], row: int) -> tuple[Optional[tuple[Any, ...]], ...]:
        """The recurrent layers' state of ``row`` (None for other layers), lazily."""
        ...

    def slice_blocks(
        self, sequence: SequenceState, cache: list[Any], start: int, stop: int
    ) -> tuple[BlockPayload, ...]:
        """Owned payloads of full blocks ``[start, stop)`` of ``cache``, queued
        (``mx.async_eval``), not waited for: a later read of them waits for
        them alone, not for work queued after them."""
        ...

    def take_encoding(self, sequence: SequenceState) -> Optional[ImageEncoding]:
        """What :meth:`start` did with the request's images (once), or None without images."""
        ...


class CacheRunner(abc.ABC):
    """What every runner over mlx-lm cache objects shares: describing the
    model's cache, rebuilding, merging, extracting, snapshotting and slicing it.

    Subclasses provide :meth:`_new_cache`, :meth:`_probe` (one token through
    a fresh cache), :meth:`prefill`, :meth:`decode` and :meth:`preparer`.

    Owns: the model's cold cache layout, which rebuilt caches must match,
    and the kept caches (:meth:`keep`: a
    :class:`~mlxkv.actors.kept_caches.KeptCaches`, whose invariants say
    what a request may take of one).
    """

    _info: ModelInfo
    _runner_config: RunnerConfig
    _layout: tuple[tuple[Any, ...], ...]
    _trimmable: bool = False
    #: finished requests' caches, kept for their continuations (made by :meth:`_measure`)
    _kept: KeptCaches
    #: whether :meth:`_forward` takes a batch of rows (a text model's does)
    _batches_prefill: bool = False
    #: the live shared prefixes (None: every request holds a copy)
    _groups: Optional[PrefixGroups] = None
    #: the signature of the payloads this model's cache slices into
    _signature: tuple[Any, ...] = ()
    #: the streams a batched prefill's rows are spread over (set by :meth:`_measure`)
    _streams: StreamPool = StreamPool(1)

    @property
    def info(self) -> ModelInfo:
        return self._info

    @abc.abstractmethod
    def _new_cache(self) -> list[Any]:
        """A fresh, empty cache for one request."""

    @abc.abstractmethod
    def _probe(self, cache: list[Any]) -> None:
        """Run one token through the model into ``cache`` (to size its buffers)."""

    def _measure(self, *, shared_prefix: bool = False) -> tuple[dict[str, Any], tuple[tuple[Any, ...], ...]]:
        """The cache's share of :class:`ModelInfo`, and the cold layout.

        Bytes per token are measured, not computed from the config: one
        token is run through a fresh cache and its buffers are sized.

        Args:
            shared_prefix: serve shared prefixes once where the model allows
                (every layer plain KV; the subclass has routed its attention).
        """
        import mlx.core as mx
        from mlx_lm.models.cache import ArraysCache

        cold = self._new_cache()
        layout = tuple(_layer_key(layer) for layer in cold)
        self._probe(cold)
        mx.eval([layer.state for layer in cold])
        if all(type(layer).__name__ == "KVCache" for layer in cold):
            self._signature = kv_state.slice_blocks(cold, 1, range(1), num_tokens=1)[0].signature
        kv_bytes = state_bytes = 0
        for layer in cold:
            if isinstance(layer, ArraysCache):
                state_bytes += sum(a.nbytes for a in layer.cache if a is not None)
                continue
            for group in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                arrays = group if isinstance(group, (tuple, list)) else (group,)
                kv_bytes += sum(a.nbytes // a.shape[2] for a in arrays if a is not None)
        try:
            kv_layout: Optional[KVLayout] = KVLayout.of(
                kv_state.slice_blocks(cold, 1, range(1), num_tokens=1)[0]
            )
        except (InvalidInput, kv_state.NotReconstructable):
            kv_layout = None
        names = tuple(type(layer).__name__ for layer in cold)
        self._trimmable = all(name in _TRIMMABLE for name in names)
        shared = shared_prefix and all(name == "KVCache" for name in names)
        self._groups = PrefixGroups() if shared else None
        self._kept = KeptCaches(self._runner_config.kept_cache_memory)
        batch_prefill = self._batches_prefill and all(name in _BATCH_PREFILL for name in names)
        if batch_prefill:
            self._streams = StreamPool(self._runner_config.prefill_streams or default_prefill_streams())
        fields = {
            "shared_prefix": shared,
            "cache_layers": names,
            "has_recurrent": any(isinstance(layer, ArraysCache) for layer in cold),
            "batchable": all(name in _BATCHABLE for name in names),
            "batch_prefill": batch_prefill,
            "prefill_streams": self._streams.count,
            "kv_bytes_per_token": kv_bytes,
            "state_bytes": state_bytes,
            "kv_layout": kv_layout,
            "device": device_name(),
        }
        return fields, layout

    # -- one request ---------------------------------------------------------

    def start(self, sequence: SequenceState) -> None:
        prefix = sequence.prefix
        cold_fallback = False
        if sequence.spec.prompt_logprobs is None:
            cache, num_cached = self._kept.take(sequence, prefix, text_only=self._text_only(sequence))
        else:
            cache, num_cached = None, 0  # every prompt position's logits are asked for
        reused = cache is not None
        if cache is not None:
            cache = self._own(sequence, cache, num_cached)
        elif prefix:
            try:
                cache = self._rebuild(sequence, prefix, len(sequence.prompt) - prefix[-1].end)
                num_cached = prefix[-1].end
            except kv_state.NotReconstructable:
                cold_fallback = True
        if cache is None:
            cache, num_cached = self._own(sequence, self._new_cache(), 0), 0
        sequence.start(
            cache,
            num_cached,
            cold_fallback=cold_fallback,
            reused_kept_cache=reused,
            num_shared=getattr(cache[0], "num_prefix", 0),
        )

    def _own(self, sequence: SequenceState, cache: list[Any], num_tokens: int) -> list[Any]:
        """A plain cache of ``num_tokens`` tokens (a fresh one, or the kept
        one) as the layers the request runs on. With shared prefixes: the
        blocks of its prefix come from their group instead (the copy of
        them is dropped, so a batch's rows stay as short as their own
        tokens), the rest stays its own."""
        if self._groups is None:
            return cache
        shared_already = isinstance(cache[0], SharedPrefixCache)
        prefix = sequence.prefix
        if not prefix or num_tokens < prefix[-1].end or not self._shares(prefix):
            if shared_already:
                return cache
            if not num_tokens:
                cache = [suffix_layer() for _ in cache]
            return [SharedPrefixCache(None, i, 0, layer) for i, layer in enumerate(cache)]
        group, shared = self._groups.take(prefix)
        num_prefix = prefix[shared - 1].end
        if shared_already:
            if cache[0].group is group and cache[0].num_prefix >= num_prefix:
                return cache
            # A kept cache over another (or no) prefix: its tokens as one
            # plain run (a copy only if it had a prefix), rebased below.
            cache = [layer.suffix if layer.num_prefix == 0 else layer.to_plain() for layer in cache]
        suffix = suffix_of(cache, num_prefix, num_tokens, sequence.room(num_tokens))
        return [SharedPrefixCache(group, i, num_prefix, layer) for i, layer in enumerate(suffix)]

    def _shares(self, prefix: tuple[BlockPayload, ...]) -> bool:
        """Whether these payloads can form a shared prefix of this model."""
        return all(p.signature == self._signature for p in prefix) and kv_state.num_reconstructable_blocks(
            prefix
        ) == len(prefix)

    def keep(self, sequence: SequenceState, cache: list[Any], num_tokens: int) -> None:
        """Only a cache of plain KV layers (which cut back exactly) is kept
        (:class:`~mlxkv.actors.kept_caches.KeptCaches`), and nothing where
        the configuration says so (``keep_caches=False``)."""
        if self._trimmable and self._runner_config.keep_caches:
            self._kept.keep(sequence, cache, num_tokens, text_only=self._text_only(sequence))

    def _text_only(self, sequence: SequenceState) -> bool:
        """Whether the request's KV depends on its tokens alone (no images)."""
        return True

    def _rebuild(self, sequence: SequenceState, prefix: tuple[BlockPayload, ...], num_new: int) -> list[Any]:
        if self._groups is not None:
            return self._share(sequence, prefix, num_new)
        # The model call that follows evaluates the copy in the same graph.
        cache = kv_state.reconstruct(prefix, extra_tokens=num_new, evaluate=False)
        if tuple(_layer_key(layer) for layer in cache) != self._layout:
            raise kv_state.NotReconstructable(
                "the prefix payloads do not match this model's cache layout"
            )
        return cache

    def _share(self, sequence: SequenceState, prefix: tuple[BlockPayload, ...], num_new: int) -> list[Any]:
        """The request's cache over a shared prefix: the live group that
        shares most of its blocks (or a new one of them all), and a suffix
        holding its own blocks after those and room for the rest."""
        assert self._groups is not None
        if not self._shares(prefix):
            raise kv_state.NotReconstructable("the prefix payloads do not match this model's cache layout")
        group, shared = self._groups.take(prefix)
        num_prefix = prefix[shared - 1].end
        suffix = suffix_cache(prefix[shared:], sequence.room(prefix[-1].end), len(self._layout))
        return [SharedPrefixCache(group, i, num_prefix, layer) for i, layer in enumerate(suffix)]

    def prefill(self, sequence: SequenceState, end: int) -> Optional[Any]:
        """One row of :meth:`prefill_batch`: positions ``[num_computed, end)``
        into the sequence's cache; the last position's logits where ``end``
        is the prompt's length, else None."""
        import mlx.core as mx

        cache = sequence.cache
        assert cache is not None, f"{sequence!r} has no cache to prefill"
        start, total = sequence.num_computed, len(sequence.prompt)
        body_end = end if end < total else total - 1
        if body_end > start:
            logits = self._run(sequence, cache, start, body_end)
            width = sequence.spec.prompt_logprobs
            if width is not None:
                # Position p's logits give token p + 1's records.
                picks = pick_positions(logits[0], sequence.prompt[start + 1 : body_end + 1], width, start + 1)
                mx.async_eval(picks.arrays)
                sequence.picked_prompt(picks)
            self._record_snapshot(sequence, cache, body_end)
            sequence.computed(body_end)
        if end < total:
            mx.async_eval([layer.state for layer in cache])
            return None
        logits = self._run(sequence, cache, total - 1, total)[0, -1]
        sequence.computed(total)
        self._record_snapshot(sequence, cache, total)
        return logits

    def prefill_batch(self, rows: Seq[tuple[SequenceState, int]]) -> list[Optional[Any]]:
        """See :class:`ModelRunner`: :meth:`prefill` of each request, at once.

        For a model with :attr:`ModelInfo.batch_prefill`: the chunks' bodies
        run in one model call (right-padded; each over its own cached prefix,
        the caches merged) and the last tokens of the requests whose prompt
        ends here in another (one position each), as mlx-lm's
        ``BatchGenerator`` prefills. If it raises, each call changed no
        request that it did not finish (the caller can run them again one
        by one); a request's body and last token are two calls.

        Returns:
            Each row's last-position logits ``(vocab,)``, or None if its
            prompt goes on.
        """
        import mlx.core as mx

        if len(rows) == 1:
            return [self.prefill(*rows[0])]
        assert self._info.batch_prefill, "this model prefills one request at a time"
        bodies = []
        for sequence, end in rows:
            total = len(sequence.prompt)
            stop = end if end < total else total - 1
            if stop > sequence.num_computed:
                bodies.append((sequence, sequence.num_computed, stop))
        body_rows = [(s, s.prompt[a:b]) for s, a, b in bodies]
        finishing = [sequence for sequence, end in rows if end == len(sequence.prompt)]
        if self._body_then_last(body_rows, finishing):
            # Every row ends here, in one batch: its last tokens run on the
            # body's batch (as mlx-lm's BatchGenerator does), not on a second
            # merge of the rows taken out of it.
            last = self._forward_rows(body_rows, then_last=True)
            for sequence, _, stop in bodies:
                sequence.computed(stop)
        else:
            self._forward_rows(body_rows)
            for sequence, _, stop in bodies:
                sequence.computed(stop)
            last = self._forward_rows([(s, s.prompt[-1:]) for s in finishing])
        out: list[Optional[Any]] = []
        for sequence, end in rows:
            if end == len(sequence.prompt):
                out.append(last[id(sequence)])
                sequence.computed(end)
            else:
                out.append(None)
        mx.async_eval([layer.state for sequence, end in rows if end < len(sequence.prompt) for layer in sequence.cache])
        return out

    def _body_then_last(self, body_rows: list[tuple[SequenceState, Seq[int]]], finishing: list[SequenceState]) -> bool:
        """Whether a batched prefill's rows all have a body and end here, in
        one model call (one prefill stream's worth): the last tokens can then
        run on the body's batch."""
        if len(body_rows) < 2 or len(finishing) != len(body_rows):
            return False
        if {id(s) for s, _ in body_rows} != {id(s) for s in finishing}:
            return False
        return len(spread([(row, len(row[1])) for row in body_rows], self._streams.count)) == 1

    def _forward_rows(self, rows: list[tuple[SequenceState, Seq[int]]], *, then_last: bool = False) -> dict[int, Any]:
        """Run each row's tokens after its cache, all in one call (one row:
        on its own cache) or, with enough tokens, one call per prefill
        stream (:func:`~mlxkv.actors.prefill_streams.spread`); each row's
        last-position logits, by ``id``. ``then_last`` (several rows, one
        call): the tokens are prompts' bodies, and each prompt's last token
        then runs on the same batch in a call of one position a row; its
        logits are returned."""
        import mlx.core as mx

        if not rows:
            return {}
        if len(rows) == 1:
            assert not then_last, "a lone row's last token runs on its own"
            sequence, tokens = rows[0]
            start = sequence.num_computed
            return {id(sequence): self._run(sequence, sequence.cache, start, start + len(tokens))[0, -1]}
        groups = spread([(row, len(row[1])) for row in _by_prefix(rows)], self._streams.count)
        assert not then_last or len(groups) == 1, "the last tokens run on the body's one batch"
        streams = self._streams.streams() if len(groups) > 1 else [mx.default_stream(mx.default_device())]
        done: list[tuple[SequenceState, list[Any], Any]] = []
        for group, stream in zip(groups, streams):
            with mx.stream(stream):
                done.extend(self._forward_group(group, then_last=then_last))
        # Every row's cache is taken out before any is replaced: if one cannot
        # be, no request's state has changed (each can be run again alone).
        out = {}
        for sequence, cache, logits in done:
            sequence.replace_cache(cache)
            out[id(sequence)] = logits
        return out

    def _forward_group(
        self, rows: list[tuple[SequenceState, Seq[int]]], *, then_last: bool = False
    ) -> list[tuple[SequenceState, list[Any], Any]]:
        """Rows' tokens through one model call over their caches merged
        (right-padded): each row, its cache taken out of the batch, and its
        last-position logits (``then_last``: of each row's prompt's last
        token, run next on the batch). No row's own cache changes."""
        import mlx.core as mx

        merged = self.merge([sequence.cache for sequence, _ in rows])
        lengths = [len(tokens) for _, tokens in rows]
        width = max(lengths)
        padding = [width - length for length in lengths]
        inputs = mx.array([list(tokens) + [0] * (width - len(tokens)) for _, tokens in rows])
        if max(padding):
            for layer in merged:
                layer.prepare(lengths=lengths, right_padding=padding)
        logits = self._forward(inputs, merged)
        if max(padding):
            for layer in merged:
                layer.finalize()
        if then_last:
            logits = self._forward(mx.array([[sequence.prompt[-1]] for sequence, _ in rows]), merged)
            lengths = [1] * len(rows)
        # mlx-lm's extract reads a layer's padding (and a rotating layer's
        # offsets) on the host, evaluating them a layer at a time: each is
        # a wait for the device (on a GPU, for all work queued before it).
        # One evaluation for every layer instead (none over shared prefixes).
        read = [array for layer in merged for array in _read_by_extract(layer)]
        if read:
            mx.eval(read)
        # A shared prefix's rows keep views of the batch's suffixes: each is
        # copied again when it joins a decode batch or the next chunk's batch.
        return [
            (sequence, self.extract(merged, row, copy=False), logits[row, lengths[row] - 1])
            for row, (sequence, _) in enumerate(rows)
        ]

    def _forward(self, inputs: Any, cache: list[Any]) -> Any:
        """Token ids ``(batch, n)`` through the model on a batch cache: logits
        (a runner with ``_batches_prefill`` provides it)."""
        raise AssertionError(f"{type(self).__name__} prefills one request at a time")

    @abc.abstractmethod
    def _run(self, sequence: SequenceState, cache: list[Any], start: int, stop: int) -> Any:
        """Prompt positions ``[start, stop)`` through the model: logits ``(1, n, vocab)``."""

    def take_encoding(self, sequence: SequenceState) -> Optional[ImageEncoding]:
        return None

    def _record_snapshot(self, sequence: SequenceState, cache: list[Any], position: int) -> None:
        if self._info.has_recurrent and position % sequence.block_size == 0:
            sequence.snapshot(position, self.snapshot(cache, 0))

    # -- batches ---------------------------------------------------------------

    def merge(self, caches: Seq[list[Any]]) -> list[Any]:
        if not self._info.batchable:
            assert len(caches) == 1, "a layout mlx-lm cannot batch decodes one request at a time"
            return caches[0]
        return [type(layers[0]).merge(list(layers)) for layers in zip(*caches)]

    def extract(self, cache: list[Any], row: int, *, copy: bool = True) -> list[Any]:
        if not self._info.batchable:
            return cache
        return [
            layer.extract(row, copy=copy) if isinstance(layer, BatchSharedPrefixCache) else layer.extract(row)
            for layer in cache
        ]

    def alone(self, sequence: SequenceState, cache: list[Any]) -> list[Any]:
        """Over a shared prefix: the prefix and the request's own tokens as
        one plain run (a copy of the prefix, with room for the rest of the
        request), so a step attends through one fused call over contiguous
        KV instead of the cascade's or a per-step concatenation (a lone
        request over a 4,096-token prefix decoded ~15% slower than over a
        plain cache). The request no longer holds the group: it lives on
        only for the requests that still use it, so a lone request holds
        one copy of its prefix either way."""
        if self._groups is None or not isinstance(cache[0], SharedPrefixCache) or not cache[0].num_prefix:
            return cache
        room = sequence.room(cache[0].offset)
        return [SharedPrefixCache(None, i, 0, layer.to_plain(room)) for i, layer in enumerate(cache)]

    def together(self, sequence: SequenceState, cache: list[Any]) -> list[Any]:
        """A lone request's plain run over its prefix's live group again (a new
        group of its prefix blocks if none lives): only its own tokens are
        copied, so the batch it joins keeps its rows as short as their own
        tokens."""
        if self._groups is None or not isinstance(cache[0], SharedPrefixCache) or cache[0].num_prefix:
            return cache
        return self._own(sequence, cache, cache[0].offset)

    def snapshot(self, cache: list[Any], row: int) -> tuple[Optional[tuple[Any, ...]], ...]:
        import mlx.core as mx
        from mlx_lm.models.cache import ArraysCache

        return tuple(
            tuple(None if a is None else mx.array(a[row : row + 1]) for a in layer.cache)
            if isinstance(layer, ArraysCache)
            else None
            for layer in cache
        )

    def slice_blocks(
        self, sequence: SequenceState, cache: list[Any], start: int, stop: int
    ) -> tuple[BlockPayload, ...]:
        size = sequence.block_size
        if self._groups is not None:
            return self._slice_suffix(cache, size, start, stop)
        payloads = kv_state.slice_blocks(cache, size, range(start, stop), num_tokens=stop * size, wait=False)
        if self._info.has_recurrent:
            payloads = [_with_snapshot(p, sequence.snapshots.get(p.end)) for p in payloads]
        return tuple(payloads)


    def _slice_suffix(self, cache: list[Any], size: int, start: int, stop: int) -> tuple[BlockPayload, ...]:
        """Blocks ``[start, stop)`` of a cache over a shared prefix: those in
        the prefix from the group's buffers, the rest from the suffix."""
        from mlx_lm.models.cache import KVCache

        shift = cache[0].num_prefix // size
        payloads: list[BlockPayload] = []
        if start < shift:
            view = []
            for layer in cache:
                prefix = KVCache()
                prefix.keys = layer.group.keys[layer.layer][..., : layer.num_prefix, :]
                prefix.values = layer.group.values[layer.layer][..., : layer.num_prefix, :]
                prefix.offset = layer.num_prefix
                view.append(prefix)
            end = min(stop, shift)
            payloads += kv_state.slice_blocks(view, size, range(start, end), num_tokens=end * size, wait=False)
        if stop > shift:
            first = max(start, shift)
            view = [layer.suffix for layer in cache]
            sliced = kv_state.slice_blocks(
                view, size, range(first - shift, stop - shift), num_tokens=(stop - shift) * size, wait=False
            )
            payloads += [attrs.evolve(p, start=p.start + shift * size) for p in sliced]
        return tuple(payloads)


def _with_snapshot(payload: BlockPayload, state: Optional[tuple[Any, ...]]) -> BlockPayload:
    """``payload`` with the recurrent state recorded at its end, if it lacks one."""
    import mlx.core as mx

    if payload.has_snapshots or state is None:
        return payload
    arrays = tuple(
        group if layer_state is None else tuple(None if a is None else mx.array(a) for a in layer_state)
        for group, layer_state in zip(payload.arrays, state)
    )
    mx.async_eval([a for group in arrays if group for a in group if a is not None])
    return attrs.evolve(payload, arrays=arrays)


def _by_prefix(rows: list[tuple[SequenceState, Seq[int]]]) -> list[tuple[SequenceState, Seq[int]]]:
    """``rows`` with those over the same shared prefix side by side (prefixes
    in the order first seen; rows over none last; otherwise in their order):
    a batch merged from them groups its rows as they are held, so attention
    in bands takes each prefix's rows without gathering them into place and
    back (four gathers a layer on a GPU)."""
    first_seen: dict[int, int] = {}

    def place(row: tuple[SequenceState, Seq[int]]) -> int:
        layer = row[0].cache[0] if row[0].cache else None
        if not isinstance(layer, SharedPrefixCache) or layer.group is None or not layer.num_prefix:
            return len(rows)
        return first_seen.setdefault(id(layer.group), len(first_seen))

    return sorted(rows, key=place)


def _read_by_extract(layer: Any) -> list[Any]:
    """The small arrays mlx-lm's ``extract`` of a batch cache layer reads on
    the host: its rows' left padding, and a rotating layer's offsets too
    (none for a shared-prefix layer, which keeps its padding on the host)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchRotatingKVCache

    if isinstance(layer, BatchSharedPrefixCache):
        return []
    arrays = [getattr(layer, "left_padding", None)]
    if isinstance(layer, BatchRotatingKVCache):
        arrays.append(layer.offset)
    return [array for array in arrays if isinstance(array, mx.array)]


def cache_tokens(cache: Seq[Any]) -> int:
    """Tokens one request's cache holds (its sequence layers' offset; a
    recurrent layer has none)."""
    return next(int(layer.offset) for layer in cache if hasattr(layer, "offset"))


def _layer_key(layer: Any) -> tuple[Any, ...]:
    return (type(layer).__name__, getattr(layer, "max_size", None), getattr(layer, "keep", None))


class TextRunner(CacheRunner):
    """A model runner for mlx-lm language models.

    Owns: the model (weights evaluated) and its tokenizer, and the cold
    cache layout.
    """

    _batches_prefill = True

    def __init__(self, model: Any, tokenizer: Any, config: RunnerConfig = RunnerConfig()) -> None:
        """Describe ``model``: runs one token through a fresh cache (on the MLX
        thread, which is also where its attention's way is set).

        Args:
            config: how to hold the model and its caches (:class:`RunnerConfig`).
                Its ``transpose_weights``, ``fuse_projections`` and
                ``compile_decode`` change the model in place
                (:func:`~mlxkv.actors.weight_layout.hold_weights`,
                :func:`~mlxkv.actors.compiled_decode.compile_checked`)
                only when True: a model
                handed in is the caller's (:meth:`load` decides for the
                models it loads). With ``kv_bits``, the plain attention
                layers' KV is quantized (``QuantizedKVCache``, in groups of
                the largest of 128, 64 or 32 that divides the head size);
                mlx-lm cannot batch quantized caches: each request then
                decodes alone (``ModelInfo.batchable`` says so).

        Raises:
            ValueError: ``kv_bits`` on a model whose head size no group
                size divides.
        """
        kv_bits = config.kv_bits
        self._runner_config = config
        fused, transposed = hold_weights(model, config)
        compiled = compile_checked(model) if config.compile_decode is True else 0
        self._model = model
        self._tokenizer = tokenizer
        self._kv_group = self._group_size() if kv_bits else 0
        fields, self._layout = self._measure(
            shared_prefix=config.shared_prefix and not kv_bits and attention_hook.install(model)
        )
        if fields["shared_prefix"]:
            way = config.prefix_attention or PrefixAttention.for_device()
            if way is PrefixAttention.KERNEL and not decode_kernel.usable(*(decode_kernel.model_build(model) or ())):
                way = PrefixAttention.MIXED  # no kernel here (not CUDA, or its build failed its check: logged)
            attention_hook.use(way)
            fields["prefix_attention"] = way.value
        self._info = ModelInfo.from_args(
            getattr(model, "args", None),
            getattr(tokenizer, "eos_token_ids", None) or (),
            transposed_layers=transposed,
            fused_projections=fused,
            compiled_layers=compiled,
            **fields,
        )

    @classmethod
    def load(cls, path: str, config: RunnerConfig = RunnerConfig()) -> TextRunner:
        """Load an mlx-lm model directory (or repo id) with ``mlx_lm.load``
        (``config.transpose_weights`` None: where MLX runs on the CPU;
        ``fuse_projections`` None: fused)."""
        from mlx_lm import load

        model, tokenizer = load(str(path))
        return cls(model, tokenizer, loading(config))

    def preparer(self) -> TextPreparer:
        return TextPreparer(self._tokenizer)

    def _new_cache(self) -> list[Any]:
        from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

        cache = make_prompt_cache(self._model)
        bits = self._runner_config.kv_bits
        if bits:
            cache = [
                QuantizedKVCache(group_size=self._kv_group, bits=bits) if type(layer) is KVCache else layer
                for layer in cache
            ]
        return cache

    def _group_size(self) -> int:
        """The quantization group size for this model's head dimension: the
        largest MLX serves (128, 64 or 32) that divides it.

        Raises:
            ValueError: no served group size divides it (say a head of 48).
        """
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        cache = make_prompt_cache(self._model)
        self._model(mx.array([[0]]), cache=cache)
        dims = {layer.keys.shape[-1] for layer in cache if type(layer) is KVCache}
        for size in (128, 64, 32):
            if dims and all(dim % size == 0 for dim in dims):
                return size
        raise ValueError(
            f"kv_bits needs attention heads whose size divides by 32; this model's are {sorted(dims)}"
        )

    def _probe(self, cache: list[Any]) -> None:
        import mlx.core as mx

        self._model(mx.array([[0]]), cache=cache)

    def _run(self, sequence: SequenceState, cache: list[Any], start: int, stop: int) -> Any:
        import mlx.core as mx

        return self._model(mx.array(sequence.prompt[start:stop])[None], cache=cache)

    def _forward(self, inputs: Any, cache: list[Any]) -> Any:
        return self._model(inputs, cache=cache)

    def decode(self, inputs: Any, cache: list[Any], rows: Seq[SequenceState], positions: Seq[int]) -> Any:
        return self._model(inputs[:, None], cache=cache)[:, -1]
