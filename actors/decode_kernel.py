"""A decode step's attention over shared prefixes as one CUDA kernel a layer.

On a GPU a decode step of a small model is its kernel launches: the plain-op
ways of :mod:`~mlxkv.actors.prefix_attention` spend about a dozen a layer on
attention (products, a concatenation, a softmax, layout copies) where fused
attention over per-row copies spends one. This kernel attends every row of a
batch over its part of its shared prefix and its own suffix in one launch a
layer, reading the prefix where it is held (no copy, no join of several
prefixes): a block a row and KV head, a warp a query head of that KV head
and slice of the keys, each warp's online softmax (float32) over 32 keys at
a time, the slices merged through shared memory.

It runs only on MLX's CUDA backend (``mx.fast.cuda_kernel``); everywhere
else, and for shapes it does not take (:func:`supported`), the callers keep
their portable path. The first use of each build of it (dtype, head size
and counts) in a process checks it against plain MLX operations on a small
problem (:func:`usable`; a runner checks its model's build as it is made); a
build that fails to compile or to agree is not used again, and says so in
the log.

The kernel's source is plain CUDA with no MLX device header beyond the types
the wrapper MLX generates: ``tests/actors/test_decode_kernel.py`` compiles it
with ``nvcc`` where one is installed, and runs the same source on the CPU
under a small emulation of CUDA's blocks, warps and shuffles against the
portable attention.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

from mlxkv.actors.event_log import EventLog

__all__ = [
    "MAX_HEAD_DIM",
    "MAX_GROUPS",
    "MAX_THREADS",
    "StepLaunch",
    "decode_attention",
    "input_names",
    "kernel_source",
    "launch",
    "model_build",
    "on_cuda",
    "prefix_inputs",
    "reference_attention",
    "row_info",
    "self_check",
    "step_launch",
    "supported",
    "usable",
]

#: The most prefixes one kernel reads (an input pair each); a batch over
#: more goes the portable way.
MAX_GROUPS = 8

#: The most threads a block (CUDA's bound; a block's registers fit an SM's
#: 65,536 at it: ``tests/actors/test_decode_kernel.py`` asks ``ptxas``).
MAX_THREADS = 1024

#: The largest head the kernel takes: a block's shared memory (its warps'
#: partial outputs and its queries, float32) stays within the 48 KiB a kernel
#: has without asking. A head's size must be a multiple of 8 too: a key row
#: is read in 16-byte loads.
MAX_HEAD_DIM = 128

_LOG = EventLog(component="decode_kernel")

# The kernel body. MLX generates the signature from the input and output
# names (``const T* q, const float* scale, const int* info, const T* sk,
# const T* sv, const T* pk0, const T* pv0, ..., T* out`` and the ``_shape``
# arguments the body names) and the template constants (``T``, ``D``,
# ``REP``, ``SPLIT``). ``info`` a row: its prefix input, the prefix positions
# it sees, its suffix's left padding, the suffix length. {groups} is the
# switch that picks a row's prefix input.
_BODY = """
    constexpr int WARP = 32;
    constexpr int DL = (D + WARP - 1) / WARP;  // a lane's share of the head's outputs
    constexpr int PER = 16 / sizeof(T);
    constexpr float NONE = -1e30f;
    const int b = blockIdx.z;
    const int kvh = blockIdx.y;
    const int kv_heads = gridDim.y;
    const int warp = threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    const int r = warp / SPLIT;
    const int split = warp % SPLIT;
    const int h = kvh * REP + r;
    const int heads = kv_heads * REP;
    const int* row = info + b * 4;
    const int group = row[0];
    const int seen = row[1];
    const int pad = row[2];
    const int length = row[3];
    const int capacity = sk_shape[2];
    const T* pk = pk0;
    const T* pv = pv0;
    int held = pk0_shape[2];
    switch (group) {
{groups}
      default: break;
    }
    pk += (size_t)kvh * held * D;
    pv += (size_t)kvh * held * D;
    const T* sk_row = sk + ((size_t)b * kv_heads + kvh) * capacity * D;
    const T* sv_row = sv + ((size_t)b * kv_heads + kvh) * capacity * D;
    const float factor = scale[0];
    // The block's queries (its KV head's REP query heads), scaled, in shared memory: every lane reads them all.
    __shared__ float queries[REP * D];
    const T* qp = q + ((size_t)b * heads + kvh * REP) * D;
    for (int i = threadIdx.x; i < REP * D; i += blockDim.x) {
      queries[i] = static_cast<float>(qp[i]) * factor;
    }
    __syncthreads();
    const float* qv = queries + r * D;
    const int total = seen + (length - pad);
    float m = NONE;
    float l = 0.f;
    float acc[DL];
    for (int e = 0; e < DL; ++e) {
      acc[e] = 0.f;
    }
    for (int base = split * WARP; base < total; base += SPLIT * WARP) {
      const int j = base + lane;
      float s = NONE;
      if (j < total) {
        const T* kp = j < seen ? pk + (size_t)j * D : sk_row + (size_t)(pad + j - seen) * D;
        // A key row in 16-byte loads (a row starts 16-byte aligned: D * sizeof(T) is a multiple of 16).
        const uint4* chunks = reinterpret_cast<const uint4*>(kp);
        float dot = 0.f;
        for (int c = 0; c < D / PER; ++c) {
          const uint4 raw = chunks[c];
          const T* part = reinterpret_cast<const T*>(&raw);
          for (int e = 0; e < PER; ++e) {
            dot += qv[c * PER + e] * static_cast<float>(part[e]);
          }
        }
        s = dot;
      }
      float top = s;
      for (int o = WARP / 2; o > 0; o /= 2) {
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
      }
      const float m_new = fmaxf(m, top);
      const float p = j < total ? expf(s - m_new) : 0.f;
      float sum = p;
      for (int o = WARP / 2; o > 0; o /= 2) {
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
      }
      const float correction = expf(m - m_new);
      l = l * correction + sum;
      for (int e = 0; e < DL; ++e) {
        acc[e] *= correction;
      }
      for (int src = 0; src < WARP; ++src) {
        const float ps = __shfl_sync(0xffffffffu, p, src);
        const int js = base + src;
        if (js < total) {
          const T* vp = js < seen ? pv + (size_t)js * D : sv_row + (size_t)(pad + js - seen) * D;
          for (int e = 0; e < DL; ++e) {
            if (lane * DL + e < D) {
              acc[e] += ps * static_cast<float>(vp[lane * DL + e]);
            }
          }
        }
      }
      m = m_new;
    }
    __shared__ float shared_m[REP * SPLIT];
    __shared__ float shared_l[REP * SPLIT];
    __shared__ float shared_acc[REP * SPLIT * D];
    if (lane == 0) {
      shared_m[warp] = m;
      shared_l[warp] = l;
    }
    for (int e = 0; e < DL; ++e) {
      if (lane * DL + e < D) {
        shared_acc[warp * D + lane * DL + e] = acc[e];
      }
    }
    __syncthreads();
    if (split == 0) {
      float top = NONE;
      for (int w = 0; w < SPLIT; ++w) {
        top = fmaxf(top, shared_m[r * SPLIT + w]);
      }
      float total_l = 0.f;
      float o[DL];
      for (int e = 0; e < DL; ++e) {
        o[e] = 0.f;
      }
      for (int w = 0; w < SPLIT; ++w) {
        const int slot = r * SPLIT + w;
        const float f = expf(shared_m[slot] - top);
        total_l += shared_l[slot] * f;
        for (int e = 0; e < DL; ++e) {
          if (lane * DL + e < D) {
            o[e] += shared_acc[slot * D + lane * DL + e] * f;
          }
        }
      }
      const float inverse = total_l > 0.f ? 1.f / total_l : 0.f;
      T* op = out + ((size_t)b * heads + h) * D;
      for (int e = 0; e < DL; ++e) {
        if (lane * DL + e < D) {
          op[lane * DL + e] = static_cast<T>(o[e] * inverse);
        }
      }
    }
"""

_CASE = "      case {g}: pk = pk{g}; pv = pv{g}; held = pk{g}_shape[2]; break;"


def kernel_source(groups: int) -> str:
    """The kernel's body for ``groups`` prefix inputs (1..:data:`MAX_GROUPS`)."""
    if not 1 <= groups <= MAX_GROUPS:
        raise ValueError(f"groups must be 1..{MAX_GROUPS}, not {groups}")
    return _BODY.replace("{groups}", "\n".join(_CASE.format(g=g) for g in range(1, groups)))


def input_names(groups: int) -> list[str]:
    """The kernel's inputs, in order: the queries, the scale, each row's
    ``info``, the suffix buffers, then each prefix's keys and values."""
    return ["q", "scale", "info", "sk", "sv", *(name for g in range(groups) for name in (f"pk{g}", f"pv{g}"))]


def launch(heads: int, kv_heads: int, head_dim: int) -> Optional[tuple[int, int]]:
    """``(threads a block, SPLIT)`` for these heads (a warp a query head and
    slice of the keys; as many slices as the block's thread bound allows,
    at most 8), or None where the kernel does not take them."""
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM or kv_heads < 1 or heads % kv_heads:
        return None
    repeats = heads // kv_heads
    split = min(8, MAX_THREADS // (32 * repeats))
    if split < 1:
        return None
    return 32 * repeats * split, split


def supported(queries: Any, segments: Sequence[Any], suffix: Sequence[Any] = ()) -> bool:
    """Whether the kernel takes a decode step of these queries ``(batch,
    heads, 1, head_dim)`` over these segments and ``suffix`` buffers, on this
    device: MLX's CUDA backend, one float dtype for all of them (the kernel
    reads them as one type), a head size and count :func:`launch` takes, at
    most :data:`MAX_GROUPS` prefixes."""
    import mlx.core as mx

    if not on_cuda() or queries.shape[2] != 1 or not 1 <= len(segments) <= MAX_GROUPS:
        return False
    if queries.dtype not in (mx.float32, mx.float16, mx.bfloat16):
        return False
    if any(array.dtype != queries.dtype for array in (*suffix, *(a for _, k, v, _ in segments for a in (k, v)))):
        return False
    kv_heads = segments[0][1].shape[1]
    return launch(queries.shape[1], kv_heads, queries.shape[3]) is not None


def on_cuda(device: Any = None) -> bool:
    """Whether ``device`` (default: MLX's default device) is a GPU of MLX's
    CUDA backend (not Metal, not the CPU)."""
    import mlx.core as mx

    device = device if device is not None else mx.default_device()
    cuda = getattr(mx, "cuda", None)
    return device.type == mx.DeviceType.gpu and cuda is not None and cuda.is_available()


def prefix_inputs(segments: Sequence[Any]) -> list[Any]:
    """The kernel's prefix inputs for ``segments``: each prefix's keys and
    values, then the first's again up to :data:`MAX_GROUPS` (one build for
    any number of prefixes; no row reads the repeats)."""
    inputs = [array for _, keys, values, _ in segments for array in (keys, values)]
    return inputs + inputs[:2] * (MAX_GROUPS - len(segments))


def model_build(model: Any) -> Optional[tuple[Any, int, int, int]]:
    """``(dtype, head_dim, heads, kv_heads)`` of ``model``'s attention, read
    off its first attention layer (mlx-lm's ``n_heads``, ``n_kv_heads`` and
    key projection), or None where it does not say."""
    for _, layer in model.named_modules():
        heads, kv_heads = getattr(layer, "n_heads", None), getattr(layer, "n_kv_heads", None)
        projection = getattr(layer, "k_proj", None)
        weight = getattr(projection, "weight", None)
        if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0 and weight is not None:
            return weight.dtype, weight.shape[0] // kv_heads, heads, kv_heads
    return None


@functools.cache
def _kernel() -> Any:
    """The kernel over :data:`MAX_GROUPS` prefix inputs (a step over fewer
    repeats one), so that a model compiles one build of it."""
    import mlx.core as mx

    return mx.fast.cuda_kernel(
        name="mlxkv_shared_prefix_decode",
        input_names=input_names(MAX_GROUPS),
        output_names=["out"],
        source=kernel_source(MAX_GROUPS),
    )


def row_info(batch: int, segments: Sequence[Any], padding: Sequence[int], length: int) -> list[list[int]]:
    """Each row's ``[prefix input, prefix positions seen, suffix left padding,
    suffix length]``: a row in no segment sees no prefix (input 0)."""
    info = [[0, 0, int(pad), length] for pad in padding]
    if len(info) != batch:
        raise ValueError(f"padding has {len(info)} rows, the batch {batch}")
    for g, (rows, _, _, lengths) in enumerate(segments):
        for row, seen in zip(rows, lengths):
            info[row][0], info[row][1] = g, int(seen)
    return info


class StepLaunch(NamedTuple):
    """A decode step's launch of the kernel but for each layer's own arrays,
    made once a step for all its layers: the rows' :func:`row_info` as an
    int32 array (an input) and the call's template, grid and outputs."""

    info: Any
    arguments: dict[str, Any]


def step_launch(queries: Any, kv_heads: int, segments: Sequence[Any], padding: Sequence[int], length: int) -> StepLaunch:
    """The :class:`StepLaunch` of a step of ``queries`` ``(batch, heads, 1,
    head_dim)`` over ``segments``, its rows' suffixes from ``padding[row]``
    to ``length`` (a build :func:`launch` takes)."""
    import mlx.core as mx

    batch, heads, _, dim = queries.shape
    threads, split = launch(heads, kv_heads, dim)  # type: ignore[misc]
    return StepLaunch(
        info=mx.array(row_info(batch, segments, padding, length), dtype=mx.int32),
        arguments={
            "template": [("T", queries.dtype), ("D", dim), ("REP", heads // kv_heads), ("SPLIT", split)],
            "grid": (threads, kv_heads, batch),
            "threadgroup": (threads, 1, 1),
            "output_shapes": [queries.shape],
            "output_dtypes": [queries.dtype],
        },
    )


def decode_attention(
    queries: Any,
    suffix_keys: Any,
    suffix_values: Any,
    length: int,
    padding: Sequence[int],
    scale: float,
    segments: Sequence[Any],
    step: Optional[StepLaunch] = None,
) -> Any:
    """One decode step's attention: ``queries`` ``(batch, heads, 1, head_dim)``
    over each row's part of its prefix (``segments``, as
    :func:`~mlxkv.actors.prefix_attention.cascade_attention` takes them) and
    its own suffix: positions ``padding[row]`` to ``length`` of the whole
    suffix buffers ``(batch, kv_heads, C, head_dim)``. ``step``: the step's
    :func:`step_launch`, where the caller keeps one for the step's layers.
    Returns ``(batch, heads, 1, head_dim)`` in the queries' dtype."""
    if step is None:
        step = step_launch(queries, suffix_keys.shape[1], segments, padding, length)
    (out,) = _kernel()(
        inputs=[queries, _scale(scale), step.info, suffix_keys, suffix_values, *prefix_inputs(segments)],
        **step.arguments,
    )
    return out


@functools.lru_cache(maxsize=16)
def _scale(scale: float) -> Any:
    """``scale`` as the kernel's one-element input, made once (not an upload a layer)."""
    import mlx.core as mx

    return mx.array([scale], dtype=mx.float32)


#: ``(dtype, head_dim, heads, kv_heads)`` -> whether the kernel of that build
#: passed its check in this process. Written by the MLX threads that
#: check (no lock: two runners checking one build at once each check it, and
#: write the same answer).
_CHECKED: dict[tuple[str, int, int, int], bool] = {}


def usable(dtype: Any = None, head_dim: int = 64, heads: int = 8, kv_heads: int = 2) -> bool:
    """Whether the kernel built for these (a dtype, default float32; head size
    and counts) serves on this device: on MLX's CUDA backend, once
    it has compiled and agreed with plain MLX operations on a small problem
    of that build (checked once a process; a failure is logged and that
    build is not used again). False everywhere else."""
    import mlx.core as mx

    dtype = dtype or mx.float32
    key = (str(dtype), head_dim, heads, kv_heads)
    known = _CHECKED.get(key)  # (only ever written on CUDA)
    if known is not None:
        return known
    if not on_cuda():
        return False
    try:
        error = self_check(dtype, head_dim, heads, kv_heads)
    except Exception as exc:  # a compile or launch failure: the portable path serves
        error = f"{type(exc).__name__}: {exc}"
    _CHECKED[key] = error is None
    if error is None:
        _LOG.info("decode_kernel_checked", build=key)
    else:
        _LOG.warning("decode_kernel_unusable", build=key, reason=error)
    return error is None


def self_check(
    dtype: Any = None, head_dim: int = 64, heads: int = 8, kv_heads: int = 2, groups: int = 3
) -> Optional[str]:
    """Run the kernel of this build on a small problem against plain MLX
    operations -- a row over each prefix (the first seeing part of it, more
    keys than a block's warps take in one round) and one over none, left
    padding -- None if they agree, else what differed."""
    import mlx.core as mx

    dtype = dtype or mx.float32
    batch, capacity, length = groups + 1, 48, 30
    keys = iter(mx.random.split(mx.random.key(31), 3 + 2 * groups))

    def normal(*shape: int) -> Any:
        return mx.random.normal(shape, key=next(keys)).astype(dtype)

    queries = normal(batch, heads, 1, head_dim)
    suffix_keys, suffix_values = normal(batch, kv_heads, capacity, head_dim), normal(batch, kv_heads, capacity, head_dim)
    held = [600] + [40] * (groups - 1)
    segments = [
        ([g], normal(1, kv_heads, n, head_dim), normal(1, kv_heads, n, head_dim), [333 if g == 0 else n])
        for g, n in enumerate(held)
    ]
    padding = [(7 * row) % 20 for row in range(batch)]
    scale = head_dim**-0.5
    got = decode_attention(queries, suffix_keys, suffix_values, length, padding, scale, segments)
    want = reference_attention(queries, suffix_keys, suffix_values, length, padding, scale, segments)
    difference = mx.abs(got.astype(mx.float32) - want).max().item()
    bound = 5e-3 if dtype == mx.float32 else 5e-2
    return None if difference <= bound else f"max difference {difference:.3g} from plain operations (bound {bound})"


def reference_attention(
    queries: Any,
    suffix_keys: Any,
    suffix_values: Any,
    length: int,
    padding: Sequence[int],
    scale: float,
    segments: Sequence[Any],
) -> Any:
    """What :func:`decode_attention` computes, a row at a time in plain MLX
    operations over a copy of the row's keys (float32)."""
    import mlx.core as mx

    batch, heads, _, dim = queries.shape
    kv_heads = suffix_keys.shape[1]
    own: dict[int, tuple[Any, Any]] = {}
    for rows, keys, values, lengths in segments:
        for row, seen in zip(rows, lengths):
            own[row] = (keys[0, :, :seen], values[0, :, :seen])
    outs = []
    for row in range(batch):
        k = suffix_keys[row, :, padding[row] : length]
        v = suffix_values[row, :, padding[row] : length]
        if row in own:
            k = mx.concatenate([own[row][0], k], axis=1)
            v = mx.concatenate([own[row][1], v], axis=1)
        k = mx.repeat(k.astype(mx.float32), heads // kv_heads, axis=0)  # (heads, n, dim)
        v = mx.repeat(v.astype(mx.float32), heads // kv_heads, axis=0)
        q = queries[row, :, 0].astype(mx.float32)[:, None]  # (heads, 1, dim)
        weights = mx.softmax((q * scale) @ k.swapaxes(-1, -2), axis=-1)
        outs.append((weights @ v)[None])
    return mx.concatenate(outs).reshape(batch, heads, 1, dim)
