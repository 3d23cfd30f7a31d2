"""ReplicaBatchSampler alone: which samples each rank gets as groups come and go, with a stand-in
for the quorum (the real one is tests/fault/test_replicas.py's)."""

from __future__ import annotations

import pytest

from spikingsail.data.sampler import ReplicaBatchSampler, split_batch
from spikingsail.errors import ConfigError, SailError


class Job:
    """The engine's side: committed steps, the micro-step, and who takes part in the step."""

    def __init__(self, groups: int) -> None:
        self.steps, self.micro, self.groups, self.index = 0, 0, groups, 0

    def split(self, samples: int) -> tuple[list[int], int | None]:
        return split_batch(samples, [1.0] * self.groups), self.index

    def progress(self) -> tuple[int, int]:
        return self.steps, self.micro


def sampler(
    job: Job, length: int = 20, accumulation: int = 1, drop_last: bool = False
) -> ReplicaBatchSampler:
    return ReplicaBatchSampler(length, micro_samples=4, accumulation=accumulation, ranks=job.groups, split=job.split,
                               progress=job.progress, shuffle=False, seed=0, drop_last=drop_last)  # fmt: skip


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


def test_an_epoch_ends_with_a_short_step_of_its_last_samples_and_with_the_committed_steps() -> None:
    job = Job(groups=1)
    s = sampler(job, length=10)  # 10 samples, steps of 4: 3 steps, the last one of 2 samples
    seen, shares = [], []
    for batch in s:
        seen.append(batch)
        shares.append(s.share)
        job.steps += 1
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert shares == [(4, 4), (4, 4), (2, 2)]
    assert s.epoch() == 1
    job.steps = 0
    dropping = sampler(job, length=10, drop_last=True)
    assert len(dropping) == 2 and dropping.steps_per_epoch == 2


def test_the_short_step_is_split_over_its_micro_steps_and_the_groups() -> None:
    job = Job(groups=2)
    s = sampler(job, length=22, accumulation=2)  # steps of 8: two, then 6 samples in blocks of 3
    job.steps = 2
    batches = iter(s)
    assert (next(batches), s.share) == ([16, 17], (2, 6))
    job.micro = 1
    assert (next(batches), s.share) == ([19, 20], (2, 6))
    job.index = 1
    assert (next(batches), s.share) == ([21], (1, 6))
    assert s.position() == 19
    with pytest.raises(ConfigError, match="has 1 sample"):
        sampler(job, length=17, accumulation=2)  # 1 sample for 2 micro-steps of 2 groups


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
