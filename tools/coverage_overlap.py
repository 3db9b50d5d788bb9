"""Chooses the test bodies and fixtures that run without the coverage tracer
(tests/untraced_bodies.txt): those whose lines and branches of coat_jax and pallas_kernels other,
traced code reaches first.

The tracer slows every Python line JAX runs while it traces a program, and most tests trace
the same library code again; a test body or a fixture's set-up that reaches nothing new need not
be traced. This reads a coverage data file written with per-test contexts, each fixture's set-up
in a context of its own (conftest.py's CONTEXTS_RUN, which also runs everything traced):

    COAT_JAX_COVERAGE_CONTEXTS=1 python -m pytest -n 2 --cov=coat_jax --cov=pallas_kernels \\
        --cov-branch --cov-context=test --cov-report= --durations=0 > durations.txt
    python tools/coverage_overlap.py .coverage durations.txt          # check the list
    python tools/coverage_overlap.py .coverage durations.txt --write  # choose it again

A listed unit may rely only on arcs that collection, the rest of set-up and tear-down, or a
traced unit earlier in the run reaches: a unit that runs later can find a program traced and
cached already, so it is not counted on. A fixture's place is just before the body of the first
test, in collection order, that ran it. The check prints every arc that only listed units
reach, and every listed unit that is no longer collected or reaches nothing, and exits with
status 1 if there is one. ``--write`` chooses the list again, slowest first.
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
from conftest import FIXTURE, untraced_bodies, untraced_fixtures  # noqa: E402
from conftest import UNTRACED_BODIES as LIST  # noqa: E402

HEADER = """\
# Test bodies, and fixtures' set-ups ("fixture <where defined>::<name>"), that run without the
# coverage tracer (conftest.py): every line and branch of coat_jax and pallas_kernels they reach,
# collection or traced code before them reaches too. Written by tools/coverage_overlap.py --write;
# what is not found here runs traced.
"""
# Tests whose bodies mostly wait on child processes, which run untraced anyway: nothing to gain.
CHILD_PROCESS_FILES = (
    "tests/kernels/test_sharded_kernels.py",
    "tests/training/test_multihost.py",
    "tests/training/test_user_path.py",
)


def arcs_by_unit(data_file: Path) -> tuple[dict[str, set], set, dict[str, set]]:
    """The arcs each test body (pytest-cov's ``nodeid|run`` contexts) and each fixture's set-up
    (conftest's ``nodeid|fixture <key>`` contexts) reaches, the arcs reached anywhere else
    (collection, the rest of set-up, tear-down), and for each fixture the tests whose set-up
    ran it. Units are named by node id, or ``fixture <key>``."""
    con = sqlite3.connect(data_file)
    contexts = dict(con.execute("select id, context from context"))
    if not any(c.endswith("|run") for c in contexts.values()):
        raise SystemExit(
            f"error: {data_file} has no per-test contexts; run pytest with --cov-context=test"
        )
    files = dict(con.execute("select id, path from file"))
    units: dict[str, set] = collections.defaultdict(set)
    users: dict[str, set] = collections.defaultdict(set)
    outside: set = set()
    rows = con.execute("select file_id, context_id, fromno, tono from arc")
    for file_id, context_id, start, end in rows:
        nodeid, _, when = contexts[context_id].rpartition("|")
        arc = (files[file_id], start, end)
        if when == "run":
            units[nodeid].add(arc)
        elif when.startswith(FIXTURE):
            units[when].add(arc)
            users[when].add(nodeid)
        else:
            outside.add(arc)
    return units, outside, users


def unit_seconds(durations: Path, users: dict[str, set]) -> dict[str, float]:
    """Seconds of each test body (pytest's ``call`` durations) and of each fixture: the set-up
    durations of the tests that ran it, shared among the fixtures each of those set up."""
    seconds, setup = {}, {}
    for line in durations.read_text().splitlines():
        found = re.match(r"\s*([\d.]+)s\s+(call|setup)\s+(\S+)", line)
        if found:
            (seconds if found.group(2) == "call" else setup)[found.group(3)] = float(found.group(1))
    fixtures_of = collections.defaultdict(set)
    for fixture, nodeids in users.items():
        for nodeid in nodeids:
            fixtures_of[nodeid].add(fixture)
    for fixture, nodeids in users.items():
        seconds[fixture] = sum(setup.get(n, 0.0) / len(fixtures_of[n]) for n in nodeids)
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


def positions(units: dict[str, set], users: dict[str, set], order: dict[str, int]) -> dict:
    """Each unit's place in the run: a fixture's set-up comes just before the body of the first
    test (in collection order) that ran it, a body right after its own set-up."""
    at = {}
    for unit in units:
        if unit.startswith(FIXTURE):
            first = min((order[n] for n in users[unit] if n in order), default=None)
            if first is not None:
                at[unit] = 2 * first
        elif unit in order:
            at[unit] = 2 * order[unit] + 1
    return at


class Reach:
    """Per arc: the positions of the traced units that reach it, and the first untraced one."""

    def __init__(self, units: dict[str, set], outside: set, at: dict[str, int]):
        self.units, self.outside, self.at = units, outside, at
        self.traced: dict = collections.defaultdict(set)
        for unit, arcs in units.items():
            for arc in arcs:
                self.traced[arc].add(at.get(unit, 2 * len(at) + 2))
        self.first_untraced: dict = {}

    def lost_if_untraced(self, unit: str) -> list:
        """The arcs that no longer count as reached if ``unit`` runs untraced."""
        at = self.at[unit]
        lost = []
        for arc in self.units[unit]:
            if arc in self.outside:
                continue
            others = self.traced[arc] - {at}
            first = min(self.first_untraced.get(arc, at), at)
            if not others or min(others) >= first:
                lost.append(arc)
        return lost

    def untrace(self, unit: str) -> None:
        at = self.at[unit]
        for arc in self.units[unit]:
            self.traced[arc].discard(at)
            self.first_untraced[arc] = min(self.first_untraced.get(arc, at), at)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data_file", type=Path, help="coverage data from --cov-context=test")
    parser.add_argument("durations", type=Path, help="pytest --durations=0 output of that run")
    parser.add_argument("--write", action="store_true", help=f"choose and write {LIST.name}")
    args = parser.parse_args(argv)
    units, outside, users = arcs_by_unit(args.data_file)
    at = positions(units, users, collection_order())
    reach = Reach(units, outside, at)
    seconds = unit_seconds(args.durations, users)
    if args.write:
        chosen = []
        for unit in sorted(seconds, key=seconds.get, reverse=True):
            if unit.startswith(CHILD_PROCESS_FILES) or unit not in at:
                continue
            if not reach.lost_if_untraced(unit):
                reach.untrace(unit)
                chosen.append(unit)
        LIST.write_text(HEADER + "".join(f"{u}\n" for u in sorted(chosen, key=at.get)))
        spent = sum(seconds[u] for u in chosen)
        fixtures = sum(u.startswith(FIXTURE) for u in chosen)
        print(
            f"wrote {len(chosen) - fixtures} test bodies and {fixtures} fixtures ({spent:.0f} s) "
            f"to {LIST.relative_to(ROOT)}"
        )
        return 0
    listed_units = [*untraced_bodies(), *(FIXTURE + key for key in untraced_fixtures())]
    stale = sorted(u for u in listed_units if u not in at)
    for unit in stale:
        print(f"listed but not collected, or not in the coverage data: {unit}")
    listed = sorted((u for u in listed_units if u in at), key=at.get)
    lost = set()
    for unit in listed:
        lost.update((unit, arc) for arc in reach.lost_if_untraced(unit))
        reach.untrace(unit)
    for unit, (path, start, end) in sorted(lost):
        print(f"only untraced units reach {path} {start}->{end} ({unit})")
    print(f"{len(listed)} listed units; {len(lost)} arcs reached only by them; {len(stale)} stale")
    return 1 if lost or stale else 0


if __name__ == "__main__":
    sys.exit(main())
