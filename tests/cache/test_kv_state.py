"""KV state cut into owned per-block payloads and rebuilt into mlx-lm caches."""

from __future__ import annotations

import copy
import gc
import threading
from collections.abc import Sequence

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from mlxkv.cache import CacheError, InvalidInput
from mlxkv.cache.kv_state import (
    STEP,
    ArraysLayer,
    BlockPayload,
    KVLayer,
    NotReconstructable,
    QuantizedLayer,
    RotatingLayer,
    as_block_payload,
    capacity_for,
    describe_cache,
    num_reconstructable_blocks,
    reconstruct,
    slice_blocks,
    state_seq_axis,
)
from mlxkv.default_model import ModelSpec, ensure_model

from device_arithmetic import LOGITS_ATOL, ON_CPU, needs_quantized_attention

PROMPT = [(i * 37 + 11) % 256 for i in range(200)]
BLOCK = 32
#: fp32 tolerance for logits computed through a different (but exact) path.
ATOL = LOGITS_ATOL

#: A Llama whose head dim (32) mlx can quantize; the session models have 16.
QUANTIZABLE_LLAMA = ModelSpec(
    name="tiny-llama-hd32",
    model_type="llama",
    config={
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
)


@pytest.fixture(scope="module")
def quantizable_llama(model_dir):
    """(model, tokenizer) of a 2-layer Llama with head dim 32."""
    from mlx_lm import load

    return load(str(ensure_model(QUANTIZABLE_LLAMA, model_dir)))


def prefill(model, tokens, cache=None):
    """Run ``tokens`` through ``model``; return (cache, logits), evaluated."""
    cache = make_prompt_cache(model) if cache is None else cache
    logits = model(mx.array([tokens]), cache=cache)
    mx.eval(logits, [c.state for c in cache])
    return cache, logits


def greedy(model, cache, logits, steps=8):
    """Greedy tokens continued from ``logits`` (the prompt's last position)."""
    out = []
    for _ in range(steps):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    return out


def filled_kv(tokens=40, heads=2, dim=64, cls=KVCache, **kwargs):
    """A cache of class ``cls`` holding ``tokens`` random keys and values."""
    cache = cls(**kwargs)
    k = mx.random.normal((1, heads, tokens, dim), key=mx.random.key(1))
    v = mx.random.normal((1, heads, tokens, dim), key=mx.random.key(2))
    cache.update_and_fetch(k, v)
    mx.eval(cache.keys, cache.values)
    return cache


def seq_arrays(layer):
    """A sequence layer's arrays, trimmed to its offset."""
    if isinstance(layer, QuantizedKVCache):
        arrays = (*layer.keys, *layer.values)
    else:
        arrays = (layer.keys, layer.values)
    return [a[:, :, : layer.offset, :] for a in arrays]


def assert_same_cache(rebuilt, source):
    """Every layer of ``rebuilt`` holds exactly the tokens/state of ``source``."""
    assert len(rebuilt) == len(source)
    for new, old in zip(rebuilt, source):
        assert type(new) is type(old)
        if isinstance(old, ArraysCache):
            for a, b in zip(new.cache, old.cache):
                assert mx.array_equal(a, b).item()
            continue
        assert new.offset == old.offset
        for a, b in zip(seq_arrays(new), seq_arrays(old)):
            assert a.dtype == b.dtype
            assert mx.array_equal(a, b).item()


class TestDescribeCache:
    def test_fixture_models(self, tiny_llama, sliding_llama, hybrid_model):
        """Each fixture model's prefill cache is described layer by layer."""
        expected = {
            id(tiny_llama): (KVLayer(), KVLayer()),
            id(sliding_llama): (KVLayer(), RotatingLayer(max_size=512, keep=0)),
            id(hybrid_model): (ArraysLayer(size=1), KVLayer(), ArraysLayer(size=1)),
        }
        for pair in (tiny_llama, sliding_llama, hybrid_model):
            cache, _ = prefill(pair[0], PROMPT[:50])
            layout = describe_cache(cache)
            assert layout.layers == expected[id(pair)]
            assert layout.num_tokens == 50
        assert layout.has_recurrent

    def test_quantized(self):
        """A quantized cache records its group size and bits."""
        cache = filled_kv().to_quantized(group_size=32, bits=8)
        assert describe_cache([cache]).layers == (QuantizedLayer(group_size=32, bits=8),)

    def test_seed_dicts(self):
        """Seed-style dicts with 4-D or 3-D (keys, values) describe as KV layers."""
        kv = filled_kv(tokens=10)
        four = {"state": (kv.keys[:, :, :10], kv.values[:, :, :10]), "class_name": "KVCache"}
        three = {"state": (kv.keys[0, :, :10], kv.values[0, :, :10])}
        with_offset = {"state": (kv.keys, kv.values, 10), "class_ref": KVCache}
        for layer in (four, three, with_offset):
            assert describe_cache([layer]).num_tokens == 10
        assert state_seq_axis(four["state"]) == 2
        assert state_seq_axis(three["state"]) == 1
        assert state_seq_axis((1, 2)) is None

    def test_wrapped_rotating_refused(self):
        """A RotatingKVCache that has wrapped is not reconstructable."""
        cache = RotatingKVCache(max_size=8)
        for i in range(12):
            cache.update_and_fetch(mx.ones((1, 1, 1, 4)) * i, mx.ones((1, 1, 1, 4)))
        with pytest.raises(NotReconstructable):
            describe_cache([cache])

    def test_unknown_class_refused(self):
        """A cache class this module does not know is not reconstructable."""
        with pytest.raises(NotReconstructable) as info:
            describe_cache([KVCache(), ChunkedKVCache(16)])
        assert info.value.layer == 1
        with pytest.raises(NotReconstructable):
            describe_cache([{"state": (mx.zeros((1, 1, 2, 2)),) * 2, "class_name": "Mystery"}])

    def test_mismatched_lengths_refused(self):
        """Layers holding different numbers of tokens are not reconstructable."""
        with pytest.raises(NotReconstructable):
            describe_cache([filled_kv(tokens=10), filled_kv(tokens=11)])

    def test_batch_refused(self):
        """A batch of more than one sequence is not reconstructable."""
        cache = KVCache()
        cache.update_and_fetch(mx.zeros((2, 1, 4, 8)), mx.zeros((2, 1, 4, 8)))
        with pytest.raises(NotReconstructable):
            describe_cache([cache])

    @pytest.mark.parametrize(
        "bad",
        [
            [],
            "abc",
            {"state": 1},
            [{"meta_state": ()}],
            [{"state": (mx.zeros((2, 2)), mx.zeros((2, 2)))}],
            [{"state": (mx.zeros((1, 1, 2, 2)), mx.zeros((1, 1, 2, 2)), mx.zeros(1))}],
            [{"state": (1, 2), "class_name": "RotatingKVCache"}],
            [ArraysCache(1), {"state": [3], "class_name": "ArraysCache"}],
        ],
    )
    def test_malformed_input(self, bad):
        """Malformed cache data raises InvalidInput, a CacheError."""
        with pytest.raises(InvalidInput):
            describe_cache(bad)
        assert issubclass(InvalidInput, CacheError)


class TestSliceBlocks:
    def test_boundaries(self, tiny_llama):
        """Blocks cover consecutive ranges; the last one may be partial."""
        cache, _ = prefill(tiny_llama[0], PROMPT[:100])
        blocks = slice_blocks(cache, BLOCK)
        assert [(b.start, b.num_tokens) for b in blocks] == [(0, 32), (32, 32), (64, 32), (96, 4)]
        assert all(b.arrays[0][0].shape == (1, 2, b.num_tokens, 16) for b in blocks)
        assert blocks[-1].end == 100
        assert blocks[1].nbytes == 2 * 2 * (2 * 32 * 16 * 4)

    def test_selected_blocks_and_fewer_tokens(self, tiny_llama):
        """Only the requested blocks are cut, up to ``num_tokens``."""
        cache, _ = prefill(tiny_llama[0], PROMPT[:100])
        blocks = slice_blocks(cache, BLOCK, [2, 0], num_tokens=70)
        assert [(b.start, b.num_tokens) for b in blocks] == [(64, 6), (0, 32)]
        expected = cache[0].keys[:, :, 64:70]
        assert mx.array_equal(blocks[0].arrays[0][0], expected).item()

    def test_snapshot_only_at_cache_end(self, hybrid_model):
        """Recurrent layers are snapshotted only in the block ending at the cache's end."""
        cache, _ = prefill(hybrid_model[0], PROMPT[:96])
        blocks = slice_blocks(cache, BLOCK)
        assert [b.has_snapshots for b in blocks] == [False, False, True]
        assert blocks[0].arrays[0] is None and blocks[0].arrays[1] is not None
        assert mx.array_equal(blocks[-1].arrays[0][0], cache[0].cache[0]).item()
        shorter = slice_blocks(cache, BLOCK, num_tokens=64)
        assert not any(b.has_snapshots for b in shorter)

    @pytest.mark.parametrize(
        "kwargs",
        [{"num_tokens": 41}, {"num_tokens": 0}, {"block_indices": [2]}, {"block_indices": [-1]}],
    )
    def test_bad_arguments(self, kwargs):
        """Out-of-range token counts and block indices raise InvalidInput."""
        with pytest.raises(InvalidInput):
            slice_blocks([filled_kv(tokens=40)], 20, **kwargs)
        with pytest.raises(InvalidInput):
            slice_blocks([filled_kv(tokens=40)], 0)

    def test_recurrent_only_needs_num_tokens(self):
        """A cache without sequence layers needs ``num_tokens`` to be sliced."""
        layer = ArraysCache(1)
        layer.cache = [mx.ones((1, 2, 8))]
        with pytest.raises(InvalidInput):
            slice_blocks([layer], 4)
        blocks = slice_blocks([layer], 4, num_tokens=6)
        assert [b.has_snapshots for b in blocks] == [False, True]

    @pytest.mark.parametrize("wait", [True, False])
    def test_blocks_own_their_memory(self, wait, monkeypatch):
        """Dropping the source keeps only the blocks' bytes; dropping blocks
        frees them. Queued blocks (``wait=False``: nothing evaluated, so no
        wait for work queued before) own theirs once computed: scheduling
        let go of the graph that held the source."""
        gc.collect()
        base = mx.get_active_memory()
        source = filled_kv(tokens=2048, heads=8, dim=64)  # 2 x 4 MiB of fp32
        source_bytes = source.nbytes
        evaluations = []
        honest = mx.eval
        monkeypatch.setattr(mx, "eval", lambda *a: (evaluations.append(len(a)), honest(*a)))
        blocks = slice_blocks([source], 64, wait=wait)
        monkeypatch.undo()
        assert len(evaluations) == wait
        mx.synchronize()
        del source
        gc.collect()
        held = mx.get_active_memory() - base
        assert held <= source_bytes * 1.05
        one = blocks[5]
        del blocks
        gc.collect()
        # A view would keep the whole source buffer alive for this one block.
        assert mx.get_active_memory() - base <= one.nbytes + source_bytes * 0.05
        del one
        gc.collect()
        assert mx.get_active_memory() - base <= source_bytes * 0.01


class TestRoundTrip:
    def test_kv(self, tiny_llama):
        """KVCache layers come back element-wise equal."""
        cache, _ = prefill(tiny_llama[0], PROMPT[:100])
        assert_same_cache(reconstruct(slice_blocks(cache, BLOCK)), cache)

    def test_kv_dicts(self, tiny_llama):
        """Seed dicts with 4-D and with 3-D (H, T, D) arrays rebuild as 4-D KVCaches."""
        cache, _ = prefill(tiny_llama[0], PROMPT[:100])
        four = [{"state": (c.keys[:, :, :100], c.values[:, :, :100])} for c in cache]
        three = [{"state": (c.keys[0, :, :100], c.values[0, :, :100])} for c in cache]
        for data in (four, three):
            assert_same_cache(reconstruct(slice_blocks(data, BLOCK)), cache)

    def test_rotating(self, sliding_llama):
        """A RotatingKVCache that has not wrapped comes back equal, with max_size and keep."""
        cache, _ = prefill(sliding_llama[0], PROMPT[:100])
        rebuilt = reconstruct(slice_blocks(cache, BLOCK))
        assert_same_cache(rebuilt, cache)
        assert (rebuilt[1].max_size, rebuilt[1].keep, rebuilt[1]._idx) == (512, 0, 100)

    def test_rotating_with_keep(self):
        """A rotating layer's ``keep`` survives the round trip."""
        cache = filled_kv(tokens=20, cls=RotatingKVCache, max_size=64, keep=4)
        rebuilt = reconstruct(slice_blocks([cache], 8))
        assert_same_cache(rebuilt, [cache])
        assert (rebuilt[0].max_size, rebuilt[0].keep) == (64, 4)

    def test_quantized(self):
        """A QuantizedKVCache made by ``KVCache.to_quantized`` comes back equal."""
        cache = [filled_kv(tokens=70).to_quantized(group_size=32, bits=8)]
        rebuilt = reconstruct(slice_blocks(cache, BLOCK))
        assert_same_cache(rebuilt, cache)
        assert (rebuilt[0].group_size, rebuilt[0].bits) == (32, 8)

    def test_hybrid(self, hybrid_model):
        """A hybrid cache (ArraysCache + KVCache) comes back equal."""
        cache, _ = prefill(hybrid_model[0], PROMPT[:96])
        assert_same_cache(reconstruct(slice_blocks(cache, BLOCK)), cache)

    def test_across_threads(self, tiny_llama):
        """Payloads cut on one thread rebuild on another: only evaluated arrays leave."""
        cache, _ = prefill(tiny_llama[0], PROMPT[:70])
        result = {}

        def worker():
            result["blocks"] = slice_blocks(cache, BLOCK)

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert_same_cache(reconstruct(result["blocks"]), cache)

    def test_deepcopy_owns_new_arrays(self, hybrid_model):
        """A deep copy of a payload has equal, distinct, evaluated arrays."""
        cache, _ = prefill(hybrid_model[0], PROMPT[:32])
        (payload,) = slice_blocks(cache, BLOCK)
        clone = copy.deepcopy(payload)
        assert clone is not payload and clone.layers == payload.layers
        for a, b in zip(clone.arrays, payload.arrays):
            assert a[0] is not b[0]
            assert mx.array_equal(a[0], b[0]).item()


class TestReconstruct:
    def test_capacity(self):
        """Capacity leaves room for the suffix (at least one token), in STEP chunks."""
        assert capacity_for(100) == STEP
        assert capacity_for(256) == 2 * STEP
        assert capacity_for(200, 56) == STEP
        assert capacity_for(200, 57) == 2 * STEP

    def test_first_append_in_place(self, tiny_llama):
        """The first update_and_fetch of the suffix neither grows nor copies the buffers."""
        cache, _ = prefill(tiny_llama[0], PROMPT[:100])
        rebuilt = reconstruct(slice_blocks(cache, BLOCK), extra_tokens=180)
        assert rebuilt[0].keys.shape[2] == capacity_for(100, 180) == 2 * STEP
        before = [c.keys.shape for c in rebuilt]
        suffix = mx.ones((1, 2, 180, 16))
        for c in rebuilt:
            c.update_and_fetch(suffix, suffix)
        assert [c.keys.shape for c in rebuilt] == before
        assert all(c.offset == 280 for c in rebuilt)
        assert mx.array_equal(rebuilt[0].keys[:, :, :100], cache[0].keys[:, :, :100]).item()

    def test_quantized_first_append_in_place(self):
        """A rebuilt QuantizedKVCache also has room for its suffix."""
        rebuilt = reconstruct(
            slice_blocks([filled_kv(tokens=70).to_quantized(32, 8)], BLOCK), extra_tokens=10
        )
        before = rebuilt[0].keys[0].shape
        rebuilt[0].update_and_fetch(mx.ones((1, 2, 10, 64)), mx.ones((1, 2, 10, 64)))
        assert rebuilt[0].keys[0].shape == before and rebuilt[0].offset == 80

    def test_rotating_room(self):
        """A rotating buffer gets room only for a one-token append, never past max_size."""
        cache = filled_kv(tokens=40, cls=RotatingKVCache, max_size=300)
        blocks = slice_blocks([cache], 8)
        assert reconstruct(blocks, extra_tokens=1)[0].keys.shape[2] == STEP
        # More than one token is always concatenated by mlx-lm: no padding.
        assert reconstruct(blocks, extra_tokens=30)[0].keys.shape[2] == 40
        full = slice_blocks([filled_kv(tokens=300, cls=RotatingKVCache, max_size=300)], 100)
        assert reconstruct(full)[0].keys.shape[2] == 300

    def test_prefix_copied_once(self):
        """Rebuilding plus the first append allocate one buffer per array, no regrowth."""
        blocks = slice_blocks([filled_kv(tokens=1000, heads=4, dim=64)], 64)
        suffix = mx.ones((1, 4, 24, 64))
        mx.eval(suffix)
        gc.collect()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        (rebuilt,) = reconstruct(blocks, extra_tokens=24)
        mx.eval(rebuilt.update_and_fetch(suffix, suffix))
        buffers = rebuilt.keys.nbytes + rebuilt.values.nbytes
        assert rebuilt.keys.shape[2] == 1024
        # A regrowth would have held the old and the new buffers at once. (On
        # a GPU a buffer is freed when the kernels reading it finish, so the
        # peak counts inputs still queued: only the CPU's peak says this.)
        if ON_CPU:
            assert mx.get_peak_memory() - base <= buffers * 1.1

    def test_refusals(self, hybrid_model):
        """Empty, gapped or snapshot-less runs of payloads raise NotReconstructable."""
        cache, _ = prefill(hybrid_model[0], PROMPT[:96])
        blocks = slice_blocks(cache, BLOCK)
        with pytest.raises(NotReconstructable):
            reconstruct([])
        with pytest.raises(NotReconstructable):
            reconstruct([blocks[0], blocks[2]])
        with pytest.raises(NotReconstructable):
            reconstruct(blocks[:2])  # no recurrent snapshot at token 64
        with pytest.raises(InvalidInput):
            reconstruct(blocks, extra_tokens=-1)


class TestNumReconstructableBlocks:
    def test_counts(self, tiny_llama, hybrid_model):
        """Sequence-only runs count to the first gap; hybrid runs to the last snapshot."""
        cache, _ = prefill(tiny_llama[0], PROMPT[:100])
        kv = slice_blocks(cache, BLOCK)
        assert num_reconstructable_blocks(kv) == 4
        assert num_reconstructable_blocks([kv[0], kv[1], None, kv[3]]) == 2
        assert num_reconstructable_blocks([kv[1]]) == 0
        assert num_reconstructable_blocks([]) == 0
        assert num_reconstructable_blocks([[("keys", "values")], kv[1]]) == 0
        hybrid, _ = prefill(hybrid_model[0], PROMPT[:64])
        hb = slice_blocks(hybrid, BLOCK)
        assert num_reconstructable_blocks(hb) == 2
        assert num_reconstructable_blocks(hb[:1]) == 0
        assert num_reconstructable_blocks([*hb, kv[2]]) == 2
        half = [
            {"state": (c.keys[:, :, :100].astype(mx.float16), c.values[:, :, :100])}
            for c in cache
        ]
        half = slice_blocks(half, BLOCK)
        assert num_reconstructable_blocks([kv[0], half[1]]) == 1  # dtypes differ
        assert isinstance(hb[0], BlockPayload)


class TestBlockPayloadSequence:
    def test_layers_by_index(self, hybrid_model):
        """len is the number of layers and item i is layer i's arrays, None where it has none."""
        cache, _ = prefill(hybrid_model[0], PROMPT[:64])
        first, last = slice_blocks(cache, BLOCK)
        assert len(first) == len(cache) == len(first.layers)
        for i, spec in enumerate(first.layers):
            assert first[i] is first.arrays[i]
            assert (first[i] is None) == (not spec.sequential)
            assert last[i] is not None
        assert list(first) == list(first.arrays) and first[-1] is first.arrays[-1]
        assert isinstance(first, Sequence)

    def test_truth_and_equality(self, tiny_llama):
        """A payload is true even with no layers, and equal only to itself."""
        cache, _ = prefill(tiny_llama[0], PROMPT[:32])
        (payload,) = slice_blocks(cache, BLOCK)
        empty = BlockPayload(layers=(), start=0, num_tokens=1, arrays=())
        assert len(empty) == 0 and bool(empty) and bool(payload)
        assert payload == payload and payload != copy.deepcopy(payload)
        assert len({payload, copy.deepcopy(payload)}) == 2


class TestAsBlockPayload:
    def test_own_payload_is_returned_as_is(self, tiny_llama):
        """A BlockPayload needs no reading."""
        cache, _ = prefill(tiny_llama[0], PROMPT[:32])
        (payload,) = slice_blocks(cache, BLOCK)
        assert as_block_payload(payload, start=0, num_tokens=BLOCK) is payload

    @pytest.mark.parametrize("three_d", [False, True])
    def test_seed_pairs_read_as_kv(self, tiny_llama, three_d):
        """Per-layer (keys, values) pairs of exactly the block's tokens read as KV state."""
        cache, _ = prefill(tiny_llama[0], PROMPT[:64])
        pairs = [(c.keys[:, :, 32:64], c.values[:, :, 32:64]) for c in cache]
        if three_d:
            pairs = [(k[0], v[0]) for k, v in pairs]
        payload = as_block_payload(pairs, start=32, num_tokens=32)
        assert (payload.start, payload.num_tokens, payload.layers) == (32, 32, (KVLayer(),) * 2)
        assert payload.signature == slice_blocks(cache, BLOCK)[1].signature
        rebuilt = reconstruct([slice_blocks(cache, BLOCK)[0], payload])
        assert_same_cache(rebuilt, cache)

    @pytest.mark.parametrize(
        "make",
        [
            lambda c: None,
            lambda c: "kv",
            lambda c: {"state": (c[0].keys, c[0].values)},
            lambda c: [],
            lambda c: [None for _ in c],
            lambda c: [(x.keys[:, :, :16], x.values[:, :, :16]) for x in c],
            lambda c: [(x.keys[:, :, :32], x.values[:, :, :32], 7) for x in c],
            lambda c: [(x.keys[:, :, :32], x.values) for x in c],
            lambda c: [filled_kv(tokens=32)],
            lambda c: [{"state": (x.keys[:, :, :32], x.values[:, :, :32]),
                        "class_name": "RotatingKVCache"} for x in c],
        ],
        ids=["none", "str", "dict", "empty", "none-layers", "short", "triple", "long-values",
             "cache-object", "rotating-dict"],
    )
    def test_anything_else_is_none(self, tiny_llama, make):
        """Data that is not exactly the KV state of the block's tokens reads as None."""
        cache, _ = prefill(tiny_llama[0], PROMPT[:64])
        assert as_block_payload(make(cache), start=0, num_tokens=32) is None


class TestParity:
    @pytest.mark.parametrize("fixture", ["tiny_llama", "sliding_llama", "hybrid_model"])
    def test_continuation_matches_cold(self, fixture, request):
        """Generation from a rebuilt 128-token prefix equals a cold prefill of the prompt."""
        model = request.getfixturevalue(fixture)[0]
        cold_cache, cold_logits = prefill(model, PROMPT)
        cold_tokens = greedy(model, cold_cache, cold_logits)

        prefix, _ = prefill(model, PROMPT[:128])
        rebuilt = reconstruct(slice_blocks(prefix, BLOCK), extra_tokens=len(PROMPT) - 128)
        del prefix
        warm_cache, warm_logits = prefill(model, PROMPT[128:], cache=rebuilt)
        assert mx.allclose(warm_logits[0, -1], cold_logits[0, -1], atol=ATOL).item()
        assert greedy(model, warm_cache, warm_logits) == cold_tokens

    @needs_quantized_attention
    def test_quantized_continuation(self, quantizable_llama):
        """A rebuilt quantized prefix continues exactly like the quantized original."""
        model = quantizable_llama[0]
        original, _ = prefill(model, PROMPT[:128])
        quantized = [c.to_quantized(group_size=32, bits=8) for c in original]
        rebuilt = reconstruct(slice_blocks(quantized, BLOCK), extra_tokens=72)
        _, expected = prefill(model, PROMPT[128:], cache=quantized)
        _, got = prefill(model, PROMPT[128:], cache=rebuilt)
        assert mx.allclose(got[0, -1], expected[0, -1], atol=ATOL).item()
