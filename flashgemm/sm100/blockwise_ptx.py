"""``python -m flashgemm.sm100.blockwise_ptx OUT_DIR``: build every
blockwise spec for ``$CUTE_DSL_ARCH`` (one process serves one target arch)
and write each kernel's PTX to ``OUT_DIR/<spec name>.ptx``; prints one JSON
object ``{name: {"path": ..., "seconds": ...}, "arch": ...}``. No GPU needed.
The compile-only tests run it once per arch."""

from __future__ import annotations

import json
import os
import sys
import time

from ..jit.arch import default_arch, ensure_arch_env


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = argv[0]
    os.makedirs(out_dir, exist_ok=True)
    arch = ensure_arch_env(default_arch())
    from .blockwise_build import blockwise_specs, build_blockwise

    report = {"arch": arch}
    for spec in blockwise_specs():
        t0 = time.perf_counter()
        fn = build_blockwise(spec, arch, keep_ptx=True)
        seconds = time.perf_counter() - t0
        path = os.path.join(out_dir, spec.name() + ".ptx")
        with open(path, "w") as f:
            f.write(fn.__ptx__)
        report[spec.name()] = {"path": path, "seconds": round(seconds, 2)}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
