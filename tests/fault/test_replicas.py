"""Replica groups under ``sail launch --ft-replicas``: real torchft lighthouse, real torchrun agents,
real SIGKILL / SIGSTOP; every run is compared with one process training on the whole global batch."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from spikingsail.errors import ConfigError, LaunchError
from spikingsail.launchers.replicas import ReplicaPlan, free_port, plan_replica_groups
from spikingsail.launchers.request import parse_request
from spikingsail.monitor import ledger_check
from tests.cluster.harness import processes_with
from tests.launchers.test_local import wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.alone]

WORKER = Path(__file__).with_name("replica_worker.py")
SAIL = [sys.executable, "-m", "spikingsail.cli.main", "launch"]
EPOCHS, STEPS_PER_EPOCH, SAMPLES = 3, 12, 96


def launch(out: Path, *worker_args: str, groups: int = 2, nproc: int = 1, wait: bool = True,
           epochs: int = EPOCHS) -> subprocess.Popen[str]:  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    # a 3 s heartbeat timeout: on a loaded 2-core machine a starved group's 1 s heartbeat can lapse
    # no --max-restarts: a failed group is started again (3 times) by default
    command = [*SAIL, "--ft-replicas", str(groups), "--ft-heartbeat-timeout", "3", "-n", str(nproc),
               str(WORKER), str(out), str(epochs), "--step-sleep", "0.25", *worker_args]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if wait:
        output, _ = process.communicate(timeout=240)
        assert process.returncode == 0, output[-4000:]
        (out / "output.txt").write_text(output)
    return process


_REFERENCES: dict[int, dict[str, torch.Tensor]] = {}


def reference(tmp_path: Path, ranks: int = 2) -> dict[str, torch.Tensor]:
    """One process taking the micro-batches of all ``ranks`` at once: the same run for every test,
    so it runs once per ``ranks`` in a pytest process."""
    if ranks not in _REFERENCES:
        out = tmp_path / "reference"
        out.mkdir()
        subprocess.run([sys.executable, str(WORKER), str(out), str(EPOCHS), "--reference", str(ranks)],
                       check=True, capture_output=True, timeout=120)  # fmt: skip
        _REFERENCES[ranks] = torch.load(out / "final-0.pt")
    return {key: value.clone() for key, value in _REFERENCES[ranks].items()}


def finals(out: Path, groups: int = 2) -> list[dict[str, torch.Tensor]]:
    return [torch.load(out / f"final-{g}.pt") for g in range(groups)]


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], exact: bool = False) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        if exact:
            assert torch.equal(got[key], value), key
        else:  # the groups' gradients are summed in another order than one process's mean
            torch.testing.assert_close(
                got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}"
            )


def ledger(out: Path) -> list[dict[str, Any]]:
    """Every committed step of every group, rank and restart: its sample ids and a digest of the
    parameters after it."""
    return [json.loads(line) for path in out.glob("ledger-*.jsonl") for line in path.read_text().splitlines()]


def committed_samples(out: Path) -> dict[int, list[int]]:
    """The sample ids of each committed step (counted from 0), over the processes that took part in it.
    Groups that did not see each other may each have taken a step alone, from the same state (torchft
    gave each a quorum of its own): then each quorum took the whole step's samples, once. A group
    alone in its quorum is told apart by its group and attempt, as the engine's ledger tells it."""
    by_quorum: dict[int, dict[Any, list[int]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    for entry in ledger(out):
        by_quorum[entry["step"]][took(entry)] += entry["ids"]
    steps = {}
    for step, quorums in by_quorum.items():
        first, *others = (sorted(ids) for ids in quorums.values())
        assert all(other == first for other in others), (
            f"step {step}: quorums with different samples {quorums}"
        )
        steps[step] = first
    return steps


def took(entry: dict[str, Any]) -> Any:
    """Who took a step with this process: its quorum, or (alone in it) its group's attempt."""
    return ("alone", entry["group"], entry["attempt"]) if entry["alone"] else entry["quorum"]


def engine_quorums_match_the_script(out: Path) -> tuple[int, int]:
    """The engine's ledger names a step's quorum where other groups took it too, and none where the
    group took it alone, as the script saw (its lines matched by process and step). Returns how
    many matched lines named a quorum and how many named none."""
    seen = {(entry["pid"], entry["step"] + 1): entry for entry in ledger(out)}
    named = alone = 0
    for path in (out / "ledger").glob("*.jsonl"):
        header, *lines = [json.loads(line) for line in path.read_text().splitlines()]
        for line in lines:
            entry = seen.get((header["pid"], line.get("step")))
            if entry is None or "from" in line:
                continue
            assert line.get("quorum") == (None if entry["alone"] else entry["quorum"]), (path, line, entry)
            named, alone = named + (not entry["alone"]), alone + entry["alone"]
    return named, alone


def assert_groups_agree_after_every_step(out: Path) -> None:
    """Not only at the end: after every committed step every process that took it holds the same
    parameters (a group that trained apart, e.g. restarted alone from step 0, would differ)."""
    digests: dict[int, set[float]] = collections.defaultdict(set)
    for entry in ledger(out):
        digests[entry["step"]].add(entry["digest"])
    assert {step: d for step, d in digests.items() if len(d) > 1} == {}


def assert_every_sample_once_per_epoch(out: Path, per_epoch: int = STEPS_PER_EPOCH) -> None:
    """By the script's own record of its batches, and by the engine's sample ledger (``sail.ledger``),
    which must say the same of every step and find nothing lost or repeated."""
    steps = committed_samples(out)
    assert sorted(steps) == list(range(EPOCHS * per_epoch))
    for epoch in range(EPOCHS):
        ids = [i for s in range(epoch * per_epoch, (epoch + 1) * per_epoch) for i in steps[s]]
        assert sorted(ids) == list(range(SAMPLES)), f"epoch {epoch}"
    engines = ledger_check.resolve(out)
    assert engines.problems == [], ledger_check.report(engines)
    assert {s: sorted(ids) for s, ids in engines.steps.items()} == {
        s + 1: sorted(ids) for s, ids in steps.items()
    }


def assert_trained_as_one_process(
    out: Path, tmp_path: Path, ranks: int = 2, per_epoch: int = STEPS_PER_EPOCH
) -> None:
    """Every process held the same parameters after every committed step, the groups end bit-identical,
    equal to one process on the whole global batch, and every sample was used once per epoch."""
    assert_groups_agree_after_every_step(out)
    assert engine_quorums_match_the_script(out)[0]
    first, second = finals(out)
    assert_same(first, second, exact=True)
    assert_same(first, reference(tmp_path, ranks))
    assert_every_sample_once_per_epoch(out, per_epoch)


def finish(job: subprocess.Popen[str]) -> str:
    output, _ = job.communicate(timeout=240)
    assert job.returncode == 0, output[-4000:]
    return output


@pytest.mark.parametrize("kill_in", ["allreduce", "between"])
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
    while _state(stopped) != "T" and time.monotonic() < deadline:
        time.sleep(0.05)
    with _ended_on_failure(job, stopped):
        killed = _wait_for_worker(out, group=1)
        os.kill(killed, signal.SIGKILL)
        # continue group 0 once the restarted group 1 is past it alone (so group 0 is behind and
        # heals from it), however long the restart takes on a loaded machine
        last = max(entry["step"] for entry in _entries(out, 0))
        while (
            time.monotonic() < deadline
            and job.poll() is None
            and not any(entry["step"] > last + 1 for entry in _entries(out, 1, besides=killed))
        ):
            time.sleep(0.5)
    os.kill(stopped, signal.SIGCONT)
    finish(job)
    restarted = [entry for entry in _entries(out, 1, besides=killed) if entry["step"] <= last]
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


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _entries(out: Path, group: int, besides: int = 0) -> list[dict[str, Any]]:
    """The script's records of ``group``'s steps (a line still being written is left for the next
    look), but for those of process ``besides``."""
    found = []
    for path in out.glob(f"ledger-{group}-*.jsonl"):
        if path.stem.endswith(f"-{besides}"):
            continue
        for line in path.read_text().splitlines():
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return found


def test_the_lighthouse_killed_mid_run_is_started_again_and_training_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "run"
    job = launch(out, wait=False)
    with _ended_on_failure(job):  # mid-run: once the groups took a step together (group 1 can start late)
        wait_for(lambda: any(not entry["alone"] for entry in _entries(out, 0)), 120, "no step of both groups")
        os.kill(_child_with(job.pid, "torchft_lighthouse"), signal.SIGKILL)
    assert "torchft's lighthouse ended" in finish(job)
    assert_trained_as_one_process(out, tmp_path)


def test_a_group_first_meeting_another_under_a_restarted_lighthouse_heals_over_a_new_process_group(
    tmp_path: Path,
) -> None:
    """A lighthouse started again numbers its quorums from 1 again. Group 0 trains alone in the first
    lighthouse's quorum 1 and pauses; the lighthouse is killed and started again; group 1 joins and
    waits for group 0, which continues: the two first meet in the second lighthouse's quorum 1.
    torchft builds a process group only for a new quorum id: while the ids were the lighthouse's alone,
    group 0 sent its state to group 1 over its one-process group and crashed (SIGSEGV in gloo), was
    started again from step 0, and its first steps differed from those taken again. The engine's
    quorum ids name the members too."""
    out = tmp_path / "run"
    job = launch(out, "--hold-group", "1", wait=False)
    with _ended_on_failure(job):
        _wait_for_worker(out, group=0)
        (out / "pause-0").touch()
        wait_for((out / "paused-0").exists, 60, "group 0 did not pause")
        first = _child_with(job.pid, "torchft_lighthouse")
        os.kill(first, signal.SIGKILL)
        # the second lighthouse hears group 0's heartbeats, then group 1 asks it for a quorum
        wait_for(lambda: "sail_0" in _lighthouse_status(job.pid), 60, "no heartbeat of group 0's there")
        (out / "go-1").touch()
        wait_for(lambda: "at least half of 2" in _lighthouse_status(job.pid), 60, "group 1 not waiting")
        (out / "pause-0").unlink()
    output = finish(job)
    assert "replica group 0 ended" not in output, output[-4000:]  # not crashed, not started again
    entries = sorted(ledger(out), key=lambda entry: entry["time"])
    before = [entry for entry in entries if entry["group"] == 0 and entry["alone"]]
    met = next(entry for entry in entries if entry["group"] == 0 and not entry["alone"])
    assert before[0]["lighthouse"] == met["lighthouse"] == 1  # the same number, other members
    assert_trained_as_one_process(out, tmp_path)


@contextlib.contextmanager
def _ended_on_failure(job: subprocess.Popen[str], stopped: int | None = None) -> Iterator[None]:
    """A test that fails while its job runs ends the job (continuing the process it stopped, if any),
    so that nothing is left behind."""
    try:
        yield
    except BaseException:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        job.terminate()
        job.communicate(timeout=60)
        raise


def _lighthouse_status(job: int) -> str:
    """The status page of the job's lighthouse ("" while none serves)."""
    try:
        lighthouse = _child_with(job, "torchft_lighthouse")
        argv = Path(f"/proc/{lighthouse}/cmdline").read_bytes().decode().split("\0")
        address = argv[argv.index("--bind") + 1]
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://{address}/status", timeout=2) as page:
            return str(page.read().decode())
    except (AssertionError, OSError, ValueError):
        return ""


def test_a_lighthouse_port_taken_after_it_was_chosen_is_replaced_before_the_groups_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """free_port's port can be taken before the lighthouse binds it (it is an ephemeral port that
    another process's socket may get): the lighthouse ends at once, and the groups, started with its
    address, would wait for it until torchft's connect timeout and fail. sail launch sees it end,
    chooses another port, and starts the groups only once the lighthouse answers."""
    from spikingsail.cli import launch as cli_launch
    from spikingsail.launchers import replicas
    from spikingsail.launchers import run as launch_run

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    ports, free = iter([port]), replicas.free_port
    monkeypatch.setattr(replicas, "free_port", lambda: next(ports, None) or free())
    monkeypatch.setattr(launch_run, "free_port", replicas.free_port)
    script = tmp_path / "reach.py"
    script.write_text(
        "import os, urllib.request\n"
        "address = os.environ['TORCHFT_LIGHTHOUSE']\n"
        "direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))\n"
        "status = direct.open(address + '/status', timeout=5).read().decode()\n"
        f"open({str(tmp_path)!r} + '/group-' + os.environ['REPLICA_GROUP_ID'], 'w').write(address + ' ' + status)\n"
    )
    with taken, caplog.at_level("WARNING"):
        status = cli_launch.run(["--ft-replicas", "2", "-n", "1", "--max-restarts", "0", str(script)])
    assert status == 0
    assert f"could not listen on port {port}" in caplog.text
    reached = [(tmp_path / f"group-{g}").read_text() for g in range(2)]
    assert all("quorum" in text for text in reached)
    assert reached[0].split()[0] == reached[1].split()[0] != f"http://127.0.0.1:{port}"


def test_the_lighthouse_is_reached_directly_whatever_the_shells_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from spikingsail.launchers.command import LaunchCommand
    from spikingsail.launchers.replicas import lighthouse_argv, start_lighthouse

    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    plan = ReplicaPlan(
        groups=2, heartbeat_timeout_ms=1000, join_timeout_ms=10000, lighthouse_port=free_port()
    )
    lighthouse = start_lighthouse(
        LaunchCommand(host="localhost", argv=lighthouse_argv(plan)), plan, within=20
    )
    assert lighthouse is not None and lighthouse.poll() is None
    lighthouse.kill()
    lighthouse.wait()


def test_a_lighthouse_that_never_answers_is_a_clear_error(tmp_path: Path) -> None:
    from spikingsail.launchers.command import LaunchCommand
    from spikingsail.launchers.replicas import start_lighthouse

    plan = ReplicaPlan(
        groups=2, heartbeat_timeout_ms=1000, join_timeout_ms=10000, lighthouse_port=free_port()
    )
    program = f"import time; time.sleep(60)  # {tmp_path}"
    silent = LaunchCommand(host="localhost", argv=[sys.executable, "-c", program])
    started = time.monotonic()
    with pytest.raises(LaunchError, match=f"did not answer at 127.0.0.1:{plan.lighthouse_port} within 1 s"):
        start_lighthouse(silent, plan, within=1.0)
    assert time.monotonic() - started < 10
    assert not processes_with(str(tmp_path)), "the lighthouse that did not answer was left running"


def test_a_groups_killed_agent_is_started_again_and_its_orphaned_worker_ends(tmp_path: Path) -> None:
    """SIGKILL leaves a torchrun agent's workers running; group 1's worker ends itself, and sail
    launch starts the group again, which heals from group 0."""
    out = tmp_path / "run"
    job = launch(out, "--step-sleep", "0.8", wait=False)
    worker = _wait_for_worker(out, 1)
    agent = int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(agent, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:  # not reaped: a zombie
        if _state(worker) == "Z":
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
    lighthouse, address = _lighthouse()
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


@pytest.mark.parametrize(
    ("flags", "restarts"),
    [([], 3), (["--max-restarts", "0"], 0), (["--max_restarts=1"], 1), (["--max-re", "0"], 0)],
)
def test_replica_groups_are_started_again_unless_the_command_line_bounds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str], restarts: int
) -> None:
    """--ft-replicas asks for recovery: without --max-restarts a failed group is started again up to
    3 times; any spelling of --max-restarts torchrun's parser takes (an abbreviation too) bounds it."""
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text("")
    assert parse_request([*flags, "--ft-replicas", "2", "train.py"]).max_restarts == restarts
    assert parse_request([*flags, "train.py"]).max_restarts == (0 if not flags else restarts)


def test_launch_plans_the_lighthouse_and_one_agent_per_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    script = tmp_path / "train.py"
    script.touch()
    request = parse_request(
        ["--ft-replicas", "3", "-n", "2", "--max-restarts", "2", str(script), "--lr", "1"]
    )
    plan = ReplicaPlan(groups=3, heartbeat_timeout_ms=1000, join_timeout_ms=10000, lighthouse_port=29999)
    lighthouse, *groups = plan_replica_groups(request, plan)
    assert lighthouse.argv[0] == sys.executable and Path(lighthouse.argv[1]).name == "torchft_lighthouse.py"
    assert lighthouse.argv[lighthouse.argv.index("--bind") + 1] == "127.0.0.1:29999"
    assert [c.env["REPLICA_GROUP_ID"] for c in groups] == ["0", "1", "2"]
    secret = groups[0].env["SAIL_REPLICA_SECRET"]
    assert (
        len(bytes.fromhex(secret)) == 32 and secret != ReplicaPlan(3, 1000, 10000, 29999).secret
    )  # one per job
    for command in groups:
        assert command.env["SAIL_REPLICA_SECRET"] == secret  # in the environment only
        assert secret not in " ".join(command.argv) and secret not in command.render()
        assert command.env["NUM_REPLICA_GROUPS"] == "3"
        assert command.env["TORCHFT_LIGHTHOUSE"] == "http://127.0.0.1:29999"
        assert command.argv[1:3] == ["-m", "torch.distributed.run"]
        assert {"--standalone", "--max-restarts"} <= set(command.argv)
        assert command.argv[-3:] == [str(script), "--lr", "1"]
        # six processes on this machine: one thread each, as torchrun sets for several per node
        assert command.env["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the shell's choice stands
    assert all("OMP_NUM_THREADS" not in c.env for c in plan_replica_groups(request, plan)[1:])


def test_each_group_on_this_machine_trains_on_gpus_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group's processes take the GPUs of their local ranks, numbered from 0 in every group: each
    group gets its own slice of the machine's GPUs (of the shell's mask, when it sets one), and a
    machine with too few GPUs for a process each is refused before anything starts."""
    from spikingsail.backends import process_group

    script = tmp_path / "train.py"
    script.touch()
    plan = ReplicaPlan(groups=2, heartbeat_timeout_ms=1000, join_timeout_ms=10000, lighthouse_port=29999)

    def masks(*argv: str) -> list[str | None]:
        groups = plan_replica_groups(parse_request(["--ft-replicas", "2", *argv, str(script)]), plan)[1:]
        return [c.env.get("CUDA_VISIBLE_DEVICES") for c in groups]

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(process_group, "nvidia_gpus", lambda: 0)
    assert masks("-n", "2") == [None, None]  # a CPU machine: nothing to divide
    monkeypatch.setattr(process_group, "nvidia_gpus", lambda: 4)
    assert masks("-n", "2") == ["0,1", "2,3"]
    assert masks("-n", "1") == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert masks("-n", "2") == ["4,5", "6,7"]
    with pytest.raises(
        LaunchError, match=r"(?s)which shows 4 GPU\(s\) \(CUDA_VISIBLE_DEVICES=4,5,6,7\).*at most 2 here"
    ):
        masks("-n", "3")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(LaunchError, match="--nproc-per-node gpu"):
        masks("--nproc-per-node", "gpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(
        LaunchError, match=r"(?s)shows 1 GPU.*fix: spread the groups over nodes with -H \(or hide"
    ):
        masks("-n", "1")  # fewer GPUs than groups: no process count fits
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # GPUs hidden on purpose: the CPU
    assert masks("-n", "3") == [None, None]
    monkeypatch.setattr(process_group, "nvidia_gpus", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # a mask on a machine without GPUs: the CPU
    assert masks("-n", "3") == [None, None]


def test_the_lighthouse_address_is_this_machines_towards_the_nodes() -> None:
    from spikingsail.launchers.replicas import address_towards

    assert address_towards(["localhost", "127.0.0.2"]) == "127.0.0.1"  # nodes on this machine's loopback
    with pytest.raises(LaunchError, match="do not resolve here"):
        address_towards(["no-such-node.invalid"])


def test_launch_spreads_the_groups_over_the_hostfile_nodes(tmp_path: Path) -> None:
    """With -H each group is the multi-node job of a slice of the nodes, with its own rendezvous,
    and the lighthouse listens on the address the nodes reach this machine at."""
    from spikingsail.launchers import plan
    from spikingsail.launchers.replicas import ENV_GROUP_REQUEST, decode_request, group_requests

    script = tmp_path / "train.py"
    script.touch()
    request = parse_request(["--ft-replicas", "2", "-H", "n1:2,n2:2,n3:2,n4:2", "--max-restarts", "2",
                             "--env", "HF_TOKEN=secret", str(script)])  # fmt: skip
    replicas = ReplicaPlan(2, 1000, 10000, 29999, lighthouse_host="10.0.0.9")
    lighthouse, *children = plan_replica_groups(request, replicas)
    assert lighthouse.argv[lighthouse.argv.index("--bind") + 1] == "10.0.0.9:29999"
    subs = [decode_request(c.env[ENV_GROUP_REQUEST]) for c in children]
    assert subs == group_requests(request, replicas)
    assert all("secret" not in " ".join(c.argv) for c in children)  # --env values stay off command lines
    assert [[n.host for n in sub.nodes or []] for sub in subs] == [["n1", "n2"], ["n3", "n4"]]
    for group, sub in enumerate(subs):
        assert sub.ft_replicas == 0 and sub.max_restarts == 2
        assert sub.env["REPLICA_GROUP_ID"] == str(group) and sub.env["NUM_REPLICA_GROUPS"] == "2"
        assert sub.env["TORCHFT_LIGHTHOUSE"] == "http://10.0.0.9:29999"
        assert sub.env["HF_TOKEN"] == "secret"
        assert sub.env["SAIL_REPLICA_SECRET"] == replicas.secret  # shipped in the nodes' 0600 file
        commands = plan(sub)
        assert any(replicas.secret in str(upload.env) for c in commands for upload in c.uploads)
        assert not any(replicas.secret in " ".join(c.argv) for c in commands)
        agents = " ".join(command.render() for command in commands)
        first = (sub.nodes or [])[0].host
        assert f"--rdzv-endpoint {first}:29500" in agents and "--nnodes 2" in agents


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--ft-replicas", "1"], "one group has nobody to heal from"),
     (["--ft-replicas", "2", "-H", "a:1,b:1,c:1"], "the same number of nodes each"),
     (["--ft-replicas", "2", "-H", "a:1,b:1", "--launcher", "mpirun"], "torchrun agents of its own"),
     (["--ft-replicas", "2", "-H", "a:1,b:1", "--rdzv-endpoint", "a:2"], "a rendezvous of its own"),
     (["--ft-replicas", "2", "--ft-heartbeat-timeout", "0"], "a time in seconds")],
)  # fmt: skip
def test_launch_refuses_what_it_cannot_do(tmp_path: Path, argv: list[str], message: str) -> None:
    script = tmp_path / "train.py"
    script.touch()

    def plan() -> None:
        plan_replica_groups(parse_request([*argv, str(script)]), ReplicaPlan(2, 1000, 10000, 29999))

    with pytest.raises(LaunchError, match=message):
        plan()


def _wait_for_worker(out: Path, group: int, steps: int = 4) -> int:
    """The pid of a group's worker once it has committed ``steps`` steps."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for ledger in out.glob(f"ledger-{group}-*.jsonl"):
            if len(ledger.read_text().splitlines()) >= steps:
                return int(ledger.stem.rsplit("-", 1)[1])
        time.sleep(0.1)
    raise AssertionError(f"group {group} committed no steps in 120 s")


def _child_with(pid: int, needle: str) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and needle in cmdline:
                return int(entry.name)
    raise AssertionError(f"no child of {pid} runs {needle}")


def _lighthouse() -> tuple[subprocess.Popen[bytes], str]:
    from spikingsail.launchers.replicas import lighthouse_argv

    port = free_port()
    argv = lighthouse_argv(
        ReplicaPlan(groups=2, heartbeat_timeout_ms=1000, join_timeout_ms=2000, lighthouse_port=port)
    )
    return subprocess.Popen(argv, env={**os.environ, "RUST_LOG": "warn"}), f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("config", "backend", "message"),
    [({}, "deepspeed", "only the ddp and fsdp backends"),
     ({"fp16": {"enabled": True}}, "ddp", "loss scaler that skips a step"),
     ({"zero_optimization": {"stage": 1}}, "ddp", "ZeRO-1 over ddp shards it on its own"),
     ({"sail": {"balance": [1, 1]}}, "ddp", "follow the groups taking part")],
)  # fmt: skip
def test_what_replica_groups_cannot_keep_exact_is_refused(
    config: dict[str, Any], backend: str, message: str
) -> None:
    from spikingsail.config.parse import load_config
    from spikingsail.engine.replicas import check_supported

    with pytest.raises(ConfigError, match=message):
        check_supported(load_config({"train_micro_batch_size_per_gpu": 1, **config}, 2), backend)


def test_synchronised_batch_norm_is_refused_with_replica_groups_and_plain_batch_norm_is_not() -> None:
    from spikingsail.config.parse import load_config
    from spikingsail.engine.initialize import synchronised_batch_norm
    from spikingsail.engine.replicas import check_supported
    from spikingsail.snn import convert_sync_batchnorm

    plain = {"train_micro_batch_size_per_gpu": 1}
    cases = [({"snn": {"sync_batchnorm": True}}, torch.nn.BatchNorm1d(4), "snn.sync_batchnorm"),
             ({}, torch.nn.SyncBatchNorm(4), "the model's SyncBatchNorm layers"),
             ({}, convert_sync_batchnorm(torch.nn.BatchNorm1d(4)), "the model's SyncBatchNorm layers")]  # fmt: skip
    for extra, model, which in cases:
        config = load_config({**plain, **extra}, 2)
        with pytest.raises(ConfigError, match=rf"(?s)synchronised \({which}\).*stay within a group"):
            check_supported(config, "ddp", synchronised_batch_norm(config, model))
    config = load_config(plain, 2)
    check_supported(config, "ddp", synchronised_batch_norm(config, torch.nn.BatchNorm1d(4)))


def test_the_replica_environment_is_read_and_checked() -> None:
    from spikingsail.engine.replicas import ReplicaEnv

    assert ReplicaEnv.from_env({}) is None
    env = {"REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "3", "TORCHFT_LIGHTHOUSE": "http://h:1",
           "SAIL_REPLICA_SECRET": "ab" * 32}  # fmt: skip
    assert ReplicaEnv.from_env(env) == ReplicaEnv(1, 3, "http://h:1", bytes([0xAB] * 32))
    with pytest.raises(ConfigError, match="replica group 3 of 3"):
        ReplicaEnv.from_env({**env, "REPLICA_GROUP_ID": "3"})
    with pytest.raises(ConfigError, match="both integers"):
        ReplicaEnv.from_env({**env, "REPLICA_GROUP_ID": "x"})


def test_a_refused_replica_engine_leaves_nothing_running(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import threading

    import spikingsail
    from spikingsail.environments import RankInfo

    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "2")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")
    monkeypatch.setenv("SAIL_REPLICA_SECRET", "ab" * 32)
    threads = set(threading.enumerate())
    config = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "checkpoint": {"path": str(tmp_path / "ckpt")}}  # fmt: skip
    with pytest.raises(ConfigError, match="loss scaler that skips a step"):
        spikingsail.initialize(model=torch.nn.Linear(2, 1), config=config, rank_info=RankInfo.single())
    assert {t for t in threading.enumerate() if t.is_alive()} <= threads  # no heartbeat, no watcher
    assert not list((tmp_path / "ckpt").rglob("*.lock"))  # the checkpoint directory's lock is released


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
