"""Compile-only tests: the real sm_90a build, no GPU needed (runs in CI)."""

import re
import subprocess
import sys

import pytest

from flashgemm import compile as fg_compile
from flashgemm.__main__ import ptx_features
from flashgemm.config import HEURISTIC_CONFIGS


@pytest.fixture(scope="module")
def ptx_by_config():
    return {cfg: fg_compile.build(cfg, arch="sm_90a", keep_ptx=True).__ptx__ for cfg in HEURISTIC_CONFIGS}


@pytest.mark.parametrize("cfg", HEURISTIC_CONFIGS, ids=lambda c: c.short_name())
def test_ptx_has_hopper_features(ptx_by_config, cfg):
    ptx = ptx_by_config[cfg]
    # bf16 wgmma with the tile's N, fp32 accumulate
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{cfg.tile_n}k16\.f32\.bf16\.bf16", ptx)
    # 3D TMA loads completing on an mbarrier, 3D TMA stores in bulk groups
    assert "cp.async.bulk.tensor.3d.shared::cta.global.tile.mbarrier::complete_tx::bytes" in ptx
    assert "cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group" in ptx
    # producer/consumer register split and stmatrix epilogue
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    assert "stmatrix.sync.aligned" in ptx
    # the predicated partial-tile path stores to global directly
    assert "st.global" in ptx
    # no register spills to local memory
    assert ".local" not in ptx
    assert set(ptx_features(ptx)) == {"wgmma", "tma-load", "tma-store", "setmaxnreg", "stmatrix"}


def test_cache_compiles_once_per_key():
    cfg = HEURISTIC_CONFIGS[0]
    fn = fg_compile.get_kernel(cfg, arch="sm_90a")
    before = fg_compile.compile_count
    assert fg_compile.get_kernel(cfg, arch="sm_90a") is fn
    assert fg_compile.compile_count == before
    key = fg_compile.cache_key(cfg, "bf16", "bf16", "sm_90a")
    assert key != fg_compile.cache_key(HEURISTIC_CONFIGS[1], "bf16", "bf16", "sm_90a")
    assert key != fg_compile.cache_key(cfg, "fp16", "fp16", "sm_90a")
    assert key != fg_compile.cache_key(cfg, "bf16", "bf16", "sm_100a")


def test_unsupported_config_rejected_before_compiling():
    from flashgemm.config import GemmConfig

    before = fg_compile.compile_count
    with pytest.raises(ValueError, match="cluster"):
        fg_compile.build(GemmConfig(cluster_m=2), arch="sm_90a")
    with pytest.raises(ValueError, match="stages"):
        fg_compile.build(GemmConfig(tile_m=128, tile_n=256, stages=9), arch="sm_90a")
    assert fg_compile.compile_count == before


def test_cli_compile_lists_every_config():
    res = subprocess.run(
        [sys.executable, "-m", "flashgemm", "compile", "--arch", "sm_90a"],
        capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    for cfg in HEURISTIC_CONFIGS:
        line = next(l for l in res.stdout.splitlines() if cfg.short_name() in l)
        assert "wgmma" in line and "tma-load" in line
