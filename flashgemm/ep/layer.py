"""One expert-parallel MoE layer: dispatch, the local experts, the combine.

``EpMoELayer(experts, num_experts, buffers, recv=...)(x, topk_ids, topk_weights)``:

1. the dispatch into the masked layout: with ``recv`` (``DispatchBuffers``)
   the device dispatch (``device_dispatch``: rows stored into the owners'
   symmetric buffers, fp8 quantized on the way, masked_m made on the GPU);
   without it the ``all_to_all_single`` baseline (``dispatch``);
2. gate_up GEMM and SwiGLU (+ 1x128 fp8 quantization for an fp8 layer) on
   every SM, as ``flashgemm.moe.MaskedExperts`` does;
3. the down GEMM and the combine, in one of the forms of ``CombineForm``:
   each weighted row lands in its owner's receive buffer at (token, slot),
   and the step ends with every peer's completion;
4. ``combine.finalize``: each token's k rows summed in slot order (fp32
   accumulation, deterministic), so on return ``buffers.tokens[:T]`` holds
   this rank's outputs (float32 or bf16).

With the device dispatch the whole layer runs without a host sync and is
captured in one CUDA graph (``torch.cuda.graph`` around a call; replays read
new tokens written in place); its error word is the dispatch
buffers' sticky ``err``. The baseline reads its split sizes on the host, so
only steps 2 to 4 are capturable there.

Reuse of the receive buffers: a peer writes into them in layer i+1 only
after its dispatch of layer i+1, which waits for this rank's arrival, which
follows this rank's finalize of layer i on its stream.
"""

from __future__ import annotations

import enum
import functools
from typing import Optional

import torch

from ..api import grouped_gemm_nt_masked, signal_layout
from ..routing import Combine
from ..jit.arch import device_facts
from ..moe.layer import MaskedExperts
from ..signals import alloc_signals
from .buffers import TokenBuffers
from .combine import DEFAULT_MAX_POLLS, combine_to_owners, complete, finalize
from .device_dispatch import DEFAULT_MAX_POLLS as DISPATCH_MAX_POLLS
from .device_dispatch import DispatchBuffers, dispatch_on_device
from .dispatch import Dispatched, dispatch

DEFAULT_COMBINE_SMS = 20  # the reference combine's share in docs/signals.md's measurements


class CombineForm(enum.Enum):
    FUSED = "fused"  # form a: the GEMM's epilogue stores each row into its owner (Epilogue.COMBINE_PEERS)
    SIGNALLED = "signalled"  # form b: combine on a side stream, polling the GEMM's signals
    SEQUENTIAL = "sequential"  # the baseline: the whole down GEMM, then the combine


def check_form(form) -> CombineForm:
    if not isinstance(form, CombineForm):
        raise TypeError(f"form must be a CombineForm, got {type(form).__name__}")
    return form


@functools.lru_cache(maxsize=None)
def _side_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=index)


class EpMoELayer:
    """The expert path of one rank of an EP MoE layer.

    experts: this rank's ``MaskedExperts`` (E_local = num_experts / W of
    them); buffers: this rank's ``TokenBuffers`` (``alloc_token_buffers``,
    or ``local_token_buffers`` at world size 1 without a process group);
    gemm_sms / combine_sms: the split of the SMs while the down GEMM and the
    combine overlap (default: all but ``DEFAULT_COMBINE_SMS`` for the GEMM);
    recv: this rank's ``DispatchBuffers`` for the device dispatch (None:
    the ``all_to_all_single`` baseline)."""

    def __init__(self, experts: MaskedExperts, num_experts: int, buffers: TokenBuffers, *, group=None,
                 gemm_sms: Optional[int] = None, combine_sms: Optional[int] = None,
                 rows_per_item: Optional[int] = None, max_polls: int = DEFAULT_MAX_POLLS,
                 recv: Optional[DispatchBuffers] = None):
        if not isinstance(experts, MaskedExperts):
            raise TypeError(f"experts must be a flashgemm.moe.layer.MaskedExperts, got {type(experts).__name__}")
        if not isinstance(buffers, TokenBuffers):
            raise TypeError(f"buffers must be a TokenBuffers, got {type(buffers).__name__}")
        if experts.num_experts * buffers.world_size != num_experts:
            raise ValueError(f"experts holds {experts.num_experts} experts; with world size "
                             f"{buffers.world_size} num_experts must be {experts.num_experts * buffers.world_size}, "
                             f"got {num_experts}")
        if buffers.hidden != experts.hidden:
            raise ValueError(f"buffers.tokens has H={buffers.hidden}, the experts H={experts.hidden}")
        if recv is not None:
            _check_recv(recv, experts, num_experts, buffers)
        device = buffers.tokens.device
        sm_count = device_facts(device.index)[1]
        combine_sms = DEFAULT_COMBINE_SMS if combine_sms is None else combine_sms
        gemm_sms = sm_count - combine_sms if gemm_sms is None else gemm_sms
        if not (1 <= gemm_sms < sm_count and 1 <= combine_sms <= sm_count - gemm_sms):
            raise ValueError(f"need gemm_sms + combine_sms <= {sm_count} (co-residency: the combine polls, "
                             f"the GEMM must keep its SMs), got {gemm_sms} + {combine_sms}")
        self.experts, self.num_experts, self.buffers, self.group = experts, num_experts, buffers, group
        self.gemm_sms, self.combine_sms, self.sm_count = gemm_sms, combine_sms, sm_count
        self.rows_per_item, self.max_polls = rows_per_item, max_polls
        self.device, self.recv = device, recv
        self._spaces = {}

    # the parts, each on the current stream (the demo times them one by one)
    def dispatch(self, x, topk_ids, topk_weights, *, x_scale=None, max_m=None) -> Dispatched:
        if self.recv is None:
            return dispatch(x, topk_ids, topk_weights, self.num_experts, x_scale=x_scale,
                            max_tokens_per_rank=self.buffers.max_tokens, max_m=max_m, group=self.group)
        if x_scale is not None or max_m is not None:
            raise ValueError("the device dispatch takes bf16 x (it quantizes for an fp8 layer) and the "
                             "capacity of its buffers: x_scale and max_m must be None")
        if topk_weights.dtype != torch.float32:
            topk_weights = topk_weights.float()
        return dispatch_on_device(x, topk_ids, topk_weights, self.recv,
                                  max_polls=min(self.max_polls, DISPATCH_MAX_POLLS))

    def up(self, d: Dispatched, expected_m: Optional[int] = None):
        """gate_up GEMM and SwiGLU on every SM (the experts' activation path): (h, h_scale)."""
        return self.experts.up(d.x, d.masked_m, x_scale=d.x_scale, expected_m=expected_m)

    def down_and_combine(self, d: Dispatched, h, h_scale, topk_ids, *, form: CombineForm = CombineForm.FUSED,
                         expected_m: Optional[int] = None, err: Optional[torch.Tensor] = None):
        """The down GEMM and the combine in ``form``, then ``finalize``;
        returns (tokens[:T], err)."""
        check_form(form)
        ex, buffers = self.experts, self.buffers
        e_count, max_m, _ = h.shape
        if err is None:
            err = self.recv.err if self.recv is not None else torch.zeros(1, dtype=torch.int32, device=self.device)
        if form is CombineForm.FUSED:
            self.down_fused(d, h, h_scale, err, expected_m)
            return finalize(buffers, topk_ids), err
        overlap = form is CombineForm.SIGNALLED
        gemm_sms = self.gemm_sms if overlap else None
        layout = signal_layout(e_count, max_m, ex.hidden, ex.intermediate, expected_m=expected_m,
                               num_sms=gemm_sms, fp8=ex.fp8, device=self.device)
        y, signals = self._workspace(layout, e_count, max_m)
        combine = functools.partial(combine_to_owners, y, d.masked_m, signals, layout, d.routing, buffers,
                                    max_polls=self.max_polls, rows_per_item=self.rows_per_item, err=err)
        gemm = functools.partial(grouped_gemm_nt_masked, h, ex.w2, y, d.masked_m, a_scale=h_scale,
                                 b_scale=ex.w2_scale, expected_m=expected_m, num_sms=gemm_sms,
                                 dst_signals=signals)
        if not overlap:
            gemm()
            combine(num_sms=self.sm_count)
            return finalize(buffers, topk_ids), err
        main = torch.cuda.current_stream(self.device)
        side = _side_stream(self.device.index)
        ready = main.record_event()
        # the GEMM first, so its clusters are placed on an empty GPU
        # (flashgemm.overlap.run_gemm_and_combine explains the measurement)
        gemm()
        side.wait_event(ready)
        with torch.cuda.stream(side):
            combine(num_sms=self.combine_sms)
        main.wait_stream(side)
        if not torch.cuda.is_current_stream_capturing():  # a captured graph joins the branches itself
            routing = d.routing
            for t in (y, signals, err, d.masked_m, routing.src_rank, routing.src_token, routing.src_slot,
                      routing.weight):
                t.record_stream(side)
        return finalize(buffers, topk_ids), err

    def down_fused(self, d: Dispatched, h, h_scale, err: torch.Tensor, expected_m: Optional[int] = None) -> None:
        """The fused form's down GEMM, its epilogue storing each weighted row
        into its owner's receive buffer, then the completion step (every
        peer's rows have landed here on return, stream-ordered)."""
        ex, buffers = self.experts, self.buffers
        rows = buffers.rows_per_rank
        target = Combine(d.routing.destinations(rows, buffers.top_k), d.routing.weight,
                         buffers.recv.view(rows, ex.hidden), err, peers=buffers.peer_recv)
        grouped_gemm_nt_masked(h, ex.w2, None, d.masked_m, a_scale=h_scale, b_scale=ex.w2_scale,
                               expected_m=expected_m, combine=target)
        complete(buffers, err, max_polls=self.max_polls)

    def _workspace(self, layout, e_count: int, max_m: int):
        """The down GEMM's output and signals of the signalled forms, made once
        per shape (no per-call allocation; the signals zeroed on the stream)."""
        key = (layout, e_count, max_m)
        if self._spaces.get("key") != key:
            self._spaces = {"key": key, "signals": alloc_signals(layout, self.device),
                            "y": torch.empty(e_count, max_m, self.experts.hidden, dtype=torch.bfloat16,
                                             device=self.device)}
        self._spaces["signals"].zero_()
        return self._spaces["y"], self._spaces["signals"]

    def __call__(self, x, topk_ids, topk_weights, *, x_scale=None, expected_m: Optional[int] = None,
                 form: CombineForm = CombineForm.FUSED):
        """x: [T, H] this rank's tokens (bf16; an fp8 layer quantizes them
        1x128 before the dispatch, or takes fp8 x with x_scale). Returns
        (out, err): out = ``buffers.tokens[:T]`` (valid until the next call),
        err the combine's error word (``combine.check_error``)."""
        check_form(form)
        if self.experts.fp8 and x.dtype == torch.bfloat16 and self.recv is None:
            from ..quant import quantize_fp8_per_token

            x, x_scale = quantize_fp8_per_token(x, m_major=False)
        d = self.dispatch(x, topk_ids, topk_weights, x_scale=x_scale)
        h, h_scale = self.up(d, expected_m)
        return self.down_and_combine(d, h, h_scale, topk_ids, form=form, expected_m=expected_m)


def _check_recv(recv, experts, num_experts, buffers) -> None:
    if not isinstance(recv, DispatchBuffers):
        raise TypeError(f"recv must be a flashgemm.ep.device_dispatch.DispatchBuffers, got {type(recv).__name__}")
    want = {"num_experts": num_experts, "hidden": experts.hidden, "fp8": experts.fp8,
            "world_size": buffers.world_size, "rank": buffers.rank, "top_k": buffers.top_k}
    for name, value in want.items():
        if getattr(recv, name) != value:
            raise ValueError(f"recv.{name} is {getattr(recv, name)!r}, the layer needs {value!r}")
    if recv.max_tokens > buffers.max_tokens:
        raise ValueError(f"recv.max_tokens={recv.max_tokens} exceeds the combine buffers' "
                         f"max_tokens={buffers.max_tokens}")
