"""benchmarks/fp8_tiles.py runs end to end (CPU: Pallas interpret mode, tiny shapes) and writes
its records: every tile setting of an element-wise kernel gives the default's codes.

32 rows: each swept block height (8, 16 or 32 rows) still tiles them whole, and interpret mode
runs one program step per block, so fewer rows and columns are the test's saving. 2304 columns
(the script's ``F``, set here) are 144 groups of 16: as for its 11008 (688 groups), the largest
power of two dividing the group count is 16, so every setting gets the block widths it gets at
the real size. The script runs in this process, with the command line it would have."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fp8_tiles  # noqa: E402


def test_tile_sweep_runs_and_every_setting_gives_the_same_codes(tmp_path, monkeypatch):
    out = tmp_path / "tiles"
    args = ["--interpret", "--rows", "32", "--reps", "1", "--only", "cast to E4M3"]
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(fp8_tiles, "F", 2304)
    monkeypatch.setattr(sys, "argv", ["benchmarks/fp8_tiles.py", *args, "--out", str(out)])
    fp8_tiles.main()
    rows = [json.loads(line) for line in (tmp_path / "tiles.jsonl").read_text().splitlines()]
    pallas = [r for r in rows if r["setting"] != "XLA's fusion"]
    assert len(pallas) >= 8 and all(r["op"] == "cast to E4M3" for r in rows)
    assert sum(r["setting"].endswith("(default)") for r in pallas) == 1
    assert all(r.get("equal_to_default") is True for r in pallas), pallas
    assert "| cast to E4M3 |" in (tmp_path / "tiles.md").read_text()
