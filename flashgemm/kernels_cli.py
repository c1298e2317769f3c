"""``python -m flashgemm compile``: build every kernel the package can launch
and list the PTX features found in each; and the GPU check the demo uses."""

from __future__ import annotations

import os
import re
import sys
import time
import uuid

from .jit.arch import BACKENDS

# the targets ``compile --arch`` takes: one per compute capability with kernels
# (the "a" variants: wgmma and tcgen05 need the arch-specific features)
SUPPORTED_ARCHS = tuple(f"sm_{major}{minor}a" for major, minor in BACKENDS)

PTX_FEATURES = {
    "wgmma": "wgmma.mma_async",
    "fp8-wgmma": ".e4m3.e4m3",
    # 3d TMA loads into this CTA (Hopper, 1-CTA Blackwell) or into a CTA pair's
    # shared memory (sm_100 2-CTA: .shared::cluster ... .cta_group::2)
    "tma-load": re.compile(r"cp\.async\.bulk\.tensor\.3d\.shared::(cta|cluster)\.global"),
    "tma-store": "cp.async.bulk.tensor.3d.global.shared::cta",
    "setmaxnreg": "setmaxnreg",
    "stmatrix": "stmatrix",
    "bulk-reduce": "cp.reduce.async.bulk",
    "acquire-poll": "ld.acquire.gpu",
    "combine-reduce": "red.relaxed.gpu.global.add.v4.f32",
    "combine-reduce-bf16": "red.relaxed.gpu.global.add.noftz.v4.bf16x2",
    # 16-byte plain stores after 64-bit loads (the peers' receive-buffer
    # addresses); a STORE kernel's partial-tile stores load no address
    "combine-peer-store": re.compile(r"ld\.global\.b64\s.*?st\.global\.v4\.b32\s", re.S),
    # 16-byte global loads: in a GEMM only the bias pieces of the fused
    # combine's *_BIAS builds (the activation and EP kernels load rows so)
    "v4-load": re.compile(r"ld\.global\S*\.v4\."),
    "fp8-cvt": "cvt.rn.satfinite.e4m3x2.f32",
    # MXFP4 weights on Hopper: the e2m1 -> e4m3 table lookups (device.e2m1)
    "e2m1-lookup": "prmt.b32",
    # the EP completion handshake: counts into the peers, waits on their counts
    "sys-release": "red.release.sys.global.add.s32",
    "sys-acquire": "ld.acquire.sys.global",
    # Blackwell (sm_100a / sm_103a)
    "tcgen05-mma-mxf8f6f4": re.compile(r"tcgen05\.mma\S*\.kind::mxf8f6f4\.block_scale"),
    "tcgen05-mma-mxf4nvf4": re.compile(r"tcgen05\.mma\S*\.kind::mxf4nvf4\.block_scale"),
    "tcgen05-mma-f16": re.compile(r"tcgen05\.mma\S*\.kind::f16"),
    "tcgen05-mma-f8f6f4": re.compile(r"tcgen05\.mma\S*\.kind::f8f6f4"),  # fp8 without block scales
    "cta_group::2": re.compile(r"tcgen05\.mma\.cta_group::2"),
    "tcgen05.alloc": "tcgen05.alloc",
    "tcgen05.cp": "tcgen05.cp",
    "tcgen05.ld": "tcgen05.ld",
}
# A signalled kernel's publishing sequence, in this order: the bulk stores
# complete (the full wait, not ``.read``), the async-proxy writes are fenced
# before generic operations, then the GPU-scope release add.
SIGNAL_SEQUENCE = re.compile(
    r"cp\.async\.bulk\.wait_group\s+0;\s*fence\.proxy\.async\.global;"
    r"[^;]*(?:;[^;]*){0,8}?red\.release\.gpu\.global\.add\.s32"
)


def ptx_features(ptx: str) -> list[str]:
    feats = [name for name, needle in PTX_FEATURES.items()
             if (needle.search(ptx) if isinstance(needle, re.Pattern) else needle in ptx)]
    if SIGNAL_SEQUENCE.search(ptx):
        feats.append("signal-publish")
    return feats


def hopper_gpu():
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA GPU found"
    cap = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if cap != (9, 0):
        return None, f"found {name} (sm_{cap[0]}{cap[1]}), but the kernels need sm_90"
    return name, ""


def check_arch(arch: str) -> str:
    """``arch`` if flashgemm has kernels for it, else a ValueError naming the
    supported ones (an unsupported target fails deep in the DSL otherwise)."""
    if arch in SUPPORTED_ARCHS:
        return arch
    hint = f"; did you mean {arch}a?" if f"{arch}a" in SUPPORTED_ARCHS else ""
    raise ValueError(f"--arch {arch!r} is not supported: flashgemm compiles for "
                     f"{', '.join(SUPPORTED_ARCHS)}{hint}")


def check_cache_dir(path: str) -> str:
    """``path`` if it is, or can be made, a writable directory the disk cache
    trusts; else a ValueError (the cache would fall back to the process,
    storing nothing)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--cache-dir {path!r} exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".probe-{uuid.uuid4().hex}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as err:
        raise ValueError(f"--cache-dir {path!r} is not a writable directory: {err}") from None
    from .jit.diskcache import untrusted

    why = untrusted(os.stat(path))
    if why:  # the cache would refuse it and store nothing
        raise ValueError(f"--cache-dir {path!r} is refused by the disk cache: {why} (chmod go-w, or use a "
                         f"directory you own)")
    return path


def _no_match(match: str, arch: str, names) -> int:
    """``--match`` that names no GEMM: say so, and fail (compiling nothing
    is never what was asked)."""
    print(f"flashgemm compile: no GEMM kernel for {arch} has {match!r} in its name, so nothing was compiled. "
          f"There are {len(names)}, named like {names[0]!r}; compile without --match lists them all.",
          file=sys.stderr)
    return 2


def cmd_compile(args) -> int:
    """Build (and with ``--cache-dir`` store) every kernel the package can
    launch, or with ``--match`` the GEMMs whose name contains it, one line
    each with the PTX features found; exit 1 if a kernel lacks what it must
    have, 2 if ``--match`` names no GEMM."""
    from . import backend
    from .jit.arch import ensure_arch_env

    arch = ensure_arch_env(check_arch(args.arch))
    be = backend.for_arch(arch)
    gemms = be.gemm_jobs(arch, args.match or "")
    if args.match and not gemms:
        return _no_match(args.match, arch, [s.name() for s in be.reachable_specs()])
    block_ms = [] if args.match else be.signal_block_ms(be.reachable_specs())
    extra = be.extra_jobs(arch, block_ms)
    activations = _activation_jobs(args, arch)
    ep = _ep_jobs(arch, block_ms)
    if args.match:  # say what the subset is, not what the full listing holds
        what = _subset(args.match, f"{len(gemms)} GEMMs", activations)
    else:
        what = (f"{len(gemms)} GEMMs (every configuration the heuristic picks x signal mode and epilogue), "
                f"{len(activations)} MoE activations"
                + (f", {len(extra)} reference combines" if extra else "")
                + (f" and {len(ep)} expert-parallel kernels" if ep else ""))
    return _run_jobs(gemms + extra + activations + ep, arch, getattr(args, "cache_dir", None), what,
                     subset=bool(args.match))


def _subset(match: str, gemms: str, activations) -> str:
    """The header of a ``--match`` listing: which kernels it builds."""
    return (f"{gemms} whose name contains {match!r}"
            + (f" and the {len(activations)} MoE activations" if activations else ""))


def _ep_jobs(arch: str, block_ms) -> list:
    """The expert-parallel kernels (``flashgemm.ep``; none under ``--match``,
    which passes no m-block heights): the signalled combine polls and
    completes at system scope, the completion step only completes, the
    device dispatch stores rows into the peers' buffers (quantizing them for
    fp8) and waits on the peers' posts at system scope, the owner's sum
    neither polls nor completes."""
    if not block_ms:
        return []
    from .ep.combine import ep_kernel_jobs

    handshake = {"sys-release", "sys-acquire"}
    checks = {"ep-combine": lambda name, feats: handshake | {"acquire-poll"} <= set(feats),
              "ep-complete": lambda name, feats: handshake <= set(feats) and "acquire-poll" not in feats,
              "ep-dispatch": lambda name, feats: ({"sys-acquire", "combine-peer-store"} <= set(feats)
                                                  and "acquire-poll" not in feats
                                                  and ("fp8-cvt" in feats) == ("-fp8-" in name)),
              "ep-token-sum": lambda name, feats: not (handshake | {"acquire-poll"}) & set(feats)}
    from .backend import CompileJob

    jobs = []
    for name, key, make in ep_kernel_jobs(arch, block_ms):
        check = next((c for prefix, c in checks.items() if name.startswith(prefix)), None)
        if check is None:  # a new EP kernel needs its PTX rule here
            raise RuntimeError(f"no PTX check for the expert-parallel kernel {name!r}")
        jobs.append(CompileJob(name, key, lambda keep, make=make: make(keep_ptx=keep),
                               lambda feats, name=name, check=check: check(name, feats)))
    return jobs


def _activation_jobs(args, arch: str) -> list:
    """The MoE activation kernels (arch-neutral), unless ``--match`` narrows
    the listing without ``--moe`` (the demo passes both)."""
    from .moe.activation import activation_jobs

    return activation_jobs(arch) if not args.match or getattr(args, "moe", False) else []


def _run_jobs(jobs, arch: str, cache_dir, what: str, subset: bool = False) -> int:
    """Build (or store) each (name, cache key, build, PTX check) job and list
    it with its PTX features; 1 if a check failed, else 0."""
    from .jit import cache

    count = f"{len(jobs)} of the kernels" if subset else f"the {len(jobs)} kernels"
    print(f"compiling {count} flashgemm can launch on {arch}: {what} (no GPU needed)"
          + (f", into {cache_dir}" if cache_dir else ""), flush=True)
    ok = True
    t_all = time.perf_counter()
    for i, job in enumerate(jobs):
        name, check = job.name, job.check
        t0 = time.perf_counter()
        fn = cache.store(job.key, lambda: job.build(True), cache_dir) if cache_dir else job.build(True)
        ptx = getattr(fn, "__ptx__", None)
        head = f"  [{i + 1:3d}/{len(jobs)}] {name:58s} {time.perf_counter() - t0:5.1f} s"
        if ptx is None:  # loaded from the cache directory: no PTX to read
            print(f"{head}  (in the cache)", flush=True)
            continue
        feats = ptx_features(ptx)
        good = check(feats)
        ok &= good
        print(f"{head}  PTX: {', '.join(feats) or '-'}" + ("" if good else "  MISSING A REQUIRED FEATURE"),
              flush=True)
    secs = time.perf_counter() - t_all
    print(f"done in {secs:.0f} s", flush=True)
    if cache_dir:
        print(f"{len(jobs)} kernels for {arch} in {cache_dir} ({secs:.1f} s); "
              f"use them with FLASHGEMM_CACHE_DIR={cache_dir}")
    return 0 if ok else 1
