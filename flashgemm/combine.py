"""Consumer side of the completion signals.

* ``wait_signal``: a device helper for CuTe-DSL kernels: acquire-poll a counter
  until it reaches a target, with exponential nanosleep back-off, giving up
  after ``max_polls`` polls and raising a bit in an error word instead of
  hanging the GPU.
* ``MaskedCombineSm90``: the single-GPU stand-in for a DeepEP-style combine.
  For each slice of valid rows, in the GEMM's (expert, m-block) order, it
  waits until the m-block's counter reaches ``n_tiles`` and then scatter-adds
  the rows into a token-major fp32 output:
  ``combined[token_idx[e, r]] += weight[e, r] * out[e, r]``.
  It runs concurrently with the GEMM, on the SMs the GEMM was told to leave
  free (``num_sms``), which is the overlap the package exists for.

Error word bits: 1 = a wait timed out, 2 = a routing entry named a token
outside ``[0, T)`` (that row was skipped).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32
from cutlass._mlir import ir
from cutlass._mlir.dialects import vector
from cutlass.experimental.primitives.nvvm_wrapper import nanosleep

from .scheduler import MaskedTileScheduler

def _F32X4():
    return ir.VectorType.get([4], ir.F32Type.get())


ERR_TIMEOUT = 1
ERR_BAD_TOKEN = 2
# One CTA per SM it is given (more would land on the GEMM's SMs), so it is
# made as wide as a CTA can be: 1024 threads, each moving 16-byte chunks.
COMBINE_THREADS = 1024
CHUNK = 8  # bf16 elements per 16-byte load
ROWS_PER_ITEM = 8  # divides every block_m (64, 128, 192, 256)


@cute.jit
def wait_signal(counter: cute.Pointer, target: Int32, max_polls: Int32, err: cute.Pointer) -> Boolean:
    """Spin until ``*counter >= target`` (GPU-scope acquire). On timeout, OR
    ERR_TIMEOUT into ``*err`` and return False. Every caller thread does its
    own acquire, so its later loads are ordered after the producer's release."""
    value = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
    polls = Int32(0)
    backoff = Int32(32)
    while (value < target) & (polls < max_polls):
        nanosleep(backoff)
        backoff = cutlass.min(backoff * 2, Int32(2048))
        polls = polls + 1
        value = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
    ok = value >= target
    if not ok:
        cute.arch.atomic_or(err, Int32(ERR_TIMEOUT))
    return ok


class MaskedCombineSm90:
    """Signal-driven combine (reference quality: fp32 atomics into the output).

    Work items are 8-row slices of the valid rows, in the GEMM's expert-major
    order, dealt round-robin to the CTAs (``COMBINE_THREADS`` threads each).
    Every thread polls the item's m-block counter itself (one acquire each, so
    no reasoning about barrier cumulativity is needed), then moves 16-byte
    chunks of the slice.
    """

    def __init__(self, block_m: int):
        self.block_m = block_m

    @cute.jit
    def __call__(
        self,
        mOut: cute.Tensor,  # (E, max_m, N) bf16: the GEMM output
        mMaskedM: cute.Tensor,  # (E,) int32
        mSignals: cute.Tensor,  # (E * num_m_slots,) int32, "m_block" layout
        mTokenIdx: cute.Tensor,  # (E, max_m) int32
        mWeight: cute.Tensor,  # (E, max_m) float32
        mCombined: cute.Tensor,  # (T, N) float32, accumulated into
        mErr: cute.Tensor,  # (1,) int32 error word
        n_tiles: Int32,
        max_polls: Int32,
        num_ctas: Int32,
        stream,
    ):
        self.kernel(mOut, mMaskedM, mSignals, mTokenIdx, mWeight, mCombined, mErr, n_tiles, max_polls).launch(
            grid=[num_ctas, 1, 1], block=[COMBINE_THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mOut: cute.Tensor,
        mMaskedM: cute.Tensor,
        mSignals: cute.Tensor,
        mTokenIdx: cute.Tensor,
        mWeight: cute.Tensor,
        mCombined: cute.Tensor,
        mErr: cute.Tensor,
        n_tiles: Int32,
        max_polls: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        num_experts = cute.size(mOut, mode=[0])
        max_m = cute.size(mOut, mode=[1])
        n = cute.size(mOut, mode=[2])
        num_tokens = cute.size(mCombined, mode=[0])
        num_m_slots = (max_m + self.block_m - 1) // self.block_m
        chunks = n // CHUNK
        frag = cute.make_rmem_tensor((CHUNK,), mOut.element_type)
        # Work items are ROWS_PER_ITEM-row slices of the valid rows only,
        # walked expert-major by the GEMM's own masked scheduler (one "n-block"):
        # with one item per (expert, m-block) and most m-blocks empty, the
        # dsv3-ep8 work landed on 5 of 20 CTAs.
        sched = MaskedTileScheduler.create(
            mMaskedM, num_experts, max_m, Int32(1), ROWS_PER_ITEM, bidx, gdim
        )
        work = sched.work()
        while work.is_valid:
            e = work.expert
            row0 = work.m_block * ROWS_PER_ITEM
            unit = e * num_m_slots + row0 // self.block_m  # the GEMM m-block's counter
            if wait_signal(mSignals.iterator + unit, n_tiles, max_polls, mErr.iterator):
                for i in cutlass.range(tidx, work.valid_rows * chunks, COMBINE_THREADS, unroll=1):
                    r = i // chunks
                    c = i - r * chunks
                    token = Int32(mTokenIdx[e, row0 + r])
                    if (token >= 0) & (token < num_tokens):
                        w = cutlass.Float32(mWeight[e, row0 + r])
                        src = cute.local_tile(mOut[e, row0 + r, None], (CHUNK,), (c,))
                        cute.autovec_copy(src, frag)
                        vals = frag.load().to(cutlass.Float32) * w
                        base = mCombined.iterator + (token * n + c * CHUNK)
                        # red.global.add.v4.f32 (sm_90): 4x fewer atomics than
                        # scalar adds
                        for q in cutlass.range_constexpr(CHUNK // 4):
                            v4 = vector.from_elements(
                                _F32X4(), [vals[4 * q + j].ir_value() for j in range(4)]
                            )
                            cute.arch.red(
                                base + 4 * q, v4, op="add", dtype=cutlass.Float32,
                                sem="relaxed", scope="gpu",
                            )
                    else:
                        cute.arch.atomic_or(mErr.iterator, Int32(ERR_BAD_TOKEN))
            sched.advance()
            work = sched.work()
