"""benchmarks/kernel_sass.py's reading of a SASS listing (the compile itself needs the CUDA
plugin and ptxas, which CI lacks): where the kernel issues its loads."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
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


def test_load_schedule_places_each_global_load_in_the_listing():
    lines = kernel_sass.parse_listing(LISTING)
    assert len(lines) == 14
    assert [kernel_sass.opcode(ins) for _, ins in lines][-4:] == ["FFMA", "BRA", "FADD", "EXIT"]
    wide = lines[:4] + [(0x038, "LDG.E.128 R8, desc[UR4][R6.64]")] + lines[4:]
    got = kernel_sass.load_schedule(lines)
    assert got == {"loads": 1, "last_load_at": 0.0, "wide_loads_at": []}
    got = kernel_sass.load_schedule(wide)
    # 15 instructions; the 128-bit load is the fifth.
    assert got == {"loads": 2, "last_load_at": 4 / 15, "wide_loads_at": [4 / 15]}
