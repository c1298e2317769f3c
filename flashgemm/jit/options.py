"""TVM-FFI compile options shared by every kernel build."""

from __future__ import annotations

import contextlib
import tempfile


@contextlib.contextmanager
def compile_options(keep_ptx: bool):
    """TVM-FFI compile options. With keep_ptx the DSL writes the PTX to a file
    named after the function (the same name for every config) and reads it back
    into ``__ptx__``: give each build a private directory, so concurrent builds
    (two test runs, two processes) never read each other's PTX."""
    if not keep_ptx:
        yield "--enable-tvm-ffi"
        return
    with tempfile.TemporaryDirectory(prefix="flashgemm-ptx-") as dump_dir:
        yield f"--enable-tvm-ffi --keep-ptx --dump-dir {dump_dir}"
