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
    assert "2 attempt(s), steps 1 to 2, 2 step(s) taken again after a restart" in done.stdout
    assert "PROBLEM epoch 0: 4 sample(s) trained more than once: 0, 1, 2, 3 (steps 1, 2)" in done.stdout
    assert "PROBLEM epoch 0: 4 of its 8 samples never trained: 4, 5, 6, 7" in done.stdout


def test_replica_groups_that_all_restarted_from_a_checkpoint_count_each_step_once(tmp_path: Path) -> None:
    """Two groups took steps 1-4 (half the samples each) and ended; group 0 alone started again from
    the checkpoint at step 2 and took steps 3 and 4 with the whole batch. Group 1's steps 3 and 4
    were lost with it: superseded, though group 1 never started again. A group that heals while
    another trains (group 1 at step 3, beside group 0) supersedes nothing of the other's."""
    ledger = tmp_path / "run" / "ledger"
    half = {0: [[0, 1], [4, 5], [0, 1], [4, 5]], 1: [[2, 3], [6, 7], [2, 3], [6, 7]]}
    for group in (0, 1):
        records = [{**step(n, half[group][n - 1]), "time": 1.0 + n} for n in range(1, 5)]
        write(
            ledger,
            f"{group + 1}000000000-g{group}-r0.jsonl",
            header((group + 1) * 10**9, group=group),
            *records,
        )
    write(ledger, "10000000000-g0-r0.jsonl", header(10 * 10**9, group=0),
          {**step(3, [0, 1, 2, 3]), "time": 11.0}, {**step(4, [4, 5, 6, 7]), "time": 12.0})  # fmt: skip
    resolved = ledger_check.resolve(tmp_path / "run")
    assert resolved.problems == [] and resolved.redone == 4, ledger_check.report(resolved)
    assert {s: sorted(i) for s, i in resolved.steps.items()} == {1: [0, 1, 2, 3], 2: [4, 5, 6, 7],
                                                                  3: [0, 1, 2, 3], 4: [4, 5, 6, 7]}  # fmt: skip
    # group 1 heals at step 3 while group 0's first attempt trains on: nothing of group 0's is superseded
    write(ledger, "10000000000-g0-r0.jsonl", header(10 * 10**9, group=0))  # took no step
    write(ledger, "1500000000-g1-r0.jsonl", header(int(1.5 * 10**9), group=1),
          {**step(3, [2, 3]), "time": 4.1}, {**step(4, [6, 7]), "time": 5.1})  # fmt: skip
    resolved = ledger_check.resolve(tmp_path / "run")
    assert resolved.problems == [] and resolved.redone == 2, ledger_check.report(resolved)


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
    ]
)
VALUES = st.one_of(
    st.integers(-3, 3), st.booleans(), st.none(), st.text(max_size=3), st.lists(st.integers(-1, 9))
)
LINES = st.one_of(st.binary(max_size=60), st.dictionaries(KEYS, VALUES).map(lambda d: json.dumps(d).encode()))


@settings(max_examples=300, deadline=None)
@given(st.lists(LINES, max_size=6), st.booleans())
def test_any_ledger_file_gives_a_report_or_a_clear_error(tmp_path_factory: pytest.TempPathFactory,
                                                         lines: list[bytes], with_header: bool) -> None:  # fmt: skip
    run = tmp_path_factory.mktemp("fuzz")
    (run / "ledger").mkdir()
    head = [header(1).encode()] if with_header else []
    (run / "ledger" / "1-r0.jsonl").write_bytes(b"\n".join(head + lines))
    try:
        ledger_check.report(ledger_check.resolve(run))
    except ReportError as err:
        message = str(err)
    else:
        return
    assert "not a line of the sample ledger" in message or "an empty ledger file" in message
