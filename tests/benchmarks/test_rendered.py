"""The rendered blocks of README.md and docs/ match a fresh render of benchmarks/results/.

A published figure is rendered from its record (benchmarks/render.py), never retyped: after a
record or a renderer changes, ``python benchmarks/render.py`` rewrites the blocks.
"""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import render  # noqa: E402


def test_committed_blocks_match_a_fresh_render(capsys):
    assert render.main(["--check"]) == 0, capsys.readouterr().out


def test_every_block_is_used():
    used = {name for path in render.targets() for name in render.render_file(path)[1]}
    assert used == set(render.BLOCKS)


def test_an_unknown_block_names_the_known_ones(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- rendered: nope -->\nold\n<!-- end rendered -->\n")
    with pytest.raises(ValueError, match=r"unknown rendered block 'nope'; known: \["):
        render.render_file(page)
