"""scripts/probe_swap_bound.py: the transposed problem's configs (CPU only)."""

import sys

import pytest


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("tokens", [64, 128, 192])
def test_transposed_config_is_a_valid_128_by_t_tile(swap_bound_script, fp8, tokens):
    cfg = swap_bound_script.transposed_config(tokens, fp8).validate(1 if fp8 else 2)
    assert (cfg.tile_m, cfg.tile_n) == (128, tokens)
    # one n-block of tokens: a cluster along N would pair it with an empty one
    assert cfg.cluster_n == 1 and not cfg.l2_hints
    if fp8:
        # two product sets while they fit in registers, two parts above
        assert (cfg.promote_overlap, cfg.promote_parts) == ((True, 1) if tokens <= 128 else (False, 2))


def test_a_token_count_the_kernel_cannot_build_is_refused_before_any_gpu_work(
    swap_bound_script, monkeypatch, capsys
):
    monkeypatch.setattr(sys, "argv", ["probe_swap_bound.py", "--tokens", "64", "100"])
    with pytest.raises(SystemExit) as exc:
        swap_bound_script.main()
    assert exc.value.code == 2
    assert "--tokens 100" in capsys.readouterr().err
