"""``torchrun --nproc-per-node N -m flashgemm.ep.demo``: a DeepSeek-V3-shaped
MoE layer (256 experts, top-8, H 7168, I 2048, block-scaled fp8) with N-way
expert parallelism.

Each rank: the device dispatch (token rows stored straight into the owners'
symmetric buffers, fp8 quantized on the way; ``--baseline``: the host-synced
``all_to_all_single``), the local experts' gate_up + SwiGLU, then the down
GEMM and the combine into the owners' receive buffers in each of three forms:
fused (the GEMM's epilogue stores each row into its owner), signalled (a
combine kernel on another stream polls the GEMM's completion signals) and
sequential; then each rank sums its tokens' k rows. The tokens are checked
against the all-gather reference (every form). Then, per size in
``--sizes``, the whole layer is captured in CUDA graphs and replayed
against the same rank's GEMMs alone (medians, interleaved), each part's
time inside the layer's graph beside its time alone, with the
dispatch alone against its bound (the bytes any rank sends to or receives
from its peers over a plain peer copy measured in the same run) and the
combine kernel alone against the same copy rate. ``--layers N`` replays the
layer's graph N times; ``--fail-rank R`` makes rank R skip its down GEMM and
combine once, and every rank must then raise instead of hanging.

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

from . import parts
from .buffers import multicast_off_env

FP8 = torch.float8_e4m3fn
SIMILARITY_TOL = 1e-3


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m flashgemm.ep.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank of the correctness check (default 128)")
    p.add_argument("--sizes", default="1,8,32,128,256",
                   help="comma-separated tokens per rank to time (default 1,8,32,128,256)")
    p.add_argument("--baseline", action="store_true",
                   help="the all_to_all_single dispatch (host-synced) instead of the device dispatch")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--bf16", action="store_true", help="bf16 weights and tokens instead of fp8")
    p.add_argument("--combine-sms", type=int, default=20)
    p.add_argument("--rows-per-item", type=int, default=None, help="rows of one combine work item (power of 2)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--layers", type=int, default=0, help="then replay the whole layer's graph this many times")
    p.add_argument("--fail-rank", type=int, default=None,
                   help="rank that skips its down GEMM and combine in one extra layer: every rank must raise, "
                        "none hang")
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
    from .device_dispatch import build_ep_dispatch

    dptx = build_ep_dispatch(args.top_k, not args.bf16, torch.int64, "sm_90a", keep_ptx=True).__ptx__
    dfeats = [name for name, pat in (("atom.sys row claims", "atom.global.sys.add"),
                                     ("st.global.v4 rows", "st.global.v4.b32"),
                                     ("st.release.sys arrival", "st.release.sys"),
                                     ("ld.acquire.sys peer wait", "ld.acquire.sys")) if pat in dptx]
    print(f"  compiled the device dispatch for sm_90a (top-{args.top_k}, {'bf16' if args.bf16 else 'fp8'} rows): "
          f"{', '.join(dfeats)}; no multimem: {'multimem' not in dptx}")
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


def _sized(t, x, ids, w):
    return x[:t].contiguous(), ids[:t].contiguous(), w[:t].contiguous()


def _failure_drill(layer, x, ids, w, rank, fail_rank, expected_m) -> str:
    """Rank ``fail_rank`` skips its down GEMM and combine in one layer (as a
    rank that died there would); every rank then runs one more whole layer.
    Every other rank's wait gives up in the first layer; the failed rank
    learns of it at the next arrival (the word is sticky)."""
    from .combine import check_error
    from .layer import CombineForm

    d = layer.dispatch(x, ids, w)
    h, hs = layer.up(d, expected_m)
    if rank != fail_rank:
        layer.down_and_combine(d, h, hs, ids, form=CombineForm.FUSED, expected_m=expected_m)
    layer(x, ids, w, expected_m=expected_m, form=CombineForm.FUSED)
    torch.cuda.synchronize()
    try:
        check_error(layer.recv.err, rank)
    except RuntimeError as raised:
        return f"raised RuntimeError: {raised}"
    return f"rank {rank}: NO ERROR RAISED"


def _run(args) -> int:
    import torch.distributed as dist

    from ..api import grouped_gemm_nt_masked
    from ..reference import similarity
    from ..timing import capture_graph
    from .buffers import alloc_token_buffers
    from .combine import check_error, complete
    from .device_dispatch import alloc_dispatch_buffers
    from .layer import CombineForm, EpMoELayer
    from .reference import ep_layer_ref

    rank, world, local = _init()
    device = torch.device("cuda", local)
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} must be a multiple of the world size {world}")
    sizes = sorted({int(v) for v in args.sizes.split(",")}) if args.sizes else [args.tokens]
    t_max = max(sizes + [args.tokens])
    e_local = args.experts // world
    fp8 = not args.bf16
    _say(rank, f"EP{world} MoE layer, DeepSeek-V3 shapes: {args.experts} experts ({e_local} per rank), "
               f"top-{args.top_k}, H {args.hidden}, I {args.intermediate}, up to {t_max} tokens/rank, "
               f"{'fp8 block-scaled' if fp8 else 'bf16'}")
    _say(rank, f"engine: torch symmetric memory (CUDA backend), multicast off "
               f"({', '.join(f'{k}={v}' for k, v in multicast_off_env().items())}); "
               f"dispatch: {'all_to_all_single baseline' if args.baseline else 'device kernel (no host sync)'}")
    experts = _weights(args, e_local, rank, device)
    buffers = alloc_token_buffers(t_max, args.hidden, args.top_k, device=device)
    recv = None if args.baseline else alloc_dispatch_buffers(t_max, args.hidden, args.top_k, args.experts,
                                                            fp8=fp8, device=device)
    layer = EpMoELayer(experts, args.experts, buffers, combine_sms=args.combine_sms,
                       rows_per_item=args.rows_per_item, recv=recv)
    g = torch.Generator(device=device).manual_seed(args.seed + 17 * (rank + 1))
    x_all = torch.randn(t_max, args.hidden, generator=g, device=device).to(torch.bfloat16)
    ids_all = torch.topk(torch.rand(t_max, args.experts, generator=g, device=device), args.top_k).indices
    w_all = torch.softmax(torch.randn(t_max, args.top_k, generator=g, device=device), dim=1)
    forms = (CombineForm.FUSED, CombineForm.SIGNALLED, CombineForm.SEQUENTIAL)

    def inputs(t):
        x, ids, w = _sized(t, x_all, ids_all, w_all)
        if args.baseline and fp8:
            from ..quant import quantize_fp8_per_token

            return (*quantize_fp8_per_token(x, m_major=False), ids, w)
        return x, None, ids, w

    def reference(x, x_scale, ids, w):
        if fp8 and x_scale is None:
            from ..quant import quantize_fp8_per_token

            x, x_scale = quantize_fp8_per_token(x, m_major=False)
        return ep_layer_ref(experts, x, ids, w, args.experts, x_scale=x_scale, rank=rank, world=world)

    x, x_scale, ids, w = inputs(args.tokens)
    expected_m = max(1, args.tokens * world * args.top_k // args.experts)
    ref = reference(x, x_scale, ids, w)
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
    _say(rank, f"  {args.tokens} tokens/rank vs all-gather reference, worst similarity diff over ranks: "
               + ", ".join(f"{f.value} {float(v):.1e}" for f, v in zip(forms, diffs))
               + f" -> {'OK' if ok else 'FAILED'}")
    if args.baseline:
        return _baseline_times(layer, x, x_scale, ids, w, expected_m, forms, args, rank, world, device, ok)

    _say(rank, "  per size: the whole layer (fused form) from CUDA graphs of 10 layers back to back after a "
               "barrier, against the same rank's GEMMs alone (gate_up + SwiGLU, down) timed the same way on the "
               "same rows, interleaved; per layer, medians, the slowest rank")
    _say(rank, f"  {'T/rank':>6} {'layer us':>9} {'GEMMs us':>9} {'ratio':>6} {'sig. us':>8} {'disp. us':>9} "
               f"{'bound us':>9} {'d/(2b+10)':>9} {'peer GB/s':>9} {'comb. us':>9} {'comb/peer':>9} {'check':>8}")
    rate_lines = []
    for t in sizes:
        x, _, ids, w = inputs(t)
        em = max(1, t * world * args.top_k // args.experts)
        layers = []
        graph = capture_graph(lambda: layers.append(layer(x, ids, w, expected_m=em, form=CombineForm.FUSED)),
                              calls=1)
        buffers.tokens.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_error(layers[-1][1], rank)
        sim = similarity(buffers.tokens[:t].clone(), reference(x, None, ids, w)) if t else 0.0
        d = layer.dispatch(x, ids, w)
        torch.cuda.synchronize()
        y = torch.empty(e_local, recv.max_m, args.hidden, dtype=torch.bfloat16, device=device)

        def gemms():
            h, hs = layer.up(d, em)
            grouped_gemm_nt_masked(h, experts.w2, y, d.masked_m, a_scale=hs, b_scale=experts.w2_scale,
                                   expected_m=em)

        timed = parts.chains_us(lambda: complete(buffers, recv.err), {
            "layer": lambda: layer(x, ids, w, expected_m=em, form=CombineForm.FUSED),
            "gemms": gemms,
            "signalled": lambda: layer(x, ids, w, expected_m=em, form=CombineForm.SIGNALLED)}, args)
        torch.cuda.synchronize()
        check_error(recv.err, rank)
        d = layer.dispatch(x, ids, w)
        sent, received = parts.dispatch_bytes(recv, d, ids, rank, world, e_local, device)
        remote = int(((d.routing.src_rank != rank) & (torch.arange(recv.max_m, device=device)[None]
                                                       < d.masked_m[:, None])).sum()) * 2 * args.hidden
        h, hs = layer.up(d, em)
        seq = parts.sequential_parts_us(layer, d, h, hs, ids, em, args)
        disp = parts.dispatch_alone_us(layer, x, ids, w, args)
        cut = parts.layer_parts_us(layer, x, ids, w, em, args)
        cut_names = list(cut)
        cut_t = torch.tensor([cut[k] for k in cut_names], device=device, dtype=torch.float64)
        if world > 1:
            dist.all_reduce(cut_t, op=dist.ReduceOp.MAX)
        cut = dict(zip(cut_names, cut_t.tolist()))
        worst = max(sent, received)
        rates = parts.peer_copy_gbps(recv, args) if world > 1 else {"engines": 0.0, "sms": 0.0}
        stats = torch.tensor([timed["layer"], timed["gemms"], timed["signalled"], disp,
                              -max(rates.values()), seq["combine"], sim, remote, -rates["engines"],
                              -rates["sms"]], device=device, dtype=torch.float64)
        if world > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # times: the slowest rank; rates: the slowest (negated)
        lay_us, gem_us, sig_us, disp_us, peer_gbps, comb_us, sim, remote, ce, sm = stats.tolist()
        peer_gbps, ce, sm = -peer_gbps, -ce, -sm
        bound = worst / peer_gbps / 1e3 if world > 1 else float("nan")
        comb_rate = remote / comb_us / 1e3 if comb_us else float("nan")
        rate_lines.append(f"  {t:6d} tokens/rank: peer copy {ce:.0f} GB/s by the copy engines, {sm:.0f} GB/s by "
                          f"an SM kernel ({parts.RATE_BYTES >> 20} MiB per rank, every rank at once); the dispatch "
                          f"moves {worst / 1e6:.2f} MB at most per rank, the combine {remote / 1e6:.2f} MB "
                          f"({comb_rate:.0f} GB/s), the down GEMM alone {seq['down']:.1f} us\n"
                          f"    parts inside the layer's graph: dispatch {cut['dispatch']:.1f} us, gate_up + SwiGLU "
                          f"{cut['up']:.1f} (alone {cut['up_alone']:.1f}), down + combine + completion "
                          f"{cut['down+combine']:.1f} (down alone {cut['down_alone']:.1f}), sum {cut['sum']:.1f}")
        good = sim < SIMILARITY_TOL
        ok = ok and good
        _say(rank, f"  {t:6d} {lay_us:9.1f} {gem_us:9.1f} {lay_us / gem_us:6.3f} {sig_us:8.1f} {disp_us:9.1f} "
                   f"{bound:9.1f} {disp_us / (2 * bound + 10):9.2f} {peer_gbps:9.0f} {comb_us:9.1f} "
                   f"{comb_rate / peer_gbps if world > 1 else float('nan'):9.2f} "
                   f"{'OK' if good else 'FAILED'} {sim:.0e}")
    for line in rate_lines:
        _say(rank, line)
    if world == 1:
        _say(rank, "  world size 1: the dispatch and the combine wrote into this GPU's own buffers; the NVLink "
                   "bounds need 2+ GPUs")

    if args.layers:
        x, _, ids, w = inputs(args.tokens)
        outs = []
        graph = capture_graph(lambda: outs.append(layer(x, ids, w, expected_m=expected_m)), calls=1)
        for _ in range(args.layers):
            graph.replay()
        torch.cuda.synchronize()
        check_error(outs[-1][1], rank)
        final = similarity(outs[-1][0].clone(), reference(x, None, ids, w))
        _say(rank, f"  {args.layers} graph replays of the whole layer back to back: no hang, no error "
                   f"word; last layer's similarity diff {final:.1e}")
        ok = ok and final < SIMILARITY_TOL
    if args.fail_rank is not None:
        layer.max_polls = args.drill_polls
        x, _, ids, w = inputs(args.tokens)
        seen = _failure_drill(layer, x, ids, w, rank, args.fail_rank, expected_m)
        everyone = [None] * world
        dist.all_gather_object(everyone, seen)  # one line per rank, printed whole by rank 0
        for r, text in enumerate(everyone):
            _say(rank, f"  failure drill (rank {args.fail_rank} skips its down GEMM and combine): rank {r}: {text}")
        ok = ok and "raised RuntimeError" in seen
        dist.barrier()
        dist.destroy_process_group()  # the flags no longer agree: these buffers are not reused
        return 0 if ok else 1
    buffers.barrier(timeout_ms=60_000)  # the engine's signal-pad barrier (no multicast), once at the end
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return 0 if ok else 1


def _baseline_times(layer, x, x_scale, ids, w, expected_m, forms, args, rank, world, device, ok) -> int:
    """The ``all_to_all_single`` baseline's parts, eager, forms interleaved."""
    import torch.distributed as dist

    runs = {form: [] for form in forms}
    for i in range(args.warmup + args.iters):
        for form in forms:
            t = parts.timed_layer(layer, x, x_scale, ids, w, expected_m, form)
            if i >= args.warmup:
                runs[form].append(t)
    keys = ("dispatch", "up", "down+combine", "layer")
    stats = torch.tensor([statistics.median(t[k] for t in runs[f]) for f in forms for k in keys],
                         device=device, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    s = stats.tolist()
    for i, form in enumerate(forms):
        _say(rank, f"    {form.value:10s} dispatch {s[4 * i]:8.1f} us, gate_up + SwiGLU {s[4 * i + 1]:8.1f} us, "
                   f"down + combine + sum {s[4 * i + 2]:8.1f} us, whole layer {s[4 * i + 3]:8.1f} us")
    layer.buffers.barrier(timeout_ms=60_000)
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
