"""The shared LRU map: bounded by entries and by cost, recency by use, newest always kept."""

from hotlora.lru import LRU


def test_entries_bound_evicts_the_least_recently_used():
    lru = LRU(max_entries=2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # a is now the most recent
    lru.put("c", 3)
    assert "b" not in lru and lru.get("a") == 1 and lru.get("c") == 3 and len(lru) == 2
    assert lru.get("b", "none") == "none"


def test_cost_bound_counts_replacements_and_keeps_the_newest():
    lru = LRU(max_cost=10, cost=len)
    lru.put("a", "xxxx")
    lru.put("b", "yyyy")
    lru.put("a", "zz")  # replaced: its old cost is returned
    assert lru.total_cost == 6
    lru.put("c", "w" * 50)  # over the budget alone: everything older goes, it stays
    assert len(lru) == 1 and lru.get("c") == "w" * 50 and lru.total_cost == 50
