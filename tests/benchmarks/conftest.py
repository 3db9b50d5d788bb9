"""Every test of a benchmark script carries the ``benchmark`` marker.

CI runs them with the rest (they check that each script builds its modes with the trainer's own
functions and still runs on the CPU); ``pytest -m "not benchmark"`` leaves them out while working
on the library, ``pytest -m benchmark`` runs only them.
"""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.fspath).resolve().parents:
            item.add_marker(pytest.mark.benchmark)
