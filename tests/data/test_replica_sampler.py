"""ReplicaBatchSampler alone: which samples each rank gets as groups come and go, with a stand-in
for the quorum (the real one is tests/fault/test_replicas.py's)."""

from __future__ import annotations

import pytest

from spikingsail.data.sampler import ReplicaBatchSampler, split_batch
from spikingsail.errors import SailError


class Job:
    """The engine's side: committed steps, the micro-step, and who takes part in the step."""

    def __init__(self, groups: int) -> None:
        self.steps, self.micro, self.groups, self.index = 0, 0, groups, 0

    def split(self, samples: int) -> tuple[list[int], int | None]:
        return split_batch(samples, [1.0] * self.groups), self.index

    def progress(self) -> tuple[int, int]:
        return self.steps, self.micro


def sampler(job: Job, length: int = 20, accumulation: int = 1) -> ReplicaBatchSampler:
    return ReplicaBatchSampler(length, micro_samples=4, accumulation=accumulation, split=job.split,
                               progress=job.progress, shuffle=False, seed=0)  # fmt: skip


def test_a_step_not_committed_is_served_again_with_the_same_samples() -> None:
    job = Job(groups=2)
    batches = iter(sampler(job))
    assert next(batches) == [0, 1]
    assert next(batches) == [0, 1]  # not committed: the same step
    job.steps = 1
    assert next(batches) == [4, 5]


def test_while_a_group_is_missing_the_others_take_its_share() -> None:
    job = Job(groups=2)
    job.index = 1
    batches = iter(sampler(job))
    assert next(batches) == [2, 3]
    job.groups, job.index = 1, 0  # group 0 died: this one takes the whole step
    assert next(batches) == [0, 1, 2, 3]


def test_an_epoch_is_whole_steps_padded_with_its_first_samples_and_ends_with_the_committed_steps() -> None:
    job = Job(groups=1)
    s = sampler(job, length=10)  # 10 samples, steps of 4: 3 steps, the last one padded
    seen = []
    for batch in s:
        seen += batch
        job.steps += 1
    assert seen == [*range(10), 0, 1]
    assert s.epoch() == 1


def test_accumulation_reads_the_micro_step() -> None:
    job = Job(groups=1)
    batches = iter(sampler(job, accumulation=2))
    assert next(batches) == [0, 1, 2, 3]
    job.micro = 1
    assert next(batches) == [4, 5, 6, 7]


def test_a_group_that_heals_more_than_an_epoch_ahead_stops_for_a_restart() -> None:
    job = Job(groups=1)
    batches = iter(sampler(job))
    next(batches)
    job.steps = 2 * 5  # healed to the start of epoch 2 (5 steps per epoch)
    with pytest.raises(SailError, match="healed from epoch 0 to epoch 2"):
        next(batches)


def test_its_position_is_a_plain_loaders_so_a_resume_without_groups_continues_there() -> None:
    """The position a checkpoint keeps is the samples of the epoch's global order taken so far, as
    a ShardedLoader counts them: a run without replica groups resumes at the same sample."""
    job = Job(groups=2)
    replicas = sampler(job, length=40, accumulation=2)  # 8 samples a step, 5 steps an epoch
    job.steps, job.micro = 7, 1  # epoch 1, its step 2, the second micro-batch
    assert (replicas.epoch(), replicas.position()) == (1, 2 * 8 + 4)
    assert next(iter(replicas)) == [20, 21]  # where the plain loader's order continues: sample 20
