"""tests/shard.py: N shards together run every collected test exactly once."""

from types import SimpleNamespace

import pytest

from tests.shard import Shard


def _run(index, count, items, *, gpu=False):
    dropped = []
    hook = SimpleNamespace(pytest_deselected=lambda items: dropped.extend(items))
    items = list(items)
    Shard(index, count, gpu=gpu).pytest_collection_modifyitems(SimpleNamespace(hook=hook), items)
    return items, dropped


def test_shards_partition_the_collection():
    items = [f"t{i}" for i in range(11)]
    kept = []
    for k in range(4):
        mine, dropped = _run(k, 4, items)
        assert mine == items[k::4]
        assert sorted(mine + dropped) == sorted(items)
        kept += mine
    assert sorted(kept) == sorted(items)


def test_a_shard_outside_the_count_is_refused():
    with pytest.raises(ValueError, match="0 <= K < N"):
        Shard(3, 3)


class _Item:
    def __init__(self, nodeid, reasons=()):
        self.nodeid = nodeid
        self._marks = [SimpleNamespace(kwargs={"reason": r}) for r in reasons]

    def iter_markers(self, name):
        assert name == "skipif"
        return iter(self._marks)


def test_the_gpu_selection_keeps_gpu_files_and_gpu_skips_only():
    gpu_file = _Item("tests/fp8/test_gemm_output.py::test_a")
    cudnn = _Item("tests/model/test_llama.py::test_b", ["cuDNN's attention needs a GPU"])
    cpu = _Item("tests/model/test_llama.py::test_c", ["the CPU only"])
    plain = _Item("tests/training/test_train.py::test_d")
    items, dropped = _run(0, 1, [gpu_file, cudnn, cpu, plain], gpu=True)
    assert items == [gpu_file, cudnn]
    assert dropped == [cpu, plain]
