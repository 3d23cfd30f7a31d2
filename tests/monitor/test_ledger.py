"""The sample ledger (``sail.ledger``) and its check (``sail report --ledger``): real runs on real gloo
process groups, a resume on another world size with steps taken again, and damaged or contradictory
ledgers, each found and named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

import spikingsail
from spikingsail.monitor import ledger_check
from spikingsail.monitor.report import ReportError
from tests.multiprocess import run_ranks

SAMPLES, EPOCHS = 44, 3  # 8 per step: 5 whole steps and a short one of 4 per epoch
SAIL = [sys.executable, "-m", "spikingsail.cli.main", "report", "--ledger"]


def train(
    out: str, checkpoints: str, micro: int, resume: bool, stop_after: int | None, workers: int = 0
) -> dict[int, list[int]]:
    """Train EPOCHS epochs (or until ``stop_after`` steps: the run dies there, its last checkpoint at
    a multiple of 4 steps); return the sample ids of every step this process took, from its batches.
    ``workers``: DataLoader workers, which take batches ahead of the step."""
    torch.manual_seed(0)
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": micro,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "checkpoint": {"interval_steps": 4},
              "sail": {"seed": 5, "progress_bar": False, "ledger": True, "log_dir": out}}  # fmt: skip
    engine, _ = spikingsail.initialize(model=torch.nn.Linear(4, 2), config=config, checkpoints_path=checkpoints,
                                       resume=resume)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(SAMPLES, 4, generator=g), torch.randint(0, 2, (SAMPLES,), generator=g),
                         torch.arange(SAMPLES))  # fmt: skip
    loader = engine.dataloader(data, num_workers=workers)
    steps: dict[int, list[int]] = {}
    for _ in range(loader.epoch, EPOCHS):
        for x, y, ids in loader:
            steps.setdefault(engine.global_steps + 1, []).extend(ids.tolist())  # the step this batch is in
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()
            if engine.global_steps == stop_after:
                engine.close()  # no save: the steps after the last checkpoint are taken again
                return steps
    engine.close()
    return steps


@pytest.mark.multiprocess
def test_a_resume_on_another_world_size_accounts_for_every_sample_and_matches_a_fault_free_run(
    tmp_path: Path,
) -> None:
    run, checkpoints, reference = tmp_path / "run", tmp_path / "ckpt", tmp_path / "reference"
    first = run_ranks(train, 2, str(run), str(checkpoints), 2, False, 10)  # dies after step 10 (saved at 8)
    second = run_ranks(train, 1, str(run), str(checkpoints), 4, True, None)[0]  # resumes at 8 on one process
    run_ranks(train, 1, str(reference), str(tmp_path / "unused"), 4, False, None, 2)
    ledger = ledger_check.resolve(run)
    assert ledger.problems == [], ledger_check.report(ledger)
    assert (ledger.attempts, ledger.redone) == (2, 2)  # steps 9 and 10, taken again
    # what the script's batches were: the first run's two ranks to step 8, then the resumed run's
    seen = {s: sorted(first[0][s] + first[1][s]) for s in range(1, 9)} | {
        s: sorted(i) for s, i in second.items()
    }
    assert {s: sorted(ids) for s, ids in ledger.steps.items()} == seen
    assert sorted(seen) == list(range(1, 6 * EPOCHS + 1))
    for epoch in range(EPOCHS):
        ids = [i for s in range(6 * epoch + 1, 6 * epoch + 7) for i in ledger.steps[s]]
        assert sorted(ids) == list(range(SAMPLES))
    done = subprocess.run([*SAIL, str(run), "--against", str(reference)], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 attempt(s), steps 1 to 18, 2 step(s) taken again" in done.stdout
    assert "epoch 2: 44 samples, each once" in done.stdout
    assert "18 of 18 step(s) both runs took used the same samples" in done.stdout


def header(attempt: int, rank: int = 0, **facts: object) -> str:
    return json.dumps({"ledger": 1, "attempt": attempt, "rank": rank, "world_size": 1, "group": None,
                       "samples": 8, "epoch_samples": 8, "steps_per_epoch": 2, **facts})  # fmt: skip


def write(directory: Path, name: str, *lines: str | dict[str, object], end: str = "\n") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    (directory / name).write_text(text + end)


def step(number: int, ids: list[int], epoch: int | None = None) -> dict[str, object]:
    return {"step": number, "epoch": (number - 1) // 2 if epoch is None else epoch, "ids": ids}


def check(run: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SAIL, str(run)], capture_output=True, text=True, timeout=60, check=False)


def test_a_restart_that_took_earlier_samples_again_is_named(tmp_path: Path) -> None:
    """Attempt 2 resumed at step 2 (superseding attempt 1's steps 2 and 3) but took step 1's samples
    again: in epoch 0, samples 0..3 twice and 4..7 never."""
    ledger = tmp_path / "run" / "ledger"
    write(
        ledger, "1-r0.jsonl", header(1), step(1, [0, 1, 2, 3]), step(2, [4, 5, 6, 7]), step(3, [7, 6, 5, 4])
    )
    write(ledger, "2-r0.jsonl", header(2), step(2, [0, 1, 2, 3]))
    done = check(tmp_path / "run")
    assert done.returncode == 1, done.stdout
    assert "2 attempt(s), steps 1 to 2, 2 step(s) taken again after a restart or a heal" in done.stdout
    assert "PROBLEM epoch 0: 4 sample(s) trained more than once: 0, 1, 2, 3 (steps 1, 2)" in done.stdout
    assert "PROBLEM epoch 0: 4 of its 8 samples never trained: 4, 5, 6, 7" in done.stdout


def took(number: int, ids: list[int], quorum: int, when: float) -> dict[str, object]:
    """A replica group's step: its share of the step's samples, taken in torchft quorum ``quorum``."""
    return {**step(number, ids), "quorum": quorum, "time": when}


def loaded(group: int | None, attempt: int, number: int, when: float) -> dict[str, object]:
    """The line of a state loaded from ``group``'s ``attempt`` at step ``number`` (a resume or a heal)."""
    return {"from": {"group": group, "attempt": attempt}, "step": number, "time": when}


HALVES = {0: [[0, 1], [4, 5], [0, 1], [4, 5]], 1: [[2, 3], [6, 7], [2, 3], [6, 7]]}
WHOLE = [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_replica_groups_that_all_restarted_from_a_checkpoint_count_each_step_once(tmp_path: Path) -> None:
    """Two groups took steps 1-4 (half the samples each, quorum 1) and ended; group 0 alone was
    launched again from its checkpoint at step 2 and took steps 3 and 4 with the whole batch (in a
    quorum 1 of the new job). Group 1's steps 3 and 4 were lost with it, though group 1 never started
    again; so were group 0's."""
    ledger = tmp_path / "run" / "ledger"
    for group in (0, 1):
        records = [took(n, HALVES[group][n - 1], 1, 1.0 + n) for n in range(1, 5)]
        write(ledger, f"{group + 1}000000000-g{group}-r0.jsonl",
              header((group + 1) * 10**9, group=group, job="first"), *records)  # fmt: skip
    # launched again: torchft's quorum ids count from 1 again, in another job
    write(ledger, "10000000000-g0-r0.jsonl", header(10 * 10**9, group=0, job="second"),
          loaded(0, 10**9, 2, 10.0), took(3, WHOLE[0], 1, 11.0), took(4, WHOLE[1], 1, 12.0))  # fmt: skip
    resolved = ledger_check.resolve(tmp_path / "run")
    assert resolved.problems == [] and resolved.redone == 4, ledger_check.report(resolved)
    assert {s: sorted(i) for s, i in resolved.steps.items()} == {1: WHOLE[0], 2: WHOLE[1], 3: WHOLE[0],
                                                                  4: WHOLE[1]}  # fmt: skip
    assert "crosses 1 load(s) of another attempt's or group's state" in ledger_check.report(resolved)
    # the same without the line of the loaded state (a checkpoint saved without the ledger): the
    # latest earlier attempt of the group that took step 2 is where it came from
    write(ledger, "10000000000-g0-r0.jsonl", header(10 * 10**9, group=0, job="second"),
          took(3, WHOLE[0], 1, 11.0), took(4, WHOLE[1], 1, 12.0))  # fmt: skip
    resolved = ledger_check.resolve(tmp_path / "run")
    assert resolved.problems == [] and resolved.redone == 4, ledger_check.report(resolved)


def test_a_stopped_group_that_healed_from_a_restarted_one_counts_the_restarted_groups_steps(
    tmp_path: Path,
) -> None:
    """The case of the chaos benchmark: both groups took steps 1-4 together (quorum 1); group 0 was
    stopped and group 1 killed after step 4. Group 1 started again from its checkpoint at step 2 and
    took steps 3-6 alone (quorum 3). Group 0, continued, took step 5 alone (quorum 2), then healed
    from group 1 at step 6, and both took steps 7 and 8 together (quorum 4). The final state holds
    group 1's steps 3-6, not group 0's 3-5: every sample once. A group that trained alone and then
    healed from the other, and one whose heal is not in its ledger, are told apart."""
    ledger = tmp_path / "run" / "ledger"
    first, second = 10**9, 5 * 10**9
    write(ledger, f"{first}-g0-r0.jsonl", header(first, group=0),
          *[took(n, HALVES[0][n - 1], 1, float(n)) for n in range(1, 5)], took(5, WHOLE[0], 2, 9.0),
          loaded(1, second, 6, 10.0), took(7, HALVES[0][0], 4, 11.0), took(8, HALVES[0][1], 4, 12.0))  # fmt: skip
    write(ledger, f"{first}-g1-r0.jsonl", header(first, group=1),
          *[took(n, HALVES[1][n - 1], 1, float(n)) for n in range(1, 5)])  # fmt: skip
    write(ledger, f"{second}-g1-r0.jsonl", header(second, group=1), loaded(1, first, 2, 5.0),
          *[took(n, WHOLE[(n - 1) % 2], 3, 5.0 + n / 2) for n in range(3, 7)],
          took(7, HALVES[1][0], 4, 11.0), took(8, HALVES[1][1], 4, 12.0))  # fmt: skip
    resolved = ledger_check.resolve(tmp_path / "run")
    shown = ledger_check.report(resolved)
    assert resolved.problems == [], shown
    assert "3 attempt(s), 2 replica groups, steps 1 to 8, 5 step(s) taken again" in shown
    # group 1's, from its checkpoint at step 2
    assert "crosses 1 load(s) of another attempt's or group's state" in shown
    for epoch in range(4):
        assert f"epoch {epoch}: 8 samples, each once" in shown
    assert {s: sorted(i) for s, i in resolved.steps.items()} == {n: WHOLE[(n - 1) % 2] for n in range(1, 9)}
    # without group 0's heal line, its history has no step 6: the heal is not accounted for
    lines = (ledger / f"{first}-g0-r0.jsonl").read_text().splitlines()
    (ledger / f"{first}-g0-r0.jsonl").write_text(
        "\n".join(line for line in lines if '"from"' not in line) + "\n"
    )
    shown = ledger_check.report(ledger_check.resolve(tmp_path / "run"))
    assert (f"PROBLEM attempt {first} of replica group 0 took step 8 with attempt {second} of replica group 1 "
            "but has another history: other samples or no record at steps 6") in shown  # fmt: skip
    # the heal names an attempt whose files are gone
    (ledger / f"{second}-g1-r0.jsonl").unlink()
    (ledger / f"{first}-g0-r0.jsonl").write_text("\n".join(lines) + "\n")
    shown = ledger_check.report(ledger_check.resolve(tmp_path / "run"))
    assert (f"PROBLEM the state at step 6 of attempt {first} of replica group 0 came from attempt {second} of "
            "replica group 1, whose ledger files are not here") in shown  # fmt: skip


def test_a_script_that_loads_its_own_earlier_checkpoint_counts_the_steps_after_it(tmp_path: Path) -> None:
    """One process took steps 1-3, went back to its checkpoint at step 1 (engine.load_checkpoint in
    the script) and took steps 2-4 again: the first steps 2 and 3 were set aside."""
    write(tmp_path / "run" / "ledger", "1-r0.jsonl", header(1), step(1, [0, 1, 2, 3]), step(2, [4, 5, 6, 7]),
          step(3, [0, 1, 2, 3]), loaded(None, 1, 1, 0.0), step(2, [4, 5, 6, 7]), step(3, [3, 2, 1, 0]),
          step(4, [7, 6, 5, 4]))  # fmt: skip
    resolved = ledger_check.resolve(tmp_path / "run")
    assert resolved.problems == [] and resolved.redone == 2, ledger_check.report(resolved)
    assert {s: sorted(i) for s, i in resolved.steps.items()} == {n: WHOLE[(n - 1) % 2] for n in range(1, 5)}


def test_groups_that_disagree_on_a_steps_epoch_are_named(tmp_path: Path) -> None:
    ledger = tmp_path / "run" / "ledger"
    write(ledger, "1-g0-r0.jsonl", header(1, group=0), took(1, [0, 1], 1, 1.0))
    write(ledger, "1-g1-r0.jsonl", header(1, group=1), {**took(1, [2, 3], 1, 1.0), "epoch": 1})
    shown = ledger_check.report(ledger_check.resolve(tmp_path / "run"))
    assert "PROBLEM step 1 is in epochs [0, 1] in the records of the processes that took it together" in shown


def test_lost_samples_missing_steps_and_steps_out_of_order_are_named(tmp_path: Path) -> None:
    ledger = tmp_path / "run" / "ledger"
    write(ledger, "1-r0.jsonl", header(1), step(1, [0, 1, 2]), step(2, [4, 5, 6, 7]), step(5, [0, 1]),
          step(4, [2, 3]))  # fmt: skip
    done = check(tmp_path / "run")
    assert done.returncode == 1
    assert "PROBLEM epoch 0: 1 of its 8 samples never trained: 3" in done.stdout
    assert "PROBLEM 1 step(s) have no record: 3" in done.stdout
    assert "PROBLEM 1-r0.jsonl: the steps are not in order (1, 2, 5, 4)" in done.stdout


def test_a_line_cut_short_by_a_kill_is_left_out_and_a_damaged_one_refused(tmp_path: Path) -> None:
    ledger = tmp_path / "run" / "ledger"
    write(ledger, "1-r0.jsonl", header(1), step(1, [0, 1, 2, 3]), step(2, [4, 5, 6, 7]), '{"step": 3, "ep',
          end="")  # fmt: skip
    done = check(tmp_path / "run")
    assert done.returncode == 0, done.stdout
    assert "its last line was cut short" in done.stdout and "epoch 0: 8 samples, each once" in done.stdout
    write(ledger, "1-r0.jsonl", header(1), step(1, [0, 1, 2, 3]), "not json", step(2, [4, 5, 6, 7]))
    done = check(tmp_path / "run")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"{ledger / '1-r0.jsonl'}:3: not a line of the sample ledger" in done.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    done = check(empty)
    assert done.returncode == 2 and "no sample ledger" in done.stderr and '"ledger": true' in done.stderr


def test_two_runs_that_took_different_samples_in_a_step_are_told_apart(tmp_path: Path) -> None:
    write(tmp_path / "a" / "ledger", "1-r0.jsonl", header(1), step(1, [0, 1, 2, 3]), step(2, [4, 5, 6, 7]))
    write(tmp_path / "b" / "ledger", "1-r0.jsonl", header(1), step(1, [0, 1, 2, 4]), step(2, [3, 5, 6, 7]))
    done = subprocess.run([*SAIL, str(tmp_path / "a"), "--against", str(tmp_path / "b")], capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 1
    assert "0 of 2 step(s) both runs took used the same samples" in done.stdout
    assert f"PROBLEM step 1: only in {tmp_path / 'a'}: 3; only in {tmp_path / 'b'}: 4" in done.stdout


KEYS = st.sampled_from(
    [
        "ledger",
        "attempt",
        "group",
        "step",
        "epoch",
        "ids",
        "quorum",
        "time",
        "samples",
        "epoch_samples",
        "steps_per_epoch",
        "from",
        "taking",
    ]
)
VALUES = st.one_of(
    st.integers(-3, 3), st.booleans(), st.none(), st.text(max_size=3), st.lists(st.integers(-1, 9)),
    st.dictionaries(st.sampled_from(["group", "attempt"]), st.one_of(st.none(), st.integers(-1, 2))),
)  # fmt: skip


def taking(number: int, ids: list[int], quorum: int, when: float) -> dict[str, object]:
    """What a replica group's step took, written as its gradients went to the groups of ``quorum``."""
    return {"taking": number, "epoch": (number - 1) // 2, "ids": ids, "quorum": quorum, "time": when}


def test_a_group_killed_after_its_gradients_went_to_the_quorum_counts_in_the_step_the_others_committed(
    tmp_path: Path,
) -> None:
    """Both groups took steps 1 and 2 together (quorum 1); in step 3 group 1's gradients reached
    group 0, which committed, and group 1 was killed before it wrote the step (its agent gone: the
    worker SIGKILLs itself). Started again, it healed from group 0 at step 3 and both took step 4
    (quorum 2). Step 3 trained on both halves; a group that died before its gradients left (group 0
    then committed step 3 alone, in its own quorum) or took the step again itself adds nothing."""
    ledger = tmp_path / "run" / "ledger"
    first, second = 10**9, 5 * 10**9

    def group_0(step_3: dict[str, object]) -> None:
        write(ledger, f"{first}-g0-r0.jsonl", header(first, group=0, ledger=2),
              *[x for n in (1, 2) for x in (taking(n, HALVES[0][n - 1], 1, n), took(n, HALVES[0][n - 1], 1, n))],
              taking(3, HALVES[0][2], 1, 3.0), step_3, taking(4, HALVES[0][3], 2, 5.0),
              took(4, HALVES[0][3], 2, 5.0))  # fmt: skip

    def group_1(*step_3: dict[str, object]) -> None:
        write(ledger, f"{first}-g1-r0.jsonl", header(first, group=1, ledger=2),
              *[x for n in (1, 2) for x in (taking(n, HALVES[1][n - 1], 1, n), took(n, HALVES[1][n - 1], 1, n))],
              *step_3)  # fmt: skip

    group_0(took(3, HALVES[0][2], 1, 3.0))
    group_1(taking(3, HALVES[1][2], 1, 3.0))
    write(ledger, f"{second}-g1-r0.jsonl", header(second, group=1, ledger=2), loaded(0, first, 3, 4.0),
          taking(4, HALVES[1][3], 2, 5.0), took(4, HALVES[1][3], 2, 5.0))  # fmt: skip
    resolved = ledger_check.resolve(tmp_path / "run")
    assert resolved.problems == [], ledger_check.report(resolved)
    assert {s: sorted(i) for s, i in resolved.steps.items()} == {n: WHOLE[(n - 1) % 2] for n in range(1, 5)}
    # without its taking line (format 1), group 1's half of step 3 is missing: the false alarm
    group_1()
    shown = ledger_check.report(ledger_check.resolve(tmp_path / "run"))
    assert "PROBLEM epoch 1: 2 of its 8 samples never trained: 2, 3" in shown
    # group 1 died before its gradients left: group 0 took step 3 alone (no quorum named), with all of it
    group_0({**step(3, WHOLE[0]), "time": 3.0})
    group_1(taking(3, HALVES[1][2], 1, 3.0))
    resolved = ledger_check.resolve(tmp_path / "run")
    assert resolved.problems == [] and sorted(resolved.steps[3]) == WHOLE[0], ledger_check.report(resolved)
    # group 1 voted no and took step 3 again (committed): its taking line is not counted on top
    group_0(took(3, HALVES[0][2], 1, 3.0))
    group_1(taking(3, HALVES[1][2], 1, 3.0), took(3, HALVES[1][2], 1, 3.5))
    resolved = ledger_check.resolve(tmp_path / "run")
    assert resolved.problems == [] and sorted(resolved.steps[3]) == WHOLE[0], ledger_check.report(resolved)


LINES = st.one_of(st.binary(max_size=60), st.dictionaries(KEYS, VALUES).map(lambda d: json.dumps(d).encode()))


@settings(max_examples=300, deadline=None)
@given(st.lists(LINES, max_size=6), st.lists(LINES, max_size=4), st.booleans())
def test_any_ledger_files_give_a_report_or_a_clear_error(tmp_path_factory: pytest.TempPathFactory,
                                                         lines: list[bytes], others: list[bytes],
                                                         with_header: bool) -> None:  # fmt: skip
    """Two processes' files (one of a replica group, which the other may name as a state's source):
    whatever their lines, a report or an error that names the file and line."""
    run = tmp_path_factory.mktemp("fuzz")
    (run / "ledger").mkdir()
    head = [header(1).encode()] if with_header else []
    (run / "ledger" / "1-r0.jsonl").write_bytes(b"\n".join(head + lines))
    other = [header(2, group=0).encode(), json.dumps(step(1, [0, 1])).encode()]
    (run / "ledger" / "2-g0-r0.jsonl").write_bytes(b"\n".join(other + others))
    try:
        ledger_check.report(ledger_check.resolve(run))
    except ReportError as err:
        message = str(err)
    else:
        return
    assert "not a line of the sample ledger" in message or "an empty ledger file" in message
