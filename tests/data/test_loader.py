"""Per-rank shards: disjoint, complete, reshuffled every epoch identically on every rank."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from spikingsail.data.digits import load_digits_split
from spikingsail.data.loader import ShardedLoader

DATA = TensorDataset(torch.arange(20))


def epoch_indices(loader: ShardedLoader) -> list[int]:
    return [int(i) for (batch,) in loader for i in batch]


def test_shards_are_disjoint_and_cover_the_data_and_reshuffle() -> None:
    loaders = [ShardedLoader(DATA, batch_size=3, rank=r, world_size=2, seed=5) for r in range(2)]
    first = [epoch_indices(loader) for loader in loaders]
    second = [epoch_indices(loader) for loader in loaders]
    assert sorted(first[0] + first[1]) == list(range(20))
    assert not set(first[0]) & set(first[1])
    assert first[0] != second[0], "the epoch must advance without set_epoch"
    assert sorted(second[0] + second[1]) == list(range(20))
    assert loaders[0].epoch == 2


def test_unpadded_shards_count_every_sample_once() -> None:
    data = TensorDataset(torch.arange(7))
    shards = [
        epoch_indices(ShardedLoader(data, batch_size=2, rank=r, world_size=3, pad=False)) for r in range(3)
    ]
    assert sorted(i for shard in shards for i in shard) == list(range(7))


def test_padded_shards_repeat_to_even_out() -> None:
    data = TensorDataset(torch.arange(7))
    shards = [epoch_indices(ShardedLoader(data, batch_size=2, rank=r, world_size=3)) for r in range(3)]
    assert [len(s) for s in shards] == [3, 3, 3]


def test_digits_are_the_real_bundled_images() -> None:
    train, test = load_digits_split()
    assert len(train) + len(test) == 1797
    image, label = train[0]
    assert image.shape == (1, 8, 8) and float(image.min()) >= 0.0 and float(image.max()) <= 1.0
    assert 0 <= int(label) <= 9
