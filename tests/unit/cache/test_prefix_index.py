"""The prefix index against a brute-force reference: longest usable prefix, LRU under a byte budget,
redundant entries replaced, and a short side request never evicting a long conversation."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_dspark.domain.cache import CacheEntry, PrefixIndex, common_prefix, snapshot_points


def entry(tokens, nbytes=10, min_length=0) -> CacheEntry:
    return CacheEntry(tokens=tuple(tokens), handle=object(), nbytes=nbytes, min_length=min_length)


def reference_best(entries, prompt, limit) -> int:
    prompt = prompt[:limit]
    return max((e.usable(common_prefix(e.tokens, prompt)) for e in entries), default=0)


seqs = st.lists(st.integers(0, 3), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(seqs, st.booleans()), max_size=8),
    st.lists(st.integers(0, 3), max_size=14),
    st.integers(0, 14),
)
def test_lookup_finds_the_longest_usable_prefix(stored, prompt, limit):
    index = PrefixIndex(budget_bytes=10**9)
    kept = []
    for tokens, snapshot in stored:
        e = entry(tokens, min_length=len(tokens) if snapshot else 0)
        result = index.insert(e)
        assert result.stored == (not any(k.serves(e) for k in kept))
        if result.stored:
            kept = [k for k in kept if k not in result.replaced] + [e]
    assert sorted(map(id, index.entries())) == sorted(map(id, kept))
    match = index.lookup(prompt, limit=limit)
    best = reference_best(kept, prompt, limit)
    if best == 0:
        assert match is None
    else:
        assert match is not None and match.length == best
        assert match.entry.usable(common_prefix(match.entry.tokens, prompt[:limit])) == best


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(seqs, st.integers(1, 40)), min_size=1, max_size=12), st.integers(0, 100))
def test_the_budget_always_holds_and_removals_keep_the_tree_consistent(stored, budget):
    index = PrefixIndex(budget_bytes=budget)
    for tokens, size in stored:
        index.insert(entry(tokens, nbytes=size, min_length=len(tokens)))
        assert index.used_bytes <= budget
        assert index.used_bytes == sum(e.nbytes for e in index.entries())
    for e in index.entries():
        assert index.lookup(e.tokens) is not None
        index.remove(e)
    assert len(index) == 0 and index.used_bytes == 0


def test_eviction_is_least_recently_used():
    index = PrefixIndex(budget_bytes=30)
    a, b, c = entry([1, 2, 3], min_length=3), entry([2, 3, 4], min_length=3), entry([3, 4, 5], min_length=3)
    index.insert(a)
    index.insert(b)
    index.touch(a)  # a hit makes a the most recent
    result = index.insert(c)
    assert result.stored and result.evicted == ()
    d = entry([4, 5, 6], min_length=3)
    result = index.insert(d)
    assert result.evicted == (b,)
    assert set(map(id, index.entries())) == {id(a), id(c), id(d)}


def test_a_short_side_request_never_evicts_the_conversation():
    index = PrefixIndex(budget_bytes=100)
    conversation = entry(range(50), nbytes=90)
    assert index.insert(conversation).stored
    title = entry([7, 7, 7], nbytes=20)
    result = index.insert(title)
    assert not result.stored and result.evicted == ()
    match = index.lookup([*range(50), 9])
    assert match is not None and match.entry is conversation and match.length == 50
    # A longer conversation does take its place.
    longer = entry([9, *range(60)], nbytes=95)
    assert index.insert(longer).evicted == (conversation,)


def test_a_longer_trimmable_entry_replaces_its_prefix_but_not_snapshots():
    index = PrefixIndex(budget_bytes=10**6)
    turn1 = entry([1, 2, 3, 4])
    index.insert(turn1)
    assert not index.insert(entry([1, 2], min_length=2)).stored  # turn1 already serves it
    turn2 = entry([1, 2, 3, 4, 5, 6])
    result = index.insert(turn2)
    assert result.stored and result.replaced == (turn1,)
    assert index.entries() == [turn2]
    recurrent = PrefixIndex(budget_bytes=10**6)
    s1, s2 = entry([1, 2], min_length=2), entry([1, 2, 3, 4], min_length=4)
    recurrent.insert(s1)
    recurrent.insert(s2)
    assert len(recurrent) == 2
    match = recurrent.lookup([1, 2, 3, 9])
    assert match is not None and match.entry is s1 and match.length == 2


def test_a_lookup_never_serves_the_whole_prompt_past_its_limit():
    index = PrefixIndex(budget_bytes=10**6)
    index.insert(entry([1, 2, 3], min_length=3))
    assert index.lookup([1, 2, 3], limit=2) is None
    index.insert(entry([1, 2, 3, 4]))
    match = index.lookup([1, 2, 3], limit=2)
    assert match is not None and match.length == 2


def test_an_entry_over_the_budget_is_not_stored():
    index = PrefixIndex(budget_bytes=5)
    assert not index.insert(entry([1], nbytes=6)).stored
    assert PrefixIndex(budget_bytes=0).insert(entry([1], nbytes=0)).stored


def test_shrinking_the_budget_evicts_oldest_first():
    index = PrefixIndex(budget_bytes=100)
    es = [entry([i], nbytes=30, min_length=1) for i in range(3)]
    for e in es:
        index.insert(e)
    assert index.shrink_to(40) == es[:2]
    assert index.entries() == es[2:]


def test_snapshot_points_keep_the_system_prompt_and_the_latest_turns():
    assert snapshot_points([20, 50, 90, 130, 170], start=0, end=200, most=3) == (20, 130, 170)
    assert snapshot_points([10, 50, 90], start=50, end=200) == (90,)
    assert snapshot_points([24, 28, 28], start=0, end=40) == (24, 28)
    assert snapshot_points([10, 12, 60], start=0, end=60, min_gap=16) == (60,)
    assert snapshot_points([5, 300], start=0, end=200, min_gap=1) == (5,)
    assert snapshot_points([100, 105], start=0, end=200, min_gap=16) == (100,)
    assert snapshot_points([8, 100], start=0, end=200, min_gap=16) == (100,)
