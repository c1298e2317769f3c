"""Property-based tests (hypothesis, CPU only): the public op's argument
checks, and the tile-order model's invariants.

The checks: random invalid calls on CPU tensors must each be refused with a
TypeError or ValueError that names the bad argument, before the device
check; random calls valid apart from the CPU tensors must reach the device
check. The tile order: every valid tile exactly once, nothing past the
valid rows or N, and the dealing rules ``schedule.model`` and
``schedule.rules`` document.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Callable, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashgemm
from flashgemm import Combine, GemmConfig, Promotion, Sm100Config, Tail, TileOrder
from flashgemm.blockscaled_args import blocked_scale_shape, validate_blockscaled_args, validate_mxfp4_weight_args
from flashgemm.config import Epilogue
from flashgemm.formats import Format
from flashgemm.schedule.model import tile_order, valid_tiles
from flashgemm.sm90.heuristic import reachable_specs
from flashgemm.sm90.limits import check_config
from flashgemm.validation import check_problem_sizes, validate_args

# fixed examples (no database, no .hypothesis folder in the checkout): a
# failure replays the same way on every machine; about 15 s in all on 2 cores
_FIXED = dict(deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
VALID_CALLS = settings(max_examples=200, **_FIXED)
EACH_MUTATION = settings(max_examples=12, **_FIXED)  # (times ~65 mutations)
PURE = settings(max_examples=300, **_FIXED)  # pure-Python functions: cheap examples

BF16, FP8, E8M0, FP4 = torch.bfloat16, torch.float8_e4m3fn, torch.uint8, torch.uint8
DEVICE_ERROR = "must be on a CUDA device"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------
# valid calls on CPU tensors
# ---------------------------------------------------------------------------

_SM90_CONFIGS = {
    Format.BF16: tuple(dict.fromkeys(s.config for s in reachable_specs(Format.BF16))),
    Format.FP8_BLOCK128: tuple(dict.fromkeys(s.config for s in reachable_specs(Format.FP8_BLOCK128))),
    Format.FP8_MXFP4: tuple(dict.fromkeys(s.config for s in reachable_specs(Format.FP8_MXFP4))),
    Format.BF16_MXFP4: tuple(dict.fromkeys(s.config for s in reachable_specs(Format.BF16_MXFP4))),
}


def _config_fits(cfg: GemmConfig, fmt: Format, num_sms, signals: bool, combine: bool) -> bool:
    try:
        check_config(cfg, fmt, Epilogue.COMBINE if combine else Epilogue.STORE)
    except ValueError:
        return False
    return not (signals and cfg.tail is Tail.SPLIT) and (num_sms is None or num_sms >= cfg.cluster_n)


SM90_FORMATS = (Format.BF16, Format.FP8_BLOCK128, Format.FP8_MXFP4, Format.BF16_MXFP4)


@st.composite
def valid_calls(draw, formats=tuple(Format), combine=None, out=None, experts=(1, 4)):
    """A call valid in every respect but the device, as a Call. ``combine``,
    ``out``: True or False to force one (None: either); ``experts``: the
    range of E."""
    fmt = draw(st.sampled_from([f for f in formats if f in SM90_FORMATS] if combine else formats))
    e = draw(st.integers(*experts))
    m = draw(st.integers(1, 80))
    n_mult, k_mult = {Format.BF16: (8, 8), Format.FP8_BLOCK128: (16, 16), Format.FP8_MXFP4: (16, 32),
                      Format.BF16_MXFP4: (16, 32), Format.MXFP8_MXFP4: (8, 32)}.get(fmt, (8, 32))
    n = n_mult * draw(st.integers(1, 160 // n_mult))
    k = k_mult * draw(st.integers(1, 256 // k_mult))
    args = dict(masked_m=torch.tensor(draw(st.lists(st.integers(-4, m + 4), min_size=e, max_size=e)),
                                      dtype=torch.int32))
    if fmt is Format.BF16:
        args.update(a=torch.zeros(e, m, k, dtype=BF16), b=torch.zeros(e, n, k, dtype=BF16))
    elif fmt is Format.FP8_BLOCK128:
        args.update(a=torch.zeros(e, m, k, dtype=FP8), b=torch.zeros(e, n, k, dtype=FP8),
                    a_scale=torch.ones(e, m, cdiv(k, 128)), b_scale=torch.ones(e, cdiv(n, 128), cdiv(k, 128)))
    elif fmt.converts_weights:  # (prepared weights: int8 bytes, exponents N contiguous)
        fp8 = fmt is Format.FP8_MXFP4
        args.update(a=torch.zeros(e, m, k, dtype=FP8 if fp8 else BF16), b=torch.zeros(e, n, k // 2, dtype=torch.int8),
                    b_scale=torch.zeros(e, k // 32, n, dtype=draw(st.sampled_from([E8M0, torch.float8_e8m0fnu])))
                    .transpose(1, 2))
        if fp8:
            args["a_scale"] = torch.ones(e, m, cdiv(k, 128))
    else:
        packed = k // 2 if fmt is Format.NVFP4 else k
        ab = FP4 if fmt is Format.NVFP4 else FP8
        sf = FP8 if fmt is Format.NVFP4 else draw(st.sampled_from([E8M0, torch.float8_e8m0fnu]))
        b = torch.zeros(e, n, packed, dtype=ab)
        if fmt is Format.MXFP8_MXFP4:  # (a checkpoint's packed e2m1 bytes)
            b = torch.zeros(e, n, -(-k // 128) * 64, dtype=torch.uint8).view(  # rows in whole 128-value pieces
                draw(st.sampled_from([FP4, torch.float4_e2m1fn_x2])))
        args.update(a=torch.zeros(e, m, packed, dtype=ab), b=b,
                    a_scale=torch.zeros(blocked_scale_shape(fmt, e, m, k), dtype=sf),
                    b_scale=torch.zeros(blocked_scale_shape(fmt, e, n, k), dtype=sf))
        if fmt is Format.NVFP4:
            args["alpha"] = torch.ones(e)
    if combine is None:
        combine = not out and fmt in SM90_FORMATS and draw(st.integers(0, 3)) == 0
    if combine:
        peers = draw(st.booleans())
        output = torch.zeros(draw(st.integers(1, 32)), n, dtype=BF16 if peers else draw(
            st.sampled_from([torch.float32, BF16])))
        args["combine"] = Combine(torch.zeros(e, m, dtype=torch.int32), torch.zeros(e, m), output,
                                  draw(st.sampled_from([None, torch.zeros(1, dtype=torch.int32)])),
                                  torch.tensor([output.data_ptr()], dtype=torch.int64) if peers else None)
        args["out"] = None
    else:
        with_out = draw(st.booleans()) if out is None else out
        args["out"] = torch.empty(e, m, n, dtype=BF16) if with_out else None
        if draw(st.booleans()):
            args["dst_signals"] = torch.zeros(e * cdiv(m, 64), dtype=torch.int32)
            args["signal_granularity"] = draw(st.sampled_from(["m_block", "expert"]))
    args["expected_m"] = draw(st.one_of(st.none(), st.integers(0, 10**6)))
    args["num_sms"] = draw(st.one_of(st.none(), st.integers(1, 132)))
    if fmt in SM90_FORMATS:
        fits = [c for c in _SM90_CONFIGS[fmt]
                if _config_fits(c, fmt, args["num_sms"], "dst_signals" in args, combine)]
        if fmt is Format.BF16 and not combine:
            fits.append(Sm100Config(fmt=fmt))  # (what an sm_100 GPU takes)
        args["config"] = draw(st.sampled_from([None, *fits]))
    else:
        args["config"] = draw(st.sampled_from([None, Sm100Config(fmt=fmt)]))
    return Call(fmt, e, m, n, k, args)


class Call(NamedTuple):
    fmt: Format
    e: int
    m: int
    n: int
    k: int
    args: dict


def invoke(args: dict):
    args = dict(args)
    return flashgemm.grouped_gemm_nt_masked(args.pop("a"), args.pop("b"), args.pop("out"), args.pop("masked_m"),
                                            **args)


@VALID_CALLS
@given(valid_calls())
def test_calls_valid_but_for_the_device_reach_the_device_check(call):
    with pytest.raises(ValueError, match=f"^a {DEVICE_ERROR}, got cpu$"):
        invoke(call.args)


# ---------------------------------------------------------------------------
# invalid calls: one thing wrong with a valid call
# ---------------------------------------------------------------------------


def names(message: str) -> set:
    """The arguments a message names: an argument's name as a word, "a" and
    "b" only where they lead a clause or an attribute ("a must", "b.shape")."""
    found = {arg for arg in ("out", "masked_m", "a_scale", "b_scale", "alpha", "expected_m", "num_sms",
                             "config", "dst_signals", "signal_granularity", "stream", "combine")
             if re.search(rf"(?<![\w.]){arg}(?!\w)", message)}
    found |= {f"combine.{f}" for f in ("token_index", "weight", "output", "err", "peers")
              if f"combine.{f}" in message}
    found |= {arg for arg in ("a", "b")
              if re.search(rf"(?<![\w.]){arg}(\.(shape|stride)|\s+(must|and|is|base)\b)", message)}
    return found


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """The same shape and strides one element past a 16-byte aligned base."""
    buf = torch.empty(t.numel() + 16, dtype=t.dtype)
    return buf[1: 1 + t.numel()].view(t.shape)


def _row_padded(t: torch.Tensor) -> torch.Tensor:
    """Rows one element longer than the tensor's: a row stride off the 16-byte grid."""
    e, rows, width = t.shape
    return torch.zeros(e, rows, width + 1, dtype=t.dtype)[:, :, :width]


def _k_strided(t: torch.Tensor) -> torch.Tensor:
    e, rows, width = t.shape
    return torch.zeros(e, width, rows, dtype=t.dtype).transpose(1, 2)


def _inside(victim: torch.Tensor, dtype: torch.dtype, count: int) -> torch.Tensor:
    """``count`` elements of ``dtype`` on ``victim``'s first bytes."""
    raw = victim.reshape(-1).view(torch.uint8)
    return raw[: count * torch.empty(0, dtype=dtype).element_size()].view(dtype)


NOT_TENSORS = st.sampled_from([[1, 2, 3], 3, "tensor", 2.5, (4,)])


class Mutation(NamedTuple):
    what: str
    change: Callable  # (Call, draw) -> the arguments to replace
    names: frozenset  # the arguments a refusal may name
    needs: dict  # valid_calls' arguments: the calls this mutation applies to


MUTATIONS = []


def mutation(what, names, **needs):
    def register(change):
        MUTATIONS.append(Mutation(what, change, frozenset(names), needs))
        return change
    return register


def _simple(what, names, change, **needs):
    mutation(what, names, **needs)(lambda c, draw: change(c))


SINGLE_EXPERT = dict(experts=(1, 1))
MULTI_EXPERT = dict(experts=(2, 4))
NO_COMBINE, WITH_COMBINE, WITH_OUT = dict(combine=False), dict(combine=True), dict(out=True)

# the operands
mutation("a not a tensor", {"a"})(lambda c, draw: dict(a=draw(NOT_TENSORS)))
mutation("b not a tensor", {"b"})(lambda c, draw: dict(b=draw(NOT_TENSORS)))
mutation("masked_m not a tensor", {"masked_m"})(lambda c, draw: dict(masked_m=draw(NOT_TENSORS)))
_simple("a float32", {"a"}, lambda c: dict(a=c.args["a"].float()))
_simple("a float16", {"a"}, lambda c: dict(a=c.args["a"].to(torch.float16)))
_simple("b of another dtype", {"a", "b"}, lambda c: dict(b=c.args["b"].float()))
_simple("masked_m int64", {"masked_m"}, lambda c: dict(masked_m=c.args["masked_m"].long()))
_simple("masked_m uint32", {"masked_m"}, lambda c: dict(masked_m=c.args["masked_m"].view(torch.uint32)))
_simple("masked_m float", {"masked_m"}, lambda c: dict(masked_m=c.args["masked_m"].float()))
_simple("masked_m 2-D", {"masked_m"}, lambda c: dict(masked_m=c.args["masked_m"].view(1, c.e)))
_simple("masked_m length", {"masked_m"}, lambda c: dict(masked_m=torch.zeros(c.e + 1, dtype=torch.int32)))
_simple("masked_m sparse", {"masked_m"}, lambda c: dict(masked_m=c.args["masked_m"].to_sparse()))
_simple("masked_m sparse, one expert", {"masked_m"}, lambda c: dict(masked_m=c.args["masked_m"].to_sparse()),
        **SINGLE_EXPERT)
_simple("masked_m strided", {"masked_m"}, lambda c: dict(masked_m=torch.zeros(2 * c.e, dtype=torch.int32)[::2]),
        **MULTI_EXPERT)
_simple("a sparse", {"a"}, lambda c: dict(a=c.args["a"].float().to_sparse()))
_simple("a rank 4", {"a"}, lambda c: dict(a=c.args["a"].unsqueeze(0)))
_simple("a rank 2", {"a"}, lambda c: dict(a=c.args["a"][0]))
_simple("b rank 2", {"b"}, lambda c: dict(b=c.args["b"][0]))
_simple("b expert count", {"b"}, lambda c: dict(b=torch.zeros(c.e + 1, *c.args["b"].shape[1:],
                                                              dtype=c.args["b"].dtype)))
_simple("b K", {"b"}, lambda c: dict(b=torch.zeros(c.e, c.n, c.args["b"].shape[2] + 16, dtype=c.args["b"].dtype)))
_simple("no rows", {"a"}, lambda c: dict(a=c.args["a"][:, :0]))
_simple("no experts", {"a"}, lambda c: dict(a=c.args["a"][:0]))
_simple("a K-strided", {"a"}, lambda c: dict(a=_k_strided(c.args["a"])))
_simple("a row stride", {"a"}, lambda c: dict(a=_row_padded(c.args["a"])))
_simple("b row stride", {"b"}, lambda c: dict(b=_row_padded(c.args["b"])))
_simple("a misaligned", {"a"}, lambda c: dict(a=_misaligned(c.args["a"])))
_simple("b misaligned", {"b"}, lambda c: dict(b=_misaligned(c.args["b"])))
_simple("a broadcast", {"a"}, lambda c: dict(a=c.args["a"][:1].expand(c.args["a"].shape)), **MULTI_EXPERT)
_simple("K not a multiple", {"a", "b"}, lambda c: dict(a=torch.zeros(c.e, c.m, 12, dtype=c.args["a"].dtype),
                                                       b=torch.zeros(c.e, c.n, 12, dtype=c.args["b"].dtype)))
_simple("N not a multiple", {"b"}, lambda c: dict(b=torch.zeros(c.e, 12, c.args["b"].shape[2],
                                                                dtype=c.args["b"].dtype), out=None))
# out
mutation("out not a tensor", {"out"}, **WITH_OUT)(lambda c, draw: dict(out=draw(NOT_TENSORS)))
_simple("out float32", {"out"}, lambda c: dict(out=c.args["out"].float()), **WITH_OUT)
_simple("out shape", {"out"}, lambda c: dict(out=torch.empty(c.e, c.m, c.n + 8, dtype=BF16)), **WITH_OUT)
_simple("out misaligned", {"out"}, lambda c: dict(out=_misaligned(c.args["out"])), **WITH_OUT)
_simple("out sparse", {"out"}, lambda c: dict(out=c.args["out"].to_sparse()), **WITH_OUT)
_simple("out over masked_m", {"out", "masked_m"},
        lambda c: dict(masked_m=_inside(c.args["out"], torch.int32, c.e)), **WITH_OUT)


@mutation("out over a", {"out", "a"}, **WITH_OUT)
def _out_over_a(c, draw):
    a = c.args["a"]
    a_bytes, out_bytes = a.numel() * a.element_size(), 2 * c.e * c.m * c.n
    buf = torch.zeros(max(a_bytes, out_bytes), dtype=torch.uint8)  # both from its first byte
    return dict(a=buf[:a_bytes].view(a.dtype).view(a.shape), out=buf[:out_bytes].view(BF16).view(c.e, c.m, c.n))


_simple("out overlaps itself", {"out"}, lambda c: dict(out=c.args["out"][:1].expand(c.args["out"].shape)),
        **WITH_OUT, **MULTI_EXPERT)
# the scales
_simple("scales with bf16", {"a_scale"}, lambda c: dict(a_scale=torch.ones(c.e, c.m, cdiv(c.k, 128))),
        formats=(Format.BF16,))
_simple("no b_scale", {"b_scale"}, lambda c: dict(b_scale=None), formats=(Format.FP8_BLOCK128,))
# (without its scales an MXFP8 call reads as 1x128 fp8, whose N and K rules may come first)
_simple("no a_scale", {"a_scale", "a", "b"}, lambda c: dict(a_scale=None), formats=(Format.MXFP8, Format.NVFP4))
_simple("a_scale shape", {"a_scale"}, lambda c: dict(a_scale=c.args["a_scale"][:, :-1]),
        formats=(Format.FP8_BLOCK128, Format.MXFP8))
_simple("a_scale float16", {"a_scale"}, lambda c: dict(a_scale=c.args["a_scale"].half()),
        formats=(Format.FP8_BLOCK128,))
_simple("no alpha", {"alpha"}, lambda c: dict(alpha=None), formats=(Format.NVFP4,))
_simple("alpha", {"alpha", "combine"}, lambda c: dict(alpha=torch.ones(c.e)),
        formats=(Format.BF16, Format.FP8_BLOCK128, Format.MXFP8))
# the options
mutation("expected_m", {"expected_m"})(lambda c, draw: dict(expected_m=draw(st.sampled_from([-1, 1.5, "8", True]))))
mutation("num_sms", {"num_sms"})(
    lambda c, draw: dict(num_sms=draw(st.sampled_from([0, -5, 2.5, "8", True, False]))))
mutation("granularity", {"signal_granularity"})(
    lambda c, draw: dict(signal_granularity=draw(st.sampled_from(["tile", None, 3, ["expert"]]))))
mutation("stream", {"stream"})(lambda c, draw: dict(stream=draw(st.sampled_from([7, "default"]))))
mutation("config not a config", {"config"})(
    lambda c, draw: dict(config=draw(st.sampled_from([{"tile_m": 64}, "m128n128", 3]))))
SM90_BAD_CONFIGS = [
    GemmConfig(tile_m=96), GemmConfig(tile_n=100), GemmConfig(tile_m=128.0), GemmConfig(stages=2.5),
    GemmConfig(cluster_n=True), GemmConfig(cluster_n=4), GemmConfig(l2_hints="no"), GemmConfig(pdl=1),
    GemmConfig(order="dynamic"), GemmConfig(stages=1), GemmConfig(stages=40), GemmConfig(stages=-1),
    GemmConfig(tile_m=192, tile_n=256), GemmConfig(n_major_window=3, order=TileOrder.N_MAJOR),
    GemmConfig(tail=Tail.SPLIT, order=TileOrder.DYNAMIC), GemmConfig(a_chunk_rows=24),
    GemmConfig(promotion="overlapped"), Sm100Config(fmt=Format.MXFP8),  # another format's
]
mutation("sm90 config bad", {"config"}, formats=SM90_FORMATS)(
    lambda c, draw: dict(config=draw(st.sampled_from(SM90_BAD_CONFIGS))))
_simple("bf16 config overlapped", {"config"}, lambda c: dict(config=GemmConfig(promotion=Promotion.OVERLAPPED)),
        formats=(Format.BF16,))
_simple("config pair on one SM", {"config", "num_sms"}, lambda c: dict(config=GemmConfig(cluster_n=2), num_sms=1),
        formats=SM90_FORMATS)
mutation("sm100 config bad", {"config"}, formats=(Format.MXFP8, Format.NVFP4))(
    lambda c, draw: dict(config=draw(st.sampled_from([
        GemmConfig(), Sm100Config(fmt=Format.BF16), Sm100Config(fmt=c.fmt, tile_n=96),
        Sm100Config(fmt=c.fmt, tile_m=128.0), Sm100Config(fmt=c.fmt, stages=-1)]))))
# dst_signals
mutation("signals not a tensor", {"dst_signals"}, **NO_COMBINE)(lambda c, draw: dict(dst_signals=draw(NOT_TENSORS)))


@mutation("signals bad", {"dst_signals"}, **NO_COMBINE)
def _bad_signals(c, draw):
    sig = torch.zeros(max(c.e, 8), dtype=torch.int32)
    return dict(dst_signals=draw(st.sampled_from([
        sig.long(), sig.view(1, -1), torch.zeros(2 * max(c.e, 2), dtype=torch.int32)[::2], sig[: c.e - 1],
        sig.to_sparse()])))


@mutation("signals over a tensor", {"dst_signals"}, **NO_COMBINE)
def _signals_over_a_tensor(c, draw):
    victim = draw(st.sampled_from(["a", "masked_m"] + (["out"] if c.args["out"] is not None else [])))
    return dict(dst_signals=_inside(c.args[victim], torch.int32, c.e))


_simple("split tail with signals", {"config"}, lambda c: dict(
    dst_signals=torch.zeros(max(c.e, 8), dtype=torch.int32), config=GemmConfig(cluster_n=2, tail=Tail.SPLIT)),
    formats=SM90_FORMATS, combine=False)
# combine
_simple("combine not a Combine", {"combine"}, lambda c: dict(combine=(c.args["a"], c.args["b"]), out=None),
        **NO_COMBINE)
_simple("combine with block scales", {"combine"}, lambda c: dict(combine=Combine(
    torch.zeros(c.e, c.m, dtype=torch.int32), torch.zeros(c.e, c.m), torch.zeros(4, c.n)), out=None,
    dst_signals=None), formats=(Format.MXFP8, Format.NVFP4))
_simple("combine with out", {"out", "combine"}, lambda c: dict(out=torch.empty(c.e, c.m, c.n, dtype=BF16)),
        **WITH_COMBINE)
_simple("combine with signals", {"dst_signals"}, lambda c: dict(dst_signals=torch.zeros(8, dtype=torch.int32)),
        **WITH_COMBINE)
_simple("token_index int64", {"combine.token_index"}, lambda c: dict(combine=c.args["combine"]._replace(
    token_index=c.args["combine"].token_index.long())), **WITH_COMBINE)
_simple("weight shape", {"combine.weight"}, lambda c: dict(combine=c.args["combine"]._replace(
    weight=torch.zeros(c.e, c.m + 1))), **WITH_COMBINE)
_simple("output width", {"combine.output"}, lambda c: dict(combine=c.args["combine"]._replace(
    output=torch.zeros(4, c.n + 8))), **WITH_COMBINE)
_simple("err two words", {"combine.err"}, lambda c: dict(combine=c.args["combine"]._replace(
    err=torch.zeros(2, dtype=torch.int32))), **WITH_COMBINE)


@mutation("err over another tensor", {"combine.err"}, **WITH_COMBINE)
def _err_over_another_tensor(c, draw):
    combine = c.args["combine"]
    tensors = {**c.args, "token_index": combine.token_index, "weight": combine.weight, "peers": combine.peers}
    victim = draw(st.sampled_from([name for name in ("a", "b", "masked_m", "a_scale", "b_scale", "token_index",
                                                      "weight", "peers") if tensors.get(name) is not None]))
    return dict(combine=combine._replace(err=_inside(tensors[victim], torch.int32, 1)))


@pytest.mark.parametrize("case", MUTATIONS, ids=[m.what for m in MUTATIONS])
def test_invalid_calls_are_refused_by_name_before_the_device_check(case):
    """Each way to get a call wrong, on random valid calls it applies to:
    refused with a TypeError or ValueError naming the argument, never only
    by the device check."""

    @EACH_MUTATION
    @given(valid_calls(**case.needs), st.data())
    def check(call, data):
        bad = {**call.args, **case.change(call, data.draw)}
        with pytest.raises((TypeError, ValueError)) as info:
            invoke(bad)
        message = str(info.value)
        assert DEVICE_ERROR not in message, "refused only by the device check"
        assert names(message) & case.names, f"{message!r} names none of {sorted(case.names)}"

    check()


def _call_accepts(fmt: Format, e: int, m: int, n: int, k: int) -> bool:
    """Whether the call's own metadata checks take these sizes (valid tensors otherwise)."""
    mm = torch.zeros(e, dtype=torch.int32)
    try:
        if fmt.converts_weights:  # (prepared int8 weights, exponents N contiguous)
            fp8 = fmt is Format.FP8_MXFP4
            validate_mxfp4_weight_args(
                torch.zeros(e, m, k, dtype=FP8 if fp8 else BF16), torch.zeros(e, n, k // 2, dtype=torch.int8), None,
                mm, torch.ones(e, m, cdiv(k, 128)) if fp8 else None,
                torch.zeros(e, k // 32, n, dtype=E8M0).transpose(1, 2), fmt)
        elif fmt in SM90_FORMATS:
            dtype = BF16 if fmt is Format.BF16 else FP8
            scales = {} if fmt is Format.BF16 else dict(a_scale=torch.ones(e, m, cdiv(k, 128)),
                                                          b_scale=torch.ones(e, cdiv(n, 128), cdiv(k, 128)))
            validate_args(torch.zeros(e, m, k, dtype=dtype), torch.zeros(e, n, k, dtype=dtype), None, mm, **scales)
        else:
            packed, ab = (k // 2, FP4) if fmt is Format.NVFP4 else (k, FP8)
            sf = FP8 if fmt is Format.NVFP4 else E8M0
            b = torch.zeros(e, n, -(-k // 128) * 64 if fmt is Format.MXFP8_MXFP4 else packed,
                            dtype=FP4 if fmt in (Format.NVFP4, Format.MXFP8_MXFP4) else ab)
            validate_blockscaled_args(
                fmt, torch.zeros(e, m, packed, dtype=ab), b, None, mm,
                torch.zeros(blocked_scale_shape(fmt, e, m, k), dtype=sf),
                torch.zeros(blocked_scale_shape(fmt, e, n, k), dtype=sf),
                torch.ones(e) if fmt is Format.NVFP4 else None)
    except ValueError:
        return False
    return True


@PURE
@given(st.sampled_from(tuple(Format)), st.integers(1, 3), st.integers(1, 70), st.integers(1, 300),
       st.integers(1, 300))
def test_signal_layout_takes_the_sizes_the_call_takes(fmt, e, m, n, k):
    """``signal_layout``'s size checks (``check_problem_sizes``) accept exactly
    the N and K the call's tensor checks accept, for every format."""
    try:
        check_problem_sizes(fmt, e, m, n, k)
        sizes_ok = True
    except ValueError:
        sizes_ok = False
    if fmt is Format.NVFP4 and k % 2:  # no packed tensor holds an odd K
        assert not sizes_ok
        return
    assert sizes_ok == _call_accepts(fmt, e, m, n, k)


# ---------------------------------------------------------------------------
# the tile order (schedule.model.tile_order)
# ---------------------------------------------------------------------------


@st.composite
def problems(draw):
    """A masked problem and a grid: masked_m entries negative, zero, within
    and past max_m; any N; every order and tail the model takes."""
    e = draw(st.integers(1, 20))
    max_m = draw(st.integers(1, 300))
    entry = st.one_of(st.integers(-8, 0), st.integers(0, max_m), st.integers(max_m, max_m + 64), st.just(10**6))
    masked_m = draw(st.lists(entry, min_size=e, max_size=e))
    n = draw(st.integers(1, 1100))
    mode = draw(st.sampled_from(["expert_major", "balance", "n_major", "n_major_balance", "split"]))
    tile_m = 128 if mode == "split" else draw(st.sampled_from([64, 128, 192]))
    tile_n = draw(st.sampled_from([64, 128, 192, 256]))
    cluster_n = draw(st.sampled_from([1, 2]))
    num_ctas = cluster_n * draw(st.integers(1, 40))
    window = draw(st.sampled_from([0, 1, 2, 4, 8, 16, 32])) if mode.startswith("n_major") else 0
    return dict(masked_m=masked_m, max_m=max_m, n=n, tile_m=tile_m, tile_n=tile_n, num_ctas=num_ctas,
                cluster_n=cluster_n, balance=mode.endswith("balance"), n_major=mode.startswith("n_major"),
                split=mode == "split", window=window)


def _valid_tiles(p) -> set:
    """From the op's definition: m_block < ceil(clamp(m_e, 0, max_m) / tile_m), every n-block of N."""
    rows = [min(max(m, 0), p["max_m"]) for m in p["masked_m"]]
    return {(e, mb, nb) for e, r in enumerate(rows) for mb in range(cdiv(r, p["tile_m"]))
            for nb in range(cdiv(p["n"], p["tile_n"]))}


def _units_in_order(p) -> list:
    """Units (expert, m_block, n_group) in the documented numbering:
    expert-major numbers expert, then n-group, then m-block; n-major numbers
    the n-group first within each window of experts (0: one window)."""
    n_groups = cdiv(cdiv(p["n"], p["tile_n"]), p["cluster_n"])
    units = {(e, mb, nb // p["cluster_n"]) for e, mb, nb in _valid_tiles(p)}
    if p["n_major"]:
        w = p["window"] or len(p["masked_m"])
        key = lambda u: (u[0] // w, u[2], u[0], u[1])  # noqa: E731
    else:
        key = lambda u: (u[0], u[2], u[1])  # noqa: E731
    assert all(0 <= u[2] < n_groups for u in units)
    return sorted(units, key=key)


def _clusters_taking(units: int, clusters: int, balance: bool) -> int:
    """Tail.BALANCE: a last round at most half full is spread so every round
    is full, on ceil(units / rounds) clusters (rules.active_clusters' doc)."""
    if not balance or units == 0:
        return clusters
    rounds = cdiv(units, clusters)
    last = units - (rounds - 1) * clusters
    return cdiv(units, rounds) if 2 * last <= clusters else clusters


def _virtual(units: list, clusters: int, split: bool) -> list:
    """Tail.SPLIT: a last round holding r units with 0 < 2r <= clusters runs
    as 2r half units, the two halves of a unit one after the other
    (rules.tail_start's doc); every other unit whole (half -1)."""
    rem = len(units) % clusters
    start = len(units) - rem if split and 0 < 2 * rem <= clusters else len(units)
    return [(*u, -1) for u in units[:start]] + [(*u, h) for u in units[start:] for h in (0, 1)]


@PURE
@given(problems())
def test_tile_order_visits_every_valid_tile_once_in_the_documented_order(p):
    order = tile_order(**p)
    n_blocks = cdiv(p["n"], p["tile_n"])
    cn, num_clusters = p["cluster_n"], p["num_ctas"] // p["cluster_n"]
    assert len(order) == p["num_ctas"]
    want = _valid_tiles(p)
    assert valid_tiles(p["masked_m"], p["max_m"], p["n"], p["tile_m"], p["tile_n"]) == want

    # nothing past the valid rows or N; every valid tile exactly once
    # (under SPLIT: whole once, or both halves once each)
    visits = Counter(t for cta in order for t in cta)
    for (e, mb, nb, *half), count in visits.items():
        assert 0 <= e < len(p["masked_m"]) and 0 <= nb < n_blocks
        assert 0 <= mb and mb * p["tile_m"] < min(max(p["masked_m"][e], 0), p["max_m"])
        assert count == 1 and half in ([], [-1], [0], [1])
    if p["split"]:
        whole = {t[:3] for t in visits if t[3] == -1}
        halves = Counter(t[:3] for t in visits if t[3] != -1)
        assert not whole & set(halves) and set(halves.values()) <= {2}
        assert whole | set(halves) == want
    else:
        assert set(visits) == want

    # the CTAs of a cluster walk the same units in step, on adjacent n-blocks
    # (those past N left out); rank 0's n-block starts its n-group
    for c in range(num_clusters):
        lead = order[c * cn]
        assert all(t[2] % cn == 0 for t in lead)
        for rank in range(1, cn):
            assert order[c * cn + rank] == [(t[0], t[1], t[2] + rank, *t[3:]) for t in lead if t[2] + rank < n_blocks]

    # units dealt round-robin in the documented numbering, over the clusters
    # that take any (all of them, unless BALANCE cuts a half-empty last round)
    units = _units_in_order(p)
    taking = _clusters_taking(len(units), num_clusters, p["balance"])
    seq = _virtual(units, taking, p["split"])
    for c in range(num_clusters):
        dealt = seq[c::taking] if c < taking else []
        got = [(t[0], t[1], t[2] // cn, *t[3:]) for t in order[c * cn]]
        assert got == [u if p["split"] else u[:3] for u in dealt]

    # the round count is the plain round-robin's: BALANCE and SPLIT only move
    # the last round's units
    rounds = max(map(len, order[::cn]), default=0)
    assert rounds == cdiv(len(units), num_clusters)
    if not (p["balance"] or p["split"]):
        assert {len(t) for t in order[::cn]} <= {len(units) // num_clusters, rounds}
