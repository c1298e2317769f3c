"""tools/ncu_regions.py on a small source page written here (CPU only)."""

import csv

import pytest

from conftest import _load_script

HEAD = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait",
        "stall_long_sb", "stall_wait (Not Issued)"]


@pytest.fixture(scope="module")
def ncu_regions():
    return _load_script("tools", "ncu_regions")


def _page(path, rows):
    with open(path, "w", newline="") as f:
        f.write('"Kernel Name","k"\n')  # ncu puts a preamble before the table
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows([HEAD, *rows])


def test_regions_are_runs_of_equal_execution_counts_and_their_shares_sum(ncu_regions, tmp_path, capsys):
    rows = [
        ["0x10", "LDS R1, [R2]", "10", "100", "4", "6", "0"],
        ["0x20", "PRMT R3, R1, 0x654, R4", "30", "100", "30", "0", "0"],
        ["0x30", "BRA 0x10", "0", "400", "0", "0", "0"],  # a hot loop around the two
        ["0x40", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "60", "100", "0", "60", "0"],
    ]
    path = tmp_path / "page.csv"
    _page(path, rows)
    head, sass = ncu_regions.read_sass(str(path))
    assert [[r[0] for r in group] for group in ncu_regions.regions(head, sass)] == [["0x10", "0x20"], ["0x30"], ["0x40"]]
    ncu_regions.main([str(path), "--top", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "4 instructions, 100 samples"
    # the first region: 40 of 100 samples, its reasons wait 34 / long_sb 6 of 40; the empty one is left out
    assert "40.0%" in out[1] and "wait 85%, long_sb 15%" in out[1]
    assert "60.0%" in out[2] and "long_sb 100%" in out[2]
    assert out[3] == ""
    assert out[4].startswith("0x40") and "60.0%" in out[4]


def test_a_page_without_samples_is_refused_with_the_section_to_record(ncu_regions, tmp_path):
    path = tmp_path / "page.csv"
    with open(path, "w") as f:
        f.write('"Address","Source","Instructions Executed"\n"0x10","NOP","1"\n')
    with pytest.raises(SystemExit, match="SourceCounters"):
        ncu_regions.read_sass(str(path))
