"""Per-rank shards: disjoint, complete, reshuffled every epoch identically on every rank."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy
import torch
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.data.digits import digits_arrays, load_digits_split
from spikingsail.data.loader import ShardedLoader
from spikingsail.environments import RankInfo

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


def test_digits_read_without_scikit_learn_are_what_its_load_digits_gives(tmp_path: Path) -> None:
    """Read from scikit-learn's file directly, and through ``load_digits()`` where that file is not
    found (a scikit-learn that moved it): the same images, labels and dtypes either way."""
    from sklearn.datasets import load_digits

    theirs = load_digits()
    for locations in (None, [str(tmp_path)]):
        images, target = digits_arrays(locations)
        assert images.dtype == theirs.images.dtype and target.dtype == theirs.target.dtype
        assert numpy.array_equal(images, theirs.images) and numpy.array_equal(target, theirs.target)


def test_the_digits_load_without_importing_scikit_learn() -> None:
    """What each rank of the main job pays for its data: no scikit-learn, and so no SciPy."""
    probe = (
        "import sys; from spikingsail.data.digits import digits_arrays, load_digits_split; "
        "train, test = load_digits_split(); assert len(train) + len(test) == 1797; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_global_order_matches_torch_distributed_sampler() -> None:
    from torch.utils.data import DistributedSampler

    from spikingsail.data.sampler import ResumableShardSampler

    for length, world, drop_last in [(20, 3, False), (20, 3, True), (7, 4, False), (16, 2, False)]:
        for rank in range(world):
            ours = ResumableShardSampler(length, rank=rank, world_size=world, seed=9, drop_last=drop_last)
            theirs = DistributedSampler(
                range(length), num_replicas=world, rank=rank, seed=9, drop_last=drop_last
            )
            ours.set_epoch(2)
            theirs.set_epoch(2)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


def test_resuming_mid_epoch_continues_with_the_next_batch() -> None:
    full = [epoch_indices(ShardedLoader(DATA, batch_size=3, rank=r, world_size=2, seed=5)) for r in range(2)]
    resumed = []
    for rank in range(2):
        first = ShardedLoader(DATA, batch_size=3, rank=rank, world_size=2, seed=5)
        taken = []
        for (batch,) in first:
            taken += [int(i) for i in batch]
            if len(taken) == 6:
                break
        state = first.state_dict()
        assert state == {"epoch": 0, "position": 12}
        second = ShardedLoader(DATA, batch_size=3, rank=rank, world_size=2, seed=5)
        second.load_state_dict(state)
        resumed.append(taken + epoch_indices(second))
    assert resumed == full


def test_the_global_order_carries_over_to_another_world_size() -> None:
    """Two ranks × 2 samples and one rank × 4 samples see the same samples at every step."""
    two = [ShardedLoader(DATA, batch_size=2, rank=r, world_size=2, seed=1, drop_last=True) for r in range(2)]
    steps_two = [sorted(int(i) for (b,) in pair for i in b) for pair in zip(*two, strict=True)]
    one = ShardedLoader(DATA, batch_size=4, rank=0, world_size=1, seed=1, drop_last=True)
    one.load_state_dict({"epoch": 0, "position": 8})  # resume after two steps of the 2-rank run
    steps_one = [sorted(int(i) for i in b) for (b,) in one]
    assert steps_one == steps_two[2:]


def test_a_pass_left_with_break_is_followed_by_the_next_epoch_with_a_new_shuffle() -> None:
    loader = ShardedLoader(DATA, batch_size=3, rank=0, world_size=1, seed=5)
    reference = ShardedLoader(DATA, batch_size=3, rank=0, world_size=1, seed=5)
    epochs = [epoch_indices(reference) for _ in range(4)]
    for taken, _batch in enumerate(loader):
        if taken == 2:
            break
    # a checkpoint saved now continues the epoch that was left (as torchdata's StatefulDataLoader)
    assert loader.state_dict() == {"epoch": 0, "position": 9}
    assert epoch_indices(loader) == epochs[1], "the next pass must be the next epoch, from its start"
    assert loader.state_dict() == {"epoch": 2, "position": 0}
    held = iter(loader)  # a pass whose iterator stays alive, unfinished, while a new one starts
    next(held)
    assert epoch_indices(loader) == epochs[3]
    assert loader.state_dict() == {"epoch": 4, "position": 0}
    assert list(held) == []  # the abandoned pass yields nothing more and changes nothing
    assert loader.state_dict() == {"epoch": 4, "position": 0}


def test_set_epoch_of_the_epoch_under_way_keeps_its_position() -> None:
    # a torchrun loop kept after porting: `for epoch in range(loader.epoch, E): loader.set_epoch(epoch)`
    full = epoch_indices(ShardedLoader(DATA, batch_size=3, rank=0, world_size=1, seed=5))
    resumed = ShardedLoader(DATA, batch_size=3, rank=0, world_size=1, seed=5)
    resumed.load_state_dict({"epoch": 0, "position": 6})
    resumed.set_epoch(resumed.epoch)
    assert epoch_indices(resumed) == full[6:], "set_epoch of the current epoch must not go back to its start"
    resumed.set_epoch(0)  # another epoch than the one it is in (1 now): from that epoch's start
    assert epoch_indices(resumed) == full


def test_asking_the_engine_for_the_same_loader_every_epoch_reshuffles() -> None:
    engine, _ = spikingsail.initialize(
        model=torch.nn.Linear(1, 1),
        rank_info=RankInfo.single(),
        config={"train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "sail": {"seed": 5, "progress_bar": False}},
    )  # fmt: skip
    per_epoch = [[int(i) for (b,) in engine.dataloader(DATA, shuffle=True) for i in b] for _ in range(3)]
    one = engine.dataloader(DATA, shuffle=True)
    assert one is engine.dataloader(DATA, shuffle=True)
    assert engine.dataloader(DATA, shuffle=False) is not one  # other arguments: another loader
    reference = ShardedLoader(DATA, batch_size=3, rank=0, world_size=1, seed=5)
    assert per_epoch == [epoch_indices(reference) for _ in range(3)]
    assert per_epoch[0] != per_epoch[1] != per_epoch[2]
    assert len(engine.loaders.loaders) == 2  # and a checkpoint holds one position per loader
    engine.close()
