"""The epilogue registry (flashgemm.epilogue): every Epilogue has its op, the
ops' parameters are launch slots of the kernels that take them, and their
declared rules are what the sm_90 builds use."""

import pytest

from flashgemm.config import GemmConfig, Staging
from flashgemm.epilogue import Epilogue, EpilogueOp, family, op
from flashgemm.epilogue.base import COMBINE_BIAS_LOAD
from flashgemm.sm90.epilogues import DEVICE
from flashgemm.sm90.launch import SLOTS
from flashgemm.sm90.limits import epi_bytes


def test_every_epilogue_has_one_op_and_device_code():
    assert {e.op.name for e in Epilogue} == {e.value for e in Epilogue}
    assert all(isinstance(op(e), EpilogueOp) for e in Epilogue)
    assert {e.op.family for e in Epilogue} == set(DEVICE)  # sm_90 builds every family
    assert family("combine") == (Epilogue.COMBINE, Epilogue.COMBINE_BF16, Epilogue.COMBINE_PEERS,
                                 Epilogue.COMBINE_BIAS, Epilogue.COMBINE_BF16_BIAS, Epilogue.COMBINE_PEERS_BIAS)
    assert family("swiglu") == (Epilogue.SWIGLU_FP8, Epilogue.SWIGLU_BF16)


@pytest.mark.parametrize("kind", list(Epilogue), ids=lambda e: e.value)
def test_op_rules_are_the_builds_rules(kind):
    o = kind.op
    assert set(o.params) <= set(SLOTS)  # what it fills is a parameter of the sm_90 kernel
    assert kind.combines == (o.family == "combine") and kind.activates == (o.family == "swiglu")
    assert o.signals == (kind is Epilogue.STORE)  # only the plain store publishes signals
    assert o.writes_out == (o.family != "combine")
    cfg = GemmConfig(tile_m=128, tile_n=128, cluster_n=2, staging=Staging.PAIR)
    assert epi_bytes(cfg, kind) - epi_bytes(cfg) == o.smem_bytes(cfg.tile_m)
    # a kernel showing exactly what the op requires passes, one missing a requirement or showing a
    # forbidden feature does not
    base = {"wgmma", "tma-load"} | set(o.ptx_required)
    assert o.ptx_ok(base)
    for need in o.ptx_required:
        assert not o.ptx_ok(base - {need})
    for banned in o.ptx_forbidden:
        assert not o.ptx_ok(base | {banned})


@pytest.mark.parametrize("kind", family("combine"), ids=lambda e: e.value)
def test_each_combine_has_a_bias_twin(kind):
    """A ``*_BIAS`` combine is its plain twin plus the ``bias`` slot and its
    16-byte loads, which every other epilogue's kernels must not show."""
    biased = kind.value.endswith("_bias")
    plain = Epilogue(kind.value.removesuffix("_bias"))
    o, twin = kind.op, plain.op
    assert ("bias" in o.params) == biased and o.params == twin.params + (("bias",) if biased else ())
    assert (o.rows_dtype, o.writes_out, o.extra_smem) == (twin.rows_dtype, twin.writes_out, twin.extra_smem)
    assert o.ptx_required - {COMBINE_BIAS_LOAD} == twin.ptx_required
    assert (COMBINE_BIAS_LOAD in o.ptx_required) == biased
    assert all(COMBINE_BIAS_LOAD in e.op.ptx_forbidden for e in Epilogue if not e.value.endswith("_bias"))
