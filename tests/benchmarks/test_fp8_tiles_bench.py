"""benchmarks/fp8_tiles.py runs end to end (CPU: Pallas interpret mode, tiny shapes) and writes
its records: every tile setting of an element-wise kernel gives the default's codes.

32 rows: each swept block height (8, 16 or 32 rows) still tiles them whole, and interpret mode
runs one program step per block, so fewer rows is the test's main saving."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tile_sweep_runs_and_every_setting_gives_the_same_codes(tmp_path):
    out = tmp_path / "tiles"
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/fp8_tiles.py",
            "--interpret",
            "--rows",
            "32",
            "--reps",
            "1",
            "--only",
            "cast to E4M3",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "tiles.jsonl").read_text().splitlines()]
    pallas = [r for r in rows if r["setting"] != "XLA's fusion"]
    assert len(pallas) >= 8 and all(r["op"] == "cast to E4M3" for r in rows)
    assert sum(r["setting"].endswith("(default)") for r in pallas) == 1
    assert all(r.get("equal_to_default") is True for r in pallas), pallas
    assert "| cast to E4M3 |" in (tmp_path / "tiles.md").read_text()
