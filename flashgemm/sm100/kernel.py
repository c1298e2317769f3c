"""Kernel assembly: the masked grouped GEMM for sm_100a / sm_103a.

out[e, :m_e] = alpha[e] * (a[e, :m_e] @ b[e].T), m_e = clamp(masked_m[e], 0, max_m),
with MXFP8 / NVFP4 block-scaled or bf16 operands, or e4m3 A beside MXFP4
(e2m1) weights (``kind::mxf8f6f4``). This module builds the TMA
descriptors, the shared storage, the pipelines and the TMEM allocation, then
hands each warp its role (``producer``, ``mma_warp``, ``epilogue``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass import GridConstant, Int32
from cutlass.experimental.cuda import TensorMap
from cutlass.cute.nvgpu import cpasync

from ..device.layout import batch_last
from .config import Sm100Config
from .limits import SMEM_BYTES
from .padded_b import padded_b_descriptor
from .roles import run_roles
from .tiling import Tiling

THREADS = 32 * 6  # warps 0-3 epilogue, 4 MMA, 5 TMA (roles.py)


def _scale_layout(shape_mkl, vec: int):
    """Layout of a (E, rm, rk, 32, 4, 4) scale tensor as (((32, 4), rm), ((vec, 4), rk), E)
    over an operand of ``shape_mkl``: M padded to whole 128-row atoms and K to
    whole 4-scale atoms, as ``blockscale.to_blocked_scales`` stores them (so
    a K tail's scales are read from the padding, not cut off)."""
    m, k, e = shape_mkl
    padded = ((m + 127) // 128 * 128, (k + 4 * vec - 1) // (4 * vec) * (4 * vec), e)
    return blockscaled_utils.tile_atom_to_shape_SF(padded, vec)


class MaskedGroupedGemmSm100:
    """Persistent, warp-specialized masked grouped GEMM on tcgen05 (NT;
    MXFP8 / NVFP4 block-scaled or bf16 in, fp32 accumulate in TMEM, bf16 out).

    Warp roles (192 threads, one CTA per SM; 2-CTA builds pair two SMs in a
    cluster that computes one 256-row tile with ``cta_group::2`` MMAs):

    * warp 5, the **TMA warp** (``producer.run_tma_warp``): walks the
      masked tile order and loads A, B and the scale factors of each k-tile
      into the ``stages``-deep ring (MXFP4 weights: B by a tensor map of its
      own that unpacks e2m1 into the padded form, ``padded_b``);
    * warp 4, the **MMA warp** (``mma_warp.run_mma_warp``): copies each
      stage's scale factors into TMEM (``tcgen05.cp``) and issues the
      ``tcgen05.mma``s into an accumulator buffer in TMEM; in a 2-CTA pair
      only the leader CTA's MMA warp issues;
    * warps 0-3, the **epilogue** (``epilogue.run_epilogue``): warp 0
      allocates TMEM; all four drain accumulators (``tcgen05.ld``), convert
      to bf16 (x alpha), store full tiles by TMA store and partial tiles row
      by row (valid rows only), and publish signals (``publish``).

    Every role walks its own copy of the tile order (``walk``): the cluster's
    units, from the same masked_m, so all roles and both CTAs of a pair see
    the same units and no pipeline waits for a skipped tile.

    Pipelines and barriers (named-barrier ids in ``barriers``):

    * operands: ``PipelineTmaUmma``, TMA warp -> MMA warp, full/empty
      mbarriers per stage (full: TMA transaction bytes of the pair; empty:
      ``tcgen05.commit`` of the MMAs that read the stage, multicast to both
      CTAs of a pair);
    * accumulators: ``PipelineUmmaAsync``, MMA warp -> epilogue, one or two
      TMEM buffers (full: ``tcgen05.commit``; empty: every epilogue thread
      of the pair);
    * ``barriers.TMEM_ALLOC``: epilogue + MMA warps, the TMEM address in
      shared memory; ``barriers.EPILOGUE``: the epilogue warps around each
      staged sub-tile and before a signal.

    Launched with programmatic dependent launch: every thread waits in
    ``griddepcontrol.wait`` after the barrier set-up and before its first
    global access; the TMA warp triggers the next launch once its loads are
    issued.
    """

    def __init__(self, config: Sm100Config, ab_dtype, sf_dtype, signal_mode=None, b_dtype=None):
        self.config = config
        self.signal_mode = signal_mode
        self.ab_dtype = ab_dtype
        self.b_dtype = b_dtype or ab_dtype
        self.sf_dtype = sf_dtype
        self.out_dtype = cutlass.BFloat16
        self.cluster_size = config.cluster_size

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # (E, max_m, K), K contiguous (NVFP4: logical fp4 elements)
        mB: cute.Tensor,  # (E, N, K)
        mSFA: cute.Tensor,  # (E, rm, rk, 32, 4, 4) scale atoms, or None (bf16)
        mSFB: cute.Tensor,
        mAlpha: cute.Tensor,  # (E,) fp32, or None
        mD: cute.Tensor,  # (E, max_m, N) bf16, N contiguous
        mMaskedM: cute.Tensor,  # (E,) int32
        mSignals: cute.Tensor,  # (S,) int32, or None
        num_ctas: Int32,
        stream,
    ):
        tiling = Tiling(self.config, self.ab_dtype, self.sf_dtype, self.out_dtype, self.b_dtype).setup()
        self.tiling = tiling
        mA_mkl, mB_nkl, mD_mnl = batch_last(mA), batch_last(mB), batch_last(mD)
        tiled_mma, cl_vmnk = tiling.tiled_mma, tiling.cluster_layout_vmnk
        thr_id = tiled_mma.thr_id

        def load_atom(make, op, tensor, smem_layout, tiler, mma, layout_vmnk, internal=None):
            return make(op, tensor, cute.slice_(smem_layout, (None, None, None, 0)), tiler, mma,
                        layout_vmnk.shape, internal_type=internal)

        cs = tiling.cluster_shape_mn
        tma_a = load_atom(cute.nvgpu.make_tiled_tma_atom_A, sm100_utils.cluster_shape_to_tma_atom_A(cs, thr_id),
                          mA_mkl, tiling.a_smem_layout, tiling.mma_tiler, tiled_mma, cl_vmnk)
        desc_b = None
        if cutlass.const_expr(tiling.b_padded):
            tma_b, desc_b = None, padded_b_descriptor(mB, tiling.mma_tiler, cute.size(thr_id.shape))
        else:
            tma_b = load_atom(cute.nvgpu.make_tiled_tma_atom_B, sm100_utils.cluster_shape_to_tma_atom_B(cs, thr_id),
                              mB_nkl, tiling.b_smem_layout, tiling.mma_tiler, tiled_mma, cl_vmnk)
        tma_sfa, tma_sfb = (None, None), (None, None)
        if cutlass.const_expr(tiling.block_scaled):
            # the 128x4-atom scale tensors, (((32, 4), RestM), ((vec, 4), RestK), E)
            vec = tiling.sf_vec
            mSFA_mkl = cute.make_tensor(mSFA.iterator, _scale_layout(mA_mkl.shape, vec))
            mSFB_nkl = cute.make_tensor(mSFB.iterator, _scale_layout(mB_nkl.shape, vec))
            tma_sfa = load_atom(cute.nvgpu.make_tiled_tma_atom_A,
                                sm100_utils.cluster_shape_to_tma_atom_A(cs, thr_id), mSFA_mkl,
                                tiling.sfa_smem_layout, tiling.mma_tiler, tiled_mma, cl_vmnk, cutlass.Int16)
            tma_sfb = load_atom(cute.nvgpu.make_tiled_tma_atom_B,
                                sm100_utils.cluster_shape_to_tma_atom_SFB(cs, thr_id), mSFB_nkl,
                                tiling.sfb_smem_layout, tiling.mma_tiler_sfb, tiling.tiled_mma_sfb,
                                tiling.cluster_layout_sfb_vmnk, cutlass.Int16)
        tma_c = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mD_mnl, cute.slice_(tiling.c_smem_layout, (None, None, 0)),
            tiling.epi_tile,
        )
        self.shared_storage = self._shared_storage(tiling)
        used = self.shared_storage.size_in_bytes()
        if cutlass.const_expr(used > SMEM_BYTES):  # limits undercounted
            raise ValueError(f"config.stages: {used} bytes of shared memory; sm_100 allows {SMEM_BYTES}")
        self.kernel(
            tma_a, tma_b, tma_sfa, tma_sfb, tma_c, mD_mnl, mMaskedM, mAlpha, mSignals, desc_b,
        ).launch(
            grid=[num_ctas, 1, 1], block=[THREADS, 1, 1], cluster=[self.cluster_size, 1, 1],
            min_blocks_per_mp=1, stream=stream, use_pdl=True,
        )

    def _shared_storage(self, tiling: Tiling):
        align = 1024
        t = tiling
        sf_dtype = self.sf_dtype if t.block_scaled else cutlass.Uint8
        sfa_len = cute.cosize(t.sfa_smem_layout) if t.block_scaled else 1
        sfb_len = cute.cosize(t.sfb_smem_layout) if t.block_scaled else 1

        fields = {  # (built explicitly: annotations are strings under postponed evaluation)
            "ab_mbar": cute.struct.MemRange[cutlass.Int64, t.stages * 2],
            "acc_mbar": cute.struct.MemRange[cutlass.Int64, t.acc_stages * 2],
            "tmem_dealloc_mbar": cutlass.Int64,
            "tmem_holding_buf": cutlass.Int32,
            "sC": cute.struct.Align[cute.struct.MemRange[t.out_dtype, cute.cosize(t.c_smem_layout.outer)], align],
            "sA": cute.struct.Align[cute.struct.MemRange[t.ab_dtype, cute.cosize(t.a_smem_layout.outer)], align],
            "sB": cute.struct.Align[cute.struct.MemRange[t.b_smem_dtype, cute.cosize(t.b_smem_layout.outer)], align],
            "sSFA": cute.struct.Align[cute.struct.MemRange[sf_dtype, sfa_len], align],
            "sSFB": cute.struct.Align[cute.struct.MemRange[sf_dtype, sfb_len], align],
        }
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.kernel
    def kernel(self, tma_a, tma_b, tma_sfa, tma_sfb, tma_c, mD_mnl, mMaskedM, mAlpha, mSignals,
               desc_b: GridConstant[TensorMap]):
        # desc_b: B's own tensor map (a kernel parameter, as TMA requires) when
        # e2m1 B is unpacked by the TMA (``padded_b``); None otherwise
        run_roles(self, tma_a, tma_b if desc_b is None else desc_b, tma_sfa, tma_sfb, tma_c, mD_mnl, mMaskedM,
                  mAlpha, mSignals)
