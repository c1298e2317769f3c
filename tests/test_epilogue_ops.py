"""The epilogue registry (flashgemm.epilogue): every Epilogue has its op, the
ops' parameters are launch slots of the kernels that take them, and their
declared rules are what the sm_90 builds use."""

import pytest

from flashgemm.config import GemmConfig, Staging
from flashgemm.epilogue import Epilogue, EpilogueOp, family, op
from flashgemm.sm90.epilogues import DEVICE
from flashgemm.sm90.launch import SLOTS
from flashgemm.sm90.limits import epi_bytes


def test_every_epilogue_has_one_op_and_device_code():
    assert {e.op.name for e in Epilogue} == {e.value for e in Epilogue}
    assert all(isinstance(op(e), EpilogueOp) for e in Epilogue)
    assert {e.op.family for e in Epilogue} == set(DEVICE)  # sm_90 builds every family
    assert family("combine") == (Epilogue.COMBINE, Epilogue.COMBINE_BF16, Epilogue.COMBINE_PEERS)
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
