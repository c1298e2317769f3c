#!/usr/bin/env python3
"""The host-time floor under grouped_gemm_nt_masked: a TVM-FFI call that
launches an empty CuTe kernel, with five torch tensors as arguments or five
ints (the launch alone), with and without a 2-CTA cluster. Needs a GPU.

    python scripts/probe_launch_floor.py
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("probe_launch_floor.py needs a CUDA GPU")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32, Int64  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench import host_us  # noqa: E402


class Noop:
    def __init__(self, cluster):
        self.cluster = cluster

    @cute.kernel
    def kernel(self, x: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 1023:  # never true (128 threads): a body the compiler keeps
            cute.printf("%d", x)

    @cute.jit
    def tensors(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, d: cute.Tensor, e: cute.Tensor, n: Int32, stream):
        self.kernel(Int64(0)).launch(grid=[2 * n, 1, 1], block=[128, 1, 1], cluster=[self.cluster, 1, 1], stream=stream)

    @cute.jit
    def ints(self, a: Int64, b: Int64, c: Int64, d: Int64, e: Int64, n: Int32, stream):
        self.kernel(a).launch(grid=[2 * n, 1, 1], block=[128, 1, 1], cluster=[self.cluster, 1, 1], stream=stream)

    @cute.jit
    def mixed(self, a: Int64, b: Int64, c: Int64, d: Int64, e: cute.Tensor, n: Int32, stream):
        self.kernel(a).launch(grid=[2 * n, 1, 1], block=[128, 1, 1], cluster=[self.cluster, 1, 1], stream=stream)


fake = cute.runtime.make_fake_compact_tensor
stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
xs = [torch.zeros(64, device="cuda", dtype=torch.bfloat16) for _ in range(5)]
for cluster in (1, 2):
    k = Noop(cluster)
    ft = [fake(cutlass.BFloat16, (cute.sym_int(),), assumed_align=16) for _ in range(5)]
    f_t = cute.compile(k.tensors, *ft, Int32(1), stream, options="--enable-tvm-ffi")
    f_i = cute.compile(k.ints, *[Int64(0)] * 5, Int32(1), cute.runtime.make_fake_stream(), options="--enable-tvm-ffi")
    f_m = cute.compile(k.mixed, *[Int64(0)] * 4, ft[0], Int32(1), stream, options="--enable-tvm-ffi")
    f_t = f_t.__tvm_ffi_object__() or f_t
    f_i = f_i.__tvm_ffi_object__() or f_i
    f_m = f_m.__tvm_ffi_object__() or f_m
    ptrs = [x.data_ptr() for x in xs]
    raw_stream = torch._C._cuda_getCurrentRawStream
    for name, f in (("5 tensor args", lambda: f_t(*xs, 66)),
                    ("5 int args + raw stream", lambda: f_i(*ptrs, 66, raw_stream(0))),
                    ("4 int args + 1 tensor", lambda: f_m(*ptrs[:4], xs[4], 66))):
        try:
            print(f"cluster {cluster}: {name}: {host_us(f, reps=3000):.1f} us", flush=True)
        except Exception as exc:
            print(f"cluster {cluster}: {name}: failed: {exc!r}"[:300], flush=True)
y = torch.zeros(1, device="cuda")
print(f"torch y.add_(1): {host_us(lambda: y.add_(1), reps=3000):.1f} us")
print(f"5 x data_ptr(): {host_us(lambda: [x.data_ptr() for x in xs], reps=3000):.2f} us")
