"""Fixtures the trainer tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_runs import load_train_script


@pytest.fixture(scope="session")
def trainer_caches(tmp_path_factory) -> Path:
    """The folder whose ``tokens`` subfolder holds the token cache of the trainer tests' runs:
    each pytest process tokenizes a corpus once (the cache is keyed by the corpus and the
    tokenizer, and written atomically), not once per test module."""
    return tmp_path_factory.mktemp("trainer_caches")


@pytest.fixture(scope="session")
def train_script():
    """train.py loaded as a module (:func:`tests.tiny_runs.load_train_script`)."""
    return load_train_script()


@pytest.fixture
def train_py(train_script, capsys):
    """``train_py(*args)`` runs ``python train.py *args`` in this process: its exit code
    (argparse's after ``--help``), stdout and stderr."""

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            code = train_script.main(list(args))
        except SystemExit as e:
            code = e.code
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run
