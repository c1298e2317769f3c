"""scripts/bench.py's DeepGEMM peer and the tables it feeds (CPU only)."""

import sys

LIMITS = {"copy_GBps": 3000.0, "bf16_mm_TFLOPS": 800.0, "fp8_rowwise_mm_TFLOPS": 1400.0}


def _row(dtype, ms, peer=None, case="dsv3-ep32-down"):
    row = {
        "case": case, "dtype": dtype, "regime": "decode", "flops": 2.0e12 * 0.1, "eff_bytes": 2.5e8,
        "ms": ms, "deepgemm_peer": peer, "quack_peer": None,
    }
    row["max_similarity_diff" if dtype == "fp8" else "max_rel_err"] = 1e-6
    return row


def _table_lines(md):
    """(header, first row) of the one table in ``md`` (the separator starts with '|-')."""
    return [line for line in md.splitlines() if line.startswith("| ")][:2]


def _cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_deepgemm_peer_is_skipped_when_it_cannot_be_imported(bench_script, monkeypatch, capsys):
    """Without deep_gemm the peer returns None, times nothing and says why."""
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # makes `import deep_gemm` raise
    results = {}
    got = bench_script.time_deepgemm_peer(results, {"name": "dense-like", "expected_m": 4096},
                                   None, None, None, None, reps=1)
    assert got is None and results == {}
    assert "DeepGEMM peer skipped" in capsys.readouterr().out


def test_fp8_table_has_same_run_and_listed_deepgemm_columns(bench_script):
    rows = [_row("fp8", {"flashgemm": 0.050, "deepgemm_masked": 0.055}, {"expected_m": 153, "err": 1e-6})]
    md = bench_script.fp8_markdown(rows, LIMITS, "H100", "cmd", {"dsv3-ep32-down": {"deepgemm_fp8_us": 60.0}})
    header, body = _table_lines(md)
    cells = dict(zip(_cells(header), _cells(body)))
    assert len(_cells(header)) == len(_cells(body))
    assert (cells["DeepGEMM us"], cells["vs DeepGEMM"]) == ("55.0", "1.10x")
    assert (cells["DeepGEMM listed us"], cells["vs listed"]) == ("60.0", "1.20x")
    assert "timed in this run" in md and "kept: 153" in md


def test_bf16_table_has_a_deepgemm_column_or_says_it_did_not_run(bench_script):
    ms = {"flashgemm": 0.100, "flashgemm_eager": 0.110, "torch_grouped_mm_3d": 1.0}
    with_peer = bench_script.to_markdown([_row("bf16", dict(ms, deepgemm_masked=0.125), {"expected_m": 128, "err": 0.0})],
                                  LIMITS, "H100", "cmd")
    header, body = _table_lines(with_peer)
    cells = dict(zip(_cells(header), _cells(body)))
    assert len(_cells(header)) == len(_cells(body))
    assert (cells["DeepGEMM us"], cells["vs DeepGEMM"]) == ("125.0", "1.25x")
    without = bench_script.to_markdown([_row("bf16", ms)], LIMITS, "H100", "cmd")
    assert "not run (deep_gemm not importable)" in without
    body = _table_lines(without)[1]
    assert dict(zip(_cells(header), _cells(body)))["vs DeepGEMM"] == "n/a"


def test_sustained_summary(sustained_script):
    """The sustained-load summary: median time over the second half of the
    replays, clock and power medians over the samples after the ramp-up."""
    import pytest

    call_us = [200.0] * 4 + [230.0, 231.0, 229.0, 240.0]
    lines = ["1980, 150.0, 40"] * 5 + ["1410, 690.5, 55", "1395, 699.0, 57", "1425, 688.0, 56", ""]
    us, clock, power, temp = sustained_script.summarize(call_us, lines)
    assert us == 230.5 and clock == 1410 and power == 690.5 and temp == (55, 57)
    with pytest.raises(ValueError, match="no nvidia-smi samples"):
        sustained_script.summarize(call_us, [])
    with pytest.raises(ValueError, match="no timed replays"):
        sustained_script.summarize([], lines)
