"""The bounded wait on a completion counter, for CuTe-DSL kernels:
acquire-poll until the counter reaches a target, with exponential nanosleep
back-off, giving up after ``max_polls`` polls and raising a bit in the error
word instead of hanging the GPU."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32
from cutlass.experimental.primitives.nvvm_wrapper import nanosleep

from .errors import ERR_TIMEOUT


@cute.jit
def wait_signal(counter: cute.Pointer, target: Int32, max_polls: Int32, err: cute.Pointer) -> Boolean:
    """Spin until ``*counter >= target`` (GPU-scope acquire). On timeout, OR
    ERR_TIMEOUT into ``*err`` and return False. Once any wait of the launch
    has timed out (ERR_TIMEOUT in ``*err``), every other wait gives up at its
    next poll: one poll budget for the launch, not one per work item. The
    caller's later loads are ordered after the producer's release; a CTA
    barrier after the wait extends that to the CTA's other threads. Back-off
    32 ns doubling to 256 ns: the slack after the counter flips sits on the
    critical path of the last m-block."""
    value = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
    given_up = cute.arch.load(err, Int32, sem="relaxed", scope="gpu") & Int32(ERR_TIMEOUT)
    polls = Int32(0)
    backoff = Int32(32)
    while (value < target) & (polls < max_polls) & (given_up == 0):
        nanosleep(backoff)
        backoff = cutlass.min(backoff * 2, Int32(256))
        polls = polls + 1
        value = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
        given_up = cute.arch.load(err, Int32, sem="relaxed", scope="gpu") & Int32(ERR_TIMEOUT)
    ok = value >= target
    if not ok:
        cute.arch.atomic_or(err, Int32(ERR_TIMEOUT))
    return ok
