"""The GEMM epilogues: where finished tiles go. Each is an ``EpilogueOp``
in its own module (its parameters, shared memory, PTX rules and build
rules); this registry names them. Adding one: its module, a member of
``Epilogue`` and its line in ``_OPS``, and its device code in each arch
package that builds it (``sm90.epilogues``)."""

from __future__ import annotations

import enum

from .base import EpilogueOp
from . import combine, store, swiglu


class Epilogue(enum.Enum):
    """Where the finished tiles go (the identity of an ``EpilogueOp``)."""

    STORE = "store"  # bf16 rows out[e, :m_e]
    COMBINE = "combine"  # weight * row reduce-added into its token's fp32 row of a [T, N] output
    COMBINE_BF16 = "combine_bf16"  # the same into a bf16 output: half the bytes (docs/design.md)
    # weight * row stored as bf16 into the receive buffer of its token's owner
    # rank (an NVLink peer address), no reduction: the owner sums its k rows
    COMBINE_PEERS = "combine_peers"
    # the three above with a per-expert fp32 bias added to each row before its weight
    COMBINE_BIAS = "combine_bias"
    COMBINE_BF16_BIAS = "combine_bf16_bias"
    COMBINE_PEERS_BIAS = "combine_peers_bias"
    # gate_up with the SwiGLU activation fused: each tile leaves as
    # h = silu(gate) * up, quantized 1x128 to fp8 or as bf16
    SWIGLU_FP8 = "swiglu_fp8"
    SWIGLU_BF16 = "swiglu_bf16"

    @property
    def op(self) -> EpilogueOp:
        return _OPS[self]

    @property
    def combines(self) -> bool:
        """The fused combine: every row leaves weighted, one by one."""
        return self.op.family == "combine"

    @property
    def activates(self) -> bool:
        """The fused SwiGLU: the tile leaves as the down projection's input."""
        return self.op.family == "swiglu"


_OPS = {
    Epilogue.STORE: store.STORE,
    Epilogue.COMBINE: combine.COMBINE_F32,
    Epilogue.COMBINE_BF16: combine.COMBINE_BF16,
    Epilogue.COMBINE_PEERS: combine.COMBINE_PEERS,
    Epilogue.COMBINE_BIAS: combine.COMBINE_F32_BIAS,
    Epilogue.COMBINE_BF16_BIAS: combine.COMBINE_BF16_BIAS,
    Epilogue.COMBINE_PEERS_BIAS: combine.COMBINE_PEERS_BIAS,
    Epilogue.SWIGLU_FP8: swiglu.SWIGLU_FP8,
    Epilogue.SWIGLU_BF16: swiglu.SWIGLU_BF16,
}
assert set(_OPS) == set(Epilogue) and all(k.value == v.name for k, v in _OPS.items())


def op(kind: Epilogue) -> EpilogueOp:
    return _OPS[kind]


def family(name: str) -> tuple:
    """The epilogues of one family ("store", "combine", "swiglu")."""
    return tuple(k for k, v in _OPS.items() if v.family == name)
