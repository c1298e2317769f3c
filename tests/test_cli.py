"""The command line's argument handling and the demo's CPU path: the builds
are stubbed (the real ones are tested in test_compile.py), so these run in
seconds and check only what the user is told and what is (not) compiled."""

import os
import sys

import pytest

from flashgemm import demo, kernels_cli
from flashgemm.__main__ import main
from flashgemm.jit import arch as jit_arch
from flashgemm.moe import activation
from flashgemm.sm90 import build as sm90_build
from flashgemm.sm90.heuristic import reachable_specs
from flashgemm.version import __version__


class _FakeBuild:
    def __init__(self, ptx):
        self.__ptx__ = ptx


@pytest.fixture
def no_builds(monkeypatch):
    """Every build fails the test: for commands that must compile nothing."""
    def fail(*args, **kwargs):
        pytest.fail("compiled a kernel")

    for module, name in ((sm90_build, "build"), (sm90_build, "build_combine"), (activation, "build")):
        monkeypatch.setattr(module, name, fail)


@pytest.fixture
def fake_builds(monkeypatch):
    """Record what is built; hand back PTX that passes the checks of a plain GEMM."""
    built = []
    monkeypatch.setattr(sm90_build, "build", lambda spec, arch=None, **kw: built.append(spec.name()) or _FakeBuild(
        "wgmma.mma_async cp.async.bulk.tensor.3d.shared::cta.global"))
    monkeypatch.setattr(activation, "build", lambda fp8, arch=None, kind=activation.ActivationKind.SILU, **kw:
                        built.append(f"{kind.value}-{fp8}") or _FakeBuild("cvt.rn.satfinite.e4m3x2.f32" if fp8 else ""))
    return built


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"flashgemm {__version__}"


def test_supported_archs_are_the_backends():
    assert kernels_cli.SUPPORTED_ARCHS == ("sm_90a", "sm_100a", "sm_103a")
    assert len(kernels_cli.SUPPORTED_ARCHS) == len(jit_arch.BACKENDS)


@pytest.mark.parametrize("arch, hint", [("sm_80", None), ("sm_90", "did you mean sm_90a?"),
                                        ("hopper", None), ("sm_120a", None)])
def test_unsupported_arch_is_a_usage_error(capsys, no_builds, arch, hint):
    with pytest.raises(SystemExit) as exit_:
        main(["compile", "--arch", arch])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --arch: {arch!r} is not supported" in err
    assert "sm_90a, sm_100a, sm_103a" in err
    assert "\x1b[" not in err  # a plain argparse message, no DSL colour codes
    assert (hint in err) if hint else "did you mean" not in err


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_match_without_a_hit_fails_and_compiles_nothing(monkeypatch, capsys, no_builds, arch):
    # (the arch of this process's DSL is sm_90a; nothing is built, so sm_100a needs no env of its own)
    monkeypatch.setattr(jit_arch, "ensure_arch_env", lambda a=None: a)
    rc = main(["compile", "--arch", arch, "--match", "no-such-kernel"])
    assert rc == 2
    out, err = capsys.readouterr()
    assert f"no GEMM kernel for {arch} has 'no-such-kernel' in its name" in err
    assert "nothing was compiled" in err
    assert "compiling" not in out


def test_match_lists_the_subset_it_compiles(capsys, fake_builds):
    """The header says what a --match run builds, not what the full listing holds."""
    rc = main(["compile", "--match", demo.CPU_SAMPLE])
    want = [s.name() for s in reachable_specs() if demo.CPU_SAMPLE in s.name()]
    assert want and fake_builds == want  # no activations without --moe, no combines, no EP kernels
    out = capsys.readouterr().out
    assert (f"compiling {len(want)} of the kernels flashgemm can launch on sm_90a: {len(want)} GEMMs whose "
            f"name contains {demo.CPU_SAMPLE!r} (no GPU needed)") in out
    assert "every configuration the heuristic picks" not in out
    assert rc in (0, 1)  # (the stub's PTX lacks what signalled or fused kernels must show)


def test_moe_flag_adds_the_activations_to_a_match(capsys, fake_builds):
    main(["compile", "--match", demo.CPU_SAMPLE, "--moe"])
    gemms = [s.name() for s in reachable_specs() if demo.CPU_SAMPLE in s.name()]
    assert fake_builds == gemms + ["silu_mul-True", "silu_mul-False", "gpt_oss-True", "gpt_oss-False"]
    out = capsys.readouterr().out
    assert f"compiling {len(gemms) + 4} of the kernels" in out
    assert f"{len(gemms)} GEMMs whose name contains {demo.CPU_SAMPLE!r} and the 4 MoE activations" in out


def test_cache_dir_that_is_a_file_is_refused(tmp_path, capsys, no_builds):
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    with pytest.raises(SystemExit) as exit_:
        main(["compile", "--cache-dir", str(path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--cache-dir {str(path)!r} exists and is not a directory" in err
    assert path.read_text() == "x"  # left as it was


def test_check_cache_dir_makes_a_missing_directory(tmp_path):
    path = tmp_path / "a" / "b"
    assert kernels_cli.check_cache_dir(str(path)) == str(path)
    assert path.is_dir() and os.listdir(path) == []  # the write probe is gone
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not a writable directory"):
        kernels_cli.check_cache_dir(str(tmp_path / "file" / "sub"))


def test_demo_without_gpu_says_what_it_compiles(monkeypatch, capsys):
    seen = []

    def fake_compile(args):
        seen.append(args)
        return 1  # a failed PTX check must reach the exit status

    monkeypatch.setattr(kernels_cli, "cmd_compile", fake_compile)
    rc = demo._without_gpu("no CUDA GPU found")
    assert rc == 1
    assert len(seen) == 1 and seen[0].match == demo.CPU_SAMPLE and seen[0].moe and seen[0].arch == "sm_90a"
    out = capsys.readouterr().out
    assert "compile a sample of the layer's sm_90a kernels" in out
    assert "one fp8 GEMM tile configuration (64x128, 2-CTA clusters)" in out
    assert demo.CPU_SAMPLE.startswith("fp8") and "m64n128sAc2" in demo.CPU_SAMPLE  # what that sentence says
    assert "the others zero: True" in out


def test_demo_says_it_skipped_the_plot_without_matplotlib(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise
    png = tmp_path / "moe_layer.png"
    demo._plot([("layer", {}, {})], str(png))
    out = capsys.readouterr().out
    assert f"skipped the plot {png}: matplotlib is not installed" in out
    assert "pip install matplotlib" in out
    assert not png.exists()


def test_every_expert_parallel_kernel_has_a_ptx_check():
    """The full listing builds each EP kernel with its own rule (a kernel
    without one would stop the listing before anything compiles)."""
    from flashgemm.ep.combine import ep_kernel_jobs

    jobs = kernels_cli._ep_jobs("sm_90a", [64])
    assert [job.name for job in jobs] == [name for name, _, _ in ep_kernel_jobs("sm_90a", [64])]
    checks = {job.name: job.check for job in jobs}
    dispatch = [name for name in checks if name.startswith("ep-dispatch")]
    assert dispatch and any("-fp8-" in n for n in dispatch) and any("-bf16-" in n for n in dispatch)
    for name in dispatch:  # what the dispatch's PTX shows: peer stores, system-scope waits, fp8 conversion
        fp8 = "-fp8-" in name
        feats = ["combine-peer-store", "sys-acquire"] + (["fp8-cvt"] if fp8 else [])
        assert checks[name](feats), name
        assert not checks[name](["combine-peer-store"] + (["fp8-cvt"] if fp8 else [])), name  # no wait
        assert not checks[name](feats + ["acquire-poll"]), name
        assert checks[name](["combine-peer-store", "sys-acquire"] + ([] if fp8 else ["fp8-cvt"])) is False, name


def test_check_cache_dir_refuses_a_directory_the_cache_would_not_trust(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # writable by others: the disk cache loads nothing from it and stores nothing
    with pytest.raises(ValueError, match="is refused by the disk cache: group or others may write it"):
        kernels_cli.check_cache_dir(str(shared))
    shared.chmod(0o700)
    assert kernels_cli.check_cache_dir(str(shared)) == str(shared)
