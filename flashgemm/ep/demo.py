"""``torchrun --nproc-per-node N -m flashgemm.ep.demo``: a DeepSeek-V3-shaped
MoE layer (256 experts, top-8, H 7168, I 2048, block-scaled fp8) with N-way
expert parallelism.

Each rank: dispatch (baseline ``all_to_all_single``), the local experts'
gate_up + SwiGLU (``flashgemm.moe`` kernels), then the down GEMM and the
combine into the owners' symmetric-memory receive buffers in each of three
forms: fused (the GEMM's epilogue stores each row into its owner), signalled
(a combine kernel on another stream polls the GEMM's completion signals) and
sequential (the whole GEMM, then the combine); then each rank sums its
tokens' k rows. The tokens are checked against the all-gather reference
(every form); each part's median time (CUDA events, after warm-up) and the
whole layer's are printed by rank 0, with each overlapped form's speed-up
over the sequential layer. ``--fail-rank R`` makes rank R skip its combine
once, to show that every other rank then raises instead of hanging.

Run as a plain ``python -m flashgemm.ep.demo`` it makes a world of one
(symmetric memory with one rank: the combine writes into this GPU's own
buffer, "peer 0"; no NVLink traffic). Without a GPU it says so, compiles the
combine for sm_90a (PTX checked) and runs the plan's round trip on the CPU;
nothing is launched. NVLink multicast stays off in every process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

from .buffers import multicast_off_env

FP8 = torch.float8_e4m3fn
COPY_GBPS = 3000.0  # H100 device-to-device copy, read + write (notes, 2026-11-25)
NVLINK_GBPS = 450.0  # H100 SXM NVLink 4, one direction (the nominal figure, not measured here)
SIMILARITY_TOL = 1e-3


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m flashgemm.ep.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank (default 128)")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--bf16", action="store_true", help="bf16 weights and tokens instead of fp8")
    p.add_argument("--combine-sms", type=int, default=20)
    p.add_argument("--rows-per-item", type=int, default=None, help="rows of one combine work item (power of 2)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--layers", type=int, default=0, help="then run this many back-to-back layers (hang test)")
    p.add_argument("--fail-rank", type=int, default=None,
                   help="rank that skips its combine in one extra layer: every other rank must raise, none hang")
    p.add_argument("--drill-polls", type=int, default=20_000,
                   help="bound of each wait in the failure drill (the layers before it keep the default bound, "
                        "which must cover one rank compiling while the other waits)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _say(rank, *msg):
    if rank == 0:
        print(*msg, flush=True)


def _no_gpu(args) -> int:
    from .plan import plan_world

    print("No CUDA GPU here: nothing is launched. What this run does instead:")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from .combine import build_ep_combine

    ptx = build_ep_combine(64, 4, "sm_90a", keep_ptx=True).__ptx__
    feats = [name for name, pat in (("ld.acquire.gpu poll", "ld.acquire.gpu"),
                                    ("st.global.v4 rows", "st.global.v4.b32"),
                                    ("red.release.sys completion", "red.release.sys"),
                                    ("ld.acquire.sys peer wait", "ld.acquire.sys")) if pat in ptx]
    print(f"  compiled the signalled EP combine for sm_90a: {', '.join(feats)}; no multimem: "
          f"{'multimem' not in ptx}")
    world, experts, tokens, k, hidden = 4, 16, 12, 4, 32
    g = torch.Generator().manual_seed(args.seed)
    ids = [torch.topk(torch.rand(tokens, experts, generator=g), k).indices for _ in range(world)]
    ws = [torch.rand(tokens, k, generator=g) for _ in range(world)]
    xs = [torch.randn(tokens, hidden, generator=g) for _ in range(world)]
    scale = torch.randn(experts, hidden, generator=g)
    plan = plan_world(ids, ws, experts)
    outs = [torch.zeros(tokens, hidden) for _ in range(world)]
    for dest in range(world):
        src_rank, src_token = plan.sources[dest]
        r = plan.routing[dest]
        e_local = experts // world
        for row, s, t in zip(plan.rows[dest].tolist(), src_rank.tolist(), src_token.tolist()):
            e, m = divmod(row, plan.receive[dest].max_m)
            y = torch.tanh(xs[s][t] * scale[dest * e_local + e])
            outs[int(r.src_rank[e, m])][int(r.src_token[e, m])] += float(r.weight[e, m]) * y
    worst = 0.0
    for rank in range(world):
        ref = sum(ws[rank][:, j:j + 1] * torch.tanh(xs[rank] * scale[ids[rank][:, j]]) for j in range(k))
        worst = max(worst, float((outs[rank] - ref).abs().max()))
    print(f"  CPU round trip of the dispatch plan, {world} emulated ranks x {tokens} tokens, {experts} experts, "
          f"top-{k}: max error {worst:.1e} -> {'OK' if worst < 1e-4 else 'FAILED'}")
    return 0 if worst < 1e-4 else 1


def _init():
    """(rank, world, local device): torchrun's environment, else a world of one."""
    import torch.distributed as dist

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        return dist.get_rank(), dist.get_world_size(), local
    torch.cuda.set_device(0)
    path = os.path.join(tempfile.mkdtemp(prefix="flashgemm-ep-"), "store")
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    print("Not under torchrun: a world of one on this GPU (symmetric memory with one rank; the combine "
          "writes into this GPU's own buffer as peer 0, so no NVLink traffic is measured).", flush=True)
    return 0, 1, 0


def _weights(args, e_local, rank, device):
    from ..moe.layer import MaskedExperts

    g = torch.Generator(device=device).manual_seed(args.seed * 1000 + rank)
    h, i = args.hidden, args.intermediate
    if args.bf16:
        w13 = (torch.randn(e_local, 2 * i, h, generator=g, device=device) * h ** -0.5).to(torch.bfloat16)
        w2 = (torch.randn(e_local, h, i, generator=g, device=device) * i ** -0.5).to(torch.bfloat16)
        return MaskedExperts(w13, w2)

    def fp8(shape):  # e4m3 values and 128x128 block scales, drawn directly (no fp32 copy)
        w = torch.empty(shape, dtype=torch.bfloat16, device=device)
        for e in range(shape[0]):
            w[e].normal_(generator=g)
        s = torch.rand(shape[0], -(-shape[1] // 128), -(-shape[2] // 128), generator=g, device=device)
        return w.to(FP8), (s + 0.5) * shape[2] ** -0.5

    w13, s13 = fp8((e_local, 2 * i, h))
    w2, s2 = fp8((e_local, h, i))
    return MaskedExperts(w13, w2, w13_scale=s13, w2_scale=s2)


def _median_us(fn, args):
    for _ in range(args.warmup):
        fn()
    times = [fn() for _ in range(args.iters)]
    return {k: statistics.median(t[k] for t in times) for k in times[0]}


def _timed_layer(layer, x, x_scale, ids, w, expected_m, form):
    """One layer on the current stream with events between its parts: {part: us}."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    ev[0].record()
    d = layer.dispatch(x, ids, w, x_scale=x_scale)
    ev[1].record()
    h, hs = layer.up(d, expected_m)
    ev[2].record()
    _, err = layer.down_and_combine(d, h, hs, ids, form=form, expected_m=expected_m)
    ev[3].record()
    ev[3].synchronize()
    from .combine import check_error

    check_error(err, layer.buffers.rank)
    return {"dispatch": ev[0].elapsed_time(ev[1]) * 1e3, "up": ev[1].elapsed_time(ev[2]) * 1e3,
            "down+combine": ev[2].elapsed_time(ev[3]) * 1e3, "layer": ev[0].elapsed_time(ev[3]) * 1e3}


def _sequential_parts_us(layer, d, h, hs, ids, expected_m, args) -> dict:
    """The sequential form's parts timed one by one: the down GEMM (all SMs,
    with signals), the combine kernel (all SMs; its completion step waits
    for the peers) and the local sum."""
    from ..api import grouped_gemm_nt_masked, signal_layout
    from ..signals import alloc_signals
    from .combine import combine_to_owners, finalize

    ex, buffers = layer.experts, layer.buffers
    y = torch.empty(h.shape[0], h.shape[1], ex.hidden, dtype=torch.bfloat16, device=h.device)
    layout = signal_layout(h.shape[0], h.shape[1], ex.hidden, ex.intermediate, expected_m=expected_m,
                           fp8=ex.fp8, device=h.device)
    signals = alloc_signals(layout, h.device)
    err = torch.zeros(1, dtype=torch.int32, device=h.device)

    def run():
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        signals.zero_()
        ev[0].record()
        grouped_gemm_nt_masked(h, ex.w2, y, d.masked_m, a_scale=hs, b_scale=ex.w2_scale, expected_m=expected_m,
                               dst_signals=signals)
        ev[1].record()
        combine_to_owners(y, d.masked_m, signals, layout, d.routing, buffers, num_sms=layer.sm_count,
                          rows_per_item=layer.rows_per_item, err=err)
        ev[2].record()
        finalize(buffers, ids)
        ev[3].record()
        ev[3].synchronize()
        return {"down": ev[0].elapsed_time(ev[1]) * 1e3, "combine": ev[1].elapsed_time(ev[2]) * 1e3,
                "sum": ev[2].elapsed_time(ev[3]) * 1e3}

    parts = _median_us(run, args)
    from .combine import check_error

    check_error(err, buffers.rank)
    return parts


def _failing_layer(layer, x, x_scale, ids, w, expected_m, rank, fail_rank) -> str:
    """One layer in which ``fail_rank`` skips its down GEMM and combine (as a
    rank that died there would): what this rank then sees."""
    from .combine import check_error
    from .layer import CombineForm

    d = layer.dispatch(x, ids, w, x_scale=x_scale)
    h, hs = layer.up(d, expected_m)
    if rank == fail_rank:
        return f"rank {rank}: skipped its combine on purpose"
    _, err = layer.down_and_combine(d, h, hs, ids, form=CombineForm.FUSED, expected_m=expected_m)
    torch.cuda.synchronize()
    try:
        check_error(err, rank)
    except RuntimeError as raised:
        return f"raised RuntimeError: {raised}"
    return f"rank {rank}: NO ERROR RAISED"


def _run(args) -> int:
    import torch.distributed as dist

    from ..quant import quantize_fp8_per_token
    from ..reference import similarity
    from .buffers import alloc_token_buffers
    from .combine import check_error
    from .layer import CombineForm, EpMoELayer
    from .reference import ep_layer_ref

    rank, world, local = _init()
    device = torch.device("cuda", local)
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} must be a multiple of the world size {world}")
    e_local = args.experts // world
    _say(rank, f"EP{world} MoE layer, DeepSeek-V3 shapes: {args.experts} experts ({e_local} per rank), "
               f"top-{args.top_k}, H {args.hidden}, I {args.intermediate}, {args.tokens} tokens/rank, "
               f"{'bf16' if args.bf16 else 'fp8 block-scaled'}")
    _say(rank, f"engine: torch symmetric memory (CUDA backend), multicast off "
               f"({', '.join(f'{k}={v}' for k, v in multicast_off_env().items())}); "
               f"dispatch: all_to_all_single baseline")
    experts = _weights(args, e_local, rank, device)
    buffers = alloc_token_buffers(args.tokens, args.hidden, args.top_k, device=device)
    layer = EpMoELayer(experts, args.experts, buffers, combine_sms=args.combine_sms,
                       rows_per_item=args.rows_per_item)
    g = torch.Generator(device=device).manual_seed(args.seed + 17 * (rank + 1))
    x = torch.randn(args.tokens, args.hidden, generator=g, device=device).to(torch.bfloat16)
    ids = torch.topk(torch.rand(args.tokens, args.experts, generator=g, device=device), args.top_k).indices
    w = torch.softmax(torch.randn(args.tokens, args.top_k, generator=g, device=device), dim=1)
    x_scale = None
    if not args.bf16:
        x, x_scale = quantize_fp8_per_token(x, m_major=False)
    expected_m = max(1, args.tokens * world * args.top_k // args.experts)
    forms = (CombineForm.FUSED, CombineForm.SIGNALLED, CombineForm.SEQUENTIAL)

    ref = ep_layer_ref(experts, x, ids, w, args.experts, x_scale=x_scale, rank=rank, world=world)
    diffs = []
    for form in forms:
        out, err = layer(x, ids, w, x_scale=x_scale, expected_m=expected_m, form=form)
        torch.cuda.synchronize()
        check_error(err, rank)
        diffs.append(similarity(out.clone(), ref))
    diffs = torch.tensor(diffs, device=device, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    ok = bool((diffs < SIMILARITY_TOL).all())
    _say(rank, "  tokens vs all-gather reference, worst similarity diff over ranks: "
               + ", ".join(f"{f.value} {float(v):.1e}" for f, v in zip(forms, diffs))
               + f" -> {'OK' if ok else 'FAILED'}")

    times = {}
    for _ in range(args.warmup):
        for form in forms:
            _timed_layer(layer, x, x_scale, ids, w, expected_m, form)
    runs = {form: [] for form in forms}
    for _ in range(args.iters):  # the forms interleaved, so clocks and power state are shared
        for form in forms:
            runs[form].append(_timed_layer(layer, x, x_scale, ids, w, expected_m, form))
    for form in forms:
        times[form] = {k: statistics.median(t[k] for t in runs[form]) for k in runs[form][0]}
    d = layer.dispatch(x, ids, w, x_scale=x_scale)
    h, hs = layer.up(d, expected_m)
    parts = _sequential_parts_us(layer, d, h, hs, ids, expected_m, args)
    rows = int(d.masked_m.sum())
    active = int((d.masked_m > 0).sum())
    w2_bytes = active * experts.w2[0].numel() * experts.w2.element_size()
    down_bytes = w2_bytes + rows * (experts.intermediate * h.element_size() + experts.hidden * 2)
    remote = int((d.routing.src_rank[d.routing.src_rank >= 0] != rank).sum())
    row_bytes = 2 * experts.hidden  # a weighted bf16 row into the receive buffer
    keys = ("dispatch", "up", "down+combine", "layer")
    stats = torch.tensor([times[f][k] for f in forms for k in keys] + [parts["down"], parts["combine"], parts["sum"]],
                         device=device, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    s = stats.tolist()
    t = {f: dict(zip(keys, s[4 * i:4 * i + 4])) for i, f in enumerate(forms)}
    down, combine_us, sum_us = s[-3:]
    fused, sig, seq = (t[f] for f in forms)
    _say(rank, f"  (rank 0's counts: {rows} rows in {active} active experts, {remote} rows to other ranks; "
               f"times: median of {args.iters}, forms interleaved, the slowest rank)")
    _say(rank, f"    dispatch (all_to_all_single)              {seq['dispatch']:8.1f} us")
    _say(rank, f"    gate_up GEMM + SwiGLU                     {seq['up']:8.1f} us")
    _say(rank, f"    down GEMM alone (with signals)            {down:8.1f} us   {down_bytes / down / 1e3:6.0f} GB/s "
               f"({down_bytes / down / 1e3 / COPY_GBPS:4.0%} of copy)")
    _say(rank, f"    combine kernel alone (all SMs)            {combine_us:8.1f} us   "
               f"{remote * row_bytes / 1e6:.1f} MB to peers: {remote * row_bytes / combine_us / 1e3:.0f} GB/s against ~{NVLINK_GBPS:.0f} GB/s per "
               f"direction (bound {remote * row_bytes / NVLINK_GBPS / 1e3:.1f} us)")
    _say(rank, f"    sum of each token's k rows                {sum_us:8.1f} us   "
               f"{buffers.recv[:args.tokens].numel() * 2 / sum_us / 1e3:.0f} GB/s of rows read")
    _say(rank, f"    down GEMM, then combine + sum (sequential) {seq['down+combine']:7.1f} us")
    for name, part in (("fused into the GEMM epilogue", fused), ("signalled, overlapped", sig)):
        _say(rank, f"    down GEMM + combine + sum, {name:28s} {part['down+combine']:8.1f} us   "
                   f"{seq['down+combine'] / part['down+combine']:.2f}x the sequential")
    for name, part in (("sequential", seq), ("fused", fused), ("signalled", sig)):
        _say(rank, f"    whole layer, {name:10s}                   {part['layer']:8.1f} us   "
                   f"{seq['layer'] / part['layer']:.2f}x the sequential")
    if world == 1:
        _say(rank, "  world size 1: the combine wrote into this GPU's own buffer; NVLink bounds and the 1.2x "
                   "bar need 2+ GPUs")

    for i in range(args.layers):
        out, err = layer(x, ids, w, x_scale=x_scale, expected_m=expected_m, form=forms[i % 2])
        if i % 100 == 99 or i == args.layers - 1:
            torch.cuda.synchronize()
            check_error(err, rank)
    if args.layers:
        final = similarity(out.clone(), ref)
        _say(rank, f"  {args.layers} back-to-back layers (fused and signalled alternating): no hang, no error "
                   f"word; last layer's similarity diff {final:.1e}")
        ok = ok and final < SIMILARITY_TOL
    if args.fail_rank is not None:
        layer.max_polls = args.drill_polls
        seen = _failing_layer(layer, x, x_scale, ids, w, expected_m, rank, args.fail_rank)
        print(f"  failure drill (rank {args.fail_rank} skips its combine): rank {rank}: {seen}", flush=True)
        ok = ok and ("raised RuntimeError" in seen or rank == args.fail_rank)
        dist.barrier()
        dist.destroy_process_group()  # the flags no longer agree: these buffers are not reused
        return 0 if ok else 1
    buffers.barrier(timeout_ms=60_000)  # the engine's signal-pad barrier (no multicast), once at the end
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return 0 if ok else 1


def main(argv=None) -> int:
    args = _args(argv)
    multicast_off_env()  # before any process group or symmetric buffer
    if not torch.cuda.is_available():
        return _no_gpu(args)
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
