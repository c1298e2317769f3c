"""The development timeline (flashgemm.trace): decoding on the CPU, and that
only trace builds carry the timer reads."""

import random

from flashgemm import trace
from flashgemm.config import GemmConfig, KernelSpec
from flashgemm.formats import Format
from flashgemm.sm90.build import build


def _buffer(entries, tiles):
    buf = [0] * (len(entries) * trace.SLOTS)
    for c, (entry, times) in enumerate(zip(entries, tiles)):
        base = c * trace.SLOTS
        buf[base + trace.ENTRY] = entry % (1 << 32)
        buf[base + trace.TILES] = len(times)
        for t, (ml, ep) in enumerate(times[: trace.MAX_TILES]):
            buf[base + trace.TILE0 + 2 * t] = ml % (1 << 32)
            buf[base + trace.TILE0 + 2 * t + 1] = ep % (1 << 32)
    return buf


def test_timeline_relative_to_first_entry_across_the_32_bit_wrap():
    for start in [5_000, (1 << 32) - 1_000, random.randrange(1 << 32)]:
        entries = [start + 300, start, start + 2_000]  # the earliest is not CTA 0
        tiles = [[(start + 10_000, start + 11_000)], [], [(start + 9_000, start + 9_500), (start + 20_000, start + 20_100)]]
        t = trace.timeline(_buffer(entries, tiles), 3)
        assert t["entry"] == [300, 0, 2_000]
        assert t["tiles"] == [1, 0, 2]
        assert t["tile_times"] == [[(10_000, 11_000)], [], [(9_000, 9_500), (20_000, 20_100)]]


def test_timeline_keeps_at_most_max_tiles_per_cta():
    times = [(1_000 * i, 1_000 * i + 10) for i in range(trace.MAX_TILES + 5)]
    buf = _buffer([0], [times])
    buf[trace.TILES] = len(times)  # the kernel counts every tile, stamps the first MAX_TILES
    t = trace.timeline(buf, 1)
    assert t["tiles"] == [trace.MAX_TILES + 5] and len(t["tile_times"][0]) == trace.MAX_TILES
    assert trace.SLOTS >= trace.TILE0 + 2 * trace.MAX_TILES


def test_only_trace_builds_read_the_timer():
    spec = KernelSpec(GemmConfig(tile_m=64, tile_n=128, cluster_n=2), Format.BF16)
    plain = build(spec, arch="sm_90a", keep_ptx=True).__ptx__
    traced = build(spec, arch="sm_90a", keep_ptx=True, trace=True).__ptx__
    assert "globaltimer" not in plain
    assert traced.count("%globaltimer_lo") >= 7
