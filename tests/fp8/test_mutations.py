"""The mutation check (tools/mutations.py): its faults still target today's code, and a few
cheap ones are caught by tests/fp8/test_fp8_oracle.py (``pytest -m mutation``; each copies the
repository and runs a selection of that file, about a minute apiece)."""

import pytest

from tools import mutations


def test_every_fault_still_targets_the_code():
    assert mutations.stale_edits() == []


CHEAP = (
    "SiLU derivative x1.05 (kernel and reference share silu_grad)",
    "linear output gradient quantized as E4M3 instead of E5M2",
    "E8M0 scale's exact-boundary corrections removed",
)


@pytest.mark.slow
@pytest.mark.mutation
@pytest.mark.parametrize("name", CHEAP)
def test_fault_is_caught(name):
    (fault,) = [f for f in mutations.FAULTS if f.name == name]
    status, test = mutations.run(fault, existing=False, timeout=600)["new"]
    assert status == "caught", (name, status)
    assert test.startswith("tests/fp8/test_fp8_oracle.py::"), test
