"""Compile the project's custom CUDA kernels with NVRTC on a machine without a GPU (syntax and types only).

MLX wraps a `mx.fast.cuda_kernel` body in its own JIT prelude, which its wheel does not ship as a header; this
compiles the same wrapper (signature, template constants, body) against a stand-in prelude that declares the
types a signature uses (`Shape`, `Strides`) and CUDA's own headers, so a kernel that does not compile is found
here and not in a GPU slot. NVRTC and the headers come from PyPI:

    pip install --target /tmp/nvrtc nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 nvidia-cuda-cccl-cu12
    python scripts/check_cuda_kernels.py --nvrtc /tmp/nvrtc
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "build" / "pp"))

PRELUDE = """#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cuda/std/cstdint>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
}
"""


def wrapped(name: str, inputs: list[str], outputs: list[str], body: str, consts: dict[str, str]) -> str:
    """The kernel as MLX's `build_kernel` writes it: concrete types in the signature (every input with its
    shape), the template constants as `using` / `constexpr` lines, then the body."""
    t = consts["T"]
    args = [f"    const {t}* {n},\n    const __grid_constant__ Shape {n}_shape" for n in inputs]
    args += [f"    {t}* {n}" for n in outputs]
    lines = [f"  using {k} = {v};" if k == "T" else f"  constexpr int {k} = {v};" for k, v in consts.items()]
    return (
        '#include "mlx/backend/cuda/device/utils.cuh"\n#include <cooperative_groups.h>\n'
        "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
        f"__global__ void {name}(\n" + ",\n".join(args) + ") {\n" + "\n".join(lines) + "\n" + body + "\n}\n}\n"
    )


def compile_source(lib: ctypes.CDLL, source: str, includes: list[str], arch: str) -> tuple[int, str]:
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None) != 0:
        return 1, "nvrtcCreateProgram failed"
    opts = [b"--std=c++17", f"-arch={arch}".encode(), b"-default-device", *(f"-I{i}".encode() for i in includes)]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    return rc, log.value.decode(errors="replace")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvrtc", type=Path, required=True, help="the pip --target folder holding nvidia/cuda_*")
    p.add_argument("--arch", default="compute_90")
    args = p.parse_args(argv)
    from mlx_dspark.adapters.mlx import row_products

    nv = args.nvrtc / "nvidia"
    lib = ctypes.CDLL(str(next((nv / "cuda_nvrtc" / "lib").glob("libnvrtc.so.*"))))
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        stub = Path(tmp) / "mlx" / "backend" / "cuda" / "device"
        stub.mkdir(parents=True)
        (stub / "utils.cuh").write_text(PRELUDE)
        includes = [tmp, str(nv / "cuda_runtime" / "include"), str(nv / "cuda_cccl" / "include")]
        for dtype in ("__nv_bfloat16", "__half", "float"):
            consts = {"T": dtype, "ROWS": str(row_products.SKINNY_ROWS)}
            source = wrapped("dspark_skinny", ["x", "w"], ["y"], row_products._SKINNY_SOURCE, consts)
            rc, log = compile_source(lib, source, includes, args.arch)
            print(f"dspark_skinny<{dtype}>: {'ok' if rc == 0 else 'FAILED'}")
            if rc != 0 or log.strip():
                print(log)
            failed += rc != 0
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
