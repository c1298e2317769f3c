"""Timing the parts of an expert-parallel layer (used by ``ep.demo``): the
layer's parts one by one, graph replays, the dispatch alone, the combine
alone, and the plain peer copy rate they are held to. Every function that
launches a collective step is itself collective: all ranks call it in the
same order."""

from __future__ import annotations

import statistics

import torch

SETTLE_CYCLES = 200_000  # ~100 us of GPU spin: the host enqueues the timed launches meanwhile
REPS = 10  # launches per graph replay when one step is timed alone
RATE_BYTES = 64 << 20  # bytes per rank of the peer copy that measures the rate


def median_us(fn, args):
    for _ in range(args.warmup):
        fn()
    times = [fn() for _ in range(args.iters)]
    return {k: statistics.median(t[k] for t in times) for k in times[0]}


def timed_layer(layer, x, x_scale, ids, w, expected_m, form):
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


def sequential_parts_us(layer, d, h, hs, ids, expected_m, args) -> dict:
    """The sequential form's parts timed one by one: the down GEMM (all SMs,
    with signals) and the local sum from events, and the combine kernel
    (all SMs; its completion step waits for the peers) alone from graph
    replays, ``REPS`` launches each after a barrier, less the barriers (no
    rank's time then holds another's GEMM or the host's launch)."""
    from ..api import grouped_gemm_nt_masked, signal_layout
    from ..signals import alloc_signals
    from .combine import check_error, combine_to_owners, complete, finalize

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
        return {"down": ev[0].elapsed_time(ev[1]) * 1e3, "sum": ev[2].elapsed_time(ev[3]) * 1e3}

    parts = median_us(run, args)  # leaves y and its signals final: the combine below waits on nothing
    parts["combine"] = alone_us(lambda: complete(buffers, err), lambda: combine_to_owners(
        y, d.masked_m, signals, layout, d.routing, buffers, num_sms=layer.sm_count,
        rows_per_item=layer.rows_per_item, err=err), args)
    torch.cuda.synchronize()
    check_error(err, buffers.rank)
    return parts


def alone_us(barrier, step, args) -> float:
    """One collective step alone, from graph replays: ``REPS`` launches, each
    after ``barrier`` (every rank), less the same graph of barriers alone."""
    from ..timing import capture_graph

    def pair():
        barrier()
        step()

    with_step = capture_graph(pair, calls=REPS)
    barriers = capture_graph(barrier, calls=REPS)
    a, b = [], []
    for i in range(args.warmup + args.iters):  # interleaved; ends with a barrier
        ta, tb = graph_us(with_step, 1), graph_us(barriers, 1)
        if i >= args.warmup:
            a += ta
            b += tb
    return (statistics.median(a) - statistics.median(b)) / REPS


def settle() -> None:
    """Keep the GPU busy for ~100 us, so a timed launch that follows starts
    when the GPU reaches it, not when the host gets to it (and every rank,
    leaving a barrier together, reaches it together)."""
    torch.cuda._sleep(SETTLE_CYCLES)


def graph_us(graph, iters) -> list:
    """Event times of ``iters`` replays, one replay each (the layer's arrival
    keeps the ranks in step)."""
    out = []
    for _ in range(iters):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        graph.replay()
        ev[1].record()
        ev[1].synchronize()
        out.append(ev[0].elapsed_time(ev[1]) * 1e3)
    return out


def peer_copy_gbps(recv, args) -> dict:
    """The plain peer-to-peer copy rate out of this rank, every rank at once:
    ``RATE_BYTES`` split evenly over the peers, one copy per peer into its
    receive buffer, by the copy engines (``copy_``) and by an SM kernel (an
    elementwise op with the peer's memory as its output). Between copies,
    the engine's barrier. {"engines": GB/s, "sms": GB/s}."""
    world, rank = recv.world_size, recv.rank
    share = min(RATE_BYTES // (world - 1), recv.layout.nbytes - recv.layout.x) // 16 * 16
    src = torch.empty(share, dtype=torch.uint8, device=recv.raw.device).random_(0, 255)
    dsts = [recv.handle.get_buffer(p, (share,), torch.uint8, storage_offset=recv.layout.x)
            for p in range(world) if p != rank]
    ways = {"engines": lambda dst: dst.copy_(src),
            "sms": lambda dst: torch.bitwise_or(src.view(torch.int64), 0, out=dst.view(torch.int64))}
    rates = {}
    for name, copy in ways.items():
        times = []
        for i in range(args.warmup + args.iters):
            recv.handle.barrier(channel=1, timeout_ms=60_000)
            settle()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
            for dst in dsts:
                copy(dst)
            ev[1].record()
            ev[1].synchronize()
            if i >= args.warmup:
                times.append(ev[0].elapsed_time(ev[1]) * 1e3)
        rates[name] = share * len(dsts) / statistics.median(times) / 1e3
    recv.handle.barrier(channel=1, timeout_ms=60_000)
    torch.cuda.synchronize()
    return rates


def dispatch_alone_us(layer, x, ids, w, args) -> float:
    """The dispatch kernel alone (``alone_us``), each launch after the
    combine's completion step: no rank claims rows of the next launch before
    the owners took the counts of this one."""
    from .combine import complete

    return alone_us(lambda: complete(layer.buffers, layer.recv.err), lambda: layer.dispatch(x, ids, w), args)


def dispatch_bytes(recv, d, ids, rank, world, e_local, device) -> tuple:
    """(bytes this rank sends to peers, bytes it receives from them) in the
    dispatch: each remote copy's row (H values, its scales) and its routing."""
    import torch.distributed as dist

    row = recv.hidden * (1 if recv.fp8 else 2) + (4 * recv.layout.blocks if recv.fp8 else 0) + 16
    routed = ids[ids >= 0]
    sent = int(((routed // e_local) != rank).sum()) * row
    got = d.routing.src_rank.clone()
    valid = torch.arange(got.shape[1], device=device)[None] < d.masked_m[:, None]
    received = int(((got != rank) & valid).sum()) * row
    out = torch.tensor([sent, received], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return int(out[0]), int(out[1])



def chains_us(barrier, steps: dict, args, reps: int = REPS) -> dict:
    """Each step's time per launch, from graph replays: one ``barrier``
    (every rank) and then ``reps`` launches of the step back to back, less
    a graph of the barrier alone. The barrier lines the ranks up, so a
    rank's host launching its replay late shows up in the barrier, not in a
    step; the steps' graphs are replayed interleaved. Collective."""
    from ..timing import capture_graph

    def chain(step):
        def run():
            barrier()
            for _ in range(reps):
                step()
        return run

    graphs = {name: capture_graph(chain(step), calls=1) for name, step in steps.items()}
    graphs[None] = capture_graph(barrier, calls=1)
    times = {name: [] for name in graphs}
    for i in range(args.warmup + args.iters):
        for name, graph in graphs.items():
            got = graph_us(graph, 1)
            if i >= args.warmup:
                times[name] += got
    base = statistics.median(times.pop(None))
    return {name: (statistics.median(t) - base) / reps for name, t in times.items()}


def layer_parts_us(layer, x, ids, w, expected_m, args) -> dict:
    """The fused layer's parts where they run, inside its graph: the layer
    cut after each part (dispatch; + gate_up; + down with the fused combine
    and the completion; + the sum), each cut ended by a completion step so
    that no rank claims rows of the next launch early, timed by
    ``chains_us``; a part's time is the difference of two neighbouring
    cuts. Beside them, gate_up and down alone on the same rows
    (``up_alone``, ``down_alone``). Collective."""
    from ..api import grouped_gemm_nt_masked
    from .combine import complete, finalize

    ex, buffers, err = layer.experts, layer.buffers, layer.recv.err

    def cut(parts):
        def run():
            d = layer.dispatch(x, ids, w)
            if parts > 1:
                h, hs = layer.up(d, expected_m)
            if parts > 2:
                layer.down_fused(d, h, hs, err, expected_m)
            if parts > 3:
                finalize(buffers, ids)
            complete(buffers, err)
        return run

    d = layer.dispatch(x, ids, w)
    h, hs = layer.up(d, expected_m)
    y = torch.empty(h.shape[0], h.shape[1], ex.hidden, dtype=torch.bfloat16, device=h.device)
    steps = {k: cut(k) for k in (1, 2, 3, 4)}
    steps["up_alone"] = lambda: layer.up(d, expected_m)
    steps["down_alone"] = lambda: grouped_gemm_nt_masked(h, ex.w2, y, d.masked_m, a_scale=hs, b_scale=ex.w2_scale,
                                                         expected_m=expected_m)
    t = chains_us(lambda: complete(buffers, err), steps, args)
    return {"dispatch": t[1], "up": t[2] - t[1], "down+combine": t[3] - t[2], "sum": t[4] - t[3],
            "up_alone": t["up_alone"], "down_alone": t["down_alone"]}
