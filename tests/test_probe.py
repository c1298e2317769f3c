"""tools/probe.py: the subcommands' argument checks and the swap-bound
probe's transposed configs (CPU only)."""

import pytest

from flashgemm.config import Promotion, Staging, Tail
from flashgemm.formats import Format
from flashgemm.sm90.limits import check_config


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("tokens", [64, 128, 192])
def test_transposed_config_is_a_valid_128_by_t_tile(probe_script, fp8, tokens):
    cfg = check_config(probe_script.transposed_config(tokens, fp8), Format.FP8_BLOCK128 if fp8 else Format.BF16)
    assert (cfg.tile_m, cfg.tile_n) == (128, tokens)
    # one n-block of tokens: a cluster along N would pair it with an empty one
    assert cfg.cluster_n == 1 and not cfg.l2_hints and cfg.tail is Tail.BALANCE
    if fp8:
        # two product sets while they fit in registers, two parts (whole-tile staging) above
        wide = tokens > 128
        assert cfg.promotion is (Promotion.TWO_PARTS if wide else Promotion.OVERLAPPED)
        assert cfg.promote_parts == (2 if wide else 1)
        assert cfg.staging is (Staging.WHOLE_TILE if wide else Staging.PAIR)
    else:
        assert cfg.promotion is Promotion.SERIAL and cfg.staging is Staging.PAIR


def test_a_token_count_the_kernel_cannot_build_is_refused_before_any_gpu_work(probe_script, capsys):
    with pytest.raises(SystemExit) as exc:
        probe_script.main(["swap-bound", "--tokens", "64", "100"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "swap-bound: error: --tokens 100" in err


@pytest.mark.parametrize("command", ["mblock-cost", "swap-bound"])
def test_an_unknown_case_is_refused_before_any_gpu_work(probe_script, capsys, command):
    with pytest.raises(SystemExit) as exc:
        probe_script.main([command, "--cases", "dsv3-ep32-down", "no-such-case"])
    assert exc.value.code == 2
    assert "unknown case(s) no-such-case" in capsys.readouterr().err


def test_every_probe_is_a_subcommand(probe_script, capsys):
    with pytest.raises(SystemExit) as exc:
        probe_script.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("launch-floor", "fixed-cost", "mblock-cost", "swap-bound"):
        assert command in out
    with pytest.raises(SystemExit) as exc:
        probe_script.main(["fixed-cost", "--ks", "4096"])
    assert exc.value.code == 2 and "--ks" in capsys.readouterr().err


def test_fixed_cost_fit_recovers_a_line(probe_script):
    icpt, slope = probe_script.fit_line([1024, 2048, 4096, 8192], [3.0 + 0.002 * k for k in (1024, 2048, 4096, 8192)])
    assert icpt == pytest.approx(3.0) and slope == pytest.approx(0.002)


def test_launch_floor_kernels_compile_without_a_gpu(probe_script):
    """The empty kernel and its three launchers build for sm_90a (what the
    probe then times on a GPU)."""
    fns = probe_script.compile_launch_floor(2)
    assert len(fns) == 3 and all(callable(f) for f in fns)
