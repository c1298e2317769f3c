"""The fused combine into the peers' receive buffers (``Combine.peers``,
``Epilogue.COMBINE_PEERS``) on an sm_90 GPU, every "peer" a buffer of this
GPU: each valid row lands, weighted and rounded to bf16, in its destination
row of the right buffer; no other byte of the buffers is written."""

import pytest
import torch

import flashgemm
from flashgemm import Combine
from flashgemm.quant import quantize_fp8_per_block, quantize_fp8_per_token
from flashgemm.reference import grouped_gemm_nt_masked_ref, similarity

from conftest import requires_hopper

pytestmark = requires_hopper
POISON = 0x7FC1  # a bf16 NaN bit pattern, in every destination no row was sent to
E, MAX_M, N, K = 6, 80, 1008, 512  # N: a partial last n-block for every tile width
MASKED = [80, 0, 37, 80 + 9, 1, 64]  # an empty expert, an over-long one (clamped to max_m)
SLOTS = 400  # destinations over all ranks: more than the 262 valid rows


def _inputs(fp8):
    a = torch.randn(E, MAX_M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    if not fp8:
        return a, b, None, None
    a, xs = quantize_fp8_per_token(a)
    b, ws = quantize_fp8_per_block(b)
    return a, b, xs, ws


def _routing(mm, slots):
    """Distinct destinations in [0, slots) for the valid rows (no two rows
    write one row); the padding rows hold anything, never read as routing."""
    rows = mm.clamp(0, MAX_M).tolist()
    dest = torch.randperm(slots)[: sum(rows)].to(torch.int32)
    tok = torch.randint(-(2**31), 2**31 - 1, (E, MAX_M), dtype=torch.int32)
    start = 0
    for e, m in enumerate(rows):
        tok[e, :m] = dest[start : start + m]
        start += m
    return tok.cuda(), torch.rand(E, MAX_M, device="cuda") * 2 - 1


def _buffers(world):
    bufs = [torch.empty(SLOTS // world, N, device="cuda", dtype=torch.bfloat16) for _ in range(world)]
    for t in bufs:
        t.view(torch.int16).fill_(POISON)
    return bufs, torch.tensor([t.data_ptr() for t in bufs], dtype=torch.int64, device="cuda")


def _expected(a, b, mm, xs, ws, tok, wt):
    """bf16(weight * bf16(row)) at each valid row's destination, and which
    destinations were sent a row (float reference of the same dequantized inputs)."""
    y = grouped_gemm_nt_masked_ref(a, b, mm, a_scale=xs, b_scale=ws).to(torch.bfloat16)
    want = torch.zeros(SLOTS, N, device="cuda", dtype=torch.bfloat16)
    sent = torch.zeros(SLOTS, dtype=torch.bool, device="cuda")
    for e, m in enumerate(mm.clamp(0, MAX_M).tolist()):
        dest = tok[e, :m].long()
        want[dest] = (wt[e, :m, None] * y[e, :m].float()).to(torch.bfloat16)
        sent[dest] = True
    return want, sent


@pytest.mark.parametrize("world", [1, 2], ids=["W1", "W2"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_rows_land_in_their_owners_buffers(seed, fp8, world):
    a, b, xs, ws = _inputs(fp8)
    mm = torch.tensor(MASKED, dtype=torch.int32, device="cuda")
    tok, wt = _routing(mm, SLOTS)
    bufs, peers = _buffers(world)
    got, err = flashgemm.grouped_gemm_nt_masked(a, b, None, mm, a_scale=xs, b_scale=ws, expected_m=40,
                                                combine=Combine(tok, wt, bufs[0], None, peers))
    torch.cuda.synchronize()
    assert got is bufs[0] and int(err.item()) == 0  # (padding rows' garbage never read as routing)
    recv = torch.cat(bufs)  # destination owner * R + row is row owner * R + row here
    want, sent = _expected(a, b, mm, xs, ws, tok, wt)
    assert (recv[~sent].view(torch.int16) == POISON).all(), "a row, or columns >= N, written where none was sent"
    assert not (recv[sent].view(torch.int16) == POISON).any(), "a destination row not fully written"
    assert similarity(recv[sent].float(), want[sent].float()) < (1e-4 if fp8 else 1e-6)
    # bit for bit what the bf16 reduction of the same configuration adds into zeros
    sums = torch.zeros(SLOTS, N, device="cuda", dtype=torch.bfloat16)
    flashgemm.grouped_gemm_nt_masked(a, b, None, mm, a_scale=xs, b_scale=ws, expected_m=40,
                                     combine=Combine(tok, wt, sums))
    torch.cuda.synchronize()
    assert torch.equal(recv[sent].float(), sums[sent].float())


def test_destinations_out_of_range_are_reported_and_skipped(seed):
    world = 2
    a, b, _, _ = _inputs(False)
    mm = torch.tensor(MASKED, dtype=torch.int32, device="cuda")
    tok, wt = _routing(mm, SLOTS)
    want, sent = _expected(a, b, mm, None, None, tok, wt)
    skipped = [int(tok[2, 5]), int(tok[4, 0])]  # two valid rows (m_e 37 and 1) sent nowhere
    sent[skipped] = False
    tok[2, 5] = SLOTS  # one past the last rank's last row
    tok[4, 0] = -3
    bufs, peers = _buffers(world)
    _, err = flashgemm.grouped_gemm_nt_masked(a, b, None, mm, combine=Combine(tok, wt, bufs[0], None, peers))
    torch.cuda.synchronize()
    assert int(err.item()) == 2
    recv = torch.cat(bufs)
    assert (recv[skipped].view(torch.int16) == POISON).all()  # their old destinations: nothing
    assert (recv[~sent].view(torch.int16) == POISON).all()
    assert similarity(recv[sent].float(), want[sent].float()) < 1e-6


def test_peers_table_on_the_host_is_refused():
    a, b, _, _ = _inputs(False)
    mm = torch.tensor(MASKED, dtype=torch.int32, device="cuda")
    tok, wt = _routing(mm, SLOTS)
    bufs, peers = _buffers(1)
    with pytest.raises(ValueError, match="combine.peers must be on a CUDA device, got cpu"):
        flashgemm.grouped_gemm_nt_masked(a, b, None, mm, combine=Combine(tok, wt, bufs[0], None, peers.cpu()))
    assert (bufs[0].view(torch.int16) == POISON).all()
