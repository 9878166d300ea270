"""Property tests of elastic_emb.sharding: ownership partitions every table, and a reshard plan
moves every row exactly once from its old owner to its new one."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_emb.sharding import RowRange, owned_range, owner_of, reshard_plan, rows_per_owner

rows = st.integers(min_value=0, max_value=5000)
eps = st.integers(min_value=1, max_value=64)


@settings(max_examples=300, deadline=None)
@given(n=rows, ep=eps)
def test_ranges_partition_the_table(n, ep):
    ranges = [owned_range(n, ep, r) for r in range(ep)]
    covered = 0
    for r, rr in enumerate(ranges):
        assert rr.start == covered, f"rank {r} starts at {rr.start}, expected {covered} (n={n}, ep={ep})"
        assert len(rr) <= rows_per_owner(n, ep)
        covered = rr.stop
    assert covered == n
    # ranks beyond ep_size own nothing
    for r in range(ep, ep + 3):
        assert len(owned_range(n, ep, r)) == 0


@settings(max_examples=200, deadline=None)
@given(n=st.integers(min_value=1, max_value=3000), ep=eps, data=st.data())
def test_owner_of_agrees_with_owned_range(n, ep, data):
    row = data.draw(st.integers(min_value=0, max_value=n - 1))
    owner = owner_of(row, n, ep)
    assert 0 <= owner < ep
    rr = owned_range(n, ep, owner)
    assert rr.start <= row < rr.stop


@settings(max_examples=50, deadline=None)
@given(n=st.integers(min_value=1, max_value=200), ep=st.integers(min_value=1, max_value=9))
def test_layout_is_torch_chunk(n, ep):
    """The local shard is exactly torch.chunk's piece (what DTensor Shard(0) holds)."""
    pieces = torch.arange(n).chunk(ep)
    for r in range(ep):
        rr = owned_range(n, ep, r)
        want = pieces[r].tolist() if r < len(pieces) else []
        assert list(range(rr.start, rr.stop)) == want


@settings(max_examples=300, deadline=None)
@given(n=rows, old=eps, new=eps)
def test_reshard_plan_partitions_rows_exactly(n, old, new):
    plan = reshard_plan(n, old, new)
    seen = [0] * n
    for tr in plan:
        assert len(tr.rows) > 0
        assert 0 <= tr.src < old and 0 <= tr.dst < new
        src_range, dst_range = owned_range(n, old, tr.src), owned_range(n, new, tr.dst)
        assert src_range.start <= tr.rows.start and tr.rows.stop <= src_range.stop, (tr, src_range)
        assert dst_range.start <= tr.rows.start and tr.rows.stop <= dst_range.stop, (tr, dst_range)
        for i in range(tr.rows.start, tr.rows.stop):
            seen[i] += 1
    assert all(c == 1 for c in seen), f"rows covered {seen} times (n={n}, old={old}, new={new})"
    # at most old + new - 1 pieces: the boundaries of both shardings cut the rows
    assert len(plan) <= old + new - 1 or n == 0


@given(n=rows, ep=eps)
def test_same_sharding_plan_keeps_rows_in_place(n, ep):
    assert all(tr.src == tr.dst for tr in reshard_plan(n, ep, ep))


def test_errors_name_the_value():
    with pytest.raises(ValueError, match="ep_size=0"):
        owned_range(10, 0, 0)
    with pytest.raises(ValueError, match="num_rows=-1"):
        owned_range(-1, 2, 0)
    with pytest.raises(ValueError, match="rank=-1"):
        owned_range(10, 2, -1)
    with pytest.raises(ValueError, match="row=10"):
        owner_of(10, 10, 2)
    with pytest.raises(ValueError, match=r"\[5, 3\)"):
        RowRange(5, 3)


def test_uneven_example():
    # 10 rows over 4 owners: torch.chunk gives 3, 3, 3, 1
    assert [len(owned_range(10, 4, r)) for r in range(4)] == [3, 3, 3, 1]
    # 5 rows over 4 owners: 2, 2, 1, 0 (the last owner holds nothing)
    assert [len(owned_range(5, 4, r)) for r in range(4)] == [2, 2, 1, 0]
    assert rows_per_owner(5, 4) == math.ceil(5 / 4)
