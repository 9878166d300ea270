"""ElasticSampler: over any sequence of world sizes and restores of committed cursors, every
sample of an epoch is read exactly once in the committed history; bad state is refused by name."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_emb.data import ElasticSampler


def _committed_reads(sampler: ElasticSampler, plan: list[tuple[int, bool]]) -> list[int]:
    """Run ``plan``: each item a step of a world of that size, committed or lost (a crash before
    its commit: the world that follows restores the committed cursor and reads those positions
    again). Returns every index the committed steps read, in order."""
    committed_cursor, reads, pending = sampler.cursor, [], []
    for world_size, committed in plan:
        step = [sampler.indices(r, world_size) for r in range(world_size)]
        sampler.advance(world_size)
        pending += [int(i) for t in step for i in t]
        if committed:
            committed_cursor, reads, pending = sampler.cursor, reads + pending, []
        else:  # lost: the next world restores the newest commit
            sampler.load_state_dict({**sampler.state_dict(), "cursor": committed_cursor})
            pending = []
    return reads


@settings(max_examples=200, deadline=None)
@given(
    num_samples=st.integers(1, 97),
    batch_size=st.integers(1, 9),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**31),
    plan=st.lists(st.tuples(st.integers(1, 8), st.booleans()), min_size=1, max_size=60),
)
def test_every_sample_of_an_epoch_is_read_once_across_resizes_and_restores(
    num_samples, batch_size, shuffle, seed, plan
):
    sampler = ElasticSampler(num_samples, batch_size, seed=seed, shuffle=shuffle)
    reads = _committed_reads(sampler, plan)
    assert len(reads) == sampler.cursor  # the committed positions, each read once
    for e in range(len(reads) // num_samples):  # every whole epoch: each sample exactly once
        assert sorted(reads[e * num_samples : (e + 1) * num_samples]) == list(range(num_samples))
    rest = reads[len(reads) // num_samples * num_samples :]  # the epoch in progress: no sample twice
    assert len(set(rest)) == len(rest)


def test_a_step_splits_the_next_positions_among_the_ranks_and_crosses_epochs():
    s = ElasticSampler(5, 2, shuffle=False)
    assert [s.indices(r, 2).tolist() for r in range(2)] == [[0, 1], [2, 3]]
    s.advance(2)
    assert [s.indices(r, 3).tolist() for r in range(3)] == [[4, 0], [1, 2], [3, 4]]  # into epoch 1
    s.advance(3)
    assert (s.cursor, s.epoch) == (10, 2)


def test_shuffled_orders_differ_by_epoch_and_seed_and_repeat_for_the_same_pair():
    def order(seed, epoch):
        s = ElasticSampler(50, 50, seed=seed)
        s.cursor = 50 * epoch
        return s.indices(0, 1).tolist()

    assert sorted(order(0, 0)) == list(range(50))
    assert order(0, 0) == order(0, 0) and order(0, 0) != order(0, 1) and order(0, 0) != order(1, 0)


def test_batches_prefetch_without_moving_the_cursor_and_feed_a_dataloader():
    s = ElasticSampler(20, 3, seed=7)
    want = [s.indices(1, 2, steps_ahead=k).tolist() for k in range(4)]
    data = torch.arange(100, 120)
    loader = torch.utils.data.DataLoader(data, batch_sampler=s.batches(1, 2))
    got = []
    for k, batch in enumerate(loader):
        got.append((batch - 100).tolist())
        if k == 3:
            break
    assert got == want and s.cursor == 0


def test_state_round_trips_and_a_foreign_state_is_refused_by_name():
    s = ElasticSampler(10, 2, seed=3)
    s.advance(4, steps=3)
    t = ElasticSampler(10, 2, seed=3)
    t.load_state_dict(s.state_dict())
    assert t.cursor == 24 and t.indices(0, 3).tolist() == s.indices(0, 3).tolist()
    for key, value in (("seed", 4), ("num_samples", 11), ("batch_size", 3), ("shuffle", False)):
        with pytest.raises(ValueError, match=f"{key}={value!r} was committed"):
            t.load_state_dict({**s.state_dict(), key: value})
    with pytest.raises(ValueError, match="lacks \\['cursor'\\]"):
        t.load_state_dict({k: v for k, v in s.state_dict().items() if k != "cursor"})
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="cursor="):
            t.load_state_dict({**s.state_dict(), "cursor": bad})
    assert t.cursor == 24  # a refused state changes nothing


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 1), "num_samples=0"),
        ((5, 0), "batch_size=0"),
        ((5, 1.5), "batch_size=1.5"),
        ((True, 1), "num_samples=True"),
    ],
)
def test_bad_construction_is_refused_by_name(args, match):
    with pytest.raises(ValueError, match=match):
        ElasticSampler(*args)


def test_bad_worlds_are_refused():
    s = ElasticSampler(5, 1)
    for rank, ws in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="world_size"):
            s.indices(rank, ws)
    with pytest.raises(ValueError, match="steps_ahead"):
        s.indices(0, 1, steps_ahead=-1)
    with pytest.raises(ValueError):
        s.advance(0)


def test_a_dataloader_reads_the_samples_the_sampler_names_and_is_rebuilt_after_a_resize():
    import itertools

    from torch.utils.data import DataLoader

    data = torch.arange(40) * 10
    s = ElasticSampler(40, 3, seed=1)
    loader = DataLoader(data, batch_sampler=s.batches(1, 2))
    for batch in itertools.islice(loader, 2):
        assert torch.equal(batch, data[s.indices(1, 2)])
        s.advance(2)
    loader = DataLoader(data, batch_sampler=s.batches(0, 3))  # a world of three from here
    assert torch.equal(next(iter(loader)), data[s.indices(0, 3)])
