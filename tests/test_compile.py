"""Compile-only tests: the real sm_90a build, no GPU needed (runs in CI)."""

import dataclasses
import re
import subprocess
import sys

import pytest

from flashgemm import compile as fg_compile
from flashgemm.__main__ import ptx_features
from flashgemm.config import FP8_HEURISTIC_CONFIGS, HEURISTIC_CONFIGS, SM90_SMEM_BYTES


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
    _check_balance_ptx(ptx, cfg)
    _check_a_loads(ptx, cfg, fp8=False)


def _check_a_loads(ptx, cfg, fp8):
    """One TMA load per box of A a CTA may load: its share of the tile, or
    with a_chunk_rows each of its chunks (multicast to the cluster when
    cluster_n is 2); then B, and the activation scales for fp8."""
    boxes = cfg.tile_m // cfg.a_chunk_rows // cfg.cluster_n if cfg.a_chunk_rows else 1
    multicast = re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::cluster\.global\.tile\S*multicast", ptx)
    local = re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::cta\.global\.tile\.mbarrier", ptx)
    if cfg.cluster_n == 2:
        assert (len(multicast), len(local)) == (boxes, 1 + fp8), cfg.short_name()
    else:
        assert (len(multicast), len(local)) == (0, boxes + 1 + fp8), cfg.short_name()


def test_a_chunk_rows_rules():
    from flashgemm.config import GemmConfig

    for bad, cfg in ((8, GemmConfig()), (48, GemmConfig()), (64, GemmConfig(tile_m=192, consumer_warpgroups=3, cluster_n=2))):
        with pytest.raises(ValueError, match=r"config\.a_chunk_rows must be 0, or 16, 32 or 64"):
            dataclasses.replace(cfg, a_chunk_rows=bad).validate()
    # a 128-row tile of a 2-CTA cluster: 64-row chunks, one per CTA, are fine
    GemmConfig(cluster_n=2, a_chunk_rows=64).validate()
    # the heuristic skips the chunks past m_e up to expected_m 256, not in prefill
    from flashgemm.config import choose_config

    for fp8 in (False, True):
        for signals in (False, True):
            for m in (16, 32, 64, 100, 128, 200, 256, 1024):
                cfg = choose_config(m, 4096, 4096, 7168, 132, fp8=fp8, num_experts=8, signals=signals)
                assert cfg.a_chunk_rows == (32 if m <= 256 else 0), (m, cfg.short_name())


def _check_balance_ptx(ptx, cfg):
    reductions = re.findall(r"redux\.sync\.add\.s32", ptx)
    barrier_3 = bool(re.search(r"bar(rier)?\.sync(\.aligned)?\s+3,", ptx))
    ballots = re.findall(r"vote\.sync\.ballot\.b32", ptx)
    if cfg.n_major:
        # each role (producer, store warp, consumers) counts the m-blocks
        # with one warp reduction, finds its tiles with a warp scan and a
        # ballot, and cuts its own grid: no barrier 3
        assert len(reductions) == 3 and not barrier_3
        assert ballots and re.search(r"shfl\.sync\.up\.b32", ptx)
        # with n_major_window, one more ballot per search finds the window
        assert len(ballots) == (12 if cfg.n_major_window else 6)
        return
    if cfg.split_last_round:
        # each role counts the units itself (one warp reduction) to find the
        # last round; no barrier 3, no scan
        assert len(reductions) == 3 and not barrier_3 and not ballots
        return
    # balance_rounds: one warp (the producer) counts the units with a warp
    # reduction and hands the result over on named barrier 3
    assert len(reductions) == (1 if cfg.balance_rounds else 0)
    assert barrier_3 == cfg.balance_rounds
    assert not ballots


@pytest.fixture(scope="module")
def fp8_ptx_by_config():
    return {
        cfg: fg_compile.build(cfg, "fp8e4m3", arch="sm_90a", keep_ptx=True).__ptx__
        for cfg in FP8_HEURISTIC_CONFIGS
    }


@pytest.mark.parametrize("cfg", FP8_HEURISTIC_CONFIGS, ids=lambda c: c.short_name())
def test_fp8_ptx(fp8_ptx_by_config, cfg):
    ptx = fp8_ptx_by_config[cfg]
    # fp8 e4m3 wgmma, k32 per instruction, fp32 accumulate
    # (promote_parts: one chain per part of the tile's width)
    part_n = cfg.tile_n // cfg.promote_parts
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{part_n}k32\.f32\.e4m3\.e4m3", ptx)
    assert "bf16" not in re.findall(r"wgmma\.mma_async\S*", ptx)[0]
    # operand and activation-scale TMA loads (A, B, scales) and the TMA store
    # (A may be multicast: shared::cluster)
    loads = re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::\w+\.global\.tile\.mbarrier", ptx)
    assert len(loads) >= 3
    assert "cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group" in ptx
    # promotion: fp32 FMAs on the CUDA cores
    assert "fma.rn.f32" in ptx
    assert ".local" not in ptx
    if cfg.tile_n % 128:
        # a 192-wide tile straddles a 128-column weight-scale block: the scale
        # is picked per row half (2 selects), not per value (48, which made
        # the prefill tile 1.3-1.5x slower)
        assert len(re.findall(r"selp\.f32", ptx)) <= 4
    # promote_overlap: the next k-tile's chain is committed before this one's
    # is waited for (wait_group 1); one product set waits for everything,
    # in promote_parts steps (the parts after the one promoted still pending)
    waits = set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx))
    assert waits == ({"0", "1"} if cfg.promote_overlap else {str(p) for p in range(cfg.promote_parts)})
    # the weight scales ride in the slot: after arming the slot's full barrier
    # and issuing its TMA loads, the producer copies them from global to
    # shared memory with 4-byte cp.async, whose completion is the barrier's
    # second arrival ...
    lines = ptx.splitlines()
    noinc = [i for i, line in enumerate(lines) if "cp.async.mbarrier.arrive.noinc.shared.b64" in line]
    assert len(noinc) == 1
    before = "\n".join(lines[noinc[0] - 6:noinc[0]])
    # one scale per 128-row block of N the tile covers: two where it straddles
    assert len(re.findall(r"cp\.async\.ca\.shared\.global [^;]*, 4, 4;", before)) == (2 if 128 % cfg.tile_n else 1)
    window = "\n".join(lines[max(0, noinc[0] - 200):noinc[0]])
    armed = window.rfind("mbarrier.arrive.expect_tx")
    assert armed >= 0 and "cp.async.bulk.tensor.3d.shared" in window[armed:]
    # ... so no consumer loads anything from global memory while a chain runs
    in_flight = re.findall(r"wgmma\.commit_group\.sync\.aligned;(.*?)wgmma\.wait_group", ptx, re.S)
    assert in_flight and "ld.global" not in "".join(in_flight)
    assert {"wgmma", "fp8-wgmma", "tma-load", "tma-store"} <= set(ptx_features(ptx))
    _check_balance_ptx(ptx, cfg)
    _check_a_loads(ptx, cfg, fp8=True)


@pytest.mark.parametrize(
    "cfg, dtype",
    [
        (next(c for c in HEURISTIC_CONFIGS if c.tile_n == 256), "bf16"),  # 8 sub-tiles
        (next(c for c in FP8_HEURISTIC_CONFIGS if c.tile_n == 192), "fp8e4m3"),  # 6 sub-tiles
    ],
    ids=["bf16-n256", "fp8-n192"],
)
def test_epi_whole_tile_staging(cfg, dtype):
    """With epi_whole_tile the staging area holds every sub-tile (fewer stages
    fit) and each consumer warpgroup hands its rows to the store warp on its
    own pair of named barriers (epilogue.WarpgroupHandoff): the store warp
    arrives at each *free* barrier (ids 4..) after waiting for that
    warpgroup's bulk group to have read its rows, and waits at each *staged*
    one before storing them, one box of 64 rows per warpgroup and sub-tile;
    the consumers wait at *free* only and arrive at *staged*. The two-buffer
    staging crosses named barrier 1 twice per sub-tile instead."""
    sub_tiles = cfg.tile_n // 32
    wgs = cfg.consumer_warpgroups
    cfgs = {whole: dataclasses.replace(cfg, epi_whole_tile=whole) for whole in (False, True)}
    ptx = {whole: fg_compile.build(c, dtype, arch="sm_90a", keep_ptx=True).__ptx__ for whole, c in cfgs.items()}

    def bars(text, op, threads):
        return re.findall(rf"\bbar\.{op}\s+(\S+), {threads};", text)

    stores = r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta\.tile\.bulk_group"
    two, whole = ptx[False], ptx[True]
    assert len(re.findall(stores, two)) == sub_tiles
    assert len(re.findall(r"cp\.async\.bulk\.wait_group\.read", two)) == sub_tiles
    # two crossings per sub-tile, written once on each side
    assert len(bars(two, "sync", 128 * wgs + 32)) == 4 * sub_tiles and not bars(two, "arrive", 160)

    assert len(re.findall(stores, whole)) == wgs * sub_tiles
    read_waits = re.findall(r"cp\.async\.bulk\.wait_group\.read\s+(\d+);", whole)
    assert sorted(read_waits) == [str(i) for i in range(wgs)]
    free_ids = [str(4 + w) for w in range(wgs)]
    staged_ids = [str(4 + wgs + w) for w in range(wgs)]
    # store warp (constant ids), consumers (their warpgroup's id, in a register)
    assert sorted(i for i in bars(whole, "arrive", 160) if i[0] != "%") == free_ids
    assert sorted(i for i in bars(whole, "sync", 160) if i[0] != "%") == staged_ids
    assert [i for i in bars(whole, "sync", 160) if i[0] == "%"]  # consumers wait at free
    assert [i for i in bars(whole, "arrive", 160) if i[0] == "%"]  # and arrive at staged
    assert not bars(whole, "sync", 128 * wgs + 32)  # barrier 1 unused

    elem = 1 if dtype == "fp8e4m3" else 2
    assert cfgs[True].epi_bytes() == cfg.tile_m * cfg.tile_n * 2
    assert cfgs[True].smem_bytes(elem) <= SM90_SMEM_BYTES
    assert cfgs[True].resolved_stages(elem) < cfgs[False].resolved_stages(elem)


def test_fp8_config_rules():
    from flashgemm.config import GemmConfig

    with pytest.raises(ValueError, match="tile_k must be 128 for 8-bit"):
        GemmConfig(tile_m=64, tile_n=128, consumer_warpgroups=1).validate(1)
    with pytest.raises(ValueError, match="tile_k must be 64 for 16-bit"):
        GemmConfig(tile_m=64, tile_n=128, tile_k=128, consumer_warpgroups=1).validate(2)
    with pytest.raises(ValueError, match="<= 192 for fp8"):
        GemmConfig(tile_m=64, tile_n=256, tile_k=128, consumer_warpgroups=1).validate(1)
    with pytest.raises(ValueError, match="promote_overlap applies to block-scaled fp8"):
        GemmConfig(promote_overlap=True).validate(2)
    with pytest.raises(ValueError, match="tile_n must be <= 128 with promote_overlap"):
        GemmConfig(tile_n=192, tile_k=128, promote_overlap=True).validate(1)
    for bad in (
        dict(promote_parts=2, promote_overlap=True),  # two product sets already overlap
        dict(promote_parts=5),
        dict(tile_n=64, promote_parts=3),  # parts must be whole 8-column groups
    ):
        with pytest.raises(ValueError, match="promote_parts"):
            GemmConfig(**{"tile_k": 128, **bad}).validate(1)
    with pytest.raises(ValueError, match="promote_parts"):
        GemmConfig(promote_parts=2).validate(2)  # bf16
    for cfg in FP8_HEURISTIC_CONFIGS:
        assert cfg.validate(1) is cfg and fg_compile.operand_dtype(cfg) == "fp8e4m3"


def test_balance_rounds_is_static_order_only():
    from flashgemm.config import GemmConfig

    with pytest.raises(ValueError, match="balance_rounds applies to the static order"):
        GemmConfig(dynamic=True, balance_rounds=True).validate()
    # the heuristic balances its 128x128 tiles (bf16 and fp8) and the fp8
    # 128x192 prefill tile when signals keep it from splitting its last round
    for cfg in HEURISTIC_CONFIGS + FP8_HEURISTIC_CONFIGS:
        fp8_prefill = cfg.tile_k == 128 and cfg.tile_n == 192
        want = cfg.tile_m == 128 and (cfg.tile_n == 128 or fp8_prefill) and not cfg.split_last_round
        assert cfg.balance_rounds == want, cfg.short_name()


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
        line = next(l for l in res.stdout.splitlines() if cfg.short_name() in l and "bf16" in l)
        assert "wgmma" in line and "tma-load" in line and "fp8-wgmma" not in line
    for cfg in FP8_HEURISTIC_CONFIGS:
        line = next(l for l in res.stdout.splitlines() if cfg.short_name() in l and "fp8e4m3" in l)
        assert "fp8-wgmma" in line and "tma-load" in line


# Global-memory instructions of the GEMM kernel (loads, stores, TMA, the
# signals' release adds) that must come after griddepcontrol.wait.
_GLOBAL_ACCESS = r"\b(ld\.global|st\.global|cp\.async\.bulk\.tensor|red\.release|atom\.)"


@pytest.mark.parametrize(
    "cfg, dtype, mode",
    [
        (HEURISTIC_CONFIGS[0], "bf16", None),
        (HEURISTIC_CONFIGS[3], "bf16", "m_block"),
        (FP8_HEURISTIC_CONFIGS[1], "fp8e4m3", "expert"),
    ],
    ids=["bf16", "bf16-signals", "fp8-signals"],
)
def test_pdl_waits_before_any_global_access(cfg, dtype, mode):
    """With programmatic dependent launch (the default) the kernel may start
    while its predecessor still runs: its one griddepcontrol.wait must come
    before the first global access in the code, and it lets dependents launch
    once (after its loads). Without PDL neither instruction is emitted."""
    ptx = fg_compile.build(cfg, dtype, arch="sm_90a", keep_ptx=True, signal_mode=mode).__ptx__
    assert cfg.pdl
    assert ptx.count("griddepcontrol.wait") == 1
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    first_access = re.search(_GLOBAL_ACCESS, ptx)
    assert first_access and ptx.index("griddepcontrol.wait") < first_access.start()
    plain = fg_compile.build(
        dataclasses.replace(cfg, pdl=False), dtype, arch="sm_90a", keep_ptx=True, signal_mode=mode
    ).__ptx__
    assert "griddepcontrol" not in plain
    assert re.search(_GLOBAL_ACCESS, plain)
    # l2_warmup (on by default, with PDL only): the TMA prefetches of the
    # first weight k-tiles into L2 are issued before the wait
    warm = "cp.async.bulk.prefetch.tensor.3d.L2.global"
    assert cfg.l2_warmup and 0 <= ptx.find(warm) < ptx.index("griddepcontrol.wait")
    assert warm not in plain
    cold = fg_compile.build(
        dataclasses.replace(cfg, l2_warmup=False), dtype, arch="sm_90a", keep_ptx=True, signal_mode=mode
    ).__ptx__
    assert warm not in cold and cold.count("griddepcontrol.wait") == 1


@pytest.mark.parametrize(
    "cfg, dtype",
    [
        (dataclasses.replace(HEURISTIC_CONFIGS[1], dynamic=True, balance_rounds=False), "bf16"),  # 2-CTA cluster
        (dataclasses.replace(HEURISTIC_CONFIGS[3], dynamic=True, balance_rounds=False, cluster_n=1), "bf16"),
        (dataclasses.replace(FP8_HEURISTIC_CONFIGS[1], dynamic=True, balance_rounds=False), "fp8e4m3"),
    ],
    ids=["bf16-cluster2", "bf16-cluster1", "fp8-cluster2"],
)
def test_dynamic_order_claims_and_returns_the_counter(cfg, dtype):
    """The dynamic order claims units with a relaxed global add, counts
    finished clusters with an acq_rel add (whose last one zeroes the counter),
    hands claims to the cluster's peer with st.async into its shared memory,
    and still touches no global memory before griddepcontrol.wait. The
    static build has none of it."""
    ptx = fg_compile.build(cfg, dtype, arch="sm_90a", keep_ptx=True).__ptx__
    assert re.search(r"atom\.global\.add\.u32", ptx)
    assert re.search(r"atom\.global\.acq_rel\.add\.u32", ptx)
    if cfg.cluster_n > 1:
        assert "st.async" in ptx and "mbarrier.arrive.expect_tx.shared::cluster" in ptx
    else:
        assert "st.async" not in ptx
    first_access = re.search(_GLOBAL_ACCESS, ptx)
    assert ptx.index("griddepcontrol.wait") < first_access.start()
    static = fg_compile.build(dataclasses.replace(cfg, dynamic=False), dtype, arch="sm_90a", keep_ptx=True).__ptx__
    assert "atom.global" not in static and "st.async" not in static
