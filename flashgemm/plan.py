"""One launch plan for every kernel called through a cached argument signature.

A call's full checks run once per signature (``signature``: the family, each
named tensor's dtype, shape, strides and device, and the options with their
types). What they derive is a :class:`LaunchPlan`: the compiled function, its
tensor parameters by name in the order it takes them, its grid, and which
tensors must be 16-byte aligned and which the kernel writes (so may alias
nothing), declared by name. Later calls with the same signature run only the
address checks (``pointers_ok``) and launch. The GEMM (``api``, both
architectures), the fused gate_up (``moe.gate_up``) and the expert-parallel
kernels (``ep``) use it; ``planned`` is the lookup they share.
"""

from __future__ import annotations

from typing import Mapping, Optional

from .validation import TMA_ALIGN, span


def signature(family: str, tensors: Mapping, *options) -> tuple:
    """The plan key of a call: ``family``, every named tensor's metadata (None
    if absent) and the options, each with its type (128 and 128.0, or 1 and
    True, must not share a plan). Raises AttributeError / TypeError for an
    argument that is no tensor or is unhashable: the caller then runs the
    full checks, which name it. (Written out for the interpreter: it runs on
    every call.)"""
    key = [family]
    add, extend = key.append, key.extend
    for t in tensors.values():
        if t is None:
            add(None)
        else:
            extend((t.dtype, t.shape, t.stride(), t.get_device()))
    extend([(type(o), o) for o in options])
    return tuple(key)


def extent(t) -> int:
    """Bytes from a tensor's first element to one past its last (its strides
    may leave gaps; they count)."""
    return 0 if t is None else span(0, t.shape, t.stride(), t.element_size())[1]


class LaunchPlan:
    """The checked launch of one argument signature.

    fn: the compiled function, called as ``fn(*tensors in slots order,
    *scalars)``; slots: its tensor parameters' names; aligned / written: the
    names whose addresses must be 16-byte aligned / that the kernel writes;
    facts: what the caller needs at launch (output shape, signal layout, ...),
    set as attributes."""

    def __init__(self, fn, slots: tuple, tensors: Mapping, *, scalars: tuple = (), aligned=(), written=(),
                 **facts):
        unknown = (set(aligned) | set(written)) - set(slots)
        if unknown:
            raise ValueError(f"pointer rules name tensors that are not parameters: {sorted(unknown)}")
        # the compiled TVM-FFI function itself, not the DSL's Python wrapper around it
        self.fn = getattr(fn, "__tvm_ffi_object__", lambda: None)() or fn
        self.slots, self.scalars = tuple(slots), tuple(scalars)
        for name, value in facts.items():
            setattr(self, name, value)
        # a launch with nothing to prepare (no a_scale copy, claim counter, dtype views or routed result)
        self.plain = not (facts.get("copy_a_scale") or facts.get("counter_device") is not None
                          or facts.get("views") or facts.get("routed"))
        # the rules are kept by position among the present tensors (the signature
        # fixes which are present): the per-call check is then index arithmetic
        self._present = tuple(name for name in self.slots if tensors.get(name) is not None)
        self._aligned = tuple(i for i, name in enumerate(self._present) if name in aligned)
        self._written = tuple(i for i, name in enumerate(self._present) if name in written)
        self._extents = tuple(extent(tensors[name]) for name in self._present)
        self._last_ok = None

    def pointers_ok(self, tensors: Mapping) -> bool:
        """This call's addresses meet the rules: the aligned ones aligned,
        nothing overlapping what the kernel writes. False sends the call
        through the full checks, which name the problem."""
        ptrs = [tensors[name].data_ptr() for name in self._present]
        if ptrs == self._last_ok:
            return True
        bits = 0
        for i in self._aligned:
            bits |= ptrs[i]
        if bits % TMA_ALIGN:
            return False
        extents = self._extents
        for w in self._written:
            lo, hi = ptrs[w], ptrs[w] + extents[w]
            for j, p in enumerate(ptrs):
                if j != w and p < hi and lo < p + extents[j]:
                    return False
        self._last_ok = ptrs
        return True

    def launch(self, tensors: Mapping, *scalars) -> None:
        """Call the kernel: the tensors by slot (absent ones None), then this
        plan's scalars, then ``scalars``."""
        self.fn(*map(tensors.get, self.slots), *self.scalars, *scalars)


def planned(cache: "PlanCache", family: str, tensors: Mapping, options: tuple, make) -> "LaunchPlan":
    """The plan of this call: the cached one of its signature when this
    call's addresses pass its rules, else ``make()`` (the full checks, which
    raise naming a bad argument) cached under the signature."""
    try:
        key = signature(family, tensors, *options)
        plan = cache.get(key)
        if plan is not None and plan.pointers_ok(tensors):
            return plan
    except (AttributeError, TypeError, RuntimeError):  # not tensors, unhashable: the full checks explain
        key = None
    return cache.put(key, make())


class PlanCache:
    """Plans by signature, bounded (cleared when full)."""

    def __init__(self, limit: int = 4096):
        self._plans, self._limit = {}, limit

    def get(self, key) -> Optional[LaunchPlan]:
        return None if key is None else self._plans.get(key)

    def put(self, key, plan: LaunchPlan) -> LaunchPlan:
        if key is not None:
            if len(self._plans) >= self._limit:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)

    def values(self):
        return self._plans.values()
