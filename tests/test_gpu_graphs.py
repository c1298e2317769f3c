"""CUDA graphs and streams (skipped without an sm_90 GPU)."""

import torch

import flashgemm
from flashgemm.reference import grouped_gemm_nt_masked_ref, relative_error
from flashgemm.timing import capture_graph

from conftest import requires_hopper

pytestmark = requires_hopper

POISON = -12345.0


def _check_valid_rows(out, ref, masked_m):
    rows = masked_m.clamp(0, out.shape[1]).tolist()
    for e, m in enumerate(rows):
        assert (out[e, m:] == POISON).all(), f"expert {e}: rows >= m_e written"
        if m:
            assert relative_error(out[e, :m].float(), ref[e, :m]) < 1e-2


def test_graph_replay_with_new_masked_m_inputs_and_signals(seed):
    e_count, max_m, n, k = 8, 192, 320, 256
    a = torch.randn(e_count, max_m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(e_count, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    masked_m = torch.randint(0, max_m + 1, (e_count,), dtype=torch.int32, device="cuda")
    out = torch.full((e_count, max_m, n), POISON, device="cuda", dtype=torch.bfloat16)
    layout = flashgemm.signal_layout(e_count, max_m, n, k, expected_m=64)
    sig = flashgemm.alloc_signals(layout, "cuda")

    def step():
        sig.zero_()
        flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, expected_m=64, dst_signals=sig)

    graph = capture_graph(step, calls=1)  # compiled and warmed up outside the capture
    for _ in range(4):
        # new token distribution (zeros, max_m, over-large) and new activations
        masked_m.copy_(torch.randint(-2, max_m + 20, (e_count,), dtype=torch.int32))
        masked_m[0] = 0
        a.copy_(torch.randn_like(a))
        out.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        _check_valid_rows(out, grouped_gemm_nt_masked_ref(a, b, masked_m), masked_m)
        assert torch.equal(sig.cpu(), layout.final_values(masked_m.cpu(), max_m))


def _stream_case():
    """A small problem, compiled once, with a poisoned `out` and an idle GPU."""
    e_count, max_m, n, k = 4, 128, 256, 256
    a = torch.randn(e_count, max_m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(e_count, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    masked_m = torch.tensor([128, 5, 0, 77], dtype=torch.int32, device="cuda")
    out = torch.full((e_count, max_m, n), POISON, device="cuda", dtype=torch.bfloat16)
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m)  # compile first
    out.fill_(POISON)
    # launch the check's own kernels once now: with CUDA's lazy module loading
    # a kernel's first launch may wait for the whole GPU, the sleep included,
    # which would hide where the GEMM ran
    assert (out == POISON).all()
    torch.cuda.synchronize()
    return a, b, masked_m, out


def _check_ran_behind_the_sleep(side, a, b, masked_m, out):
    """The call was ordered behind the sleep on `side`: nothing written while
    `side` is busy and the default stream is done, the right rows after."""
    assert not side.query()
    torch.cuda.current_stream().synchronize()
    assert (out == POISON).all()
    side.synchronize()
    _check_valid_rows(out, grouped_gemm_nt_masked_ref(a, b, masked_m), masked_m)


def test_runs_on_the_current_non_default_stream(seed):
    a, b, masked_m, out = _stream_case()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning ahead of us on this stream
        flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m)
    _check_ran_behind_the_sleep(side, a, b, masked_m, out)


def test_fresh_process_launches_from_the_disk_cache(tmp_path):
    """A kernel exported by one process is loaded and launched by the next,
    with no compile, and computes the right result."""
    import json
    import os
    import subprocess
    import sys

    script = """
import json, time, torch
t0 = time.perf_counter()
import flashgemm
from flashgemm.jit import cache as c, diskcache
from flashgemm.reference import grouped_gemm_nt_masked_ref, relative_error
a = torch.randn(4, 96, 256, device="cuda", dtype=torch.bfloat16)
b = torch.randn(4, 320, 256, device="cuda", dtype=torch.bfloat16) / 16
m = torch.tensor([96, 0, 7, 50], dtype=torch.int32, device="cuda")
out = flashgemm.grouped_gemm_nt_masked(a, b, None, m, expected_m=32)
torch.cuda.synchronize()
ref = grouped_gemm_nt_masked_ref(a, b, m)
err = max(relative_error(out[e, :r].float(), ref[e, :r]) for e, r in enumerate(m.tolist()) if r)
print(json.dumps({"compiles": c.compile_count, "loads": diskcache.load_count, "err": err,
                  "first_call_s": time.perf_counter() - t0}))
"""
    env = dict(os.environ, FLASHGEMM_CACHE_DIR=str(tmp_path))
    runs = []
    for _ in range(2):
        res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    assert runs[0]["compiles"] == 1 and runs[0]["err"] < 1e-2
    assert runs[1]["compiles"] == 0 and runs[1]["loads"] == 1 and runs[1]["err"] < 1e-2
    print(runs)


def test_runs_on_an_explicit_stream(seed):
    a, b, masked_m, out = _stream_case()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning ahead of us on `side`
    # called from the default stream, enqueued on `side` behind the sleep
    flashgemm.grouped_gemm_nt_masked(a, b, out, masked_m, stream=side)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    _check_ran_behind_the_sleep(side, a, b, masked_m, out)


def test_dependent_gemms_back_to_back_read_finished_inputs(seed):
    """Programmatic dependent launch: the second GEMM reads the first one's
    output as its A and may start before the first one has finished, so it
    must wait for it before reading; the first one may start before the torch
    fill that poisons that output just ahead of it, so it must wait before
    writing. Eager and graph-replayed, with long K so the first GEMM's last
    tiles are still computing when the second one can start."""
    e_count, max_m, n1, k1, n2 = 8, 256, 1024, 4096, 512
    a = torch.randn(e_count, max_m, k1, device="cuda", dtype=torch.bfloat16)
    b1 = torch.randn(e_count, n1, k1, device="cuda", dtype=torch.bfloat16) / k1**0.5
    b2 = torch.randn(e_count, n2, n1, device="cuda", dtype=torch.bfloat16) / n1**0.5
    masked_m = torch.randint(1, max_m + 1, (e_count,), dtype=torch.int32, device="cuda")
    mid = torch.empty(e_count, max_m, n1, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(e_count, max_m, n2, device="cuda", dtype=torch.bfloat16)

    def chain():
        mid.fill_(float("nan"))  # a read of mid before the first GEMM wrote it shows
        flashgemm.grouped_gemm_nt_masked(a, b1, mid, masked_m, expected_m=128)
        flashgemm.grouped_gemm_nt_masked(mid, b2, out, masked_m, expected_m=128)

    def check():
        torch.cuda.synchronize()
        rows = masked_m.tolist()
        ref_mid = grouped_gemm_nt_masked_ref(a, b1, masked_m)
        ref_out = grouped_gemm_nt_masked_ref(mid, b2, masked_m)  # from the mid it got
        for e, m in enumerate(rows):
            assert relative_error(mid[e, :m].float(), ref_mid[e, :m]) < 1e-2, f"expert {e}: mid"
            assert not out[e, :m].isnan().any(), f"expert {e}: read mid before it was written"
            assert relative_error(out[e, :m].float(), ref_out[e, :m]) < 1e-2, f"expert {e}: out"

    for _ in range(3):
        out.fill_(POISON)
        chain()
        check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for _ in range(3):
        a.copy_(torch.randn_like(a))
        masked_m.copy_(torch.randint(1, max_m + 1, (e_count,), dtype=torch.int32))
        out.fill_(POISON)
        graph.replay()
        check()
