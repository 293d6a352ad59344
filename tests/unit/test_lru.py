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


def test_pinned_entries_are_never_evicted_and_count_against_the_bounds():
    lru = LRU(max_entries=2)
    lru.put("catalog", 0, pin=True)
    lru.put("a", 1)
    lru.put("b", 2)  # over the cap: the oldest unpinned entry goes, never the pinned one
    assert lru.keys() == ["catalog", "b"]
    lru.put("catalog", 9)  # once pinned, always pinned
    lru.put("c", 3)
    assert lru.keys() == ["catalog", "c"] and lru.get("catalog") == 9


def test_a_put_reports_what_it_evicted_oldest_first():
    lru = LRU(max_cost=10, cost=int)
    for key, size in [("a", 4), ("b", 4), ("c", 1)]:
        assert lru.put(key, size) == []
    assert lru.put("d", 6) == [("a", 4), ("b", 4)]
    assert lru.keys() == ["c", "d"] and lru.total_cost == 7


def test_pop_oldest_skips_what_is_excluded_and_replace_all_swaps_everything():
    lru = LRU()
    for key in "abc":
        lru.put(key, key.upper())
    lru.get("a")  # order now b, c, a
    assert lru.pop_oldest(exclude={"b"}) == ("c", "C")
    assert lru.pop_oldest(exclude={"a", "b"}) is None
    assert lru.pop("a") == "A" and lru.pop("a", "gone") == "gone"
    lru.replace_all([("x", "X"), ("y", "Y")])
    assert lru.keys() == ["x", "y"] and len(lru) == 2
