"""The documentation site (mkdocs.yml) covers every page and every public name.

``mkdocs build --strict`` (the ``docs`` extra) fails on a broken link, a missing reference or
a page left out of the navigation; these checks run without it: each page of docs/ is in the
navigation once, and docs/api.md documents each name of ``coat_jax.__all__`` exactly once.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import yaml

import coat_jax

ROOT = Path(__file__).resolve().parents[1]


def nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [p for item in node for p in nav_pages(item)]
    if isinstance(node, dict):
        return [p for value in node.values() for p in nav_pages(value)]
    raise TypeError(f"unexpected nav entry {node!r} in mkdocs.yml")


def test_every_page_is_in_the_navigation_once():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = Counter(nav_pages(config["nav"]))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert not {p for p, n in listed.items() if n > 1}, "pages listed twice in mkdocs.yml's nav"
    assert set(listed) - pages == set(), "mkdocs.yml's nav names pages that do not exist"
    assert pages - set(listed) == set(), "pages of docs/ missing from mkdocs.yml's nav"


def test_the_api_reference_documents_every_public_name_once():
    text = (ROOT / "docs" / "api.md").read_text()
    documented = Counter(re.findall(r"^::: coat_jax\.(\w+)$", text, re.M))
    assert {n for n, k in documented.items() if k > 1} == set()
    assert set(documented) == set(coat_jax.__all__)
