"""Per-CTA timeline of one kernel launch (a development tool, off in every
cached kernel).

A kernel built with ``sm90.build.build(spec, trace=True)`` takes, in place of the
signal counters, an int32 buffer of ``num_ctas * SLOTS`` entries and stamps
into it the low 32 bits of ``%globaltimer`` (nanoseconds, one clock for the
whole GPU) at these points of each CTA:

* ``ENTRY``: first instruction (thread 0);
* ``PRODUCER_START`` / ``PRODUCER_END``: the TMA warp's first scheduler step
  and its exit (after the last slot was released);
* ``STORER_END``: the store warp, after its last bulk store completed;
* ``CONSUMER_END``: the consumers, after their last epilogue;
* ``TILES``: the number of tiles the consumers computed (a count, not a time);
* ``TILE0 + 2 t`` / ``TILE0 + 2 t + 1``: end of tile t's mainloop and of its
  epilogue, for the first ``MAX_TILES`` tiles.

``timeline`` turns the buffer into per-CTA times relative to the first entry;
``tools/trace_tiles.py`` prints where a launch spends its time (launch
spread, first tile, steady tiles, the last wave).
"""

from __future__ import annotations

from typing import Dict, List

ENTRY, PRODUCER_START, PRODUCER_END, STORER_END, CONSUMER_END, TILES = range(6)
TILE0 = 8
MAX_TILES = 40
SLOTS = TILE0 + 2 * MAX_TILES + 8  # 96


def timeline(buf, num_ctas: int) -> Dict[str, List]:
    """Decode a trace buffer (any int32 sequence or tensor) into per-CTA lists
    of nanoseconds since the earliest ENTRY (32-bit wrap handled)."""
    values = [int(v) for v in (buf.tolist() if hasattr(buf, "tolist") else buf)]
    rows = [values[c * SLOTS:(c + 1) * SLOTS] for c in range(num_ctas)]

    def signed(d: int) -> int:  # a 32-bit difference, wrap included
        d %= 1 << 32
        return d - (1 << 32) if d >= 1 << 31 else d

    ref = rows[0][ENTRY]
    first = min(signed(r[ENTRY] - ref) for r in rows)

    def rel(v: int) -> int:
        return signed(v - ref) - first

    out: Dict[str, List] = {
        "entry": [rel(r[ENTRY]) for r in rows],
        "producer_start": [rel(r[PRODUCER_START]) for r in rows],
        "producer_end": [rel(r[PRODUCER_END]) for r in rows],
        "storer_end": [rel(r[STORER_END]) for r in rows],
        "consumer_end": [rel(r[CONSUMER_END]) for r in rows],
        "tiles": [r[TILES] for r in rows],
        "tile_times": [],  # per CTA: [(mainloop end, epilogue end), ...]
    }
    for r in rows:
        n = min(r[TILES], MAX_TILES)
        out["tile_times"].append(
            [(rel(r[TILE0 + 2 * t]), rel(r[TILE0 + 2 * t + 1])) for t in range(n)]
        )
    return out
