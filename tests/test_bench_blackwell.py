"""benchmarks/bench_blackwell.py without a GPU: the roofline model behind
docs/blackwell.md, its markdown, and the exit on a non-Blackwell machine."""

import json
import os

import pytest

from conftest import _load_script


@pytest.fixture(scope="module")
def bench():
    return _load_script("benchmarks", "bench_blackwell")


def test_traffic_counts_valid_rows_and_live_experts_only(bench):
    n, k = 256, 512
    # two live experts (3 and 5 rows), one empty: weights of two experts, 8 rows of a and out
    b, f = bench.traffic("mxfp8", [3, 0, 5], n, k)
    assert f == 2 * 8 * n * k
    assert b == 2 * (n * k + n * k // 32) + (8 * k + 8 * k // 32) + 8 * n * 2
    b, _ = bench.traffic("nvfp4", [3, 0, 5], n, k)
    assert b == 2 * (n * k / 2 + n * k // 16 + 4) + (8 * k / 2 + 8 * k // 16) + 8 * n * 2
    b, _ = bench.traffic("fp8_block128", [8], n, k)
    assert b == (n * k + 2 * 4 * 4) + (8 * k + 8 * 4 * 4) + 8 * n * 2
    assert bench.traffic("bf16", [0, 0], n, k) == (0, 0)


def test_expected_time_is_the_larger_bound(bench):
    t_mem, t_math, t = bench.expected_us("bf16", [4096], 4096, 4096, 8000.0, 2250.0)
    assert t == max(t_mem, t_math) and t_math > t_mem  # a dense square product is compute bound
    t_mem, t_math, t = bench.expected_us("nvfp4", [1] * 32, 7168, 2048, 8000.0, 9000.0)
    assert t == t_mem > t_math


def test_expected_markdown_has_every_case_and_format(bench, capsys):
    assert bench.main(["--expected"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    with open(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "moe_cases.json")) as f:
        cases = json.load(f)["cases"]
    assert len(out) == 2 + len(cases) * len(bench.FORMATS)
    assert out[0].startswith("| case |") and "expected us" in out[0]
    assert all(line.count("|") == out[0].count("|") for line in out)


def test_exits_with_a_message_without_blackwell(bench, capsys, monkeypatch):
    monkeypatch.setattr(bench, "blackwell_gpu", lambda: (None, "found NVIDIA H100 (sm_90); this benchmark needs sm_100"))
    assert bench.main(["--formats", "nvfp4"]) == 2
    assert "needs sm_100" in capsys.readouterr().out
