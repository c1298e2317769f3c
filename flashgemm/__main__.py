"""Command line: ``python -m flashgemm demo``, ``compile`` and ``selftest``."""

from __future__ import annotations

import argparse
import sys

from .kernels_cli import (  # noqa: F401
    PTX_FEATURES, SIGNAL_SEQUENCE, SUPPORTED_ARCHS, check_arch, check_cache_dir, cmd_compile, hopper_gpu,
    ptx_features,
)
from .version import __version__


def cmd_demo(args) -> int:
    from .demo import main as demo_main

    return demo_main(png=args.png, seed=args.seed)


def _arch(value: str) -> str:
    """argparse type of --arch: a clean usage error for an unsupported target."""
    try:
        return check_arch(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--arch ")) from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flashgemm")
    p.add_argument("--version", action="version", version=f"flashgemm {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run the MoE expert layer (GPU), or compile + reference (no GPU)")
    d.add_argument("--png", default="moe_layer.png",
                   help="where the stage-time chart goes (GPU only; needs matplotlib)")
    d.add_argument("--seed", type=int, default=None)
    sub.add_parser("selftest", help="a short correctness pass on the GPU that is present")
    c = sub.add_parser("compile", help="compile every kernel the package can launch (no GPU needed)")
    c.add_argument("--arch", default="sm_90a", type=_arch,
                   help=f"the target: {', '.join(SUPPORTED_ARCHS)} (default sm_90a)")
    c.add_argument("--cache-dir", help="also store every kernel in this disk cache (use it with "
                   "FLASHGEMM_CACHE_DIR), so serving never compiles")
    c.add_argument("--match", default="", help="only the GEMM kernels whose name contains this "
                   "(exit status 2 if none does)")
    c.add_argument("--moe", action="store_true", help="with --match: also the MoE activation kernels")
    args = p.parse_args(argv)
    if args.cmd == "compile":
        if args.cache_dir is not None:
            try:
                check_cache_dir(args.cache_dir)
            except ValueError as err:
                c.error(str(err))
        return cmd_compile(args)
    if args.cmd == "selftest":
        from .selftest import main as selftest_main

        return selftest_main()
    return cmd_demo(args)


if __name__ == "__main__":
    sys.exit(main())
