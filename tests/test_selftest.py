"""``python -m flashgemm selftest`` without a GPU: which checks it picks for
each GPU generation and what it says (the checks themselves are stubbed;
they run on hardware only)."""

import pytest
import torch

from flashgemm import selftest, selftest_blockscaled


@pytest.fixture
def gpu(monkeypatch):
    """``gpu(capability)``: torch reports one CUDA GPU of that capability."""

    def make(cap, name="NVIDIA TEST"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cap)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)

    return make


@pytest.fixture
def stubbed(monkeypatch):
    """Every check replaced by one that records its name and passes."""
    ran = []

    def stub(checks):
        return [(name, lambda name=name: ran.append(name) or []) for name, _ in checks]

    real_checks, real_blockscaled = selftest._checks, selftest_blockscaled.checks
    monkeypatch.setattr(selftest, "_checks", lambda with_layer: stub(real_checks(with_layer)))
    monkeypatch.setattr(selftest_blockscaled, "checks", lambda: stub(real_blockscaled()))
    return ran


def test_without_gpu_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert selftest.main() == 2
    assert "no CUDA GPU found" in capsys.readouterr().out


def test_hopper_runs_its_checks_and_names_what_it_cannot(gpu, stubbed, capsys):
    gpu((9, 0), "NVIDIA H100")
    assert selftest.main() == 0
    out = capsys.readouterr().out
    assert "selftest on NVIDIA H100, sm_90" in out
    assert any("MoE layer" in name for name in stubbed)
    assert not any("MXFP8" in name or "NVFP4" in name for name in stubbed)
    assert "MXFP8 and NVFP4 GEMMs" in out and "not checked" in out and "sm_100 / sm_103" in out
    assert f"{len(stubbed)} passed, 0 failed" in out


@pytest.mark.parametrize("cap", [(10, 0), (10, 3)])
def test_blackwell_runs_every_format(gpu, stubbed, capsys, cap):
    gpu(cap, "NVIDIA B200")
    assert selftest.main() == 0
    out = capsys.readouterr().out
    for needle in ("bf16 GEMM", "fp8 1x128/128x128 GEMM", "MXFP8", "NVFP4", "every expert empty",
                   "completion signals"):
        assert any(needle in name for name in stubbed), needle
    assert not any("MoE layer" in name for name in stubbed)
    assert "the fused combine runs on sm_90 only" in out


def test_other_gpus_run_nothing(gpu, stubbed, capsys):
    gpu((8, 0), "NVIDIA A100")
    assert selftest.main() == 2
    out = capsys.readouterr().out
    assert "found NVIDIA A100 (sm_80)" in out and "nothing was run" in out
    assert stubbed == []


def test_a_failing_check_is_reported_in_words(gpu, monkeypatch, capsys):
    gpu((10, 0))
    monkeypatch.setattr(selftest, "_checks", lambda with_layer: [("ok one", lambda: []),
                                                                 ("bad one", lambda: ["rows >= m_e were written"])])

    def boom():
        raise RuntimeError("launch failed\nsecond line")

    monkeypatch.setattr(selftest_blockscaled, "checks", lambda: [("raises", boom)])
    assert selftest.main() == 1
    out = capsys.readouterr().out
    assert "FAIL bad one\n       - rows >= m_e were written" in out
    assert "FAIL raises\n       - raised RuntimeError: launch failed\n" in out
    assert "1 passed, 2 failed" in out
