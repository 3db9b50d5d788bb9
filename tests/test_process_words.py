"""The product speaks of the product: no words of how it was made in what ships.

README.md, docs/, configs/, coat_jax/, pallas_kernels/, benchmarks/, tools/ and tests/ state
facts about the code, its numerics and its measurements. Words of the work that made them (the
work's numbered sittings, its tickets and iterations, phrases that date the text, and dates written
in prose: :data:`WORDS`) belong in CHANGELOG.md (Keep a Changelog form, not scanned) or nowhere. A
measurement's date is part of its record under benchmarks/results/ (not scanned either) and
reaches a page through a rendered block (benchmarks/render.py), whose lines are not scanned.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = (
    "README.md",
    "docs",
    "configs",
    "coat_jax",
    "pallas_kernels",
    "benchmarks",
    "tools",
    "tests",
)
SUFFIXES = {".md", ".py", ".yaml", ".yml", ".sh", ".toml", ".txt", ".cfg"}
# Raw records (benchmarks/results/) carry their dates and commands by design.
RECORDS = ROOT / "benchmarks" / "results"
ORDINAL = (
    r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    r"\w+teenth|\w+tieth|twenty-\w+|\d+(?:st|nd|rd|th))"
)
WORDS = {
    "a numbered or relative session": re.compile(
        rf"\b(?:{ORDINAL}|this|that|previous|last|earlier|later|next|one|same|each)\s+"
        r"[s]essions?\b|\b[s]ession's\b(?! (?:flags|summary))|\b[s]essions\b",
        re.I,
    ),
    "an issue number": re.compile(
        r"\b[i]ssues?\s+#?\d+\b(?!\.\d)|(?<![\w&/#])(?<!Stream )#\d+\b", re.I
    ),
    "a round of work": re.compile(rf"\b(?:[r]ound\s+\d+|{ORDINAL}\s+[r]ound)\b(?!\s+trip)", re.I),
    "a version of the work": re.compile(
        r"\b(?:[t]his version|earlier [v]ersions?|[l]ast time|[n]ew this \w+|previous [s]ession|we [t]ried|"
        r"the [i]ssue's|as the [i]ssue asks)\b",
        re.I,
    ),
    "a date in prose": re.compile(r'(?<!"date": ")\b20\d\d-[01]\d-[0-3]\d\b'),
}
RENDERED = re.compile(r"<!-- rendered: [\w./-]+ -->\n.*?<!-- end rendered -->", re.S)


def scanned_files() -> list[Path]:
    files = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            files.append(path)
            continue
        for p in sorted(path.rglob("*")):
            if p.suffix in SUFFIXES and RECORDS not in p.parents and "__pycache__" not in p.parts:
                files.append(p)
    return files


def findings(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line: what: the words`` for each line of ``path`` that speaks of its making."""
    text = path.read_text(errors="replace")
    # Rendered blocks come from the records; blank them, keeping the line numbers.
    text = RENDERED.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    if path == Path(__file__).resolve():
        return []  # this file spells the patterns out
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in WORDS.items():
            m = pattern.search(line)
            if m:
                out.append(f"{path.relative_to(root)}:{number}: {what}: {m.group(0)!r}")
    return out


def test_no_words_of_how_it_was_made():
    found = [f for path in scanned_files() for f in findings(path)]
    assert not found, (
        f"{len(found)} lines speak of how the product was made; state the fact about the product "
        "instead (project history goes to CHANGELOG.md):\n" + "\n".join(found)
    )


def test_the_patterns_catch_what_they_name(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        # Each phrase is split across string literals, so no line of this file holds one.
        "Fast since the twentieth ses"
        "sion.\nSee iss"
        "ue 12, item 1, and #"
        "53.\n"
        "Measured 2026-"
        "12-04 on an H200.\nIn rou"
        "nd 3 we tr"
        "ied it.\n"
        "<!-- rendered: x -->\n| 2026-"
        "12-04 |\n<!-- end rendered -->\n"
        "Pytest's session fixtures, scope='session', and the ses"
        "sion's flags are fine.\n"
    )
    lines = sorted({int(f.split(":")[1]) for f in findings(page, tmp_path)})
    assert lines == [1, 2, 3, 4]
