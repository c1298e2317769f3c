"""SwiGLU activation with fp8 quantization, in the masked layout (device kernel).

``h[e, r, j] = silu(gu[e, r, j]) * gu[e, r, I + j]`` for the valid rows
r < m_e of every expert (``ActivationKind.SILU``), or gpt-oss's
``clamped_swiglu(gu[e, r] + bias[e])`` on interleaved gate / up columns
(``GPT_OSS``, ``moe.gpt_oss``), written as the down projection's input:
block-scaled fp8 e4m3 with one fp32 scale per row and 128 columns (the 1x128
recipe; a last block of fewer columns has its own scale), the scales in the
M-contiguous layout the GEMM loads in place; or plain bf16.
Rows >= m_e are never read or written. The kernel is arch-neutral (plain
loads, stores and shuffles) and compiles for sm_90a and sm_100a alike.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..schedule.walker import MaskedTileScheduler

from ..device.swiglu import FP8_MAX, MIN_AMAX, clamped_swiglu, quantize, swiglu
from .gpt_oss import SWIGLU_ALPHA, SWIGLU_LIMIT

THREADS = 256
VEC = 8  # bf16 elements per 16-byte load
LANES_PER_BLOCK = 128 // VEC  # 16 lanes cover one 128-column scale block
ROWS_PER_UNIT = 1  # rows per unit of the persistent walk: one row keeps every CTA busy (docs/design.md)


class SiluMulQuant:
    """Persistent elementwise kernel.

    Warp roles: none; every warp does the same work. Units are
    ``ROWS_PER_UNIT``-row slices of the valid rows, walked expert-major by
    the GEMM's masked walker (one n-group) and dealt round-robin to the CTAs,
    so no CTA looks at padding rows. In a unit, each warp takes (row, 256
    columns) pieces in turn: a lane loads 8 gate and 8 up values (16 bytes
    each), computes silu(gate) * up in fp32, and for fp8 the 16 lanes of a
    128-column block reduce their |max| with butterfly shuffles; the lanes
    store 8 fp8 bytes each and the block's first lane its scale (``GPT_OSS``:
    a lane loads 8 interleaved (gate, up) pairs and their 16 fp32 biases
    instead). No shared
    memory, no pipelines. Launched with PDL: every thread first waits for
    the previous grid (``griddepcontrol.wait``).
    """

    def __init__(self, fp8: bool, gpt_oss: bool = False):
        self.fp8 = fp8
        self.gpt_oss = gpt_oss

    @cute.jit
    def __call__(
        self,
        mGU: cute.Tensor,  # (E, max_m, 2I) bf16, the gate_up output: gate columns, then up (GPT_OSS: interleaved)
        mMaskedM: cute.Tensor,  # (E,) int32
        mOut: cute.Tensor,  # (E, max_m, I) fp8 e4m3 or bf16
        mScale: cute.Tensor,  # fp8: (E, max_m, ceil(I/128)) fp32, M contiguous; else None
        mBias: cute.Tensor,  # GPT_OSS: (E, 2I) fp32, gate_up's bias; else None
        num_ctas: Int32,
        stream,
    ):
        # launched programmatically dependent: its launch overlaps the gate_up
        # GEMM's tail and the down GEMM's launch overlaps this one (docs/design.md)
        self.kernel(mGU, mMaskedM, mOut, mScale, mBias).launch(
            grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(self, mGU: cute.Tensor, mMaskedM: cute.Tensor, mOut: cute.Tensor, mScale: cute.Tensor,
               mBias: cute.Tensor):
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        num_experts = cute.size(mGU, mode=[0])
        max_m = cute.size(mGU, mode=[1])
        inter = cute.size(mOut, mode=[2])
        chunks = inter // VEC  # 8-column chunks of a row
        pieces_per_row = (chunks + 31) // 32  # a warp piece: 256 columns (the last may be half)
        gate = cute.make_rmem_tensor((VEC,), mGU.element_type)
        up = cute.make_rmem_tensor((VEC,), mGU.element_type)
        g32 = cute.make_rmem_tensor((VEC,), Float32)
        u32 = cute.make_rmem_tensor((VEC,), Float32)
        hv = cute.make_rmem_tensor((VEC,), Float32)
        pairs = cute.make_rmem_tensor((2 * VEC,), mGU.element_type)  # GPT_OSS: (gate, up) interleaved
        bias = cute.make_rmem_tensor((2 * VEC,), Float32)
        # gate_up's rows are final once the grid before this one has finished;
        # the next grid (the down GEMM) waits for this one's end the same way
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        sched = MaskedTileScheduler.create(
            mMaskedM, num_experts, max_m, Int32(1), ROWS_PER_UNIT, bidx, gdim
        )
        work = sched.work()
        while work.is_valid:
            e = work.expert
            row0 = work.m_block * ROWS_PER_UNIT
            for p in cutlass.range(warp, work.valid_rows * pieces_per_row, THREADS // 32, unroll=1):
                r = p // pieces_per_row
                chunk = (p - r * pieces_per_row) * 32 + lane  # this lane's 8-column chunk
                inside = chunk < chunks  # (lanes past I load the last chunk: their block's amax is unchanged)
                src = cutlass.min(chunk, chunks - 1)
                row = row0 + r
                if cutlass.const_expr(self.gpt_oss):
                    cute.autovec_copy(cute.local_tile(mGU[e, row, None], (2 * VEC,), (src,)), pairs)
                    cute.autovec_copy(cute.local_tile(mBias[e, None], (2 * VEC,), (src,)), bias)
                    for i in cutlass.range_constexpr(VEC):
                        g32[i] = pairs[2 * i].to(Float32) + bias[2 * i]
                        u32[i] = pairs[2 * i + 1].to(Float32) + bias[2 * i + 1]
                    clamped_swiglu(g32, u32, hv, SWIGLU_ALPHA, SWIGLU_LIMIT)
                else:
                    cute.autovec_copy(cute.local_tile(mGU[e, row, None], (VEC,), (src,)), gate)
                    cute.autovec_copy(cute.local_tile(mGU[e, row, None], (VEC,), (src + chunks,)), up)
                    g32.store(gate.load().to(Float32))
                    u32.store(up.load().to(Float32))
                    swiglu(g32, u32, hv)
                dst = cute.local_tile(mOut[e, row, None], (VEC,), (src,))
                if cutlass.const_expr(self.fp8):
                    amax = Float32(MIN_AMAX)
                    for i in cutlass.range_constexpr(VEC):
                        amax = cute.arch.fmax(amax, cute.math.absf(hv[i]))
                    for off in (8, 4, 2, 1):  # within the 16 lanes of one 128-column block
                        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, off))
                    scale = amax / FP8_MAX
                    q = cute.make_rmem_tensor((VEC,), mOut.element_type)
                    quantize(hv, 1.0 / scale, q)
                    if inside:
                        cute.autovec_copy(q, dst)
                        if lane % LANES_PER_BLOCK == 0:
                            mScale[e, row, chunk // LANES_PER_BLOCK] = scale
                else:
                    o = cute.make_rmem_tensor((VEC,), mOut.element_type)
                    o.store(hv.load().to(mOut.element_type))
                    if inside:
                        cute.autovec_copy(o, dst)
            sched.advance()
            work = sched.work()
