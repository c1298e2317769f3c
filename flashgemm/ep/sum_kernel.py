"""The owner's sum of its tokens' received rows (CuTe DSL, arch-neutral).

``tokens[t] = sum over slots j with topk_ids[t, j] >= 0 of recv[t, j]``, in
slot order, accumulated in fp32 and written as fp32 or bf16: each token's
sum is deterministic. Slots nobody routed are never read (whatever they
hold, NaN included).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

THREADS = 256
VEC = 8  # bf16 elements per 16-byte load


class TokenSum:
    """Persistent elementwise kernel.

    Warp roles: none; every thread does the same work. CTA b takes tokens b,
    b + grid, ...; in a token each thread takes 8-column chunks in turn and,
    for one chunk, issues the ``top_k`` slots' 16-byte loads together (the
    slot loop is unrolled: ``top_k`` is a compile-time constant), then adds
    them in slot order in fp32 and stores the chunk. No shared memory.
    """

    def __init__(self, top_k: int):
        self.top_k = top_k

    @cute.jit
    def __call__(
        self,
        mRecv: cute.Tensor,  # (T_max, k, N) bf16
        mIds: cute.Tensor,  # (T, k) int32 or int64: -1 marks a slot nobody routed
        mOut: cute.Tensor,  # (T_max, N) fp32 or bf16
        num_ctas: Int32,
        stream,
    ):
        self.kernel(mRecv, mIds, mOut).launch(grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mRecv: cute.Tensor, mIds: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        num_tokens = cute.size(mIds, mode=[0])
        chunks = cute.size(mRecv, mode=[2]) // VEC
        rows = cute.make_rmem_tensor((VEC, self.top_k), mRecv.element_type)
        acc = cute.make_rmem_tensor((VEC,), Float32)
        res = cute.make_rmem_tensor((VEC,), mOut.element_type)
        for t in cutlass.range(bidx, num_tokens, gdim, unroll=1):
            routed = cute.make_rmem_tensor((self.top_k,), cutlass.Boolean)
            for j in cutlass.range_constexpr(self.top_k):
                routed[j] = mIds[t, j] >= 0
            for c in cutlass.range(tidx, chunks, THREADS, unroll=1):
                for j in cutlass.range_constexpr(self.top_k):
                    if routed[j]:
                        cute.autovec_copy(cute.local_tile(mRecv[t, j, None], (VEC,), (c,)), rows[None, j])
                acc.fill(0.0)
                for j in cutlass.range_constexpr(self.top_k):
                    if routed[j]:
                        acc.store(acc.load() + rows[None, j].load().to(Float32))
                res.store(acc.load().to(mOut.element_type))
                cute.autovec_copy(res, cute.local_tile(mOut[t, None], (VEC,), (c,)))
