"""The sm_90 (Hopper) backend: wgmma kernels for bf16, DeepSeek's 1x128
fp8, and MXFP4 weights with 1x128 fp8 or bf16 activations, with every
epilogue (plain store, signals, the fused combines, the fused SwiGLU) and
the reference combine."""

from __future__ import annotations

from typing import Iterable, Optional

from ..backend import Backend, CompileJob
from ..config import Epilogue, GemmConfig, KernelSpec
from ..formats import Format
from ..signals import DEFAULT_ROWS_PER_ITEM
from ..validation import check_tail_with_signals
from .limits import SM90_FORMATS, validated_config


def gemm_ptx_ok(spec: KernelSpec, feats) -> bool:
    """What an sm_90 GEMM's PTX must show: wgmma and TMA loads (MXFP4 weights:
    the e2m1 lookups, which no other build has, and the wgmma of ``a``'s
    type: e4m3 for fp8 activations, bf16 for bf16 ones), the signal
    sequence when signalled, and what its epilogue requires and forbids
    (``flashgemm.epilogue``)."""
    from ..epilogue import op

    feats = set(feats)
    ok = {"wgmma", "tma-load"} <= feats
    if spec.fmt.converts_weights:
        ok &= "e2m1-lookup" in feats and ("fp8-wgmma" in feats) == spec.fmt.promotes
    else:
        ok &= "e2m1-lookup" not in feats
    if spec.signal_mode is not None:
        ok &= "signal-publish" in feats
    return ok and op(spec.epilogue).ptx_ok(feats)


class Sm90Backend(Backend):
    name = "sm90"
    label = "sm_90"
    formats = SM90_FORMATS
    epilogues = frozenset(Epilogue)
    config_type = GemmConfig

    def choose_config(self, fmt, expected_m, max_m, n, k, num_sms, num_experts=None, signals=False,
                      epilogue=Epilogue.STORE):
        from .launch import resolve_config

        return resolve_config(None, fmt, expected_m, max_m, n, k, num_sms, num_experts, signals, epilogue)

    def check_config_arg(self, config, fmt, signals, combine) -> int:
        if fmt not in self.formats:
            raise TypeError(f"config on an sm_100 GPU must be a flashgemm.Sm100Config or None ({fmt.value} "
                            "operands run on sm_100 / sm_103 only), got GemmConfig")
        validated_config(config, fmt, Epilogue.COMBINE if combine else Epilogue.STORE)
        check_tail_with_signals(config, signals)
        return config.cluster_n

    def reachable_specs(self, fmt: Optional[Format] = None) -> tuple:
        from .heuristic import reachable_specs

        return reachable_specs(fmt)

    def kernel(self, spec: KernelSpec):
        from .build import get_kernel

        return get_kernel(spec)

    def make_plan(self, call):
        from .launch import make_plan

        return make_plan(call)

    def signal_layout(self, fmt, num_experts, max_m, n, k, expected_m, grid_cap, config, granularity):
        from .launch import signal_layout

        return signal_layout(fmt, num_experts, max_m, n, k, expected_m, grid_cap, config, granularity)

    def gemm_jobs_of(self, specs: Iterable, arch: str) -> list:
        from ..jit.key import cache_key
        from .build import build

        return [CompileJob(s.name(), cache_key(arch, s), lambda keep, s=s: build(s, arch, keep_ptx=keep),
                           lambda feats, s=s: gemm_ptx_ok(s, feats)) for s in specs]

    def signal_block_ms(self, specs: Iterable) -> list:
        from .build import combine_block_ms

        return combine_block_ms(specs)

    def extra_jobs(self, arch: str, block_ms: list) -> list:
        from .build import build_combine, combine_key

        rows = DEFAULT_ROWS_PER_ITEM
        return [CompileJob(f"combine-block_m{m}-rows{rows}", combine_key(arch, m, rows),
                           lambda keep, m=m: build_combine(m, arch, keep_ptx=keep, rows_per_item=rows),
                           lambda feats: "bulk-reduce" in feats and "acquire-poll" in feats)
                for m in block_ms]

    def reference_combine(self, block_m: int, rows_per_item: int):
        from .build import get_combine_kernel

        return get_combine_kernel(block_m, rows_per_item)


BACKEND = Sm90Backend()
