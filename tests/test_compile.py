"""Compile-only tests: the real sm_90a build, no GPU needed (runs in CI)."""

import re

import pytest

from flashgemm.__main__ import ptx_features
from flashgemm.sm90.backend import gemm_ptx_ok as sm90_ok
from flashgemm.config import Epilogue, GemmConfig, KernelSpec, Promotion, Staging, Tail, TileOrder
from flashgemm.formats import Format
from flashgemm.jit import cache
from flashgemm.jit.key import cache_key
from flashgemm.sm90 import barriers
from flashgemm.sm90 import build as sm90_build
from flashgemm.sm90.heuristic import (
    DECODE_128_CONFIG,
    DECODE_CONFIG,
    FP8_DECODE_N64_CONFIG,
    MID_192_N128_CONFIG,
    reachable_specs,
)
from flashgemm.sm90.limits import SMEM_BYTES, check_config, epi_bytes, resolved_stages, smem_bytes

BF16, FP8 = Format.BF16, Format.FP8_BLOCK128
# every configuration the heuristic can pick, once each (their signalled
# builds are listed by the CLI test below)
BF16_CONFIGS = tuple(dict.fromkeys(s.config for s in reachable_specs(BF16)))
FP8_CONFIGS = tuple(dict.fromkeys(s.config for s in reachable_specs(FP8)))


@pytest.fixture(scope="module")
def ptx(kernel_ptx):
    """``ptx(config, operands, signal_mode=None)``: the PTX of that kernel,
    each one built once per session (by the listing run when it runs:
    conftest.kernel_ptx)."""

    def get(config, operands=BF16, signal_mode=None):
        return kernel_ptx(KernelSpec(config, operands, signal_mode))

    return get


@pytest.mark.parametrize("cfg", BF16_CONFIGS, ids=lambda c: c.short_name())
def test_ptx_has_hopper_features(ptx, cfg):
    ptx = ptx(cfg)
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
    for bad, cfg in ((8, GemmConfig()), (48, GemmConfig()), (64, GemmConfig(tile_m=192, cluster_n=2))):
        with pytest.raises(ValueError, match=r"config\.a_chunk_rows must be 0, or 16, 32 or 64"):
            check_config(cfg.replace(a_chunk_rows=bad), BF16)
    # a 128-row tile of a 2-CTA cluster: 64-row chunks, one per CTA, are fine
    check_config(GemmConfig(cluster_n=2, a_chunk_rows=64), BF16)
    # the heuristic skips the chunks past m_e up to expected_m 256, not in prefill
    from flashgemm.sm90.heuristic import choose_config

    for fp8 in (False, True):
        for signals in (False, True):
            for m in (16, 32, 64, 100, 128, 200, 256, 1024):
                cfg = choose_config(m, 4096, 4096, 7168, 132, fp8=fp8, num_experts=8, signals=signals)
                assert cfg.a_chunk_rows == (32 if m <= 256 else 0), (m, cfg.short_name())


def _check_balance_ptx(ptx, cfg):
    reductions = re.findall(r"redux\.sync\.add\.s32", ptx)
    balance_barrier = bool(re.search(rf"bar(rier)?\.sync(\.aligned)?\s+{barriers.BALANCE},", ptx))
    ballots = re.findall(r"vote\.sync\.ballot\.b32", ptx)
    if cfg.n_major:
        # each role (producer, store warp, consumers) counts the m-blocks
        # with one warp reduction, finds its tiles with a warp scan and a
        # ballot, and cuts its own grid: no balance barrier
        assert len(reductions) == 3 and not balance_barrier
        assert ballots and re.search(r"shfl\.sync\.up\.b32", ptx)
        # with n_major_window, one more ballot per search finds the window
        assert len(ballots) == (12 if cfg.n_major_window else 6)
        return
    if cfg.tail is Tail.SPLIT:
        # each role counts the units itself (one warp reduction) to find the
        # last round; no balance barrier, no scan
        assert len(reductions) == 3 and not balance_barrier and not ballots
        return
    # Tail.BALANCE: one warp (the producer) counts the units with a warp
    # reduction and hands the result over on named barrier barriers.BALANCE
    balanced = cfg.tail is Tail.BALANCE
    assert len(reductions) == (1 if balanced else 0)
    assert balance_barrier == balanced
    assert not ballots


@pytest.mark.parametrize("cfg", FP8_CONFIGS, ids=lambda c: c.short_name())
def test_fp8_ptx(ptx, cfg):
    ptx = ptx(cfg, FP8)
    # fp8 e4m3 wgmma, k32 per instruction, fp32 accumulate
    # (Promotion.TWO_PARTS: one chain per part of the tile's width)
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
    # Promotion.OVERLAPPED: the next k-tile's chain is committed before this
    # one's is waited for (wait_group 1); one product set waits for
    # everything, in promote_parts steps (the parts after the one promoted
    # still pending)
    waits = set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx))
    overlapped = cfg.promotion is Promotion.OVERLAPPED
    assert waits == ({"0", "1"} if overlapped else {str(p) for p in range(cfg.promote_parts)})
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


STAGING_CASES = [
    (next(c for c in BF16_CONFIGS if c.tile_n == 256), BF16),  # 8 sub-tiles
    (next(c for c in FP8_CONFIGS if c.tile_n == 192), FP8),  # 6 sub-tiles
]


@pytest.mark.parametrize("cfg, operands", STAGING_CASES, ids=["bf16-n256", "fp8-n192"])
def test_epi_whole_tile_staging(ptx, cfg, operands):
    """With Staging.WHOLE_TILE the staging area holds every sub-tile (fewer
    stages fit) and each consumer warpgroup hands its rows to the store warp
    on its own pair of named barriers (barriers.WarpgroupHandoff): the store
    warp arrives at each *free* barrier (ids HANDOFF_FIRST..) after waiting
    for that warpgroup's bulk group to have read its rows, and waits at each
    *staged* one before storing them, one box of 64 rows per warpgroup and
    sub-tile; the consumers wait at *free* only and arrive at *staged*. The
    two-buffer staging (Staging.PAIR) crosses named barrier EPILOGUE twice
    per sub-tile instead."""
    sub_tiles = cfg.tile_n // 32
    wgs = cfg.consumer_warpgroups
    cfgs = {whole: cfg.replace(staging=Staging.WHOLE_TILE if whole else Staging.PAIR) for whole in (False, True)}
    text = {whole: ptx(c, operands) for whole, c in cfgs.items()}

    def bars(text, op, threads):
        return re.findall(rf"\bbar\.{op}\s+(\S+), {threads};", text)

    stores = r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta\.tile\.bulk_group"
    two, whole = text[False], text[True]
    assert len(re.findall(stores, two)) == sub_tiles
    assert len(re.findall(r"cp\.async\.bulk\.wait_group\.read", two)) == sub_tiles
    # two crossings per sub-tile, written once on each side
    assert len(bars(two, "sync", 128 * wgs + 32)) == 4 * sub_tiles and not bars(two, "arrive", 160)
    assert set(bars(two, "sync", 128 * wgs + 32)) == {str(barriers.EPILOGUE)}

    assert len(re.findall(stores, whole)) == wgs * sub_tiles
    read_waits = re.findall(r"cp\.async\.bulk\.wait_group\.read\s+(\d+);", whole)
    assert sorted(read_waits) == [str(i) for i in range(wgs)]
    free_ids = [str(barriers.HANDOFF_FIRST + w) for w in range(wgs)]
    staged_ids = [str(barriers.HANDOFF_FIRST + wgs + w) for w in range(wgs)]
    assert barriers.HANDOFF_FIRST == 4
    # store warp (constant ids), consumers (their warpgroup's id, in a register)
    assert sorted(i for i in bars(whole, "arrive", 160) if i[0] != "%") == free_ids
    assert sorted(i for i in bars(whole, "sync", 160) if i[0] != "%") == staged_ids
    assert [i for i in bars(whole, "sync", 160) if i[0] == "%"]  # consumers wait at free
    assert [i for i in bars(whole, "arrive", 160) if i[0] == "%"]  # and arrive at staged
    assert not bars(whole, "sync", 128 * wgs + 32)  # barrier EPILOGUE unused

    assert epi_bytes(cfgs[True]) == cfg.tile_m * cfg.tile_n * 2
    assert smem_bytes(cfgs[True], operands) <= SMEM_BYTES
    assert resolved_stages(cfgs[True], operands) < resolved_stages(cfgs[False], operands)


def test_fp8_config_rules():
    # (tile_k is no field any more: Format.tile_k derives it, so no config
    # can hold a K depth that does not match its operands)
    with pytest.raises(ValueError, match="<= 192 for fp8"):
        check_config(GemmConfig(tile_m=64, tile_n=256), FP8)
    check_config(GemmConfig(tile_m=64, tile_n=256), BF16)  # bf16 may
    with pytest.raises(ValueError, match="promotion=OVERLAPPED applies to block-scaled fp8 operands only"):
        check_config(GemmConfig(promotion=Promotion.OVERLAPPED), BF16)
    with pytest.raises(ValueError, match="tile_n must be <= 128 with promotion=OVERLAPPED"):
        check_config(GemmConfig(tile_n=192, promotion=Promotion.OVERLAPPED), FP8)
    with pytest.raises(ValueError, match="promotion=TWO_PARTS applies to block-scaled fp8"):
        check_config(GemmConfig(promotion=Promotion.TWO_PARTS), BF16)  # bf16
    check_config(GemmConfig(tile_n=192, promotion=Promotion.TWO_PARTS), FP8)
    with pytest.raises(ValueError, match=r"config\.promotion must be a flashgemm\.Promotion"):
        check_config(GemmConfig(promotion=2), FP8)
    for spec in reachable_specs(FP8):
        assert check_config(spec.config, FP8) is spec.config and spec.fmt is FP8


def test_balance_rounds_is_static_order_only():
    with pytest.raises(ValueError, match="config.tail=BALANCE applies to the static orders"):
        check_config(GemmConfig(order=TileOrder.DYNAMIC, tail=Tail.BALANCE), BF16)
    # the heuristic balances its 128x128 tiles (bf16 and fp8) and the fp8
    # 128x192 prefill tile when signals keep it from splitting its last round
    # (the MXFP4-weight picks are these, adapted: test_mxfp4_kernel)
    for spec in reachable_specs(BF16) + reachable_specs(FP8):
        if spec.epilogue.activates:  # (the fused SwiGLU widens the pick and keeps its tail)
            continue
        cfg = spec.config
        fp8_prefill = spec.fmt is FP8 and cfg.tile_n == 192
        want = cfg.tile_m == 128 and (cfg.tile_n == 128 or fp8_prefill) and cfg.tail is not Tail.SPLIT
        assert (cfg.tail is Tail.BALANCE) == want, spec.name()


def test_cache_compiles_once_per_key():
    spec = reachable_specs(BF16)[0]
    fn = sm90_build.get_kernel(spec, arch="sm_90a")
    before = cache.compile_count
    assert sm90_build.get_kernel(spec, arch="sm_90a") is fn
    assert cache.compile_count == before
    key = cache_key("sm_90a", spec)
    assert key != cache_key("sm_90a", reachable_specs(BF16)[1])
    assert key != cache_key("sm_90a", KernelSpec(spec.config, FP8, spec.signal_mode))
    assert key != cache_key("sm_90a", KernelSpec(spec.config, BF16, "m_block"))
    assert key != cache_key("sm_100a", spec)


def test_unsupported_config_rejected_before_compiling():
    before = cache.compile_count
    with pytest.raises(ValueError, match="cluster"):
        sm90_build.build(KernelSpec(GemmConfig(cluster_n=4), BF16), arch="sm_90a")
    with pytest.raises(ValueError, match="stages"):
        sm90_build.build(KernelSpec(GemmConfig(tile_m=128, tile_n=256, stages=9), BF16), arch="sm_90a")
    with pytest.raises(ValueError, match="promotion=OVERLAPPED"):
        sm90_build.build(KernelSpec(GemmConfig(promotion=Promotion.OVERLAPPED), BF16), arch="sm_90a")
    assert cache.compile_count == before


_LINE = re.compile(r"^\s*\[\s*(\d+)/(\d+)\]\s+(\S+)\s+[\d.]+ s\s+PTX: (.*)$")


def test_cli_compile_lists_every_kernel(cli_compile_listing):
    """``python -m flashgemm compile --arch sm_90a``: one line per reachable
    spec, then one per combine, per MoE activation and per expert-parallel
    kernel, each with its PTX features; exit 0."""
    res = cli_compile_listing
    assert res.returncode == 0, res.stderr[-2000:]
    lines = {}
    for line in res.stdout.splitlines():
        m = _LINE.match(line)
        if m:
            lines[m.group(3)] = (int(m.group(1)), int(m.group(2)), set(m.group(4).split(", ")))
    specs = reachable_specs()
    block_ms = sm90_build.combine_block_ms(specs)
    from flashgemm.ep.combine import ep_kernel_jobs

    ep_names = [name for name, _, _ in ep_kernel_jobs("sm_90a", block_ms)]
    total = len(specs) + len(block_ms) + 4 + len(ep_names)  # and the MoE activations, the EP kernels
    assert len(lines) == total and sorted(i for i, _, _ in lines.values()) == list(range(1, total + 1))
    assert {t for _, t, _ in lines.values()} == {total}
    for spec in specs:
        _, _, feats = lines[spec.name()]
        assert "wgmma" in feats and "tma-load" in feats, spec.name()
        assert ("fp8-wgmma" in feats) == spec.fmt.promotes, spec.name()
        # MXFP4 weights: the converters' e2m1 lookups, in those builds only
        assert ("e2m1-lookup" in feats) == spec.fmt.converts_weights, spec.name()
        # a signalled kernel publishes: bulk stores complete, proxy fence, release add
        assert ("signal-publish" in feats) == (spec.signal_mode is not None), spec.name()
        # the fused combine reduces its rows into the token rows and stores none
        fused = spec.epilogue is not Epilogue.STORE  # a combine, or the SwiGLU: rows leave from registers
        target = Epilogue(spec.epilogue.value.removesuffix("_bias"))  # (a *_BIAS combine: its plain twin)
        assert ("combine-reduce" in feats) == (target is Epilogue.COMBINE), spec.name()
        assert ("combine-reduce-bf16" in feats) == (target is Epilogue.COMBINE_BF16), spec.name()
        assert ("combine-peer-store" in feats) == (target is Epilogue.COMBINE_PEERS), spec.name()
        # 16-byte loads: the bias pieces of the *_BIAS combines, in no other GEMM
        assert ("v4-load" in feats) == ("bias" in spec.epilogue.op.params), spec.name()
        assert ("tma-store" in feats) != fused, spec.name()
        if spec.epilogue.activates:  # the fused SwiGLU: fp8 h only from the fp8 build
            assert ("fp8-cvt" in feats) == (spec.epilogue is Epilogue.SWIGLU_FP8), spec.name()
    for kind in ("silu_mul", "gpt_oss"):
        assert "fp8-cvt" in lines[f"moe-{kind}-fp8"][2] and "fp8-cvt" not in lines[f"moe-{kind}-bf16"][2]
    for block_m in block_ms:
        _, _, feats = lines[f"combine-block_m{block_m}-rows4"]
        assert "bulk-reduce" in feats and "acquire-poll" in feats
    # the EP combine polls and completes at system scope; the completion step only completes
    for name in ep_names:
        feats = lines[name][2]
        if name.startswith("ep-dispatch"):  # rows stored into the peers; waits on their posts at system scope
            assert {"sys-acquire", "combine-peer-store"} <= feats and "acquire-poll" not in feats, name
            assert ("fp8-cvt" in feats) == ("-fp8-" in name), name
            continue
        handshake = {"sys-release", "sys-acquire"} <= feats
        assert handshake == (not name.startswith("ep-token-sum")), name
        assert ("acquire-poll" in feats) == name.startswith("ep-combine"), name


# Global-memory instructions of the GEMM kernel (loads, stores, TMA, the
# signals' release adds) that must come after griddepcontrol.wait.
_GLOBAL_ACCESS = r"\b(ld\.global|st\.global|cp\.async\.bulk\.tensor|red\.release|atom\.)"


PDL_CASES = [
    (DECODE_CONFIG, BF16, None),
    (MID_192_N128_CONFIG, BF16, "m_block"),
    (FP8_DECODE_N64_CONFIG, FP8, "expert"),
]


@pytest.mark.parametrize("cfg, operands, mode", PDL_CASES, ids=["bf16", "bf16-signals", "fp8-signals"])
def test_pdl_waits_before_any_global_access(ptx, cfg, operands, mode):
    """With programmatic dependent launch (the default) the kernel may start
    while its predecessor still runs: its one griddepcontrol.wait must come
    before the first global access in the code, and it lets dependents launch
    once (after its loads). Without PDL neither instruction is emitted."""
    text = ptx(cfg, operands, mode)
    assert cfg.pdl
    assert text.count("griddepcontrol.wait") == 1
    assert text.count("griddepcontrol.launch_dependents") == 1
    first_access = re.search(_GLOBAL_ACCESS, text)
    assert first_access and text.index("griddepcontrol.wait") < first_access.start()
    plain = ptx(cfg.replace(pdl=False), operands, mode)
    assert "griddepcontrol" not in plain
    assert re.search(_GLOBAL_ACCESS, plain)
    # l2_warmup (on by default, with PDL only): the TMA prefetches of the
    # first weight k-tiles into L2 are issued before the wait
    warm = "cp.async.bulk.prefetch.tensor.3d.L2.global"
    assert cfg.l2_warmup and 0 <= text.find(warm) < text.index("griddepcontrol.wait")
    assert warm not in plain
    cold = ptx(cfg.replace(l2_warmup=False), operands, mode)
    assert warm not in cold and cold.count("griddepcontrol.wait") == 1


DYNAMIC_CASES = [
    (DECODE_128_CONFIG.replace(order=TileOrder.DYNAMIC, tail=Tail.NONE), BF16),  # 2-CTA cluster
    (MID_192_N128_CONFIG.replace(order=TileOrder.DYNAMIC, tail=Tail.NONE, cluster_n=1), BF16),
    (FP8_DECODE_N64_CONFIG.replace(order=TileOrder.DYNAMIC, tail=Tail.NONE), FP8),
]


@pytest.mark.parametrize("cfg, operands", DYNAMIC_CASES, ids=["bf16-cluster2", "bf16-cluster1", "fp8-cluster2"])
def test_dynamic_order_claims_and_returns_the_counter(ptx, cfg, operands):
    """The dynamic order claims units with a relaxed global add, counts
    finished clusters with an acq_rel add (whose last one zeroes the counter),
    hands claims to the cluster's peer with st.async into its shared memory,
    and still touches no global memory before griddepcontrol.wait. The
    static build has none of it."""
    text = ptx(cfg, operands)
    assert re.search(r"atom\.global\.add\.u32", text)
    assert re.search(r"atom\.global\.acq_rel\.add\.u32", text)
    if cfg.cluster_n > 1:
        assert "st.async" in text and "mbarrier.arrive.expect_tx.shared::cluster" in text
    else:
        assert "st.async" not in text
    first_access = re.search(_GLOBAL_ACCESS, text)
    assert text.index("griddepcontrol.wait") < first_access.start()
    static = ptx(cfg.replace(order=TileOrder.EXPERT_MAJOR), operands)
    assert "atom.global" not in static and "st.async" not in static


# one fused combine into the peers' receive buffers per operand format (the
# listing checks every reachable one)
PEER_SPECS = tuple(next(s for s in reachable_specs(ops) if s.epilogue is Epilogue.COMBINE_PEERS) for ops in (BF16, FP8))


@pytest.mark.parametrize("spec", PEER_SPECS, ids=lambda s: s.name())
def test_combine_peers_stores_each_row_piece_once_without_reductions(kernel_ptx, spec):
    ptx = kernel_ptx(spec)
    feats = ptx_features(ptx)
    assert "combine-peer-store" in feats and sm90_ok(spec, feats)
    assert not {"combine-reduce", "combine-reduce-bf16", "tma-store"} & set(feats)
    assert not re.search(r"\bred\.", ptx) and "atom.global.add.f32" not in ptx  # plain stores only
    # each row's address read from the table (64-bit loads), one 16-byte store per
    # row piece: 2 rows a thread x tile_n / 32 sub-tiles, the compile-time unrolled count
    assert "ld.global.b64" in ptx
    assert ptx.count("st.global.v4.b32") == 2 * spec.config.tile_n // 32
    assert ".local" not in ptx


# one *_BIAS combine per target and operand format, beside its plain twin (the
# listing checks every reachable one)
BIAS_SPECS = tuple(next(s for s in reachable_specs(ops) if s.epilogue is epi)
                   for ops in (BF16, FP8, Format.FP8_MXFP4, Format.BF16_MXFP4)
                   for epi in (Epilogue.COMBINE_BIAS, Epilogue.COMBINE_BF16_BIAS, Epilogue.COMBINE_PEERS_BIAS))


@pytest.mark.parametrize("spec", BIAS_SPECS, ids=lambda s: s.name())
def test_combine_bias_loads_each_pieces_bias_and_adds_it_before_the_weight(kernel_ptx, spec):
    ptx = kernel_ptx(spec)
    twin = kernel_ptx(KernelSpec(spec.config, spec.fmt, None, Epilogue(spec.epilogue.value.removesuffix("_bias"))))
    feats, twin_feats = set(ptx_features(ptx)), set(ptx_features(twin))
    assert sm90_ok(spec, feats) and feats - twin_feats == {"v4-load"} and twin_feats <= feats
    # per row piece (2 a thread per sub-tile, the compile-time unrolled count) its 8 fp32 bias values in two
    # 16-byte loads, 8 adds, and no multiply beyond the twin's: (row + bias) * weight
    pieces = 2 * spec.config.tile_n // 32
    assert len(re.findall(r"ld\.global\S*\.v4\.", ptx)) == 2 * pieces
    adds, muls = r"\badd(?:\.rn)?\.f32\b", r"\bmul(?:\.rn)?\.f32\b"
    assert len(re.findall(adds, ptx)) - len(re.findall(adds, twin)) == 8 * pieces
    assert len(re.findall(muls, ptx)) == len(re.findall(muls, twin))
    assert ".local" not in ptx


def test_ptx_features_names_the_signal_publish_sequence_in_order():
    gemm = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 ...; cp.async.bulk.tensor.3d.shared::cta.global.tile"
    publish = (
        "cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 %r1, 1;\n\t"
        "red.release.gpu.global.add.s32 [%rd1], %r1;"
    )
    assert ptx_features(gemm) == ["wgmma", "tma-load"]
    assert ptx_features(gemm + publish)[-1] == "signal-publish"
    # out of order, the read-only wait, or no fence: no publish
    for bad in (
        "red.release.gpu.global.add.s32 [%rd1], %r1;\ncp.async.bulk.wait_group 0;\nfence.proxy.async.global;",
        publish.replace("wait_group 0", "wait_group.read 0"),
        publish.replace("fence.proxy.async.global;", ""),
    ):
        assert "signal-publish" not in ptx_features(gemm + bad)
    combine = "ld.acquire.gpu.global.b32 %r1, [%rd1]; cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32"
    assert ptx_features(combine) == ["bulk-reduce", "acquire-poll"]
    # a 16-byte store is a peer store only after a 64-bit load (the receive-buffer address)
    store = "st.global.v4.b32 [%rd9], {%r1, %r2, %r3, %r4};"
    assert ptx_features(store) == [] and ptx_features(store + "\nld.global.b64 %rd5, [%rd2];") == []
    assert ptx_features("ld.global.b64 %rd5, [%rd2];\n\tadd.s64 %rd9, %rd5, %rd8;\n\t" + store) == [
        "combine-peer-store"]
    # 16-byte global loads (a *_BIAS combine's bias pieces), cached or not; narrower ones are not
    for wide in ("ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd7+16];",
                 "ld.global.nc.v4.f32 {%f1, %f2, %f3, %f4}, [%rd7];"):
        assert ptx_features(wide) == ["v4-load"]
    assert ptx_features("ld.global.b32 %r1, [%rd7];\n\tld.global.v2.b32 {%r1, %r2}, [%rd7];") == []


class _FakeBuild:
    def __init__(self, ptx):
        self.__ptx__ = ptx


@pytest.mark.parametrize("publish", [True, False], ids=["publishes", "no-publish"])
@pytest.mark.parametrize("match", ["bf16-m128n64sAc2-ac32-l2hint-m_block", "bf16-m128n64sAc2-ac32-l2hint-nosig"])
def test_cli_compile_match_and_exit_status(monkeypatch, capsys, publish, match):
    """``compile --match SUBSTR`` lists only the GEMMs whose name holds it (no
    combine), and exits 1 when a signalled kernel's PTX lacks the publish
    sequence. (Builds stubbed: the listing's own logic, in process.)"""
    from flashgemm.__main__ import main

    ptx = ("wgmma.mma_async cp.async.bulk.tensor.3d.shared::cta.global "
           + ("cp.async.bulk.wait_group 0; fence.proxy.async.global; red.release.gpu.global.add.s32 [x], y;"
              if publish else ""))
    built = []
    monkeypatch.setattr(sm90_build, "build", lambda spec, arch=None, **kw: built.append(spec) or _FakeBuild(ptx))
    monkeypatch.setattr(sm90_build, "build_combine", lambda *a, **kw: pytest.fail("no combine with --match"))
    rc = main(["compile", "--arch", "sm_90a", f"--match={match}"])
    want = [s for s in reachable_specs() if match in s.name()]
    assert len(want) == 1 and built == want
    out = capsys.readouterr().out
    listed = [m.group(3) for m in map(_LINE.match, out.splitlines()) if m]
    assert listed == [s.name() for s in want]
    signalled = any(s.signal_mode for s in want)
    assert rc == (0 if publish or not signalled else 1)


# Every kernel whose PTX the tests above read, for the listing run to build
# beside the ones it lists (conftest.kernel_ptx).
PTX_SPECS = tuple(dict.fromkeys(
    [KernelSpec(c, BF16) for c in BF16_CONFIGS]
    + [KernelSpec(c, FP8) for c in FP8_CONFIGS]
    + [KernelSpec(cfg.replace(staging=staging), ops) for cfg, ops in STAGING_CASES for staging in Staging]
    + [KernelSpec(variant, ops, mode) for cfg, ops, mode in PDL_CASES
       for variant in (cfg, cfg.replace(pdl=False), cfg.replace(l2_warmup=False))]
    + [KernelSpec(variant, ops) for cfg, ops in DYNAMIC_CASES
       for variant in (cfg, cfg.replace(order=TileOrder.EXPERT_MAJOR))]
    + list(PEER_SPECS)
))
