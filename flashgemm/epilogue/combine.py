"""The fused combines: each valid row, times its routing weight, leaves the
GEMM for its token instead of into ``out``: reduce-added into an fp32 or a
bf16 ``[T, N]`` output (``red.global.add``, in L2), or stored as bf16 into
its owner rank's receive buffer (expert parallelism, one writer per row).
Parameters: the routing (``token_index``, ``weight``), the target
(``combined``), the error word (``err``), for the peers their
receive-buffer addresses (``peers``) and, for the ``*_BIAS`` builds, the
per-expert fp32 bias added to each row before its weight (``bias``)."""

from .base import COMBINE_BIAS_LOAD, COMBINE_SENDS, EpilogueOp

_ROUTING = ("token_index", "weight", "combined", "err")


def _combine(name: str, send: str, rows_dtype: str, peers: bool = False, bias: bool = False) -> EpilogueOp:
    loads = frozenset({COMBINE_BIAS_LOAD})
    return EpilogueOp(name=name, family="combine",
                      params=_ROUTING + (("peers",) if peers else ()) + (("bias",) if bias else ()),
                      writes_out=False, rows_dtype=rows_dtype,
                      ptx_required=frozenset({send}) | (loads if bias else frozenset()),
                      ptx_forbidden=(COMBINE_SENDS - {send}) | {"tma-store"} | (frozenset() if bias else loads))


COMBINE_F32 = _combine("combine", "combine-reduce", "fp32")
COMBINE_BF16 = _combine("combine_bf16", "combine-reduce-bf16", "bf16")
COMBINE_PEERS = _combine("combine_peers", "combine-peer-store", "bf16", peers=True)
COMBINE_F32_BIAS = _combine("combine_bias", "combine-reduce", "fp32", bias=True)
COMBINE_BF16_BIAS = _combine("combine_bf16_bias", "combine-reduce-bf16", "bf16", bias=True)
COMBINE_PEERS_BIAS = _combine("combine_peers_bias", "combine-peer-store", "bf16", peers=True, bias=True)
