"""benchmarks/bench.py's DeepGEMM peer and the tables it feeds, and
tools/sustained.py's summary (CPU only)."""

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


def test_fp8_table_has_same_run_paired_and_listed_deepgemm_columns(bench_script):
    rows = [_row("fp8", {"flashgemm": 0.050, "deepgemm_masked": 0.055},
                 {"expected_m": 153, "err": 1e-6, "paired": 0.9731})]
    md = bench_script.fp8_markdown(rows, LIMITS, "H100", "cmd", {"dsv3-ep32-down": {"deepgemm_fp8_us": 60.0}})
    header, body = _table_lines(md)
    cells = dict(zip(_cells(header), _cells(body)))
    assert len(_cells(header)) == len(_cells(body))
    assert (cells["DeepGEMM us"], cells["vs DeepGEMM"]) == ("55.0", "1.10x")
    assert cells["vs DeepGEMM paired"] == "0.97x"
    assert (cells["DeepGEMM listed us"], cells["vs listed"]) == ("60.0", "1.20x")
    assert "timed in this run" in md and "kept: 153" in md and "interleaved rounds" in md


def test_deepgemm_peer_pairs_its_kept_hint_with_ours(bench_script, monkeypatch):
    """The kept hint (the faster one) is timed against ours round by round,
    and the paired ratio is the median of DeepGEMM's time over ours."""
    import types

    calls = []
    fake = types.SimpleNamespace(m_grouped_bf16_gemm_nt_masked=lambda a, b, out, m, hint: calls.append(hint))
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    single = {128: 0.30, 153: 0.20}  # single timings: hint 153 is faster

    def time_graph(fn, reps):
        calls.clear()
        fn()
        return single[calls[-1]]

    rounds_seen = []

    def time_graph_rounds(fns, rounds, reps):
        calls.clear()
        fns[1]()
        rounds_seen.append((rounds, calls[-1]))
        ours = [0.100, 0.100, 0.100]
        theirs = [0.110, 0.090, 0.105]  # ratios 1.10, 0.90, 1.05: median 1.05
        return [ours, theirs]

    monkeypatch.setattr(bench_script, "time_graph", time_graph)
    monkeypatch.setattr(bench_script, "time_graph_rounds", time_graph_rounds)
    monkeypatch.setattr(bench_script.torch, "empty", lambda *a, **k: types.SimpleNamespace(fill_=lambda v: None))
    a = types.SimpleNamespace(shape=(2, 256, 64), device="cpu")
    b = types.SimpleNamespace(shape=(2, 32, 64))
    results = {}
    peer = bench_script.time_deepgemm_peer(results, {"name": "x", "expected_m": 128}, a, b, None,
                                           lambda out: 0.0, reps=1, ours=lambda: None)
    assert results["deepgemm_masked"] == 0.20 and rounds_seen == [(6, 153)]
    assert peer["expected_m"] == 153 and abs(peer["paired"] - 1.05) < 1e-12
    no_pair = bench_script.time_deepgemm_peer({}, {"name": "x", "expected_m": 128}, a, b, None,
                                              lambda out: 0.0, reps=1)
    assert no_pair["paired"] is None and rounds_seen == [(6, 153)]


def test_bf16_table_has_a_deepgemm_column_or_says_it_did_not_run(bench_script):
    ms = {"flashgemm": 0.100, "flashgemm_eager": 0.110, "torch_grouped_mm_3d": 1.0}
    with_peer = bench_script.to_markdown([_row("bf16", dict(ms, deepgemm_masked=0.125), {"expected_m": 128, "err": 0.0})],
                                  LIMITS, "H100", "cmd")
    header, body = _table_lines(with_peer)
    cells = dict(zip(_cells(header), _cells(body)))
    assert len(_cells(header)) == len(_cells(body))
    assert (cells["DeepGEMM us"], cells["vs DeepGEMM"]) == ("125.0", "1.25x")
    assert cells["vs DeepGEMM paired"] == "n/a"  # this peer ran without the paired rounds
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
