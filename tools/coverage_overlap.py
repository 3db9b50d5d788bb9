"""Chooses the tests whose bodies run without the coverage tracer (tests/untraced_bodies.txt):
those whose lines and branches of coat_jax and pallas_kernels other, traced tests reach first.

The tracer slows every Python line JAX runs while it traces a program, and most tests trace
the same library code again; a test body that reaches nothing new need not be traced. This
reads a coverage data file written with per-test contexts:

    python -m pytest -n 2 --cov=coat_jax --cov=pallas_kernels --cov-branch \\
        --cov-context=test --cov-report= --durations=0 > durations.txt
    python tools/coverage_overlap.py .coverage durations.txt          # check the list
    python tools/coverage_overlap.py .coverage durations.txt --write  # choose it again

A listed body may rely only on arcs that collection, a fixture, or a traced body earlier in
the collection order reaches: a body that runs later can find a program traced and cached
already, so it is not counted on. The check prints every arc that only listed bodies reach, and
every listed test that is no longer collected, and exits with status 1 if there is one.
``--write`` chooses the list again, slowest bodies first.
"""

from __future__ import annotations

import argparse
import collections
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from conftest import UNTRACED_BODIES as LIST  # noqa: E402
from conftest import untraced_bodies  # noqa: E402

HEADER = """\
# Test bodies that run without the coverage tracer (conftest.py): every line and branch of
# coat_jax and pallas_kernels they reach, collection, fixtures or a traced body before them reach
# too. Written by tools/coverage_overlap.py --write; a test not found here runs traced.
"""
# Tests whose bodies mostly wait on child processes, which run untraced anyway: nothing to gain.
CHILD_PROCESS_FILES = (
    "tests/kernels/test_sharded_kernels.py",
    "tests/training/test_multihost.py",
    "tests/training/test_user_path.py",
)


def arcs_by_body(data_file: Path) -> tuple[dict[str, set], set]:
    """The arcs each test body reaches (pytest-cov's ``nodeid|run`` contexts), and the arcs
    reached anywhere else (collection, set-up, tear-down)."""
    con = sqlite3.connect(data_file)
    contexts = dict(con.execute("select id, context from context"))
    if not any(c.endswith("|run") for c in contexts.values()):
        raise SystemExit(
            f"error: {data_file} has no per-test contexts; run pytest with --cov-context=test"
        )
    files = dict(con.execute("select id, path from file"))
    bodies: dict[str, set] = collections.defaultdict(set)
    outside: set = set()
    rows = con.execute("select file_id, context_id, fromno, tono from arc")
    for file_id, context_id, start, end in rows:
        nodeid, _, when = contexts[context_id].rpartition("|")
        arc = (files[file_id], start, end)
        (bodies[nodeid] if when == "run" else outside).add(arc)
    return bodies, outside


def body_seconds(durations: Path) -> dict[str, float]:
    """Seconds of each test body (pytest's ``call`` durations)."""
    seconds = {}
    for line in durations.read_text().splitlines():
        found = re.match(r"\s*([\d.]+)s\s+call\s+(\S+)", line)
        if found:
            seconds[found.group(2)] = float(found.group(1))
    return seconds


def collection_order() -> dict[str, int]:
    """Each test's position in pytest's collection of the suite."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    ids = [line.strip() for line in out.splitlines() if "::" in line]
    return {nodeid: i for i, nodeid in enumerate(ids)}


class Reach:
    """Per arc: the positions of the traced bodies that reach it, and the first untraced one."""

    def __init__(self, bodies: dict[str, set], outside: set, order: dict[str, int]):
        self.bodies, self.outside, self.order = bodies, outside, order
        self.traced: dict = collections.defaultdict(set)
        for nodeid, arcs in bodies.items():
            for arc in arcs:
                self.traced[arc].add(order.get(nodeid, len(order)))
        self.first_untraced: dict = {}

    def lost_if_untraced(self, nodeid: str) -> list:
        """The arcs that no longer count as reached if ``nodeid``'s body runs untraced."""
        at = self.order[nodeid]
        lost = []
        for arc in self.bodies[nodeid]:
            if arc in self.outside:
                continue
            others = self.traced[arc] - {at}
            first = min(self.first_untraced.get(arc, at), at)
            if not others or min(others) >= first:
                lost.append(arc)
        return lost

    def untrace(self, nodeid: str) -> None:
        at = self.order[nodeid]
        for arc in self.bodies[nodeid]:
            self.traced[arc].discard(at)
            self.first_untraced[arc] = min(self.first_untraced.get(arc, at), at)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data_file", type=Path, help="coverage data from --cov-context=test")
    parser.add_argument("durations", type=Path, help="pytest --durations=0 output of that run")
    parser.add_argument("--write", action="store_true", help=f"choose and write {LIST.name}")
    args = parser.parse_args(argv)
    bodies, outside = arcs_by_body(args.data_file)
    order = collection_order()
    reach = Reach(bodies, outside, order)
    seconds = body_seconds(args.durations)
    if args.write:
        chosen = []
        for nodeid in sorted(seconds, key=seconds.get, reverse=True):
            if nodeid.startswith(CHILD_PROCESS_FILES) or nodeid not in bodies:
                continue
            if nodeid in order and not reach.lost_if_untraced(nodeid):
                reach.untrace(nodeid)
                chosen.append(nodeid)
        LIST.write_text(HEADER + "".join(f"{n}\n" for n in sorted(chosen, key=order.get)))
        spent = sum(seconds[n] for n in chosen)
        print(f"wrote {len(chosen)} tests ({spent:.0f} s of bodies) to {LIST.relative_to(ROOT)}")
        return 0
    stale = sorted(n for n in untraced_bodies() if n not in order or n not in bodies)
    for nodeid in stale:
        print(f"listed but not collected, or not in the coverage data: {nodeid}")
    listed = sorted((n for n in untraced_bodies() if n in order and n in bodies), key=order.get)
    lost = set()
    for nodeid in listed:
        lost.update((nodeid, arc) for arc in reach.lost_if_untraced(nodeid))
        reach.untrace(nodeid)
    for nodeid, (path, start, end) in sorted(lost):
        print(f"only untraced bodies reach {path} {start}->{end} ({nodeid})")
    print(f"{len(listed)} listed bodies; {len(lost)} arcs reached only by them; {len(stale)} stale")
    return 1 if lost or stale else 0


if __name__ == "__main__":
    sys.exit(main())
