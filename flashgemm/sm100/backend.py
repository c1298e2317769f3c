"""The sm_100 / sm_103 (Blackwell) backend: tcgen05 kernels for bf16, MXFP8,
NVFP4 and MXFP4 weights beside MXFP8 activations (``kernel``) and DeepSeek's 1x128 fp8 (``blockwise``), with the
plain store and signals. Compiled and PTX-checked here, never run (no
Blackwell GPU)."""

from __future__ import annotations

from typing import Iterable

from ..backend import Backend, CompileJob
from ..config import Epilogue, check_field_types
from ..formats import Format
from .config import Sm100Config

# the MMA kind each format must use
MMA_FEATURE = {"mxfp8": "tcgen05-mma-mxf8f6f4", "nvfp4": "tcgen05-mma-mxf4nvf4", "bf16": "tcgen05-mma-f16",
               "mxfp8_mxfp4": "tcgen05-mma-mxf8f6f4"}


def gemm_ptx_ok(spec, feats) -> bool:
    """What an sm_100 GEMM's PTX must show: its format's MMA kind, TMEM
    allocation and loads, TMA loads and stores, tcgen05.cp for the scales,
    cta_group::2 exactly for a CTA pair, the signal sequence when signalled."""
    cfg = spec.config
    need = {MMA_FEATURE[cfg.fmt.value], "tma-load", "tma-store", "tcgen05.alloc", "tcgen05.ld"}
    if cfg.fmt.block_scaled:
        need.add("tcgen05.cp")
    if spec.signal_mode is not None:
        need.add("signal-publish")
    return need <= set(feats) and ("cta_group::2" in feats) == (cfg.cluster_size == 2)


def blockwise_ptx_ok(spec, feats) -> bool:
    """The DeepSeek fp8 recipe on sm_100: fp8 MMAs without block scales into
    tensor memory, TMA loads and stores, the signal sequence when signalled."""
    need = {"tcgen05-mma-f8f6f4", "tma-load", "tma-store", "tcgen05.alloc", "tcgen05.ld"}
    if spec.signal_mode is not None:
        need.add("signal-publish")
    return need <= set(feats) and "tcgen05.cp" not in feats


class Sm100Backend(Backend):
    name = "sm100"
    label = "sm_100 / sm_103"
    formats = (Format.BF16, Format.FP8_BLOCK128, Format.MXFP8, Format.NVFP4, Format.MXFP8_MXFP4)
    epilogues = frozenset({Epilogue.STORE})
    config_type = Sm100Config

    def choose_config(self, fmt, expected_m, max_m, n, k, num_sms, num_experts=None, signals=False,
                      epilogue=Epilogue.STORE):
        if fmt is Format.FP8_BLOCK128:
            raise ValueError("sm_100 takes no config for 1x128 fp8 operands: the blockwise kernel chooses "
                             "its own tiles")
        from .heuristic import choose_config

        return choose_config(fmt, num_experts or 1, max_m, n, k, expected_m, num_sms)

    def check_config_arg(self, config, fmt, signals, combine) -> int:
        from .limits import check_config

        if combine:
            raise TypeError("config with combine must be a flashgemm.GemmConfig or None (combine runs on "
                            "sm_90 only), got Sm100Config")
        if fmt is Format.FP8_BLOCK128:
            raise TypeError("config for 1x128 fp8 operands must be a flashgemm.GemmConfig (sm_90) or None "
                            "(sm_100 chooses its own tiles), got Sm100Config")
        check_field_types(config)
        check_config(config)
        if config.fmt is not fmt:
            raise ValueError(f"config.fmt is {config.fmt.value} but the operands are {fmt.value}")
        return config.cluster_size

    def reachable_specs(self) -> tuple:
        from .blockwise_build import blockwise_specs
        from .heuristic import reachable_specs

        return (*reachable_specs(), *blockwise_specs())

    def kernel(self, spec):
        from .launch import kernel_of

        return kernel_of(spec)

    def make_plan(self, call):
        from .launch import make_plan

        return make_plan(call)

    def signal_layout(self, fmt, num_experts, max_m, n, k, expected_m, grid_cap, config, granularity):
        from .launch import sm100_signal_layout

        return sm100_signal_layout(fmt, num_experts, max_m, n, k, expected_m, grid_cap, config, granularity)

    def gemm_jobs_of(self, specs: Iterable, arch: str) -> list:
        from ..jit.key import cache_key
        from .blockwise_build import BlockwiseSpec, build_blockwise
        from .build import build

        jobs = []
        for s in specs:
            if isinstance(s, BlockwiseSpec):
                jobs.append(CompileJob(s.name(), cache_key(arch, "sm100-blockwise", s),
                                       lambda keep, s=s: build_blockwise(s, arch, keep_ptx=keep),
                                       lambda feats, s=s: blockwise_ptx_ok(s, feats)))
            else:
                jobs.append(CompileJob(s.name(), cache_key(arch, s), lambda keep, s=s: build(s, arch, keep_ptx=keep),
                                       lambda feats, s=s: gemm_ptx_ok(s, feats)))
        return jobs


BACKEND = Sm100Backend()
