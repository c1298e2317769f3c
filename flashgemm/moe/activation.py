"""Host side of the SwiGLU activation (``activation_kernel``): checks, output
allocation in the layout the down GEMM reads in place, compile and launch.
``silu_mul`` is the usual SwiGLU, ``gpt_oss_swiglu`` gpt-oss's (biases,
interleaved gate / up columns, clamps; ``moe.gpt_oss``)."""

from __future__ import annotations

import enum
from typing import Optional

import torch

from ..jit import cache
from ..jit.arch import default_arch, device_facts, ensure_arch_env
from ..jit.key import cache_key
from ..jit.options import compile_options
from ..validation import TMA_ALIGN, check_tensor

FP8 = torch.float8_e4m3fn
SCALE_BLOCK = 128
CTAS_PER_SM = 4  # 256-thread CTAs without shared memory: four per SM ran fastest (docs/design.md)


class ActivationKind(enum.Enum):
    """Which SwiGLU the activation kernel computes (its value names the build)."""

    SILU = "silu_mul"  # silu(gate) * up; gate_up holds the gate columns, then the up columns
    GPT_OSS = "gpt_oss"  # clamped_swiglu(gate_up + bias) on interleaved columns (moe.gpt_oss)


def alloc_fp8_input(e_count: int, max_m: int, inter: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 [E, max_m, I] tensor and its fp32 [E, max_m, ceil(I/128)] scales,
    M contiguous with 16-byte-aligned strides: the activation layout the
    GEMM loads in place (as ``quant.quantize_fp8_per_token`` returns)."""
    q = torch.empty(e_count, max_m, inter, dtype=FP8, device=device)
    m_pad = -(-max_m // 4) * 4
    store = torch.empty(e_count, -(-inter // SCALE_BLOCK), m_pad, dtype=torch.float32, device=device)
    return q, store.transpose(1, 2)[:, :max_m, :]


def check_h_out(out, out_scale, shape: tuple, fp8: bool) -> None:
    """A caller's buffers for h (the down GEMM's input), before any launch:
    ``out`` [E, max_m, I] (fp8 e4m3 or bf16, last dim contiguous, 16-byte-
    aligned strides) and, for fp8, ``out_scale`` [E, max_m, ceil(I/128)] fp32 in
    ``alloc_fp8_input``'s layout; both or neither for fp8."""
    if fp8:
        if (out is None) != (out_scale is None):
            raise ValueError("pass both out and out_scale, or neither")
    elif out_scale is not None:
        raise ValueError("out_scale is only for fp8 output")
    if out is not None:
        check_tensor("out", out, 3, (FP8 if fp8 else torch.bfloat16,))
        if tuple(out.shape) != shape or out.stride(2) != 1 or any(st * out.element_size() % TMA_ALIGN
                                                                  for st in out.stride()[:2]):
            raise ValueError(f"out must be {shape}, contiguous along its last dim with 16-byte-aligned strides, "
                             f"got shape {tuple(out.shape)}, strides {out.stride()}")
    if out_scale is not None:
        check_tensor("out_scale", out_scale, 3, (torch.float32,))
        want = (shape[0], shape[1], -(-shape[2] // SCALE_BLOCK))
        st = out_scale.stride()
        if tuple(out_scale.shape) != want or st[1] != 1 or st[0] % 4 or st[2] % 4 \
                or out_scale.data_ptr() % TMA_ALIGN:
            raise ValueError(f"out_scale must be fp32 {want}, M contiguous with 16-byte-aligned strides "
                             "(alloc_fp8_input)")


def _build(fp8: bool, arch: Optional[str] = None, keep_ptx: bool = False,
           kind: ActivationKind = ActivationKind.SILU):
    arch = ensure_arch_env(arch)
    import cutlass
    import cutlass.cute as cute

    from .activation_kernel import SiluMulQuant

    def ld(dtype):  # a stride in elements that is a multiple of 16 bytes
        return cute.sym_int64(divisibility=128 // dtype.width)

    fake = cute.runtime.make_fake_tensor
    e, m, i2, i = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    out_t = cutlass.Float8E4M3FN if fp8 else bf16
    gu = fake(bf16, (e, m, i2), (ld(bf16), ld(bf16), 1), assumed_align=16)
    masked_m = fake(cutlass.Int32, (e,), (1,), assumed_align=4)
    out = fake(out_t, (e, m, i), (ld(out_t), ld(out_t), 1), assumed_align=16)
    scale = bias = None
    if fp8:
        scale = fake(f32, (e, m, cute.sym_int()), (ld(f32), 1, ld(f32)), assumed_align=16)
    if kind is ActivationKind.GPT_OSS:
        bias = fake(f32, (e, i2), (ld(f32), 1), assumed_align=16)
    with compile_options(keep_ptx) as options:
        fn = cute.compile(
            SiluMulQuant(fp8, kind is ActivationKind.GPT_OSS), gu, masked_m, out, scale, bias, cutlass.Int32(1),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options=options,
        )
    cache.count_compile()
    return fn


def build(fp8: bool, arch: Optional[str] = None, keep_ptx: bool = False,
          kind: ActivationKind = ActivationKind.SILU):
    """Compile the activation kernel (no caching)."""
    return _build(fp8, arch, keep_ptx, kind)


def activation_key(arch: str, fp8: bool, kind: ActivationKind = ActivationKind.SILU) -> tuple:
    return cache_key(arch, kind.value, fp8)


def activation_jobs(arch: str, fp8s=(True, False), kinds=tuple(ActivationKind)) -> list:
    """``backend.CompileJob`` of the activation kernels (arch-neutral): the
    fp8 ones convert to e4m3, the bf16 ones do not."""
    from ..backend import CompileJob

    return [CompileJob(f"moe-{kind.value}-{'fp8' if fp8 else 'bf16'}", activation_key(arch, fp8, kind),
                       lambda keep, fp8=fp8, kind=kind: build(fp8, arch, keep_ptx=keep, kind=kind),
                       lambda feats, fp8=fp8: ("fp8-cvt" in feats) == fp8) for kind in kinds for fp8 in fp8s]


def get_kernel(fp8: bool, arch: Optional[str] = None, kind: ActivationKind = ActivationKind.SILU):
    arch = arch or default_arch()
    return cache.cached(activation_key(arch, fp8, kind), lambda: _build(fp8, arch, kind=kind))


def silu_mul(
    gate_up: torch.Tensor,
    masked_m: torch.Tensor,
    *,
    fp8: bool = True,
    out: Optional[torch.Tensor] = None,
    out_scale: Optional[torch.Tensor] = None,
    num_sms: Optional[int] = None,
):
    """``h[e, :m_e] = silu(gate_up[e, :m_e, :I]) * gate_up[e, :m_e, I:]``.

    gate_up: [E, max_m, 2I] bf16 (the gate_up GEMM's output: gate columns
    first), last dim contiguous. masked_m: int32 [E] on the same GPU. With
    ``fp8`` (I a multiple of 128) returns (h fp8 e4m3 [E, max_m, I], scales
    fp32 [E, max_m, I/128] M-contiguous), the down GEMM's a / a_scale; else h
    bf16 (I a multiple of 8). Rows >= m_e are neither read nor written.
    ``out`` / ``out_scale``: preallocated outputs (``alloc_fp8_input``)."""
    return _run(ActivationKind.SILU, gate_up, masked_m, None, fp8, out, out_scale, num_sms)


def gpt_oss_swiglu(
    gate_up: torch.Tensor,
    bias: torch.Tensor,
    masked_m: torch.Tensor,
    *,
    fp8: bool = True,
    out: Optional[torch.Tensor] = None,
    out_scale: Optional[torch.Tensor] = None,
    num_sms: Optional[int] = None,
):
    """gpt-oss's activation: ``h[e, :m_e] = clamped_swiglu(gate_up[e, :m_e] + bias[e])``
    (``moe.gpt_oss``: gate in the even columns, up in the odd ones).

    gate_up: [E, max_m, 2I] bf16 as ``silu_mul`` takes it; bias: float32 [E,
    2I] contiguous on the same GPU. I a multiple of 16 for ``fp8`` (8 for
    bf16): the last 1x128 block may be partial (I = 2880: 22 blocks of 128
    and one of 64, each with its own scale). Returns what ``silu_mul`` returns."""
    check_tensor("bias", bias, 2, (torch.float32,))
    return _run(ActivationKind.GPT_OSS, gate_up, masked_m, bias, fp8, out, out_scale, num_sms)


def _run(kind: ActivationKind, gate_up, masked_m, bias, fp8: bool, out, out_scale, num_sms):
    check_tensor("gate_up", gate_up, 3, (torch.bfloat16,))
    check_tensor("masked_m", masked_m, 1, (torch.int32,))
    e_count, max_m, two_i = gate_up.shape
    inter = two_i // 2
    # the usual SwiGLU takes whole 1x128 blocks for fp8; gpt-oss's a partial last one, in 16-byte rows
    mult = (SCALE_BLOCK if kind is ActivationKind.SILU else 16) if fp8 else 8
    if two_i % 2 or inter < mult or inter % mult:
        raise ValueError(
            f"gate_up's last dim must be 2 * I with I a positive multiple of {mult} "
            f"({'fp8 scale blocks' if mult == SCALE_BLOCK else '16-byte rows of h'}), got {two_i}"
        )
    if gate_up.stride(2) != 1 or any(st * 2 % TMA_ALIGN for st in gate_up.stride()[:2]) \
            or gate_up.data_ptr() % TMA_ALIGN:
        raise ValueError("gate_up must be contiguous along its last dim with 16-byte-aligned strides and base")
    if masked_m.shape[0] != e_count:
        raise ValueError(f"masked_m must have E={e_count} entries, got {masked_m.shape[0]}")
    if bias is not None and (tuple(bias.shape) != (e_count, two_i) or not bias.is_contiguous()
                             or bias.data_ptr() % TMA_ALIGN):
        raise ValueError(f"bias must be a contiguous, 16-byte-aligned float32 [E, 2I] = {(e_count, two_i)}, "
                         f"got {tuple(bias.shape)}")
    for name, t in (("masked_m", masked_m), ("bias", bias), ("out", out), ("out_scale", out_scale)):
        if t is not None and t.device != gate_up.device:
            raise ValueError(f"{name} is on {t.device} but gate_up is on {gate_up.device}")
    if gate_up.device.type != "cuda":
        raise ValueError(f"gate_up must be on a CUDA device, got {gate_up.device}")
    check_h_out(out, out_scale, (e_count, max_m, inter), fp8)
    if fp8 and out is None:
        out, out_scale = alloc_fp8_input(e_count, max_m, inter, gate_up.device)
    elif out is None:
        out = torch.empty(e_count, max_m, inter, dtype=torch.bfloat16, device=gate_up.device)
    sm_count = device_facts(gate_up.device.index)[1]
    sms = sm_count if num_sms is None else num_sms
    if isinstance(sms, bool) or not isinstance(sms, int) or not 1 <= sms <= sm_count:
        raise ValueError(f"num_sms must be an int in [1, {sm_count}], got {num_sms!r}")
    from .activation_kernel import ROWS_PER_UNIT

    units = e_count * -(-max_m // ROWS_PER_UNIT)
    fn = get_kernel(fp8, kind=kind)
    fn(gate_up, masked_m, out, out_scale, bias, max(1, min(sms * CTAS_PER_SM, units)))
    return (out, out_scale) if fp8 else out


def silu_mul_ref(gate_up: torch.Tensor, masked_m: torch.Tensor, *, fp8: bool = True):
    """Torch reference: float32 activation of the valid rows (rows >= m_e zero),
    then ``quant.quantize_fp8_per_token`` for fp8. Returns (h, scales) or h."""
    inter = gate_up.shape[-1] // 2
    g, u = gate_up[..., :inter].float(), gate_up[..., inter:].float()
    return _h_as_kernel_writes(torch.nn.functional.silu(g) * u, masked_m, fp8)


def gpt_oss_swiglu_ref(gate_up: torch.Tensor, bias: torch.Tensor, masked_m: torch.Tensor, *, fp8: bool = True):
    """Torch reference of ``gpt_oss_swiglu``: float32 ``clamped_swiglu`` of
    gate_up + bias on the valid rows (rows >= m_e zero), then
    ``quant.quantize_fp8_per_token`` for fp8. Returns (h, scales) or h."""
    from .gpt_oss import clamped_swiglu

    return _h_as_kernel_writes(clamped_swiglu(gate_up.float() + bias.float()[:, None, :]), masked_m, fp8)


def _h_as_kernel_writes(h: torch.Tensor, masked_m: torch.Tensor, fp8: bool):
    """float32 h [E, max_m, I] with its rows >= m_e zeroed, as the down
    GEMM's input: (fp8, scales) 1x128 or bf16."""
    from ..quant import quantize_fp8_per_token
    from ..reference import clamp_masked_m

    rows = clamp_masked_m(masked_m, h.shape[1]).to(h.device)
    valid = torch.arange(h.shape[1], device=h.device)[None, :] < rows[:, None]
    h = h * valid[..., None]
    if not fp8:
        return h.to(torch.bfloat16)
    return quantize_fp8_per_token(h)
