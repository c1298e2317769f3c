"""Compile-only tests of the sm_100 blockwise fp8 kernel (no Blackwell GPU
needed; runs in CI). One process can target one arch and this one targets
sm_90a, so each Blackwell arch is built in a subprocess
(``python -m flashgemm.sm100.blockwise_ptx``) that writes the PTX of every
spec; the checks read it here."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from flashgemm.kernels_cli import SIGNAL_SEQUENCE
from flashgemm.schedule.model import tile_order, valid_tiles
from flashgemm.signals import GRANULARITIES, make_signal_layout
from flashgemm.sm100.blockwise_build import BlockwiseSpec, blockwise_specs, choose_blockwise

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ARCHS = ("sm_100a", "sm_103a")

TMA_LOAD = "cp.async.bulk.tensor.3d.shared::cta.global.tile.mbarrier::complete_tx::bytes"
TMA_STORE = "cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group"
RELEASE_ADD = "red.release.gpu.global.add.s32"


@pytest.fixture(scope="module", params=ARCHS)
def built(request, tmp_path_factory):
    """(arch, {spec name: PTX}, {spec name: compile seconds}) from one
    subprocess per arch."""
    arch = request.param
    out_dir = tmp_path_factory.mktemp(f"blockwise-{arch}")
    env = dict(os.environ, CUTE_DSL_ARCH=arch)
    proc = subprocess.run(
        [sys.executable, "-m", "flashgemm.sm100.blockwise_ptx", str(out_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report.pop("arch") == arch
    ptx = {}
    for name, entry in report.items():
        with open(entry["path"]) as f:
            ptx[name] = f.read()
    return arch, ptx, {name: entry["seconds"] for name, entry in report.items()}


def test_every_spec_is_built(built):
    arch, ptx, seconds = built
    assert sorted(ptx) == sorted(s.name() for s in blockwise_specs())
    for name, text in ptx.items():
        assert re.search(rf"^\.target {arch}\b", text, re.M), name
    print(arch, seconds)


@pytest.mark.parametrize("spec", blockwise_specs(), ids=lambda s: s.name())
def test_ptx_has_blackwell_blockwise_features(built, spec):
    _, ptx, _ = built
    text = ptx[spec.name()]
    # fp8 e4m3 tcgen05 MMAs, 1-CTA, accumulator in tensor memory: K = 32
    # each, four per 128-wide k-block
    mmas = re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f8f6f4\b", text)
    assert len(mmas) == 4
    assert "block_scale" not in text  # fp32 scales are applied on CUDA cores, not by the MMA
    for needle in ("tcgen05.alloc", "tcgen05.dealloc", "tcgen05.relinquish_alloc_permit", "tcgen05.commit"):
        assert needle in text, needle
    # the epilogue reads each k-block's stage (4 x 32 columns) and waits for
    # those reads before the stage goes back to the MMA warp
    assert len(re.findall(r"tcgen05\.ld\.sync\.aligned\.32x32b\.x32\.b32", text)) == 4
    ld_wait = text.index("tcgen05.wait::ld")
    wait_then_fence = r"tcgen05\.wait::ld\.sync\.aligned;\s*tcgen05\.fence::before_thread_sync;"
    assert re.match(wait_then_fence, text[ld_wait:])
    assert "mbarrier.arrive" in text[ld_wait:ld_wait + 400]
    # the MMA warp and the epilogue order their TMEM accesses after each wait
    assert text.count("tcgen05.fence::after_thread_sync;") >= 3
    # promotion on CUDA cores: 128 columns per row, two per packed FMA
    assert len(re.findall(r"fma\.rn\.f32x2", text)) == 64
    # TMA loads: A in four 32-row boxes (each issued only if it holds a valid
    # row), B, the activation scales; TMA stores of the 4 sub-tiles
    assert text.count(TMA_LOAD) == 6
    # the slot's barrier expects the loaded A boxes' bytes before any load is issued
    expect = text.index("mbarrier.expect_tx")
    first_load = text.index(TMA_LOAD)
    assert expect < first_load and "bar.warp.sync" in text[expect:first_load]
    assert text.count(TMA_STORE) == 4
    # the staged tile is reused only after the last stores have read it
    assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+0;", text)
    # partial tiles: 16-byte row stores from registers (4 sub-tiles x 4)
    assert len(re.findall(r"st\.global\.v4\.b32", text)) == 16
    # the weight scale is one global load per 32 k-blocks, handed out by shuffle
    assert "shfl.sync.idx.b32" in text
    # programmatic dependent launch: the wait precedes every global access
    wait = text.index("griddepcontrol.wait;")
    for access in ("ld.global", "st.global", "cp.async.bulk.tensor", RELEASE_ADD):
        assert access not in text[:wait], access
    assert "griddepcontrol.launch_dependents;" in text
    # no local memory at the PTX level
    assert ".local" not in text
    # only barrier 0 (set-up and teardown): named-barrier ids stay in sm_90 code
    assert re.findall(r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+(\S+?)[;,]", text) == ["0", "0"]


@pytest.mark.parametrize("spec", blockwise_specs(), ids=lambda s: s.name())
def test_signal_publish(built, spec):
    _, ptx, _ = built
    text = ptx[spec.name()]
    if spec.signal_mode is None:
        assert RELEASE_ADD not in text
        assert not SIGNAL_SEQUENCE.search(text)
        assert "fence.proxy.async.global" not in text
        return
    # full tiles (store warp): the slot is freed once the stores have read
    # shared memory, then the full wait (not .read), the async-proxy fence, the add
    assert SIGNAL_SEQUENCE.search(text)
    adds = [m.start() for m in re.finditer(re.escape(RELEASE_ADD), text)]
    assert len(adds) == 2  # one per path: full and partial tiles
    read = re.search(r"cp\.async\.bulk\.commit_group;\s*cp\.async\.bulk\.wait_group\.read\s+0;", text)
    assert read
    full_wait = re.compile(r"cp\.async\.bulk\.wait_group\s+0;\s*fence\.proxy\.async\.global;")
    full = full_wait.search(text, read.end())
    assert full and "mbarrier.arrive" in text[read.end():full.start()]
    assert adds[0] > full.end() and adds[0] - full.end() < 400
    # partial tiles: the store warp waited on the hand-off (every epilogue
    # thread's arrive follows its row stores), freed the slot, then adds
    partial = adds[1]
    assert "mbarrier.arrive" in text[partial - 300:partial]
    assert "wait_group" not in text[partial - 300:partial]
    assert "mbarrier.try_wait" in text[partial - 2500:partial]


def test_spec_contract():
    specs = blockwise_specs()
    assert len({s.name() for s in specs}) == len(specs)
    assert {s.signal_mode for s in specs} == {None, *GRANULARITIES}
    for s in specs:
        assert s.tile_n == 128 and s.signal_block == (128, 128)
    with pytest.raises(ValueError):
        BlockwiseSpec(tile_n=256)
    with pytest.raises(ValueError):
        BlockwiseSpec(signal_mode="tile")
    with pytest.raises(ValueError):
        BlockwiseSpec(stages=9)


@pytest.mark.parametrize("signal_mode", (None, *GRANULARITIES))
def test_choose_blockwise_returns_a_launchable_spec(signal_mode):
    specs = set(blockwise_specs())
    for e in (1, 8, 32, 288):
        for max_m in (1, 64, 129, 4096):
            for n, k in ((128, 128), (4096, 7168), (7168, 2048), (144, 16)):
                for expected_m in (1, max_m):
                    for sms in (20, 112, 148):
                        spec = choose_blockwise(e, max_m, n, k, expected_m, sms, signal_mode)
                        assert spec in specs
                        assert spec.signal_mode == signal_mode
    with pytest.raises(ValueError):
        choose_blockwise(1, 1, 128, 128, 1, 148, "tile")


def _kernel_counters(masked_m, max_m, n, num_ctas, signal_mode):
    """The counters after the kernel, from the package's model of the tile
    order the kernel walks and the index the epilogue adds to."""
    from flashgemm.sm100.walk import signal_index

    num_m_slots = -(-max_m // 128)
    size = len(masked_m) * (1 if signal_mode == "expert" else num_m_slots)
    counters = [0] * size
    order = tile_order(masked_m, max_m, n, 128, 128, num_ctas)
    tiles = [t for cta in order for t in cta]
    assert sorted(tiles) == sorted(valid_tiles(masked_m, max_m, n, 128, 128))  # each valid tile once
    for e, mb, _nb in tiles:
        counters[signal_index(signal_mode, e, mb, 0, 1, num_m_slots)] += 1
    return counters


@pytest.mark.parametrize("signal_mode", GRANULARITIES)
def test_signal_counts_match_signal_layout(signal_mode):
    spec = choose_blockwise(4, 300, 384, 512, 64, 148, signal_mode)
    cases = [([0, 300, 1, 129], 300, 384), ([5], 5, 128), ([-3, 1000, 0], 256, 144), ([0, 0], 64, 4096)]
    for masked, max_m, n in cases:
        layout = make_signal_layout(signal_mode, max_m, n, *spec.signal_block, len(masked))
        want = layout.final_values(torch.tensor(masked, dtype=torch.int32), max_m).tolist()
        for num_ctas in (1, 3, 148):
            got = _kernel_counters(masked, max_m, n, num_ctas, signal_mode)
            assert len(got) == layout.size
            assert got == want, (masked, max_m, n, num_ctas)


def test_kernel_class_documents_roles_and_pipelines():
    import ast

    path = os.path.join(ROOT, "flashgemm", "sm100", "blockwise.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BlockwiseMaskedGemmSm100"]
    doc = ast.get_docstring(cls)
    for needle in ("Warp roles", "**load**", "**MMA**", "**epilogue**", "**store**", "Pipelines",
                   "PipelineTmaUmma", "PipelineTmaAsync", "PipelineUmmaAsync", "PipelineAsync"):
        assert needle in doc, needle


def test_stage_choices_fit_shared_memory():
    from flashgemm.sm100 import blockwise
    from flashgemm.sm100.blockwise_build import STAGE_CHOICES

    for stages in STAGE_CHOICES:
        assert blockwise.smem_bytes(stages) <= blockwise.SMEM_BYTES
    # the deepest ring that fits is offered
    assert blockwise.smem_bytes(max(STAGE_CHOICES) + 1) > blockwise.SMEM_BYTES
    with pytest.raises(ValueError):
        blockwise.BlockwiseMaskedGemmSm100(max(STAGE_CHOICES) + 1)


def test_build_refuses_a_non_blackwell_target():
    from flashgemm.sm100.blockwise_build import build_blockwise

    # refused before the target is set or anything is traced
    with pytest.raises(ValueError, match="targets one of"):
        build_blockwise(BlockwiseSpec(), arch="sm_90a")
