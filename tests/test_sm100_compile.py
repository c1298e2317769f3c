"""Compile-only tests of the sm_100 kernel family (no Blackwell GPU needed;
runs in CI). One process targets one arch, and this one targets sm_90a, so
``python -m flashgemm compile --arch sm_100a`` (and ``sm_103a``) runs in a
child process per arch, once per module; its build is wrapped to keep each
kernel's PTX, and the tests read the listing and the PTX."""

import os
import re
import subprocess
import sys
import tempfile

import pytest

from flashgemm.formats import Format
from flashgemm.kernels_cli import ptx_features
from flashgemm.sm100.backend import MMA_FEATURE as SM100_MMA_FEATURE, blockwise_ptx_ok as blockwise_ok, gemm_ptx_ok as sm100_ok
from flashgemm.sm100.config import CtaGroup
from flashgemm.sm100.heuristic import reachable_specs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = ("sm_100a", "sm_103a")
SPECS = reachable_specs()

_CHILD = r"""
import os, sys
from flashgemm.sm100 import build as sm100_build

ptx_dir, arch = sys.argv[1], sys.argv[2]
real_build = sm100_build.build

def build(spec, arch=None, keep_ptx=False):
    fn = real_build(spec, arch, keep_ptx=keep_ptx)
    if keep_ptx:
        with open(os.path.join(ptx_dir, spec.name() + ".ptx"), "w") as f:
            f.write(fn.__ptx__ or "")
    return fn

sm100_build.build = build
from flashgemm.__main__ import main

rc = main(["compile", "--arch", arch])
sys.stdout.flush()
# precompile one spec into a disk cache, then get_kernel loads it from there
from flashgemm.jit import cache
from flashgemm.sm100.heuristic import reachable_specs

spec = reachable_specs()[0]
cache_dir = os.path.join(ptx_dir, "cache")
os.environ["FLASHGEMM_CACHE_DIR"] = cache_dir
from flashgemm import backend

count = backend.get("sm100").precompile([spec], arch=arch, cache_dir=cache_dir)
builds = cache.compile_count
cache._cache.clear()  # forget the in-process copy: the next one comes from disk
fn = sm100_build.get_kernel(spec, arch)
print(f"PRECOMPILED {count} {sorted(os.listdir(cache_dir)) != []} {cache.compile_count - builds} {callable(fn)}")
sys.exit(rc)
"""


class _Run:
    """One child ``compile --arch ARCH``, started at once (the two arches
    compile side by side)."""

    def __init__(self, arch):
        self.dir = tempfile.mkdtemp(prefix=f"flashgemm-{arch}-")
        self.out = open(os.path.join(self.dir, "stdout"), "w+")
        env = dict(os.environ, CUTE_DSL_ARCH=arch)
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, self.dir, arch], cwd=REPO, env=env,
                                     stdout=self.out, stderr=subprocess.STDOUT, text=True)
        self.done = None

    def result(self):
        if self.done is None:
            rc = self.proc.wait(timeout=3600)
            self.out.seek(0)
            self.done = (rc, self.out.read())
        return self.done

    def ptx(self, spec):
        with open(os.path.join(self.dir, spec.name() + ".ptx")) as f:
            return f.read()


@pytest.fixture(scope="module")
def runs():
    started = {arch: _Run(arch) for arch in ARCHS}
    yield started
    for run in started.values():
        if run.proc.poll() is None:
            run.proc.kill()
        run.out.close()


def _listing(run):
    """{kernel name: [features]} from the listing's lines."""
    rc, out = run.result()
    found = {}
    for line in out.splitlines():
        m = re.match(r"\s+\[\s*\d+/\s*\d+\]\s+(\S+)\s+[\d.]+ s\s+PTX: (.*)$", line)
        if m:
            found[m.group(1)] = [f.strip() for f in m.group(2).split("  MISSING")[0].split(",")]
    return rc, out, found


@pytest.mark.parametrize("arch", ARCHS)
def test_listing_builds_every_reachable_spec(runs, arch):
    rc, out, found = _listing(runs[arch])
    assert rc == 0, out[-3000:]
    # the GEMMs of every format, the DeepSeek fp8 recipe's and the MoE activations
    from flashgemm.sm100.blockwise_build import blockwise_specs

    extra = {s.name(): s for s in blockwise_specs()}
    want = [s.name() for s in SPECS] + list(extra) + [f"moe-{kind}-{t}" for kind in ("silu_mul", "gpt_oss")
                                                       for t in ("fp8", "bf16")]
    assert sorted(found) == sorted(want), out[-3000:]
    assert f"compiling the {len(want)} kernels flashgemm can launch on {arch}: {len(SPECS) + len(extra)} GEMMs" in out
    for name, spec in extra.items():
        assert blockwise_ok(spec, found[name]), (name, found[name])
        assert ("signal-publish" in found[name]) == (spec.signal_mode is not None)
    for kind in ("silu_mul", "gpt_oss"):
        assert "fp8-cvt" in found[f"moe-{kind}-fp8"] and "fp8-cvt" not in found[f"moe-{kind}-bf16"]


@pytest.mark.parametrize("arch", ARCHS)
def test_precompile_then_get_kernel_loads_from_disk(runs, arch):
    rc, out = runs[arch].result()
    # one kernel stored, files in the cache, no new build for get_kernel, a callable
    assert "PRECOMPILED 1 True 0 True" in out, out[-3000:]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name())
def test_ptx_of_each_spec(runs, arch, spec):
    rc, out, found = _listing(runs[arch])
    assert spec.name() in found, out[-3000:]
    ptx = runs[arch].ptx(spec)
    feats = set(ptx_features(ptx))
    assert feats == set(found[spec.name()])  # the listing reads the same PTX
    cfg = spec.config
    assert re.search(rf"^\.target\s+{arch}\b", ptx, re.M)
    # the format's MMA kind, and no other
    kinds = {f for f in feats if f.startswith("tcgen05-mma-")}
    assert kinds == {SM100_MMA_FEATURE[cfg.fmt.value]}
    # a CTA pair's tcgen05 instructions (mma, cp, alloc) all use cta_group::2, a single CTA's ::1
    group = cfg.cluster_size
    assert ("cta_group::2" in feats) == (group == 2)
    mmas = re.findall(r"tcgen05\.mma\.cta_group::(\d)", ptx)
    assert mmas and set(mmas) == {str(group)}
    assert set(re.findall(r"tcgen05\.alloc\.cta_group::(\d)", ptx)) == {str(group)}
    # scale factors reach TMEM by tcgen05.cp, loaded by 4d TMA (the 128x4 atoms)
    assert ("tcgen05.cp" in feats) == cfg.fmt.block_scaled
    assert bool(re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::\w+\.global", ptx)) == cfg.fmt.block_scaled
    if cfg.fmt in (Format.MXFP8, Format.MXFP8_MXFP4):
        assert ".block_scale.block32" in ptx
    if cfg.fmt is Format.NVFP4:
        assert ".block_scale.block16" in ptx
    # full tiles leave by TMA store; partial tiles by guarded row stores
    assert {"tma-load", "tma-store", "tcgen05.alloc", "tcgen05.ld"} <= feats
    assert re.search(r"st\.global\.v4\.b32", ptx)
    # every TMEM load is waited for (tcgen05.wait::ld) before its registers are used
    assert len(re.findall(r"tcgen05\.wait::ld", ptx)) > len(re.findall(r"tcgen05\.ld\.", ptx)) > 0
    # alpha: NVFP4 scales the accumulator in fp32, the other formats never multiply
    assert bool(re.search(r"\bmul(\.rn)?\.f32", ptx)) == cfg.has_alpha
    # signals: the publish sequence exactly when signalled, never after the .read wait alone
    signalled = spec.signal_mode is not None
    assert ("signal-publish" in feats) == signalled
    assert bool(re.search(r"red\.release\.gpu\.global\.add\.s32", ptx)) == signalled
    assert not re.search(r"cp\.async\.bulk\.wait_group\.read\s+0;\s*fence\.proxy\.async\.global", ptx)
    assert sm100_ok(spec, sorted(feats))
    assert ".local" not in ptx  # no register spills
    # programmatic dependent launch: wait before global accesses, trigger after the loads
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx


def _normalized(ptx):
    """PTX lines with register numbers, labels and the kernel's name erased."""
    ptx = re.sub(r"kernel_cutlass\w+", "K", ptx)
    ptx = re.sub(r"%(rd|r|p|f|rs)\d+", r"%\1", ptx)
    ptx = re.sub(r"\$L__BB\d+_\d+", "L", ptx)
    return [line.strip() for line in ptx.splitlines() if line.strip()]


def _idesc_fields(value):
    """(a type, b type, N, M) of a kind::mxf8f6f4 instruction descriptor (PTX ISA's table)."""
    return (value >> 7) & 7, (value >> 10) & 7, ((value >> 17) & 63) << 3, ((value >> 24) & 31) << 4


E4M3, E2M1 = 0, 5  # the f8f6f4 kinds' type codes


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tile", ((128, 64), (128, 128), (256, 256)), ids=lambda t: f"{t[0]}x{t[1]}")
def test_mxfp4_weights_change_only_b(runs, arch, tile):
    """MXFP4 weights (kind::mxf8f6f4 with e2m1 B) against MXFP8 of the same
    tile: the same MMAs on the same shared-memory descriptors (a padded e2m1
    k-tile is laid out as an 8-bit one); the instruction descriptor's B type
    E2M1; B by its own tensor map (a grid-constant kernel parameter), each
    stage expecting the packed bytes, half of B's shared memory; a CTA
    pair's loads arrive on the leader's barrier (``.cta_group::2``), as
    MXFP8's do."""
    from flashgemm.sm100.config import Sm100Config, Sm100Spec

    rc, out, found = _listing(runs[arch])
    assert rc == 0, out[-3000:]
    tile_m, tile_n = tile
    group = CtaGroup.TWO if tile_m == 256 else CtaGroup.ONE
    mx4 = runs[arch].ptx(Sm100Spec(Sm100Config(fmt=Format.MXFP8_MXFP4, tile_m=tile_m, tile_n=tile_n, cta_group=group)))
    mx8 = runs[arch].ptx(Sm100Spec(Sm100Config(fmt=Format.MXFP8, tile_m=tile_m, tile_n=tile_n, cta_group=group)))
    n4, n8 = _normalized(mx4), _normalized(mx8)
    mma = [line for line in n4 if line.startswith("tcgen05.mma")]
    assert mma and mma == [line for line in n8 if line.startswith("tcgen05.mma")]
    # shared-memory descriptor templates (or'ed into the stage addresses) are the same
    desc = re.compile(r"or\.b64\s+%rd\d+, %rd\d+, (\d+);")
    assert sorted(desc.findall(mx4)) == sorted(desc.findall(mx8)) != []
    # instruction descriptors: e4m3 A, and B e2m1 where MXFP8 has e4m3
    idesc = re.compile(r"or\.b32\s+%r\d+, %r\d+, (\d+);")
    fields4 = {_idesc_fields(int(v)) for v in idesc.findall(mx4) if _idesc_fields(int(v))[3] == tile_m}
    fields8 = {_idesc_fields(int(v)) for v in idesc.findall(mx8) if _idesc_fields(int(v))[3] == tile_m}
    assert fields4 == {(E4M3, E2M1, tile_n, tile_m)} and fields8 == {(E4M3, E4M3, tile_n, tile_m)}
    # each stage's transaction: A, B and the scales; B counts its packed bytes
    tx = re.compile(r"mov\.b32\s+%r\d+, (\d+);\s*mbarrier\.arrive\.expect_tx")
    (tx4,), (tx8,) = set(tx.findall(mx4)), set(tx.findall(mx8))
    assert int(tx8) - int(tx4) == tile_n * 128 // 2
    # B's tensor map is one more 128-byte grid-constant parameter in place of B's TMA atom
    params = re.compile(r"\.param \.align 64 \.b8 \w+\[128\]")
    assert len(params.findall(mx4)) == len(params.findall(mx8)) == 5
    # the same 3d loads (A, B) and 4d loads (the scales), in a pair each with .cta_group::2
    for rank in ("3d", "4d"):
        load = rf"cp\.async\.bulk\.tensor\.{rank}\.shared::\w+\.global\S*"
        kinds4 = sorted(k.replace(".L2::cache_hint", "") for k in re.findall(load, mx4))
        kinds8 = sorted(k.replace(".L2::cache_hint", "") for k in re.findall(load, mx8))
        assert kinds4 == kinds8 != []
        assert all(k.endswith(".cta_group::2") == (group is CtaGroup.TWO) for k in kinds4)
    assert ".local" not in mx4


def test_sm100_ok_requires_the_right_features():
    spec = next(s for s in SPECS if s.config.cta_group is CtaGroup.TWO and s.signal_mode)
    good = ["tma-load", "tma-store", "tcgen05-mma-mxf8f6f4", "tcgen05-mma-mxf4nvf4", "tcgen05-mma-f16",
            "tcgen05.alloc", "tcgen05.cp", "tcgen05.ld", "cta_group::2", "signal-publish"]
    assert sm100_ok(spec, good)
    for missing in ("tma-store", "cta_group::2", "signal-publish", SM100_MMA_FEATURE[spec.config.fmt.value]):
        assert not sm100_ok(spec, [f for f in good if f != missing]), missing
    one = next(s for s in SPECS if s.config.cta_group is CtaGroup.ONE and not s.signal_mode)
    assert not sm100_ok(one, good)  # cta_group::2 in a 1-CTA kernel


def test_feature_regexes_on_snippets():
    assert ptx_features("tcgen05.mma.cta_group::2.kind::mxf4nvf4.block_scale.block16 [%r1]") == [
        "tcgen05-mma-mxf4nvf4", "cta_group::2"]
    assert ptx_features("tcgen05.mma.cta_group::1.kind::f16 [%r1]") == ["tcgen05-mma-f16"]
    assert ptx_features("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier") == ["tma-load"]
    # the Hopper load still reads as a TMA load
    assert ptx_features("cp.async.bulk.tensor.3d.shared::cta.global.tile.mbarrier") == ["tma-load"]
