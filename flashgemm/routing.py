"""Arguments of the combine fused into the GEMM's epilogue
(``grouped_gemm_nt_masked(..., combine=Combine(...))``) and their checks,
metadata only, each error naming the argument."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .config import Epilogue
from .validation import byte_span, check_dense, check_tensor, overlaps

# the launch slots the Combine fields fill, in order (the combined output is ``output``)
ROUTING_SLOTS = ("token_index", "weight", "combined", "err", "peers", "bias")
COMBINE_FIELDS = ("combine.token_index", "combine.weight", "combine.output", "combine.err", "combine.peers",
                  "combine.bias")
# the dtypes the sums may have: fp32, or bf16 (half the reduction bytes; docs/design.md)
SUM_DTYPES = (torch.float32, torch.bfloat16)


class Combine(NamedTuple):
    """Where each dispatched row goes: ``output[token_index[e, r]] +=
    weight[e, r] * row`` for the valid rows r < m_e of every expert e.

    With ``peers`` (expert parallelism over W ranks, ``Epilogue.COMBINE_PEERS``)
    nothing is summed: ``token_index[e, r]`` is the flat destination
    ``owner * R + row`` and ``bf16(weight[e, r] * row)`` is stored, with plain
    16-byte stores, into row ``row`` of rank ``owner``'s receive buffer, at
    byte address ``peers[owner] + row * N * 2``. ``output`` is this rank's
    receive buffer, a contiguous bf16 [R, N] tensor (the shape every rank's
    has); each ``peers`` entry must be a 16-byte aligned address this GPU can
    store to (its own buffer, or a peer's over NVLink). The stores are plain
    (weak): the owner reads its buffer after the kernel completed and a
    cross-rank synchronization, then sums the rows it received itself, in a
    fixed order; rows sharing a destination overwrite each other.

    With ``bias`` (a contiguous float32 [E, N] tensor on the same GPU, 16-byte
    aligned) each valid row leaves as ``weight[e, r] * (row + bias[e])``: the
    bias is added in fp32 to the row rounded to bf16, before the weight, for
    every target above (with ``peers`` it travels inside the stored row). The
    combine, and so its bias, runs on sm_90 only; on sm_100 / sm_103 the call
    raises ValueError before any launch."""

    token_index: torch.Tensor  # [E, max_m] int32 (only rows < m_e are read as routing)
    weight: torch.Tensor  # [E, max_m] float32
    # [T, N] float32 or bfloat16, contiguous, 16-byte aligned: reduce-added
    # into (with peers: this rank's [R, N] bf16 receive buffer)
    output: torch.Tensor
    err: Optional[torch.Tensor] = None  # [1] int32 error word, zeroed by the caller
    peers: Optional[torch.Tensor] = None  # [W] int64 on the GPU: each rank's receive-buffer address
    bias: Optional[torch.Tensor] = None  # [E, N] float32, contiguous: added to each row before its weight


def check_combine(combine, out, dst_signals, e_count: int, max_m: int, n: int, inputs: dict) -> tuple:
    """Check a ``Combine`` against the call; returns its six fields
    (``peers`` None without expert parallelism, ``bias`` None without a bias)."""
    if not isinstance(combine, Combine):
        raise TypeError(f"combine must be a flashgemm.Combine, got {type(combine).__name__}")
    if out is not None:
        raise ValueError("out must be None with combine (the rows go to combine.output only)")
    if dst_signals is not None:
        raise ValueError("dst_signals and combine exclude each other (the combine is fused)")
    token_index, weight, output, err, peers, bias = combine
    for name, t, dtype in (("combine.token_index", token_index, torch.int32),
                           ("combine.weight", weight, torch.float32)):
        check_tensor(name, t, 2, (dtype,))
        if tuple(t.shape) != (e_count, max_m) or t.stride(1) != 1:
            raise ValueError(f"{name} must have shape (E, max_m) = {(e_count, max_m)} with a "
                             f"contiguous last dim, got shape {tuple(t.shape)} strides {tuple(t.stride())}")
    check_tensor("combine.output", output, 2, SUM_DTYPES)
    if output.shape[1] != n or not output.is_contiguous() or output.shape[0] < 1:
        raise ValueError(f"combine.output must be a contiguous [T, N={n}] tensor with T >= 1, "
                         f"got shape {tuple(output.shape)} strides {tuple(output.stride())}")
    if output.numel() >= 2**31:
        raise ValueError(f"combine.output must hold fewer than 2**31 elements, got {output.numel()}")
    if output.data_ptr() % 16:
        raise ValueError("combine.output must start at a 16-byte aligned address (16-byte reductions)")
    check_tensor("combine.err", err, 1, (torch.int32,))
    if err.shape[0] != 1:
        raise ValueError(f"combine.err must have one element, got shape {tuple(err.shape)}")
    span_out = byte_span(output)
    for name, t in {**inputs, "combine.token_index": token_index, "combine.weight": weight,
                    "combine.err": err}.items():
        if t is not None and overlaps(span_out, byte_span(t)):
            raise ValueError(f"combine.output must not overlap {name}")
    if peers is not None:
        _check_peers(peers, output, span_out)
    if bias is not None:
        _check_bias(bias, output, e_count, n)
        if overlaps(span_out, byte_span(bias)):
            raise ValueError("combine.bias must not overlap combine.output")
    # a bad token ORs its bit into err: no other tensor of the call may share a byte with it
    span_err = byte_span(err)
    for name, t in {**inputs, "combine.token_index": token_index, "combine.weight": weight,
                    "combine.peers": peers, "combine.bias": bias}.items():
        if t is not None and overlaps(span_err, byte_span(t)):
            raise ValueError(f"combine.err must not overlap {name}")
    return token_index, weight, output, err, peers, bias


def _check_bias(bias, output, e_count: int, n: int) -> None:
    """The per-expert bias: float32 [E, N], contiguous and 16-byte aligned
    (read as 16-byte pieces of 4 values; N % 8 == 0 already holds for every
    combine), on ``output``'s device (its CUDA device is checked with the
    other tensors', ``validation.validate_device``). Any other tensor is a
    ValueError naming ``combine.bias``."""
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"combine.bias must be a torch.Tensor or None, got {type(bias).__name__}")
    check_dense("combine.bias", bias)
    if bias.dtype != torch.float32:
        raise ValueError(f"combine.bias must have dtype torch.float32 (added in fp32 to each row), "
                         f"got {bias.dtype}")
    if tuple(bias.shape) != (e_count, n) or not bias.is_contiguous():
        raise ValueError(f"combine.bias must be a contiguous [E, N] = {[e_count, n]} tensor, got shape "
                         f"{tuple(bias.shape)} strides {tuple(bias.stride())}")
    if bias.numel() >= 2**31:  # (its offsets are int32)
        raise ValueError(f"combine.bias must hold fewer than 2**31 elements, got {bias.numel()}")
    if bias.device != output.device:
        raise ValueError(f"combine.bias is on {bias.device} but combine.output is on {output.device}; "
                         "both must be on the GPU of the call")
    if bias.data_ptr() % 16:
        raise ValueError("combine.bias must start at a 16-byte aligned address (read in 16-byte pieces)")


def _check_peers(peers, output, span_out) -> None:
    """The receive-buffer table of ``Epilogue.COMBINE_PEERS``; its device is
    checked with the other tensors' (``validation.validate_device``)."""
    if output.dtype != torch.bfloat16:
        raise TypeError(f"combine.output must have dtype torch.bfloat16 with combine.peers (the rows are "
                        f"stored as bf16 into the receive buffers), got {output.dtype}")
    check_tensor("combine.peers", peers, 1, (torch.int64,))
    if peers.shape[0] < 1 or not peers.is_contiguous():
        raise ValueError(f"combine.peers must be a contiguous [W] tensor with W >= 1, got shape "
                         f"{tuple(peers.shape)} strides {tuple(peers.stride())}")
    if overlaps(span_out, byte_span(peers)):
        raise ValueError("combine.peers must not overlap combine.output")
    rows, world = output.shape[0], peers.shape[0]
    if rows * world >= 2**31:  # the flat destinations owner * R + row are int32
        raise ValueError(f"combine.peers: R * W must be below 2**31, got R={rows} rows per rank, W={world}")


def combine_epilogue(combine: Combine) -> Epilogue:
    """The epilogue that stores into the peers' receive buffers, or sums
    into ``combine.output``'s dtype; its ``*_BIAS`` build with a bias."""
    biased = combine.bias is not None
    if combine.peers is not None:
        return Epilogue.COMBINE_PEERS_BIAS if biased else Epilogue.COMBINE_PEERS
    if combine.output.dtype == torch.bfloat16:
        return Epilogue.COMBINE_BF16_BIAS if biased else Epilogue.COMBINE_BF16
    return Epilogue.COMBINE_BIAS if biased else Epilogue.COMBINE
