"""tests/shard.py: N shards together run every collected test exactly once."""

from types import SimpleNamespace

import pytest

from tests.shard import Shard


def _run(index, count, items):
    dropped = []
    hook = SimpleNamespace(pytest_deselected=lambda items: dropped.extend(items))
    items = list(items)
    Shard(index, count).pytest_collection_modifyitems(SimpleNamespace(hook=hook), items)
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
