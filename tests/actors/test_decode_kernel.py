"""The shared-prefix decode kernel (actors/decode_kernel.py) without a GPU:
its source compiled by ``nvcc`` as NVRTC would take it (where ``nvcc`` is
installed), and the same source run on the CPU under an emulation of CUDA's
blocks, warps and shuffles (``tests/cuda_source.py``; where ``g++`` is),
against plain attention over each row's keys. On MLX's CUDA backend the
kernel itself runs in ``TestOnTheDevice``. The rest -- which way serves, the
rows' layout -- runs everywhere."""

from __future__ import annotations

import contextlib
import shutil
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxkv.actors import decode_kernel
from mlxkv.actors.decode_kernel import (
    MAX_GROUPS,
    input_names,
    kernel_source,
    launch,
    prefix_inputs,
    reference_attention,
    row_info,
    supported,
)
from mlxkv.actors.prefix_attention import cascade_attention

import cuda_source
from device_arithmetic import tolerance

ON_CUDA = decode_kernel.on_cuda()
#: The kernel's emulation (exact float32 sums in its own order) against the
#: cascade in MLX, whose float32 products are TF32-like on a GPU.
KERNEL_ATOL = tolerance(2e-5, gpu=2e-3)


def _problem(heads: int, kv_heads: int, dim: int, *, seed: int = 0):
    """Three rows over two prefixes (row 1 over none), left padding, a suffix
    buffer with room past the suffix: numpy float32 arrays and the layout.
    Row 2's keys take each warp of a block several rounds of 32."""
    rng = np.random.default_rng(seed)
    batch, capacity, length = 3, 48, 30
    q = rng.standard_normal((batch, heads, 1, dim), dtype=np.float32)
    sk = rng.standard_normal((batch, kv_heads, capacity, dim), dtype=np.float32)
    sv = rng.standard_normal((batch, kv_heads, capacity, dim), dtype=np.float32)
    prefixes = [
        (rng.standard_normal((1, kv_heads, n, dim), dtype=np.float32),
         rng.standard_normal((1, kv_heads, n, dim), dtype=np.float32))
        for n in (40, 300)
    ]  # fmt: skip
    # Row 2 sees more keys than a block's warps take in one round of 32 each.
    segments = [([0], *prefixes[0], [33]), ([2], *prefixes[1], [300])]
    return q, sk, sv, segments, [0, 5, 17], length


def _mx_segments(segments):
    return [(rows, mx.array(k), mx.array(v), lengths) for rows, k, v, lengths in segments]


def _cascade(q, sk, sv, segments, padding, length, scale):
    """The portable path: the cascade over the suffix positions, the padding masked."""
    batch = q.shape[0]
    keys, values = mx.array(sk[:, :, :length]), mx.array(sv[:, :, :length])
    mask = mx.array(np.arange(length)[None, :] >= np.array(padding)[:, None]).reshape(batch, 1, 1, length)
    return cascade_attention(mx.array(q), keys, values, mask, scale, _mx_segments(segments))


class TestLayout:
    def test_rows_name_their_prefix_and_what_they_see(self):
        segments = [([0, 3], None, None, [64, 40]), ([2], None, None, [128])]
        assert row_info(4, segments, [0, 2, 0, 1], 9) == [[0, 64, 0, 9], [0, 0, 2, 9], [1, 128, 0, 9], [0, 40, 1, 9]]

    def test_padding_must_cover_the_batch(self):
        with pytest.raises(ValueError, match="rows"):
            row_info(3, [], [0, 0], 4)

    @pytest.mark.parametrize(
        ("heads", "kv_heads", "dim", "expected"),
        [(32, 8, 64, (1024, 8)), (32, 8, 128, (1024, 8)), (8, 8, 64, (256, 8)), (64, 4, 128, (1024, 2)),
         (128, 4, 128, (1024, 1)), (4, 2, 16, (512, 8)), (8, 2, 80, (1024, 8)), (256, 4, 128, None), (8, 3, 64, None),
         (8, 2, 12, None), (8, 2, 256, None)],
    )  # fmt: skip
    def test_launch_takes_a_warp_a_query_head_and_slice(self, heads, kv_heads, dim, expected):
        assert launch(heads, kv_heads, dim) == expected

    def test_the_source_picks_each_prefix_input(self):
        assert "pk2_shape" in kernel_source(3) and "pk3" not in kernel_source(3)
        assert input_names(2) == ["q", "scale", "info", "sk", "sv", "pk0", "pv0", "pk1", "pv1"]
        with pytest.raises(ValueError):
            kernel_source(MAX_GROUPS + 1)

    def test_a_models_build_is_read_off_its_attention(self, tiny_llama):
        """What a runner checks as it is made: the tiny Llama's float32 heads
        of 16, 4 query and 2 KV heads; a model without attention: none."""
        import mlx.nn as nn

        model, _ = tiny_llama
        assert decode_kernel.model_build(model) == (mx.float32, 16, 4, 2)
        assert decode_kernel.model_build(nn.Sequential(nn.Linear(2, 2))) is None

    def test_the_devices_way(self, monkeypatch):
        """The cascade on the CPU; on a GPU the kernel where MLX has CUDA, else (Metal) mixed."""
        from mlxkv.actors.prefix_attention import PrefixAttention

        gpu = mx.Device(mx.DeviceType.gpu)
        assert PrefixAttention.for_device(mx.Device(mx.DeviceType.cpu)) is PrefixAttention.CASCADE
        monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
        assert PrefixAttention.for_device(gpu) is PrefixAttention.KERNEL
        monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
        assert PrefixAttention.for_device(gpu) is PrefixAttention.MIXED

    @pytest.mark.skipif(ON_CUDA, reason="off MLX's CUDA backend only")
    def test_off_cuda_the_kernel_is_not_used(self):
        q = mx.zeros((2, 8, 1, 64))
        assert not supported(q, [([0], mx.zeros((1, 2, 4, 64)), mx.zeros((1, 2, 4, 64)), [4])])
        assert not decode_kernel.usable()

    def test_the_reference_is_the_cascade(self):
        q, sk, sv, segments, padding, length = _problem(8, 2, 64)
        want = _cascade(q, sk, sv, segments, padding, length, 0.125)
        got = reference_attention(mx.array(q), mx.array(sk), mx.array(sv), length, padding, 0.125, _mx_segments(segments))
        np.testing.assert_allclose(np.array(got), np.array(want), atol=KERNEL_ATOL, rtol=0)


def _emulated(q, sk, sv, segments, padding, length, scale, folder):
    """The kernel's output, run as :func:`~mlxkv.actors.decode_kernel.decode_attention`
    runs it (its one build over :data:`MAX_GROUPS` prefix inputs), under the emulation."""
    batch, heads, _, dim = q.shape
    kv_heads = sk.shape[1]
    threads, split = launch(heads, kv_heads, dim)
    info = np.array(row_info(batch, segments, padding, length), dtype=np.int32)
    arrays = [q, np.array([scale], dtype=np.float32), info, sk, sv, *prefix_inputs(segments)]
    (out,) = cuda_source.emulate(
        kernel_source(MAX_GROUPS),
        list(zip(input_names(MAX_GROUPS), arrays)),
        [("out", q.shape)],
        [("T", "float32"), ("D", dim), ("REP", heads // kv_heads), ("SPLIT", split)],
        grid=(threads, kv_heads, batch),
        threadgroup=(threads, 1, 1),
        folder=folder,
    )
    return out


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the emulation")
class TestEmulated:
    """The kernel's source, run on the CPU a CUDA thread a host thread."""

    @pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 64), (4, 4, 128), (6, 2, 32), (4, 2, 16), (4, 2, 40)])
    def test_equals_attention_over_each_rows_keys(self, tmp_path, heads, kv_heads, dim):
        q, sk, sv, segments, padding, length = _problem(heads, kv_heads, dim, seed=dim)
        scale = dim**-0.5
        out = _emulated(q, sk, sv, segments, padding, length, scale, tmp_path)
        want = np.array(_cascade(q, sk, sv, segments, padding, length, scale))
        np.testing.assert_allclose(out, want, atol=KERNEL_ATOL, rtol=0)
        # What it is checked against moves: a row's padding read as none is far off.
        moved = np.array(_cascade(q, sk, sv, segments, [0, 0, 17], length, scale))
        assert np.abs(moved - want).max() > 1e-2

    def test_edges_of_a_round_and_a_lone_key(self, tmp_path):
        """Row 0's keys fill a block's rounds exactly (8 warps of 32, twice);
        row 1 sees no prefix and one key of its suffix (all padding but the
        last); heads of 16 (half the lanes hold no output)."""
        heads, kv_heads, dim = 4, 2, 16
        rng = np.random.default_rng(7)
        q = rng.standard_normal((2, heads, 1, dim), dtype=np.float32)
        sk = rng.standard_normal((2, kv_heads, 32, dim), dtype=np.float32)
        sv = rng.standard_normal((2, kv_heads, 32, dim), dtype=np.float32)
        pk = rng.standard_normal((1, kv_heads, 500, dim), dtype=np.float32)
        pv = rng.standard_normal((1, kv_heads, 500, dim), dtype=np.float32)
        assert launch(heads, kv_heads, dim) == (512, 8)
        length, padding = 30, [0, 29]
        segments = [([0], pk, pv, [2 * 32 * 8 - length])]  # 482 + 30 = 512 keys
        out = _emulated(q, sk, sv, segments, padding, length, 0.25, tmp_path)
        want = np.array(_cascade(q, sk, sv, segments, padding, length, 0.25))
        np.testing.assert_allclose(out, want, atol=KERNEL_ATOL, rtol=0)
        # One key: its value, for every query head of its KV head.
        np.testing.assert_allclose(out[1, :, 0], np.repeat(sv[1, :, 29], heads // kv_heads, axis=0), atol=1e-6)

    def test_rows_read_their_own_prefix_among_many(self, tmp_path):
        """Eight prefixes (the most one build takes), the rows over the last
        three inputs (one over its prefix's first positions only)."""
        heads, kv_heads, dim = 4, 2, 32
        rng = np.random.default_rng(11)
        prefixes = [rng.standard_normal((2, 1, kv_heads, 40 + 9 * g, dim), dtype=np.float32) for g in range(MAX_GROUPS)]
        rows = [0, 7, 6]
        segments = [([], *prefixes[g], []) for g in range(MAX_GROUPS) if g not in rows]
        segments += [([i], *prefixes[g], [40 + 9 * g if i else 5]) for i, g in enumerate(rows)]
        q = rng.standard_normal((3, heads, 1, dim), dtype=np.float32)
        sk = rng.standard_normal((3, kv_heads, 16, dim), dtype=np.float32)
        sv = rng.standard_normal((3, kv_heads, 16, dim), dtype=np.float32)
        out = _emulated(q, sk, sv, segments, [3, 0, 8], 12, 0.2, tmp_path)
        want = np.array(_cascade(q, sk, sv, [seg for seg in segments if seg[0]], [3, 0, 8], 12, 0.2))
        np.testing.assert_allclose(out, want, atol=KERNEL_ATOL, rtol=0)


@pytest.mark.skipif(cuda_source.nvcc() is None, reason="needs nvcc")
class TestCompiles:
    """The source as MLX's CUDA backend compiles it (its generated signature;
    the one build over :data:`MAX_GROUPS` prefix inputs, and a one-prefix
    source), for each dtype and several heads; and each block's threads fit
    an SM's registers."""

    @pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
    @pytest.mark.parametrize(
        ("groups", "heads", "kv_heads", "dim"),
        [(MAX_GROUPS, 32, 8, 64), (MAX_GROUPS, 32, 8, 128), (MAX_GROUPS, 32, 1, 128), (MAX_GROUPS, 4, 2, 16),
         (1, 8, 2, 96)],
    )  # fmt: skip
    def test_nvcc_compiles_it(self, tmp_path, dtype, groups, heads, kv_heads, dim):
        threads, split = launch(heads, kv_heads, dim)
        names = input_names(groups)
        kinds = {"scale": ("float32", 1), "info": ("int32", 2)}
        inputs = [(name, *kinds.get(name, (dtype, 4))) for name in names]
        source = cuda_source.wrapped(
            "mlxkv_decode", kernel_source(groups), inputs, [("out", dtype)],
            [("T", dtype), ("D", dim), ("REP", heads // kv_heads), ("SPLIT", split)],
        )  # fmt: skip
        built = cuda_source.compile_cuda(source, tmp_path)
        assert built.returncode == 0, built.stderr[-4000:]
        ptx = (tmp_path / "kernel.ptx").read_text()
        assert ".entry" in ptx
        registers = cuda_source.registers(tmp_path / "kernel.ptx")
        assert registers is None or registers * threads <= 65536, (registers, threads)


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend")
class TestOnTheDevice:
    @pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
    @pytest.mark.parametrize(
        ("head_dim", "heads", "kv_heads", "groups"), [(64, 8, 2, 1), (64, 32, 8, 3), (128, 4, 4, 2), (16, 4, 2, 2)]
    )
    def test_the_kernel_agrees_with_plain_operations(self, dtype, head_dim, heads, kv_heads, groups):
        assert decode_kernel.self_check(dtype, head_dim, heads, kv_heads, groups) is None

    def test_it_serves_once_checked(self):
        assert decode_kernel.usable()


def test_registers_parsed():
    assert cuda_source.parse_registers("ptxas info    : Used 96 registers, 24 bytes smem") == 96
    assert cuda_source.parse_registers("nothing") is None


def _from_info(queries, suffix_keys, suffix_values, scale, prefixes, info):
    """What the kernel computes, read off the inputs it is given
    (``prefixes``: each prefix input's keys and values; ``info`` a row:
    prefix input, positions seen, padding, suffix length): a stand-in for
    the kernel where MLX has no CUDA backend."""
    rows = np.array(info).tolist()
    batch, heads, _, dim = queries.shape
    repeats = heads // suffix_keys.shape[1]
    outs = []
    for row, (group, seen, pad, stop) in enumerate(rows):
        k, v = suffix_keys[row, :, pad:stop], suffix_values[row, :, pad:stop]
        if seen:
            pk, pv = prefixes[group]
            k = mx.concatenate([pk[0, :, :seen], k], axis=1)
            v = mx.concatenate([pv[0, :, :seen], v], axis=1)
        k = mx.repeat(k.astype(mx.float32), repeats, axis=0)
        v = mx.repeat(v.astype(mx.float32), repeats, axis=0)
        q = queries[row, :, 0].astype(mx.float32)[:, None] * scale
        outs.append((mx.softmax(q @ k.swapaxes(-1, -2), axis=-1) @ v).astype(queries.dtype)[None])
    return mx.concatenate(outs).reshape(batch, heads, 1, dim)


def _kernel_stand_in(calls: list[dict[str, Any]]):
    """A stand-in for the compiled kernel (``mx.fast.cuda_kernel``'s callable)
    where MLX has no CUDA backend: records each call's inputs and launch
    and computes what the kernel would from exactly those inputs."""

    def kernel(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        queries, scale, info, suffix_keys, suffix_values, *prefix = inputs
        assert len(inputs) == len(input_names(MAX_GROUPS))
        calls.append({"inputs": inputs, "template": template, "grid": grid, "threadgroup": threadgroup})
        pairs = list(zip(prefix[::2], prefix[1::2]))
        out = _from_info(queries, suffix_keys, suffix_values, scale.item(), pairs, info)
        assert out.shape == tuple(output_shapes[0]) and out.dtype == output_dtypes[0]
        return [out]

    return kernel


def _segment_pairs(segments):
    return [(keys, values) for _, keys, values, _ in segments]


#: Three rows' contexts: row 0 over 48 of prefix 0's tokens, row 1 over no
#: prefix, row 2 over all 32 of prefix 1's; then each row's own tokens.
_PROMPTS = [list(range(3, 67)), list(range(100, 132))]
_SEEN = [(0, 48), (None, 0), (1, 32)]
_OWN = [[70, 71, 72, 73, 74], [80, 81], [90, 91, 92]]


def _rows_over_two_prefixes(model):
    """The prefix groups of :data:`_PROMPTS` and each row's own caches (a
    layer each) after its own tokens: rows to merge into a decode batch."""
    from mlxkv.cache.shared_prefix import PrefixGroup, SharedPrefixCache, suffix_cache

    from model_blocks import block_payloads

    groups = [PrefixGroup.build(block_payloads(model, prompt, 16)) for prompt in _PROMPTS]
    layers = len(groups[0].keys)
    rows = []
    for (group, n), tokens in zip(_SEEN, _OWN):
        caches = [
            SharedPrefixCache(None if group is None else groups[group], i, n, s)
            for i, s in enumerate(suffix_cache((), 8, layers))
        ]
        model(mx.array([tokens]), cache=caches)
        rows.append(caches)
    return groups, rows


def _assert_plain_logits(model, step, fed):
    """``step``'s row ``r`` gives the logits of a plain cache of row ``r``'s
    context and own tokens fed ``fed[r]``."""
    from mlx_lm.models.cache import make_prompt_cache

    from device_arithmetic import LOGITS_ATOL

    for r, ((group, n), tokens) in enumerate(zip(_SEEN, _OWN)):
        plain = make_prompt_cache(model)
        model(mx.array([([] if group is None else _PROMPTS[group][:n]) + tokens]), cache=plain)
        want = model(mx.array([[fed[r]]]), cache=plain)[:, -1]
        assert mx.allclose(step[r : r + 1], want, atol=LOGITS_ATOL, rtol=0).item(), r


@contextlib.contextmanager
def _kernel_way_batch(model):
    """``model``'s attention routed the ``kernel`` way on this thread (the way
    before restored after), and the decode batch of the rows of
    :func:`_rows_over_two_prefixes`: yields ``(groups, rows, batch)``, the
    batch a cache a layer."""
    from mlxkv.actors import attention_hook
    from mlxkv.actors.attention_hook import install
    from mlxkv.actors.prefix_attention import PrefixAttention
    from mlxkv.cache.shared_prefix import SharedPrefixCache

    before = attention_hook.way_in_use()
    assert install(model)
    attention_hook.use(PrefixAttention.KERNEL)
    try:
        groups, rows = _rows_over_two_prefixes(model)
        yield groups, rows, [SharedPrefixCache.merge([row[i] for row in rows]) for i in range(len(groups[0].keys))]
    finally:
        attention_hook.use(before)


class TestThroughTheHook:
    def test_a_batch_caches_step_reaches_the_kernel_with_its_rows(self, tiny_llama, monkeypatch):
        """A decode step of a batch over two prefixes (a row over none), its
        suffixes left-padded, served by the ``kernel`` way: the kernel is
        called once a layer with the batch's whole suffix buffers, padding
        and rows' layout, and -- the kernel replaced by plain operations on
        those inputs, as no CUDA backend runs here (a stand-in, said so) --
        the step gives the logits of plain per-row caches."""
        from mlxkv.cache.shared_prefix import BatchSharedPrefixCache, SharedPrefixCache

        from device_arithmetic import LOGITS_ATOL

        calls: list[dict[str, Any]] = []
        # Taken for a CUDA device whose kernel is the stand-in: the kernel
        # way's whole host path runs, the build's own check included.
        monkeypatch.setattr(decode_kernel, "on_cuda", lambda device=None: True)
        monkeypatch.setattr(decode_kernel, "_kernel", lambda: _kernel_stand_in(calls))
        monkeypatch.setattr(decode_kernel, "_CHECKED", {})
        model, _ = tiny_llama
        with _kernel_way_batch(model) as (groups, rows, batch):
            layers = len(batch)
            assert batch[0].padding == [0, 3, 2]
            step = model(mx.array([[5], [6], [7]]), cache=batch)[:, -1]
            first = list(calls)
            # The same rows, then in the other order: two steps of the same length
            # and batch, and no mask object to tell them apart (the kernel reads
            # the padding off the rows; a cache may give no mask): the second's
            # layout is made anew, not taken from the step before.
            monkeypatch.setattr(BatchSharedPrefixCache, "make_mask", lambda self, N, **_: None)
            again = [SharedPrefixCache.merge([row[i] for row in rows]) for i in range(layers)]
            unmasked = model(mx.array([[5], [6], [7]]), cache=again)[:, -1]
            swapped = [SharedPrefixCache.merge([row[i] for row in reversed(rows)]) for i in range(layers)]
            calls.clear()
            second = model(mx.array([[7], [6], [5]]), cache=swapped)[:, -1]
        assert mx.allclose(unmasked, step, atol=LOGITS_ATOL, rtol=0).item()
        assert len(calls) == layers and all(call["inputs"][2] is calls[0]["inputs"][2] for call in calls)
        assert np.array(calls[0]["inputs"][2]).tolist() == [[0, 32, 2, 6], [0, 0, 3, 6], [1, 48, 0, 6]]
        assert mx.allclose(second, step[::-1], atol=LOGITS_ATOL, rtol=0).item()
        calls = first
        # The build's check ran first (the step's first layer met the build), then a call a layer.
        checks = len(calls) - layers
        assert checks > 0 and all(call["inputs"][0].shape[0] != 3 for call in calls[:checks])
        steps = calls[checks:]
        for layer, call in enumerate(steps):
            queries, _, info, suffix_keys, suffix_values, *prefix = call["inputs"]
            assert suffix_keys is batch[layer].suffix.keys and suffix_values is batch[layer].suffix.values
            assert prefix[0] is groups[0].keys[layer] and prefix[3] is groups[1].values[layer]
            assert info is steps[0]["inputs"][2]  # made once a step
            assert call["grid"] == (call["threadgroup"][0], 2, 3)
        info = np.array(steps[0]["inputs"][2]).tolist()
        assert steps[0]["inputs"][3].shape[2] >= 6
        assert info == [[0, 48, 0, 6], [0, 0, 3, 6], [1, 32, 2, 6]]
        _assert_plain_logits(model, step, [5, 6, 7])

    def test_a_step_the_kernel_does_not_serve_goes_as_mixed_its_mask_made_once(self, tiny_llama, monkeypatch):
        """Taken for a CUDA device whose kernel build failed its check: the
        kernel way's step is ``mixed``'s -- the plain caches' logits, its
        mask built once for all the step's layers (the kernel's own per-step
        lookup, which each layer still makes, does not displace it)."""
        from mlxkv.actors import prefix_attention

        monkeypatch.setattr(decode_kernel, "on_cuda", lambda device=None: True)
        monkeypatch.setattr(decode_kernel, "_CHECKED", {})
        monkeypatch.setattr(decode_kernel, "self_check", lambda *build: "max difference 1.0")
        masks: list[Any] = []
        as_bias = prefix_attention.as_bias
        monkeypatch.setattr(prefix_attention, "as_bias", lambda *args: masks.append(args) or as_bias(*args))
        model, _ = tiny_llama
        with _kernel_way_batch(model) as (_, _, batch):
            layers = len(batch)
            masks.clear()  # (the rows' own prefill made theirs)
            step = model(mx.array([[5], [6], [7]]), cache=batch)[:, -1]
        assert layers > 1 and len(masks) == 1
        _assert_plain_logits(model, step, [5, 6, 7])


class TestSelfCheck:
    """The check a kernel build passes before it serves, with the kernel
    replaced by plain operations (a stand-in: no CUDA backend here)."""

    @pytest.mark.parametrize(("head_dim", "heads", "kv_heads", "groups"), [(64, 8, 2, 1), (128, 32, 8, 3)])
    def test_a_right_kernel_passes_and_a_wrong_one_does_not(self, monkeypatch, head_dim, heads, kv_heads, groups):
        seen: list[Any] = []

        def right(queries, suffix_keys, suffix_values, length, padding, scale, segments, step=None):
            info = row_info(queries.shape[0], segments, padding, length)
            seen.append(info)
            return _from_info(queries, suffix_keys, suffix_values, scale, _segment_pairs(segments), info)

        monkeypatch.setattr(decode_kernel, "decode_attention", right)
        assert decode_kernel.self_check(mx.float32, head_dim, heads, kv_heads, groups) is None
        rows = seen[0]
        # A row over each prefix (the first over part of it, past a block's first round of keys), one over none.
        assert len(rows) == groups + 1 and rows[-1][1] == 0 and [row[0] for row in rows[:-1]] == list(range(groups))
        assert rows[0][1] > 32 * 8 and any(row[2] for row in rows)

        def padding_ignored(queries, suffix_keys, suffix_values, length, padding, scale, segments, step=None):
            return right(queries, suffix_keys, suffix_values, length, [0] * len(padding), scale, segments)

        monkeypatch.setattr(decode_kernel, "decode_attention", padding_ignored)
        assert "max difference" in decode_kernel.self_check(mx.float32, head_dim, heads, kv_heads, groups)

    def test_a_build_that_fails_is_not_used_again(self, monkeypatch):
        """On a CUDA device (said to be one here) a build whose check raises is
        logged and refused, without a second check."""
        checks: list[Any] = []

        def failing(*build):
            checks.append(build)
            raise RuntimeError("Failed to compile kernel")

        monkeypatch.setattr(decode_kernel, "on_cuda", lambda device=None: True)
        monkeypatch.setattr(decode_kernel, "self_check", failing)
        monkeypatch.setattr(decode_kernel, "_CHECKED", {})
        assert not decode_kernel.usable(mx.bfloat16, 64, 32, 8)
        assert not decode_kernel.usable(mx.bfloat16, 64, 32, 8)
        assert len(checks) == 1
