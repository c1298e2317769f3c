"""Helpers shared by ``benchmarks/`` and ``tools/``: the case file and its
masked_m draws, operands, CUDA-graph timing, config names and ``--set``
changes, and the DeepGEMM peer's call.

Scripts in ``tools/`` put this directory on ``sys.path`` and import it as
``common``; every script puts the checkout's root first, so ``flashgemm``
is the package of this checkout.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
import statistics
import time
import typing

import torch

from flashgemm.timing import capture_graph  # noqa: F401  (the scripts import it from here)

CASES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_cases.json")
DISTRIBUTIONS = ("uniform", "skewed", "sparse", "empty")


# ---- cases -------------------------------------------------------------------
def load_cases() -> dict:
    """The case file: {"cases": [...], the listed limits and peer times}."""
    with open(CASES_FILE) as f:
        return json.load(f)


def draw_masked_m(case, seed, dist="uniform"):
    """masked_m for a case.

    uniform (the case file's rule): clamp(int(expected_m * U(0.7, 1.3)), 1, max_m).
    skewed: a few hot experts (E // 8, at least one) get 4x expected_m, the others
        share the rest of the same total; sparse: a quarter of the experts (at least
        one) get the uniform draw, the others none; empty: every expert empty.
    """
    e, mean, max_m = case["E"], case["expected_m"], case["max_m"]
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(e, generator=g) * 0.6 + 0.7
    if dist == "uniform":
        m = (mean * u).to(torch.int64).clamp(1, max_m)
    elif dist == "skewed":
        hot = max(1, e // 8)
        cold_mean = max(1.0, (e * mean - hot * 4 * mean) / max(1, e - hot))
        scale = torch.full((e,), cold_mean)
        scale[torch.randperm(e, generator=g)[:hot]] = 4.0 * mean
        m = (scale * u).to(torch.int64).clamp(1, max_m)
    elif dist == "sparse":
        m = torch.zeros(e, dtype=torch.int64)
        live = torch.randperm(e, generator=g)[: max(1, e // 4)]
        m[live] = (mean * u[live]).to(torch.int64).clamp(1, max_m)
    elif dist == "empty":
        m = torch.zeros(e, dtype=torch.int64)
    else:
        raise ValueError(f"unknown distribution {dist!r}; one of {DISTRIBUTIONS}")
    return m.to(torch.int32)


def cases_by_name(names, error):
    """(seed, case) of each named case of the case file, its seed being its
    place in the file (so a run of a few cases draws the masked_m of a full
    run); an unknown name goes to ``error`` (argparse's ``p.error``) before
    any GPU work."""
    cases = load_cases()["cases"]
    known = [c["name"] for c in cases]
    unknown = [n for n in names if n not in known]
    if unknown:
        error(f"unknown case(s) {', '.join(unknown)}; one of {', '.join(known)}")
    return [(known.index(n), cases[known.index(n)]) for n in names]


def case_operands(case, seed, fp8=False, dev="cuda"):
    """Fresh random a [E, max_m, K] and b [E, N, K] / sqrt(K) for a case, from
    torch's generator seeded with ``seed``; with ``fp8``, quantized with the
    package's 1x128 / 128x128 helpers. Returns (a, b, a_scale, b_scale), the
    scales None for bf16."""
    e_count, max_m, n, k = case["E"], case["max_m"], case["N"], case["K"]
    torch.manual_seed(seed)
    a = torch.randn(e_count, max_m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(e_count, n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    if not fp8:
        return a, b, None, None
    from flashgemm.quant import quantize_fp8_per_block, quantize_fp8_per_token

    a, a_scale = quantize_fp8_per_token(a)
    b, b_scale = quantize_fp8_per_block(b)
    return a, b, a_scale, b_scale


# ---- timing ------------------------------------------------------------------
def time_fn(fn, warmup=5, reps=30):
    """Median milliseconds of `reps` CUDA-event timings of back-to-back launches.

    No sync between reps, so the host runs ahead and launch overhead hides
    behind the previous launch, as it does in a serving loop (host cost per
    call is measured separately by host_us)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def time_graph(fn, reps=30, calls=10):
    """Median milliseconds per call from CUDA-graph replays of `calls` back-to-back
    calls: GPU time without host launch overhead (serving stacks capture graphs)."""
    return time_fn(capture_graph(fn, calls).replay, warmup=3, reps=reps) / calls


def time_graph_rounds(fns, rounds=6, reps=30, calls=10):
    """Milliseconds per call of each fn in every round: its graph timed once
    per round, the rounds interleaved and every other one reversed (A B C,
    C B A, ...), so drift of the GPU's state over a run, and the place after
    a heavy or a light neighbour, land on every fn alike. Compare fns round
    by round (``paired_median``): why, in docs/design.md (Measurement method)."""
    graphs = [capture_graph(fn, calls) for fn in fns]
    samples = [[] for _ in fns]
    for r in range(rounds):
        order = list(zip(graphs, samples))
        for graph, times in order if r % 2 == 0 else reversed(order):
            times.append(time_fn(graph.replay, warmup=3, reps=reps) / calls)
    return samples


def paired_median(f, *samples):
    """Median over rounds of ``f`` applied to the same round's samples."""
    return statistics.median(f(*round_) for round_ in zip(*samples))


def host_us(fn, reps=200):
    """Median host microseconds per call (the GPU work queues up behind)."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        if i % 100 == 99:
            torch.cuda.synchronize()  # keep the launch queue short
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


# ---- configs -----------------------------------------------------------------
CONFIG_NAME_HELP = (
    "m<tile_m>n<tile_n>s<stages|A>c<cluster_n>[-n_major|-dynamic][-w<window>][-balance|-split]"
    "[-overlapped|-two_parts][-whole][-ac<rows>][-l2hint][-nopdl][-nowarm], e.g. m64n64sAc2-dynamic-ac32-l2hint"
)


def parse_config(name: str):
    """The GemmConfig whose ``short_name()`` is ``name`` (the names the tables print)."""
    from flashgemm.config import GemmConfig, Promotion, Staging, Tail, TileOrder

    def alternatives(kind, default):
        return "|".join(re.escape(m.value) for m in kind if m is not default)

    m = re.fullmatch(
        rf"m(\d+)n(\d+)s(\d+|A)c(\d+)(?:-({alternatives(TileOrder, TileOrder.EXPERT_MAJOR)}))?(?:-w(\d+))?"
        rf"(?:-({alternatives(Tail, Tail.NONE)}))?(?:-({alternatives(Promotion, Promotion.SERIAL)}))?"
        r"(-whole)?(?:-ac(\d+))?(-l2hint)?(-nopdl)?(-nowarm)?",
        name,
    )
    cfg = None
    if m:
        tm, tn, st, cn, order, window, tail, promotion, whole, chunk, hint, nopdl, nowarm = m.groups()
        cfg = GemmConfig(
            tile_m=int(tm), tile_n=int(tn), stages=0 if st == "A" else int(st), cluster_n=int(cn),
            order=TileOrder(order or TileOrder.EXPERT_MAJOR.value), n_major_window=int(window or 0),
            tail=Tail(tail or Tail.NONE.value), promotion=Promotion(promotion or Promotion.SERIAL.value),
            staging=Staging.WHOLE_TILE if whole else Staging.PAIR, a_chunk_rows=int(chunk or 0),
            l2_hints=hint is not None, pdl=nopdl is None, l2_warmup=nowarm is None,
        )
    if cfg is None or cfg.short_name() != name:
        raise SystemExit(f"--configs: cannot read {name!r} (expected {CONFIG_NAME_HELP})")
    return cfg


def _raise_value_error(message):
    raise ValueError(message)


def parse_config_changes(items, error=None, config_cls=None):
    """``--set FIELD=VALUE`` items as field changes of ``config_cls``
    (default: this checkout's GemmConfig; ``tools/ab_revision.py`` passes
    another revision's): ints as given, bools as 0/1 (or true/false), enum
    fields by member name in any case (``order=n_major``, ``tail=split``).
    An unknown field or value goes to ``error`` (a parser's ``error``;
    default: ValueError) with the valid ones."""
    if config_cls is None:
        from flashgemm.config import GemmConfig as config_cls
    error = error or _raise_value_error
    hints = typing.get_type_hints(config_cls)
    kinds = {f.name: hints[f.name] for f in dataclasses.fields(config_cls)}
    changes = {}
    for item in items:
        field, eq, value = item.partition("=")
        if not eq:
            error(f"--set {item}: expected FIELD=VALUE")
            continue
        if field not in kinds:
            error(f"--set {item}: {config_cls.__name__} has no field {field!r}; fields: {', '.join(kinds)}")
            continue
        kind = kinds[field]
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            members = {m.name.lower(): m for m in kind}
            if value.lower() not in members:
                error(f"--set {item}: {field} is one of {', '.join(members)}")
                continue
            changes[field] = members[value.lower()]
        elif kind is bool:
            bools = {"1": True, "true": True, "0": False, "false": False}
            if value.lower() not in bools:
                error(f"--set {item}: {field} is a bool: 0 or 1")
                continue
            changes[field] = bools[value.lower()]
        else:
            try:
                changes[field] = int(value)
            except ValueError:
                error(f"--set {item}: {field} is an int")
    return changes


def apply_changes(cfg, changes):
    """``cfg`` with ``--set`` changes. A dynamic order takes no tail rule
    (those are for the static orders), so one set without a tail drops the
    config's; an older revision's config with ``dynamic`` or
    ``split_last_round`` set drops its ``balance_rounds`` the same way."""
    changes = dict(changes)
    names = {f.name for f in dataclasses.fields(cfg)}
    order = changes.get("order")
    if "tail" in names and order is not None and order.name == "DYNAMIC":
        changes.setdefault("tail", type(cfg.tail).NONE)
    if "balance_rounds" in names and (changes.get("dynamic") or changes.get("split_last_round")):
        changes.setdefault("balance_rounds", False)
    return dataclasses.replace(cfg, **changes)


# ---- peers -------------------------------------------------------------------
def deepgemm_masked(deep_gemm, a, b, out, masked_m, a_scale=None, b_scale=None):
    """DeepGEMM's masked GEMM on these operands as a function of its
    expected_m hint: fp8 (same recipe) when scales are given, else bf16."""
    if a_scale is None:
        return lambda hint: deep_gemm.m_grouped_bf16_gemm_nt_masked(a, b, out, masked_m, hint)
    # its M-major, 16-byte aligned scale layout, made once here so no call re-lays it out
    lhs = (a, deep_gemm.get_mn_major_tma_aligned_tensor(a_scale))
    return lambda hint: deep_gemm.m_grouped_fp8_gemm_nt_masked(lhs, (b, b_scale), out, masked_m, hint)
