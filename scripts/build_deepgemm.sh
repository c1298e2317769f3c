#!/usr/bin/env bash
# Build DeepGEMM's Python extension in place, so that scripts/bench.py can time
# its masked kernels in the same run as ours (an optional peer; bench.py skips
# it with a note when `import deep_gemm` fails).
#
#   bash scripts/build_deepgemm.sh /path/to/DeepGEMM   # a checkout with its submodules
#   export PYTHONPATH=/path/to/DeepGEMM:$PYTHONPATH CUDA_HOME=/usr/local/cuda
#
# Why not a wheel: the sgl-deep-gemm wheels on PyPI do not run with the GPU
# machine's torch (2.11.0+cu130, docs/benchmarks.md), and that machine has no
# network to fetch or build one. This compiles the extension against the torch
# that is installed, with
# torch.utils.cpp_extension (about a minute on 16 cores); DeepGEMM then compiles
# each kernel with nvcc on its first call (about 4-8 s each) and caches it under
# DG_JIT_CACHE_DIR.
#
# The compiler must link libstdc++ dynamically. On the GPU machine the default
# CXX (/opt/gcc/bin/g++) links it statically, and the extension built with it
# crashed beside torch (SIGSEGV inside std::regex and std::ostream, which then
# run on a second, uninitialised copy of the C++ runtime). /usr/bin/g++ is used
# unless DG_CXX names another.
set -euo pipefail
src=$(realpath "${1:?usage: build_deepgemm.sh DEEPGEMM_CHECKOUT}")
cutlass=$src/third-party/cutlass/include
for d in "$cutlass/cute" "$cutlass/cutlass" "$src/third-party/fmt/include" "$src/csrc/python_api.cpp"; do
  [ -e "$d" ] || { echo "missing $d (clone with --recursive, or add the submodules)" >&2; exit 1; }
done
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
export CXX=${DG_CXX:-/usr/bin/g++} MAX_JOBS=${MAX_JOBS:-$(nproc)}
# the kernels' JIT compiles find CuTe and CUTLASS beside DeepGEMM's own headers
ln -sfn "$cutlass/cute" "$src/deep_gemm/include/cute"
ln -sfn "$cutlass/cutlass" "$src/deep_gemm/include/cutlass"
build=$src/build-flashgemm-bench
mkdir -p "$build"
(cd "$src" && python - "$build" <<'PY'
import os
import sys

from torch.utils.cpp_extension import load

cuda = os.environ["CUDA_HOME"]
load(
    name="_C",  # DeepGEMM imports it as deep_gemm._C
    sources=["csrc/python_api.cpp"],
    extra_include_paths=[f"{cuda}/include", f"{cuda}/include/cccl", "deep_gemm/include",
                         "third-party/cutlass/include", "third-party/fmt/include"],
    extra_cflags=["-O3", "-Wno-psabi", "-Wno-deprecated-declarations"],
    extra_ldflags=[f"-L{cuda}/lib64", "-lcudart", "-lnvrtc"],
    with_cuda=True, build_directory=sys.argv[1],
)
PY
)
cp "$build/_C.so" "$src/deep_gemm/_C.so"
if readelf -d "$src/deep_gemm/_C.so" | grep -q 'libstdc++'; then
  echo "built $src/deep_gemm/_C.so"
else
  echo "warning: $src/deep_gemm/_C.so does not load libstdc++ dynamically (see the note in this script)" >&2
fi
echo "now: export PYTHONPATH=$src:\$PYTHONPATH CUDA_HOME=$CUDA_HOME"
