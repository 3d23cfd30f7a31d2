"""The training loader reads an epoch in optimizer steps: an epoch that is not a whole number of
steps ends with a short step of the same samples, weighted alike, however the step is split over
processes, micro-batches and accumulation."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from spikingsail.data.loader import ShardedLoader
from spikingsail.data.sampler import ResumableShardSampler
from spikingsail.engine.balance import loss_weight
from spikingsail.errors import ConfigError

BATCH = 16  # train_batch_size
SPLITS = [(1, 16, 1), (2, 8, 1), (1, 8, 2), (2, 4, 2), (4, 2, 2), (2, 2, 4), (1, 2, 8), (8, 1, 2), (16, 1, 1)]
"""(processes, micro-batch per process, accumulation), each 16 samples per optimizer step."""


def data(length: int) -> TensorDataset:
    return TensorDataset(torch.arange(length))


def ranks(length: int, world: int, micro: int, accumulation: int, **kwargs: object) -> list[ShardedLoader]:
    return [
        ShardedLoader(data(length), batch_size=micro, rank=r, world_size=world, seed=2,
                      accumulation=accumulation, **kwargs)  # type: ignore[arg-type]
        for r in range(world)
    ]  # fmt: skip


def steps(loaders: list[ShardedLoader], accumulation: int) -> list[tuple[list[int], float]]:
    """Every optimizer step of one epoch: its sample ids (sorted) and the mean the backends make of
    the ranks' weighted mean losses when a sample's loss is its id (the average over ranks and
    micro-steps of weight × mean)."""
    world = len(loaders)
    out: list[tuple[list[int], float]] = []
    ids: list[int] = []
    total = 0.0
    for micro_step, batch in enumerate(zip(*loaders, strict=True), start=1):
        for loader, (indices,) in zip(loaders, batch, strict=True):
            own, step = loader.share if loader.share is not None else (len(indices), BATCH)
            ids += indices.tolist()
            weight = loss_weight(own, step, world, accumulation)
            total += weight * indices.double().mean().item() / (world * accumulation)
        if micro_step % accumulation == 0:
            out.append((sorted(ids), total))
            ids, total = [], 0.0
    assert not ids, "an epoch ends on a step's last micro-batch"
    return out


@pytest.mark.parametrize("length", [200, 201, 215, 223])
def test_every_step_holds_the_same_samples_and_mean_on_every_split(length: int) -> None:
    reference = steps(ranks(length, 1, 16, 1), 1)
    assert [len(ids) for ids, _ in reference] == [16] * (length // 16) + [length % 16]
    for world, micro, accumulation in SPLITS:
        if length % 16 < world * accumulation:
            continue  # refused (below)
        got = steps(ranks(length, world, micro, accumulation), accumulation)
        assert [ids for ids, _ in got] == [ids for ids, _ in reference], (world, micro, accumulation)
        for (ids, mean), (_, expected) in zip(got, reference, strict=True):
            assert mean == pytest.approx(sum(ids) / len(ids), rel=1e-12)
            assert mean == pytest.approx(expected, rel=1e-12)


def test_unequal_shares_split_the_short_step_in_the_same_blocks() -> None:
    reference = steps(ranks(200, 1, 16, 1), 1)
    balanced = ranks(200, 2, 4, 2, shares=lambda: [6, 2])
    got = steps(balanced, 2)
    assert [ids for ids, _ in got] == [ids for ids, _ in reference]
    for (ids, mean), _ in zip(got, reference, strict=True):
        assert mean == pytest.approx(sum(ids) / len(ids), rel=1e-12)
    # the short step of 8 in two blocks of 4, each split 3:1
    sizes = [[len(b) for (b,) in loader] for loader in ranks(200, 2, 4, 2, shares=lambda: [6, 2])]
    assert [s[-2:] for s in sizes] == [[3, 3], [1, 1]]


def test_an_epoch_of_whole_steps_keeps_the_plain_sampler_and_weighs_nothing() -> None:
    for loader in ranks(192, 2, 4, 2):
        assert isinstance(loader.sampler, ResumableShardSampler)
        assert not loader.weighs_losses
        assert all(len(b) == 4 for (b,) in loader) and loader.share is None
    assert all(loader.weighs_losses for loader in ranks(200, 2, 4, 2))


def test_drop_last_drops_the_short_step_on_every_split() -> None:
    reference = [ids for ids, _ in steps(ranks(203, 1, 16, 1, drop_last=True), 1)]
    assert len(reference) == 12
    for world, micro, accumulation in SPLITS:
        loaders = ranks(203, world, micro, accumulation, drop_last=True)
        assert [len(loader) for loader in loaders] == [12 * accumulation] * world
        assert [ids for ids, _ in steps(loaders, accumulation)] == reference


def test_resume_inside_the_short_step_continues_with_its_next_micro_batch() -> None:
    full = [[b.tolist() for (b,) in loader] for loader in ranks(200, 2, 4, 2)]
    resumed = ranks(200, 2, 4, 2)
    for loader in resumed:  # after 12 whole steps and one micro-batch (4 samples) of the short step
        loader.load_state_dict({"epoch": 0, "position": 196})
    assert [[b.tolist() for (b,) in loader] for loader in resumed] == [batches[-1:] for batches in full]


def test_a_position_inside_a_short_micro_batch_of_this_split_is_refused() -> None:
    (loader,) = ranks(200, 1, 2, 8)  # the short step of 8 in blocks of 1
    loader.load_state_dict({"epoch": 0, "position": 196})
    assert len(list(loader)) == 4
    (loader,) = ranks(200, 1, 8, 2)  # in blocks of 4: 197 falls inside the first
    loader.load_state_dict({"epoch": 0, "position": 197})
    with pytest.raises(ConfigError, match="falls inside a micro-batch of the epoch's short step"):
        list(loader)


@pytest.mark.parametrize(("length", "world", "accumulation"), [(196, 2, 4), (193, 2, 1), (199, 1, 8)])
def test_a_short_step_with_fewer_samples_than_micro_batches_is_refused(
    length: int, world: int, accumulation: int
) -> None:
    with pytest.raises(ConfigError) as refused:
        ranks(length, world, BATCH // world // accumulation, accumulation)
    assert f"has {length % 16} sample(s) ({length} samples, 16 per step)" in str(refused.value)
    assert "drop_last=True" in refused.value.fix
    ranks(length, world, BATCH // world // accumulation, accumulation, drop_last=True)  # accepted
