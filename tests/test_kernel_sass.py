"""benchmarks/kernel_sass.py's reading of a SASS listing (the compile itself needs the CUDA
plugin and ptxas, which CI lacks): which instructions a tile on the fast path runs."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import kernel_sass  # noqa: E402

LISTING = """
        /*0000*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0010*/                   ISETP.GE.U32.AND P0, PT, R8, 0x7fffff, PT ;
        /*0020*/              @!P0 BRA 0x60 ;
        /*0030*/                   MUFU.LG2 R2, |R2| ;
        /*0040*/                   MUFU.LG2 R3, |R3| ;
        /*0050*/                   BRA 0xa0 ;
        /*0060*/                   FSETP.GEU.AND P1, PT, |R2|, 1.1754943508222875e-38, PT ;
        /*0070*/               @!P1 FMUL R2, R2, 16777216 ;
        /*0080*/                   MUFU.LG2 R2, R2 ;
        /*0090*/               @!P1 FADD R2, R2, -24 ;
        /*00a0*/                   FFMA R2, R2, R6, R7 ;
        /*00b0*/              @!P2 BRA 0xd0 ;
        /*00c0*/                   FADD R2, R2, 1 ;
        /*00d0*/                   EXIT ;
"""


def test_fast_path_leaves_out_each_conditions_second_branch():
    lines = kernel_sass.parse_listing(LISTING)
    assert len(lines) == 14
    fast, branches = kernel_sass.fast_path(lines)
    assert branches == 1
    # The if/else's second block (0x60-0x90) is left out; a plain forward branch with no
    # else (0xb0) keeps both sides.
    assert [lines[i][0] for i in fast] == [
        0x00,
        0x10,
        0x20,
        0x30,
        0x40,
        0x50,
        0xA0,
        0xB0,
        0xC0,
        0xD0,
    ]
    assert [kernel_sass.opcode(lines[i][1]) for i in fast][-4:] == ["FFMA", "BRA", "FADD", "EXIT"]


def test_fast_path_refuses_an_if_else_that_is_not_a_flush_to_zero_pair():
    """A left-out block without the exact forms' fix-up compare means the listing's layout is
    not the one the reader assumes: it raises rather than count the wrong path."""
    swapped = LISTING.replace("1.1754943508222875e-38", "1.5")
    lines = kernel_sass.parse_listing(swapped)
    with pytest.raises(RuntimeError, match="not a flush-to-zero/exact pair"):
        kernel_sass.fast_path(lines)


def test_load_schedule_places_each_global_load_in_the_fast_path():
    lines = kernel_sass.parse_listing(LISTING)
    fast, _ = kernel_sass.fast_path(lines)
    wide = lines[:4] + [(0x038, "LDG.E.128 R8, desc[UR4][R6.64]")] + lines[4:]
    got = kernel_sass.load_schedule(lines, fast)
    assert got == {"loads": 1, "last_load_at": 0.0, "wide_loads_at": []}
    fast_wide, _ = kernel_sass.fast_path(wide)
    got = kernel_sass.load_schedule(wide, fast_wide)
    # 11 instructions on the fast path; the 128-bit load is the fifth.
    assert len(fast_wide) == 11
    assert got == {"loads": 2, "last_load_at": 4 / 11, "wide_loads_at": [4 / 11]}
