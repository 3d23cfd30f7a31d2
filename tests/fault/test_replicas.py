"""Replica groups under ``sail launch --ft-replicas``: real torchft lighthouse, real torchrun agents,
real SIGKILL / SIGSTOP; every run is compared with one process training on the whole global batch."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.fault.replicas import (
    EPOCHS,
    SAMPLES,
    STEPS_PER_EPOCH,
    WORKER,
    assert_every_sample_once_per_epoch,
    assert_groups_agree_after_every_step,
    assert_same,
    assert_trained_as_one_process,
    committed_samples,
    ended_on_failure,
    engine_quorums_match_the_script,
    finals,
    finish,
    group_entries,
    launch,
    ledger,
    process_state,
    reference,
    standalone_lighthouse,
    taken_before_dying,
    took,
    wait_for_worker,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.alone]


@pytest.mark.parametrize("kill_in", ["allreduce", "commit", "between"])
def test_a_killed_group_heals_from_the_other_and_the_run_equals_the_fault_free_one(
    tmp_path: Path, kill_in: str
) -> None:
    out = tmp_path / "run"
    # min_replicas 2: the survivor waits for the killed group's restart instead of racing it to the end
    launch(out, "--kill-group", "1", "--kill-step", "10", "--kill-in", kill_in, "--min-replicas", "2")
    output = (out / "output.txt").read_text()
    assert (out / "killed-1").exists()
    assert len(list(out.glob("ledger-1-*.jsonl"))) == 2  # the killed process and its replacement
    assert "replica group 1 in the job at step" in output  # healed from group 0, not from step 0
    if kill_in == "allreduce":
        assert "not committed by the replica groups" in output  # the survivor took the step again
    if kill_in == "commit":  # the survivor committed the step (the engine's 11) with the dead group's
        assert "step 11 not committed" not in output  # gradients, and their samples count (taking lines)
        assert any(e["taking"] == 10 for e in taken_before_dying(out)), (
            "group 1 died before step 10's exchange"
        )
    assert_trained_as_one_process(out, tmp_path)
    assert all((out / f"steps-{g}").read_text().split()[0] == str(EPOCHS * STEPS_PER_EPOCH) for g in (0, 1))


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_groups_of_two_ranks_each_weight_their_shares_and_heal(tmp_path: Path, backend: str) -> None:
    # fsdp: each group shards the model over its two ranks, and rank r of the healing group takes
    # rank r's shards (parameters and Adam's state) from the live group, as HSDP replicates them
    out = tmp_path / "run"
    # min_replicas 2: the survivor waits for the killed group's restart instead of racing it (a group
    # restarting after the others finished, with no checkpoint, would train alone from step 0)
    launch(out, "--kill-group", "0", "--kill-step", "2", "--step-sleep", "0.6", "--backend", backend,
           "--min-replicas", "2", nproc=2)  # fmt: skip
    assert [(out / f"sharded-{g}").exists() for g in (0, 1)] == [backend == "fsdp"] * 2
    assert "replica group 0 in the job at step" in (out / "output.txt").read_text()
    assert_trained_as_one_process(out, tmp_path, ranks=4, per_epoch=SAMPLES // 16)


def test_a_heal_that_fails_on_one_rank_of_a_group_restarts_the_group(tmp_path: Path) -> None:
    """torchft heals rank by rank; when rank 1's transfer fails and rank 0's does not, the group's
    ranks would hold different states (torchft does not heal them again): the group restarts and
    heals whole. min_replicas 2: neither group steps without the other, so the first heal is the killed
    group's (a group that started late on a loaded machine would heal first, or the other group finish
    alone before it came back and it train again from step 0)."""
    out = tmp_path / "run"
    launch(
        out, "--kill-group", "1", "--kill-step", "3", "--fail-heal-rank", "1", "--step-sleep", "0.6",
        "--min-replicas", "2", nproc=2,
    )  # fmt: skip
    output = (out / "output.txt").read_text()
    assert (out / "heal-failed-1").exists()
    assert "replica group 1, rank 1: torchft's quorum or heal failed" in output
    assert "ConnectionResetError" in output
    assert_trained_as_one_process(out, tmp_path, ranks=4, per_epoch=SAMPLES // 16)


def test_groups_at_the_same_step_with_different_states_take_the_first_groups(tmp_path: Path) -> None:
    """torchft heals only a group behind the others. Two groups resumed at the same step, one of them
    one float32 step off in one weight: they must not train apart; the step is taken again after the
    second heals from the first, and the run ends as the fault-free one."""
    first_run, checkpoints = tmp_path / "first", tmp_path / "ckpt"
    launch(first_run, "--checkpoints", str(checkpoints), epochs=2)
    out = tmp_path / "run"
    # min_replicas 2: no group steps alone before the other has joined
    launch(out, "--checkpoints", str(checkpoints), "--resume", "--perturb-group", "1", "--min-replicas", "2")
    first, second = finals(out)
    assert_same(first, second, exact=True)
    assert_same(first, reference(tmp_path))
    output = (out / "output.txt").read_text()
    assert "replica groups at step 24 hold different states (1 of 2 differ from the first group's)" in output
    assert "not committed by the replica groups" in output
    assert_groups_agree_after_every_step(out)
    assert sorted(committed_samples(out)) == list(range(24, EPOCHS * STEPS_PER_EPOCH))


def test_a_stopped_group_is_left_out_and_heals_from_a_group_restarted_meanwhile(tmp_path: Path) -> None:
    """Group 0 is stopped (SIGSTOP) and group 1 killed while it is: group 1 starts again from the last
    checkpoint and trains on alone (min_replicas 1), taking again steps group 0 had taken with it.
    Group 0, continued, is behind and heals from group 1. The engine's ledger follows the final state
    through group 1's resume and group 0's heal: every sample once per epoch (group 0's steps after
    the checkpoint were set aside). The groups end bit-identical, equal to one process."""
    out, checkpoints = tmp_path / "run", tmp_path / "ckpt"
    # group 0 stops itself at step 9, past the checkpoint at step 6; group 1 is killed at once (it
    # waits out the 3 s timeout in its all-reduce before it could step alone)
    job = launch(out, "--checkpoints", str(checkpoints), "--resume", "--stop-group", "0", "--stop-step", "9",
                 wait=False)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (out / "stopped-0").exists() and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.05)
    stopped = int((out / "stopped-0").read_text())
    while process_state(stopped) != "T" and time.monotonic() < deadline:
        time.sleep(0.05)
    with ended_on_failure(job, stopped):
        killed = wait_for_worker(out, group=1)
        os.kill(killed, signal.SIGKILL)
        # continue group 0 once the restarted group 1 is past it alone (so group 0 is behind and
        # heals from it), however long the restart takes on a loaded machine
        last = max(entry["step"] for entry in group_entries(out, 0))
        while (
            time.monotonic() < deadline
            and job.poll() is None
            and not any(entry["step"] > last + 1 for entry in group_entries(out, 1, besides=killed))
        ):
            time.sleep(0.5)
    os.kill(stopped, signal.SIGCONT)
    finish(job)
    restarted = [entry for entry in group_entries(out, 1, besides=killed) if entry["step"] <= last]
    assert restarted, f"the restarted group 1 took none of steps up to {last} again"
    # the engine wrote group 0's heal from group 1's new attempt (and any from before, when one
    # group started ahead of the other)
    heals = [json.loads(line)["from"] for path in (out / "ledger").glob("*-g0-r0.jsonl")
             for line in path.read_text().splitlines() if '"from"' in line]  # fmt: skip
    headers = [
        json.loads(path.read_text().partition("\n")[0]) for path in (out / "ledger").glob("*-g1-r0.jsonl")
    ]
    again = [header["attempt"] for header in headers if header["pid"] != killed]
    assert heals and heals[-1]["group"] == 1 and heals[-1]["attempt"] in again, (heals, headers)
    digests: dict[tuple[int, int], set[float]] = collections.defaultdict(set)
    for entry in ledger(out):  # the processes that took a step together held the same parameters
        digests[entry["step"], took(entry)].add(entry["digest"])
    assert {key: d for key, d in digests.items() if len(d) > 1} == {}
    named, alone = engine_quorums_match_the_script(out)
    assert named and alone, (named, alone)  # group 1 trained alone, and both groups together
    first, second = finals(out)
    assert_same(first, second, exact=True)
    assert_same(first, reference(tmp_path))
    assert_every_sample_once_per_epoch(out)


def test_a_groups_killed_agent_is_started_again_and_its_orphaned_worker_ends(tmp_path: Path) -> None:
    """SIGKILL leaves a torchrun agent's workers running; group 1's worker ends itself, and sail
    launch starts the group again, which heals from group 0."""
    out = tmp_path / "run"
    job = launch(out, "--step-sleep", "0.8", wait=False)
    worker = wait_for_worker(out, 1)
    agent = int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(agent, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:  # not reaped: a zombie
        if process_state(worker) == "Z":
            break
        time.sleep(0.1)
    else:
        assert not Path(f"/proc/{worker}").exists(), "the worker outlived its agent by 10 s"
    output = finish(job)
    assert "a group that fails is started again up to 3 time(s) (--max-restarts)" in output
    assert "replica group 1 ended with status -9" in output and "starting it again" in output
    assert "replica group 1 in the job at step" in output
    assert len(list(out.glob("ledger-1-*.jsonl"))) == 2
    assert_trained_as_one_process(out, tmp_path)


def test_a_group_alone_continues_from_the_furthest_checkpoint_of_any_group(tmp_path: Path) -> None:
    """A group that starts when no other is alive (its peer finished or died) resumes the newest
    checkpoint any group wrote, not step 0, and trains on with the whole global batch."""
    first_run, checkpoints = tmp_path / "first", tmp_path / "ckpt"
    launch(first_run, "--checkpoints", str(checkpoints), epochs=2)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["replica-0", "replica-1"]
    # group 1's own directory is lost: it must take group 0's
    for path in sorted((checkpoints / "replica-1").rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    out = tmp_path / "alone"
    out.mkdir()
    lighthouse, address = standalone_lighthouse()
    try:
        env = {
            **os.environ,
            "REPLICA_GROUP_ID": "1",
            "NUM_REPLICA_GROUPS": "2",
            "TORCHFT_LIGHTHOUSE": address,
            "SAIL_REPLICA_SECRET": "ab" * 32,
        }
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(WORKER),
             str(out), str(EPOCHS), "--checkpoints", str(checkpoints), "--resume"],
            env=env, capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
    finally:
        lighthouse.kill()
        lighthouse.wait()
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"resumed from {checkpoints / 'replica-0'}" in done.stderr
    assert "at step 24" in done.stderr
    steps = committed_samples(out)
    assert sorted(steps) == list(range(24, EPOCHS * STEPS_PER_EPOCH))  # only the last epoch, alone
    assert_same(torch.load(out / "final-1.pt"), reference(tmp_path))


def test_a_group_saves_under_its_own_directory_and_a_load_finds_the_furthest(tmp_path: Path) -> None:
    from spikingsail.checkpoint.replica_dirs import checkpoints_to_load, own_group_checkpoints
    from spikingsail.checkpoint.store import CheckpointStore

    assert own_group_checkpoints(tmp_path, 1) == tmp_path / "replica-1"
    assert own_group_checkpoints(tmp_path / "replica-1", 1) == tmp_path / "replica-1"
    assert own_group_checkpoints(tmp_path / "replica-0", 1) == tmp_path / "replica-1"  # never another's
    assert checkpoints_to_load(tmp_path) == tmp_path  # nothing anywhere: the path itself
    first_run = tmp_path / "run"
    launch(first_run, "--checkpoints", str(tmp_path / "ck"), epochs=1)
    # a resume from the job's root (with or without replica groups) reads a group's directory
    chosen = checkpoints_to_load(tmp_path / "ck")
    assert chosen.parent == tmp_path / "ck" and chosen.name in ("replica-0", "replica-1")
    assert CheckpointStore(chosen).metadata(CheckpointStore(chosen).latest() or "")["global_steps"] == 12
    assert (
        checkpoints_to_load(tmp_path / "ck", tag="global_step6") == tmp_path / "ck"
    )  # a named tag: as asked


def test_one_process_without_groups_resumes_their_checkpoints_at_the_same_sample(tmp_path: Path) -> None:
    """Replica groups train 2 epochs and save; one process without them resumes from the job's
    checkpoint root and trains the third: as if the whole run had been one process."""
    checkpoints = tmp_path / "ck"
    launch(tmp_path / "groups", "--checkpoints", str(checkpoints), epochs=2)
    out = tmp_path / "alone"
    out.mkdir()
    done = subprocess.run([sys.executable, str(WORKER), str(out), str(EPOCHS), "--reference", "2",
                           "--checkpoints", str(checkpoints), "--resume"],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "at step 24" in done.stderr and "replica-" in done.stderr
    assert sorted(committed_samples(out)) == list(range(24, EPOCHS * STEPS_PER_EPOCH))
    assert_same(torch.load(out / "final-0.pt"), reference(tmp_path))
