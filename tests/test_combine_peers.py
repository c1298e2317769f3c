"""The fused combine into the peers' receive buffers (``Combine.peers``,
``Epilogue.COMBINE_PEERS``) on the CPU: its argument checks, the epilogue it
picks, and the launch plan with the compile and the device stubbed. Its PTX
is checked in test_compile.py, its results on the GPU in
test_gpu_combine_peers.py."""

import pytest

import torch

import flashgemm
from flashgemm import Combine
from flashgemm.config import Epilogue
from flashgemm.routing import check_combine, combine_epilogue
from flashgemm.validation import validate_device

E, MAX_M, N, R = 3, 8, 16, 5


def _peers_combine(world=2, rows=R, n=N):
    tok = torch.randint(0, world * rows, (E, MAX_M), dtype=torch.int32)
    recv = torch.zeros(rows, n, dtype=torch.bfloat16)
    peers = torch.tensor([recv.data_ptr()] + [0] * (world - 1), dtype=torch.int64)
    return Combine(tok, torch.rand(E, MAX_M), recv, torch.zeros(1, dtype=torch.int32), peers)


def _check(c):
    return check_combine(c, None, None, E, MAX_M, N, {})


def test_peers_pick_the_peer_store_epilogue():
    c = _peers_combine()
    assert _check(c) == tuple(c)
    assert combine_epilogue(c) is Epilogue.COMBINE_PEERS
    assert combine_epilogue(c._replace(peers=None)) is Epilogue.COMBINE_BF16
    assert combine_epilogue(c._replace(peers=None, output=c.output.float())) is Epilogue.COMBINE
    assert Combine(*c[:4]).peers is None  # the field is optional, last


@pytest.mark.parametrize("change, error, message", [
    (lambda c: c._replace(peers=c.peers.int()), TypeError, "combine.peers must have dtype torch.int64"),
    (lambda c: c._replace(peers=c.peers.view(1, 2)), ValueError, "combine.peers must have rank 1"),
    (lambda c: c._replace(peers=[c.output.data_ptr()]), TypeError, "combine.peers must be a torch.Tensor"),
    (lambda c: c._replace(peers=torch.zeros(0, dtype=torch.int64)), ValueError,
     r"combine.peers must be a contiguous \[W\] tensor with W >= 1"),
    (lambda c: c._replace(peers=torch.zeros(4, dtype=torch.int64)[::2]), ValueError,
     r"combine.peers must be a contiguous \[W\] tensor"),
    (lambda c: c._replace(peers=c.output.view(-1)[8:16].view(torch.int64)), ValueError,
     "combine.peers must not overlap combine.output"),
    (lambda c: c._replace(output=c.output.float()), TypeError,
     "combine.output must have dtype torch.bfloat16 with combine.peers"),
    (lambda c: c._replace(output=torch.zeros(R, N, dtype=torch.float16)), TypeError,
     "combine.output must have dtype"),
    (lambda c: c._replace(output=torch.zeros(R, N + 8, dtype=torch.bfloat16)), ValueError,
     r"combine.output must be a contiguous \[T, N=16\]"),
    (lambda c: c._replace(token_index=c.token_index.long()), TypeError, "combine.token_index must have dtype"),
], ids=["dtype", "rank", "not-a-tensor", "empty", "strided", "over-output", "fp32-output", "fp16-output",
        "output-width", "token-dtype"])
def test_check_combine_names_each_bad_peers_argument(change, error, message):
    with pytest.raises(error, match=message):
        _check(change(_peers_combine()))


def test_peers_destinations_must_fit_int32():
    # the flat destinations owner * R + row are int32: R * W < 2**31
    c = _peers_combine()._replace(output=torch.zeros(2**11, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"combine.peers: R \* W must be below 2\*\*31, got R=2048 rows per "
                                         r"rank, W=1048576"):
        check_combine(c._replace(peers=torch.zeros(2**20, dtype=torch.int64)), None, None, E, MAX_M, 8, {})
    check_combine(c._replace(peers=torch.zeros(2**20 - 1, dtype=torch.int64)), None, None, E, MAX_M, 8, {})


def test_plan_passes_peers_last_and_is_reused(stub_launch):
    from flashgemm import api

    specs, seen, fn = stub_launch
    a = torch.randn(E, MAX_M, 64).to(torch.bfloat16)
    b = torch.randn(E, N, 64).to(torch.bfloat16)
    mm = torch.tensor([0, 3, MAX_M], dtype=torch.int32)
    c = _peers_combine()
    plain = c._replace(peers=None, output=torch.zeros(R, N, dtype=torch.bfloat16))
    for combine in (c, c, plain, plain):
        got = flashgemm.grouped_gemm_nt_masked(a, b, None, mm, expected_m=4, combine=combine)
        assert got[0] is combine.output and got[1] is combine.err
    # one plan per signature (the peers-less key too), the same configuration for both targets
    assert len(api._PLANS) == 2 and [s.epilogue for s in specs] == [Epilogue.COMBINE_PEERS, Epilogue.COMBINE_BF16]
    assert specs[0].config == specs[1].config
    # the routing slots, the peers table (None without it), the bias (None), the fused SwiGLU's scales
    # (None), num_ctas
    assert [len(args) for args in fn.launches] == [16] * 4
    assert all(x is y for x, y in zip(fn.launches[0][8:14], c)) and fn.launches[0][13] is None
    assert fn.launches[2][12] is None and fn.launches[2][10] is plain.output
    # the device check sees the table under its argument name
    assert seen[0]["combine.peers"] is c.peers and seen[1]["combine.peers"] is None
    cuda = {name: _OnDevice("cuda:0") for name, t in seen[0].items() if t is not None}
    with pytest.raises(ValueError, match="combine.peers must be on a CUDA device, got cpu"):
        validate_device({**cuda, "combine.peers": c.peers}, None, (9, 0), 132)
    with pytest.raises(ValueError, match="combine.peers is on cuda:1 but a is on cuda:0"):
        validate_device({**cuda, "combine.peers": _OnDevice("cuda:1")}, None, (9, 0), 132)


def test_plan_refuses_a_peers_table_moved_over_the_output(stub_launch):
    _, _, fn = stub_launch
    a = torch.randn(E, MAX_M, 64).to(torch.bfloat16)
    b = torch.randn(E, N, 64).to(torch.bfloat16)
    mm = torch.tensor([1, 3, MAX_M], dtype=torch.int32)
    c = _peers_combine()
    flashgemm.grouped_gemm_nt_masked(a, b, None, mm, combine=c)
    # same signature, but the table now inside the receive buffer: the per-call check sends it to the full checks
    inside = c.output.view(-1)[16:24].view(torch.int64)
    with pytest.raises(ValueError, match="combine.peers must not overlap combine.output"):
        flashgemm.grouped_gemm_nt_masked(a, b, None, mm, combine=c._replace(peers=inside))
    assert len(fn.launches) == 1


class _OnDevice:
    """validate_device reads only ``.device``."""

    def __init__(self, device):
        self.device = torch.device(device)
