"""A batched prefill's rows spread over MLX streams: the grouping, the default, and the runner's calls."""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxkv.actors.compute_config import RunnerConfig
from mlxkv.actors.model_runner import TextRunner
from mlxkv.actors.prefill_streams import (
    MAX_DEFAULT_STREAMS,
    MIN_TOKENS_PER_STREAM,
    default_prefill_streams,
    spread,
)
from mlxkv.actors.request import RequestSpec
from mlxkv.actors.sequence import SequenceState

from device_arithmetic import ATTENTION_ATOL, EXACT_FLOAT32, LOGITS_ATOL
from graph_ops import primitives


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(1, 300), min_size=1, max_size=12), streams=st.integers(1, 6))
def test_spread_is_a_balanced_partition(tokens, streams):
    """Every row in exactly one group, in their order; as many groups as the
    streams, rows and tokens allow; the heaviest group at most one row above
    the lightest."""
    rows = [(f"r{i}", n) for i, n in enumerate(tokens)]
    groups = spread(rows, streams)
    assert sorted(row for group in groups for row in group) == sorted(name for name, _ in rows)
    for group in groups:
        assert group == sorted(group, key=lambda name: int(name[1:]))
    expected = max(1, min(streams, len(rows), sum(tokens) // MIN_TOKENS_PER_STREAM))
    assert len(groups) == expected
    loads = [sum(dict(rows)[name] for name in group) for group in groups]
    assert max(loads) - min(loads) <= max(tokens)


def test_short_calls_are_not_split():
    """A prompt's last token for 8 rows stays one call, whatever the streams."""
    assert spread([(i, 1) for i in range(8)], 8) == [list(range(8))]
    assert len(spread([(i, MIN_TOKENS_PER_STREAM) for i in range(8)], 8)) == 8


def test_the_default_is_the_cores_on_the_cpu_and_one_on_a_gpu():
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert default_prefill_streams(mx.Device(mx.cpu)) == max(1, min(cores, MAX_DEFAULT_STREAMS))
    assert default_prefill_streams(mx.Device(mx.gpu)) == 1


def _rows(runner: TextRunner, lengths: list[int]) -> list[tuple[SequenceState, int]]:
    rows = []
    for index, length in enumerate(lengths):
        prompt = [(i * 31 + index * 17) % 250 for i in range(length)]
        spec = RequestSpec(request_id=f"r{index}", prompt=prompt, max_tokens=4, block_size=16, stop_tokens=frozenset())
        sequence = SequenceState(spec)
        runner.start(sequence)
        rows.append((sequence, length))
    return rows


class _StreamsSeen:
    """The model, recording the stream each call of more than one token ran on."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.streams: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, inputs: Any, cache: Any = None) -> Any:
        if inputs.shape[1] > 1:
            self.streams.append(mx.default_stream(mx.default_device()))
        return self.model(inputs, cache=cache)


@pytest.mark.parametrize("streams", [2, 3])
def test_rows_over_streams_give_the_one_call_logits(tiny_llama, streams):
    """Four prompts (99 to 160 tokens) prefilled over several streams, a call
    on each, give the logits of one call over all four (on the CPU bit for
    bit; within float noise where products round as a GPU's) and the same
    caches after them."""
    model, tokenizer = tiny_llama
    lengths = [160, 99, 130, 120]
    one = TextRunner(model, tokenizer, RunnerConfig(prefill_streams=1, keep_caches=False))
    expected = one.prefill_batch(_rows(one, lengths))
    seen = _StreamsSeen(model)
    runner = TextRunner(seen, tokenizer, RunnerConfig(prefill_streams=streams, keep_caches=False))
    assert runner.info.prefill_streams == streams
    rows = _rows(runner, lengths)
    seen.streams.clear()
    got = runner.prefill_batch(rows)
    assert len({str(stream) for stream in seen.streams}) == streams  # one body call a stream
    for mine, theirs in zip(got, expected):
        assert mine is not None and theirs is not None
        if EXACT_FLOAT32:
            assert mx.array_equal(mine, theirs).item()
        else:  # other shapes, other kernels: within float noise
            assert mx.allclose(mine, theirs, atol=LOGITS_ATOL, rtol=0).item()
    for (sequence, length), _ in zip(rows, lengths):
        assert sequence.num_computed == length and sequence.cache[0].offset == length


def test_no_cache_is_replaced_until_every_call_is_built(tiny_llama, monkeypatch):
    """Taking a row's cache out of the last stream's call raises: every row
    keeps the cache it had and the tokens it had computed (so each can run
    again alone), those of the calls built before it too."""
    model, tokenizer = tiny_llama
    runner = TextRunner(model, tokenizer, RunnerConfig(prefill_streams=2, keep_caches=False))
    rows = _rows(runner, [100, 90, 80, 70])
    before = [(sequence.cache, sequence.num_computed) for sequence, _ in rows]
    honest = TextRunner.extract
    calls: list[int] = []

    def failing(self: Any, cache: Any, row: int, **options: Any) -> Any:
        calls.append(row)
        if len(calls) == 3:  # the first row of the second call
            raise RuntimeError("injected extract failure")
        return honest(self, cache, row, **options)

    monkeypatch.setattr(TextRunner, "extract", failing)
    with pytest.raises(RuntimeError, match="injected"):
        runner.prefill_batch(rows)
    assert [(sequence.cache, sequence.num_computed) for sequence, _ in rows] == before


def _has_work(arrays: Any) -> bool:
    """Whether evaluating ``arrays`` runs anything (an evaluated array's graph is empty)."""
    from mlx.utils import tree_flatten

    return bool(primitives(*[a for _, a in tree_flatten(arrays) if isinstance(a, mx.array)]))


def _count_working_evals(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets an entry for every ``mx.eval`` with work to run (a wait
    for the device), from now on."""
    working: list[int] = []
    honest = mx.eval

    def counting(*arrays: Any) -> None:
        if any(_has_work(a) for a in arrays):
            working.append(1)
        honest(*arrays)

    monkeypatch.setattr(mx, "eval", counting)
    return working


@pytest.mark.parametrize("model_name, waits", [("tiny_llama", 0), ("sliding_llama", 1)])
def test_a_padded_prefill_waits_for_the_device_once_a_call_at_most(request, model_name, waits, monkeypatch):
    """Rows of different lengths prefill right-padded; taking their caches out
    reads each layer's padding on the host (mlx-lm's extract evaluates it a
    layer at a time). One evaluation with work a call for every layer's
    padding (on a GPU each is a wait for everything queued), and none where
    the layers keep it on the host (shared-prefix caches: the tiny Llama's;
    a sliding window's rotating caches are mlx-lm's own). The rows' caches
    are queued, not waited for."""
    model, tokenizer = request.getfixturevalue(model_name)
    runner = TextRunner(model, tokenizer, RunnerConfig(prefill_streams=1, keep_caches=False))
    rows = [(sequence, length - 1) for sequence, length in _rows(runner, [70, 50, 40, 33])]  # bodies only
    working = _count_working_evals(monkeypatch)
    assert runner.prefill_batch(rows) == [None] * 4
    assert len(working) == waits


def _shared_prefix_rows(
    runner: TextRunner, model: Any, owns: list[int], prefixes: Optional[list[int]] = None
) -> list[SequenceState]:
    """Requests of ``owns`` own tokens each after a 64-token prefix (request
    ``i`` after prefix ``prefixes[i]``; default: one for all), started over
    its blocks (their caches share it)."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxkv.cache import kv_state
    from mlxkv.cache.shared_prefix import SharedPrefixCache

    prefixes = prefixes or [0] * len(owns)
    texts, payloads = {}, {}
    for which in sorted(set(prefixes)):
        texts[which] = [(i * 37 + 5 + which * 11) % 250 for i in range(64)]
        cold = make_prompt_cache(model)
        model(mx.array(texts[which])[None], cache=cold)
        mx.eval([layer.state for layer in cold])
        payloads[which] = tuple(kv_state.slice_blocks(cold, 16, range(4), num_tokens=64))
    sequences = []
    for index, (own, which) in enumerate(zip(owns, prefixes)):
        prompt = texts[which] + [(i * 31 + index * 17) % 250 for i in range(own)]
        spec = RequestSpec(
            request_id=f"r{index}", prompt=prompt, prefix=payloads[which], max_tokens=4, block_size=16,
            stop_tokens=frozenset(),
        )  # fmt: skip
        sequence = SequenceState(spec)
        runner.start(sequence)
        assert isinstance(sequence.cache[0], SharedPrefixCache) and sequence.cache[0].num_prefix == 64
        sequences.append(sequence)
    return sequences


def _holds_its_cold_run(model: Any, sequence: SequenceState, length: int) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    expected = make_prompt_cache(model)
    model(mx.array(sequence.prompt[:length])[None], cache=expected)
    plain = sequence.cache[0].to_plain()
    assert plain.offset == length
    assert mx.allclose(plain.keys[..., :length, :], expected[0].keys[..., :length, :], atol=ATTENTION_ATOL).item()


def test_a_padded_prefill_over_a_shared_prefix_reads_no_padding_back(tiny_llama, monkeypatch):
    """Over a shared prefix the batch cache keeps its rows' padding on the
    host, so taking the rows' caches out reads nothing back from the device:
    the call evaluates nothing (the rows' caches are queued), and each row's
    cache then holds its prefix and its own tokens as a cold run does."""
    model, tokenizer = tiny_llama
    runner = TextRunner(model, tokenizer, RunnerConfig(prefill_streams=1, keep_caches=False))
    rows = [(sequence, len(sequence.prompt) - 1) for sequence in _shared_prefix_rows(runner, model, [20, 9, 14])]
    working = _count_working_evals(monkeypatch)
    assert runner.prefill_batch(rows) == [None] * 3  # bodies only
    assert not working
    monkeypatch.undo()
    for sequence, body in rows:
        _holds_its_cold_run(model, sequence, body)


def test_a_batched_prefill_over_a_shared_prefix_copies_no_row_out(tiny_llama, monkeypatch):
    """A batched prefill's rows keep their own tokens as views of the batch's
    suffixes: each is copied again when it joins a decode batch (or the next
    chunk's batch), so a copy out of the batch as well would be a kernel
    launch a row and layer for keys and values each on a GPU, for nothing.
    Rows that all end here run their last tokens on the body's batch (one
    merge, not a second of the rows taken out). The rows' caches hold what
    a cold run does, and their logits are a cold run's."""
    from mlxkv.actors import model_runner

    from device_arithmetic import LOGITS_ATOL

    model, tokenizer = tiny_llama
    runner = TextRunner(model, tokenizer, RunnerConfig(prefill_streams=1, keep_caches=False))
    sequences = _shared_prefix_rows(runner, model, [20, 9, 14])
    merges = []
    honest = model_runner.CacheRunner.merge
    monkeypatch.setattr(model_runner.CacheRunner, "merge", lambda self, caches: merges.append(len(caches)) or honest(self, caches))
    logits = runner.prefill_batch([(sequence, len(sequence.prompt)) for sequence in sequences])
    assert merges == [3]
    suffixes = [array for sequence in sequences for layer in sequence.cache for array in (layer.suffix.keys, layer.suffix.values)]
    assert "Contiguous" not in primitives(*suffixes)  # the rows' caches are left lazy: their graph is there
    for sequence, row in zip(sequences, logits):
        _holds_its_cold_run(model, sequence, len(sequence.prompt))
        cold = model(mx.array(sequence.prompt)[None])[0, -1]
        assert row is not None and mx.allclose(row, cold, atol=LOGITS_ATOL).item()


def test_a_banded_prefill_is_the_same_graph_whatever_its_rows_order(tiny_llama):
    """Rows over two prefixes, arriving interleaved or grouped: the runner
    lays each prefix's rows side by side before it merges them, so attention
    in bands (the GPU's) takes them as held, without gathering them into
    place and back in every layer: the same primitives either way, and each
    row's cache that of a cold run."""
    from collections import Counter

    from mlxkv.actors.prefix_attention import PrefixAttention

    model, tokenizer = tiny_llama
    graphs = []
    for prefixes in ([0, 1, 0, 1], [0, 0, 1, 1]):
        config = RunnerConfig(prefill_streams=1, keep_caches=False, prefix_attention=PrefixAttention.MIXED)
        runner = TextRunner(model, tokenizer, config)
        sequences = _shared_prefix_rows(runner, model, [20, 9, 14, 11], prefixes)
        logits = runner.prefill_batch([(sequence, len(sequence.prompt)) for sequence in sequences])
        caches = [array for sequence in sequences for layer in sequence.cache for array in (layer.suffix.keys, layer.suffix.values)]
        graphs.append(Counter(primitives(*logits, *caches)))
        for sequence in sequences:
            _holds_its_cold_run(model, sequence, len(sequence.prompt))
    assert graphs[0] == graphs[1]


def test_a_row_kept_straight_out_of_a_batched_prefill_pins_no_batch(tiny_llama):
    """A request that ends at its first token is kept straight out of its
    batched prefill, whose rows view the batch's suffixes: the kept cache
    then holds its own tokens in buffers of its own, not views that keep
    every row's suffix alive for as long as it is kept."""
    import gc

    model, tokenizer = tiny_llama
    runner = TextRunner(model, tokenizer, RunnerConfig(prefill_streams=1))
    sequences = _shared_prefix_rows(runner, model, [300, 280, 260, 240])
    gc.collect()
    mx.synchronize()
    base = mx.get_active_memory()
    mx.eval(runner.prefill_batch([(sequence, len(sequence.prompt)) for sequence in sequences]))
    kept = sequences[0]
    own = sum(2 * layer.suffix.keys[..., : layer.suffix.offset, :].nbytes for layer in kept.cache)
    runner.keep(kept, kept.cache, len(kept.prompt))
    del sequences, kept
    gc.collect()
    mx.synchronize()
    held = mx.get_active_memory() - base
    # The batch's suffixes are ~3.6x one row's: a view of them would hold them all.
    assert held <= own * 1.5


@pytest.mark.parametrize(
    "model_name, shared_prefix", [("tiny_llama", True), ("tiny_llama", False), ("sliding_llama", True)]
)
def test_rows_that_all_end_in_one_call_take_their_last_tokens_on_its_batch(request, model_name, shared_prefix, monkeypatch):
    """Prompts of different lengths prefilled to their ends in one call (one
    stream): their last tokens run on the body's batch, whatever the cache
    layers (shared-prefix suffixes, mlx-lm's plain or rotating batch
    caches) -- one merge, not a second of the rows taken out -- and each
    row's logits and cache are a cold run's."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxkv.actors import model_runner

    from device_arithmetic import LOGITS_ATOL

    model, tokenizer = request.getfixturevalue(model_name)
    config = RunnerConfig(prefill_streams=1, keep_caches=False, shared_prefix=shared_prefix)
    runner = TextRunner(model, tokenizer, config)
    rows = _rows(runner, [70, 50, 40, 33])
    merges = []
    honest = model_runner.CacheRunner.merge
    monkeypatch.setattr(model_runner.CacheRunner, "merge", lambda self, caches: merges.append(len(caches)) or honest(self, caches))
    logits = runner.prefill_batch(rows)
    monkeypatch.undo()
    assert merges == [4]
    for (sequence, length), row in zip(rows, logits):
        cold_cache = make_prompt_cache(model)
        cold = model(mx.array(sequence.prompt)[None], cache=cold_cache)[0, -1]
        assert row is not None and mx.allclose(row, cold, atol=LOGITS_ATOL).item()
        assert sequence.num_computed == length and sequence.cache[0].offset == length
