"""Timing helpers shared by the demo, the benchmarks and the GPU tests."""

from __future__ import annotations

import torch


def capture_graph(fn, calls: int = 10) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` back-to-back calls of fn, run once before on
    a side stream so compiles and allocations stay out of the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph
