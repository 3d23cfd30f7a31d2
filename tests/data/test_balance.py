"""Unequal per-rank micro-batches: each global micro-batch holds the samples one process would
take, whatever the split, and the position in the epoch carries over to another split."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from spikingsail.data.loader import ShardedLoader
from spikingsail.data.sampler import split_batch
from spikingsail.errors import ConfigError

DATA = TensorDataset(torch.arange(48))


@pytest.mark.parametrize(
    ("total", "weights", "shares"),
    [
        (8, [3, 1], [6, 2]),
        (8, [1, 1], [4, 4]),
        (10, [1, 1, 1], [4, 3, 3]),  # the leftover sample goes to the lowest rank of equal remainders
        (5, [100, 1], [4, 1]),  # at least one sample each
        (4, [1, 1, 1, 1], [1, 1, 1, 1]),
        (7, [2.5, 1.0, 0.5], [4, 2, 1]),
        (12, [0.2, 0.3, 0.5], [2, 4, 6]),
    ],
)
def test_split_is_proportional_sums_to_the_total_and_gives_everyone_one(
    total: int, weights: list[float], shares: list[int]
) -> None:
    assert split_batch(total, weights) == shares


@pytest.mark.parametrize(
    ("total", "weights", "message"),
    [
        (1, [1, 1], "cannot split 1 sample(s) over 2 rank(s)"),
        (4, [], "over 0 rank(s)"),
        (4, [1, 0], "finite and positive"),
        (4, [1, -2], "finite and positive"),
        (4, [1, float("nan")], "finite and positive"),
    ],
)
def test_impossible_splits_are_refused(total: int, weights: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        split_batch(total, weights)


def loaders(shares: list[int], **kwargs: object) -> list[ShardedLoader]:
    return [
        ShardedLoader(
            DATA, batch_size=1, rank=r, world_size=len(shares), seed=3, shares=lambda: shares, **kwargs
        )
        for r in range(len(shares))
    ]


def one_process(micro: int, **kwargs: object) -> list[list[int]]:
    (single,) = loaders([micro], **kwargs)
    return [batch.tolist() for (batch,) in single]


def test_every_global_micro_batch_holds_one_process_samples_whatever_the_split() -> None:
    reference = one_process(8)
    for shares in ([4, 4], [6, 2], [1, 7], [3, 3, 2]):
        ranks = loaders(shares)
        batches = [[batch.tolist() for (batch,) in loader] for loader in ranks]
        assert [len(b) for b in batches] == [len(reference)] * len(shares)
        for step, expected in enumerate(reference):
            got = [i for rank in batches for i in rank[step]]
            assert got == expected, (shares, step)
            assert [len(rank[step]) for rank in batches] == shares
        assert [loader.share for loader in ranks] == [(n, 8) for n in shares]
        assert all(loader.position == 48 or loader.epoch == 1 for loader in ranks)


def test_the_same_samples_as_equal_micro_batches_of_the_plain_loader() -> None:
    plain = [ShardedLoader(DATA, batch_size=4, rank=r, world_size=2, seed=3) for r in range(2)]
    steps = zip(*([batch.tolist() for (batch,) in loader] for loader in plain), strict=True)
    assert [sorted(a + b) for a, b in steps] == [sorted(b) for b in one_process(8)]


def test_a_new_split_takes_effect_at_the_next_global_micro_batch_on_every_rank() -> None:
    current = [4, 4]
    ranks = [
        ShardedLoader(DATA, batch_size=1, rank=r, world_size=2, seed=3, shares=lambda: current)
        for r in range(2)
    ]
    reference = one_process(8)
    iterators = [iter(loader) for loader in ranks]
    seen = []
    for step in range(len(reference)):
        if step == 2:
            current = [7, 1]
        batches = [next(it)[0].tolist() for it in iterators]
        seen.append([len(b) for b in batches])
        assert batches[0] + batches[1] == reference[step]
    assert seen == [[4, 4], [4, 4]] + [[7, 1]] * (len(reference) - 2)


def test_a_short_last_block_is_split_alike_or_dropped() -> None:
    data = TensorDataset(torch.arange(22))
    ranks = [
        ShardedLoader(data, batch_size=1, rank=r, world_size=2, seed=1, shares=lambda: [6, 2])
        for r in range(2)
    ]
    sizes = [[len(b) for (b,) in loader] for loader in ranks]
    assert sizes == [[6, 6, 5], [2, 2, 1]]  # 22 = 8 + 8 + 6, the last 6 split 3:1 as 5 and 1
    assert [len(loader) for loader in ranks] == [3, 3]
    dropping = [
        ShardedLoader(data, batch_size=1, rank=r, world_size=2, seed=1, shares=lambda: [6, 2], drop_last=True)
        for r in range(2)
    ]
    assert [[len(b) for (b,) in loader] for loader in dropping] == [[6, 6], [2, 2]]
    assert [len(loader) for loader in dropping] == [2, 2]
    # 22 samples in blocks of 7: 21, then one sample cannot go to two ranks: refused, unless dropped
    with pytest.raises(ConfigError, match="has 1 sample"):
        ShardedLoader(data, batch_size=1, rank=0, world_size=2, seed=1, shares=lambda: [5, 2])
    sevens = [
        ShardedLoader(data, batch_size=1, rank=r, world_size=2, seed=1, shares=lambda: [5, 2], drop_last=True)
        for r in range(2)
    ]
    assert [[len(b) for (b,) in loader] for loader in sevens] == [[5, 5, 5], [2, 2, 2]]
    assert [len(loader) for loader in sevens] == [3, 3]


def test_resume_continues_the_global_order_with_another_split_and_world_size() -> None:
    reference = [i for batch in one_process(8) for i in batch]
    first = loaders([6, 2])
    iterators = [iter(loader) for loader in first]
    taken = []
    for _ in range(3):
        taken += [i for it in iterators for i in next(it)[0].tolist()]
    state = first[0].state_dict()
    assert state == first[1].state_dict() == {"epoch": 0, "position": 24}
    after = loaders([1, 5, 2])
    for loader in after:
        loader.load_state_dict(state)
    rest = [i for step in zip(*after, strict=True) for (batch,) in step for i in batch.tolist()]
    assert taken + rest == reference


def test_prefetching_workers_keep_each_batch_with_its_share() -> None:
    current = [3, 5]
    ranks = [
        ShardedLoader(DATA, batch_size=1, rank=r, world_size=2, seed=3, shares=lambda: current, num_workers=2)
        for r in range(2)
    ]
    for loader in ranks:
        for step, (batch,) in enumerate(loader):
            if step == 1:
                current = [5, 3]  # batches already prefetched keep the split they were cut with
            assert loader.share == (len(batch), 8)
