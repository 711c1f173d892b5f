"""A kernel body for ``mx.fast.cuda_kernel``, built where no GPU is.

:func:`wrapped` puts a body in the function MLX 0.32 generates around it
(``mlx/backend/cuda/custom_kernel.cpp``, ``build_kernel``: a parameter an
input, its ``_shape`` where the body names it, the outputs, then the template
constants at the top of the body), so that ``nvcc`` compiles it as NVRTC
would. :func:`emulate` compiles that function as C++ for the CPU, with
CUDA's blocks, warps, shuffles and ``__syncthreads`` emulated by threads and
barriers, and runs it on float32 inputs: the body's indexing and arithmetic
checked against a reference without a GPU. Neither stands in for a GPU's
timing, registers or memory model.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Sequence

import numpy as np

MAX_NDIM = 10  # mlx/backend/cuda/device/config.h

_CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "int32": "int32_t"}

#: What MLX's default header gives a kernel, the parts of it these bodies use.
_NVCC_HEADER = f"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cstdint>
namespace mlx::core::cu {{
using Shape = cuda::std::array<int32_t, {MAX_NDIM}>;
}}
"""

_EMULATION = r"""
#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

struct Dim3 { int x, y, z; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
thread_local Dim3 threadIdx, blockIdx;
Dim3 blockDim, gridDim;
using Shape = std::array<int32_t, MAX_NDIM>;

static std::unique_ptr<std::barrier<>> block_barrier;
static std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
static std::vector<float> warp_slots;

inline void __syncthreads() { block_barrier->arrive_and_wait(); }

inline float exchange(float value, int from) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* slots = warp_slots.data() + warp * 32;
  slots[lane] = value;
  warp_barriers[warp]->arrive_and_wait();
  const float got = slots[from];
  warp_barriers[warp]->arrive_and_wait();
  return got;
}
inline float __shfl_sync(unsigned, float value, int src) { return exchange(value, src); }
inline float __shfl_xor_sync(unsigned, float value, int mask) { return exchange(value, (threadIdx.x % 32) ^ mask); }
#define __shared__ static
"""


def signature(name: str, body: str, inputs: Sequence[tuple[str, str, int]], outputs: Sequence[tuple[str, str]]) -> str:
    """The parameter list MLX generates: ``inputs`` ``(name, dtype, ndim)``,
    ``outputs`` ``(name, dtype)``."""
    params = []
    for input_name, dtype, ndim in inputs:
        params.append(f"const {_CUDA_TYPES[dtype]}* {input_name}")
        if ndim > 0 and f"{input_name}_shape" in body:
            params.append(f"const Shape {input_name}_shape")
        if ndim > 0 and f"{input_name}_strides" in body:
            raise NotImplementedError("strides")
    params += [f"{_CUDA_TYPES[dtype]}* {output}" for output, dtype in outputs]
    return f"void {name}(" + ", ".join(params) + ")"


def _constants(template: Sequence[tuple[str, Any]]) -> str:
    lines = []
    for name, value in template:
        if isinstance(value, str):
            lines.append(f"  using {name} = {_CUDA_TYPES[value]};")
        elif isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {str(value).lower()};")
        else:
            lines.append(f"  constexpr int {name} = {value};")
    return "\n".join(lines)


def wrapped(name: str, body: str, inputs: Sequence[tuple[str, str, int]], outputs: Sequence[tuple[str, str]],
            template: Sequence[tuple[str, Any]]) -> str:  # fmt: skip
    """The whole CUDA source of a kernel, as MLX would hand it to NVRTC."""
    return (
        _NVCC_HEADER + "namespace mlx::core::cu {\n__global__ "
        + signature(name, body, inputs, outputs).replace("const Shape", "const __grid_constant__ Shape")
        + " {\n" + _constants(template) + "\n" + body + "\n}\n}\n"
    )  # fmt: skip


def nvcc() -> str | None:
    """The path of ``nvcc``, if one is installed."""
    found = shutil.which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").exists():
        found = "/usr/local/cuda/bin/nvcc"
    return found


def compile_cuda(source: str, folder: Path, arch: str = "sm_90") -> subprocess.CompletedProcess[str]:
    """``nvcc`` compiles ``source`` to PTX for ``arch`` (its result, not raised)."""
    path = folder / "kernel.cu"
    path.write_text(source)
    return subprocess.run(
        [nvcc() or "nvcc", "-std=c++17", f"-arch={arch}", "--ptx", "-o", str(folder / "kernel.ptx"), str(path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def emulate(
    body: str,
    inputs: Sequence[tuple[str, np.ndarray]],
    outputs: Sequence[tuple[str, tuple[int, ...]]],
    template: Sequence[tuple[str, Any]],
    grid: tuple[int, int, int],
    threadgroup: tuple[int, int, int],
    folder: Path,
) -> list[np.ndarray]:
    """Run ``body`` on the CPU: float32 and int32 ``inputs``, float32
    ``outputs`` of these shapes, a block at a time (``grid`` in threads, as
    ``mx.fast.cuda_kernel`` takes it), a thread each of the block's threads."""
    compiler = shutil.which("g++")
    if compiler is None:
        raise FileNotFoundError("g++")
    arrays = [(name, np.ascontiguousarray(a)) for name, a in inputs]
    described = [(name, "int32" if a.dtype == np.int32 else "float32", a.ndim) for name, a in arrays]
    for name, a in arrays:
        if a.dtype not in (np.float32, np.int32):
            raise TypeError(f"{name}: {a.dtype}")
    main = ["int main(int, char** argv) {", '  FILE* f = std::fopen(argv[1], "rb");']
    args = []
    for index, (name, a) in enumerate(arrays):
        kind = "int32_t" if a.dtype == np.int32 else "float"
        main.append(f"  static std::vector<{kind}> in{index}({a.size});")
        main.append(f"  if (std::fread(in{index}.data(), sizeof({kind}), {a.size}, f) != {a.size}) return 2;")
        args.append(f"in{index}.data()")
        if a.ndim > 0 and f"{name}_shape" in body:
            dims = ", ".join(str(d) for d in list(a.shape) + [0] * (MAX_NDIM - a.ndim))
            args.append(f"Shape{{{dims}}}")
    for index, (_, shape) in enumerate(outputs):
        main.append(f"  static std::vector<float> out{index}({int(np.prod(shape))});")
        args.append(f"out{index}.data()")
    bx, by, bz = (g // t for g, t in zip(grid, threadgroup))
    threads = threadgroup[0] * threadgroup[1] * threadgroup[2]
    main += [
        f"  blockDim = Dim3{{{threadgroup[0]}, {threadgroup[1]}, {threadgroup[2]}}};",
        f"  gridDim = Dim3{{{bx}, {by}, {bz}}};",
        f"  warp_slots.assign({(threads + 31) // 32 * 32}, 0.f);",
        f"  for (int z = 0; z < {bz}; ++z) for (int y = 0; y < {by}; ++y) for (int x = 0; x < {bx}; ++x) {{",
        f"    block_barrier = std::make_unique<std::barrier<>>({threads});",
        "    warp_barriers.clear();",
        f"    for (int w = 0; w < {(threads + 31) // 32}; ++w) warp_barriers.push_back(std::make_unique<std::barrier<>>(32));",
        "    std::vector<std::thread> team;",
        f"    for (int t = 0; t < {threads}; ++t) team.emplace_back([=] {{",
        "      blockIdx = Dim3{x, y, z};",
        f"      threadIdx = Dim3{{t % {threadgroup[0]}, 0, 0}};",
        f"      kernel({', '.join(args)});",
        "    });",
        "    for (auto& thread : team) thread.join();",
        "  }",
        '  FILE* o = std::fopen(argv[2], "wb");',
        *(f"  std::fwrite(out{i}.data(), sizeof(float), out{i}.size(), o);" for i in range(len(outputs))),
        "  std::fclose(o);",
        "  return 0;",
        "}",
    ]
    source = (
        f"#define MAX_NDIM {MAX_NDIM}\n" + _EMULATION
        + signature("kernel", body, described, [(name, "float32") for name, _ in outputs])
        + " {\n" + _constants(template) + "\n" + body + "\n}\n" + "\n".join(main) + "\n"
    )  # fmt: skip
    (folder / "emulated.cpp").write_text(source)
    binary = folder / "emulated"
    built = subprocess.run(
        [compiler, "-std=c++20", "-O1", "-pthread", "-o", str(binary), str(folder / "emulated.cpp")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if built.returncode:
        raise RuntimeError(f"the emulation did not compile:\n{built.stderr[-4000:]}")
    with open(folder / "inputs.bin", "wb") as handle:
        for _, a in arrays:
            handle.write(a.tobytes())
    ran = subprocess.run([str(binary), str(folder / "inputs.bin"), str(folder / "outputs.bin")], timeout=300)
    if ran.returncode:
        raise RuntimeError(f"the emulation exited {ran.returncode}")
    flat = np.fromfile(folder / "outputs.bin", dtype=np.float32)
    results, start = [], 0
    for _, shape in outputs:
        size = int(np.prod(shape))
        results.append(flat[start : start + size].reshape(shape))
        start += size
    return results


def parse_registers(report: str) -> int | None:
    """The registers a thread, from ``ptxas -v``'s report."""
    found = re.search(r"Used (\d+) registers", report)
    return int(found.group(1)) if found else None


def registers(ptx: Path, arch: str = "sm_90") -> int | None:
    """The registers a thread of the kernel in ``ptx`` takes (``ptxas -v``), or
    None where ``ptxas`` is not beside ``nvcc``."""
    ptxas = Path(nvcc() or "nvcc").with_name("ptxas")
    if not ptxas.exists():
        return None
    done = subprocess.run(
        [str(ptxas), f"-arch={arch}", "-v", "-o", str(ptx.with_suffix(".cubin")), str(ptx)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(done.stderr[-4000:])
    return parse_registers(done.stderr + done.stdout)
