"""What the replica-group tests share: a job of replica groups under ``sail launch --ft-replicas``
running ``replica_worker.py``, the one process it is compared with, and the checks that a run
trained as that one process."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from spikingsail.launchers.replicas import ReplicaPlan, free_port
from spikingsail.monitor import ledger_check

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


def _lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in out.glob("ledger-*.jsonl") for line in path.read_text().splitlines()]


def ledger(out: Path) -> list[dict[str, Any]]:
    """Every committed step of every group, rank and restart: its sample ids and a digest of the
    parameters after it."""
    return [entry for entry in _lines(out) if "step" in entry]


def taken_before_dying(out: Path) -> list[dict[str, Any]]:
    """The steps a process wrote it took as its gradients went to the other groups, and never wrote
    it committed: killed in between (the other groups may have committed the step with them)."""
    committed = {(entry["pid"], entry["step"]) for entry in ledger(out)}
    return [e for e in _lines(out) if "taking" in e and (e["pid"], e["taking"]) not in committed]


def committed_samples(out: Path) -> dict[int, list[int]]:
    """The sample ids of each committed step (counted from 0), over the processes that took part in it.
    Groups that did not see each other may each have taken a step alone, from the same state (torchft
    gave each a quorum of its own): then each quorum took the whole step's samples, once. A group
    alone in its quorum is told apart by its group and attempt, as the engine's ledger tells it. A
    process killed after its gradients went to its quorum counts in the step the others committed."""
    by_quorum: dict[int, dict[Any, list[int]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    for entry in ledger(out):
        by_quorum[entry["step"]][took(entry)] += entry["ids"]
    for entry in taken_before_dying(out):  # in a quorum whose other groups committed the step
        if entry["quorum"] in by_quorum.get(entry["taking"], {}):
            by_quorum[entry["taking"]][entry["quorum"]] += entry["ids"]
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


def process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def group_entries(out: Path, group: int, besides: int = 0) -> list[dict[str, Any]]:
    """The script's records of ``group``'s committed steps (a line still being written is left for
    the next look), but for those of process ``besides``."""
    found = []
    for path in out.glob(f"ledger-{group}-*.jsonl"):
        if path.stem.endswith(f"-{besides}"):
            continue
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                break
            if "step" in entry:
                found.append(entry)
    return found


@contextlib.contextmanager
def ended_on_failure(job: subprocess.Popen[str], stopped: int | None = None) -> Iterator[None]:
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


def lighthouse_status(job: int) -> str:
    """The status page of the job's lighthouse ("" while none serves)."""
    try:
        lighthouse = child_with(job, "torchft_lighthouse")
        argv = Path(f"/proc/{lighthouse}/cmdline").read_bytes().decode().split("\0")
        address = argv[argv.index("--bind") + 1]
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://{address}/status", timeout=2) as page:
            return str(page.read().decode())
    except (AssertionError, OSError, ValueError):
        return ""


def wait_for_worker(out: Path, group: int, steps: int = 4) -> int:
    """The pid of a group's worker once it has committed ``steps`` steps."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for ledger in out.glob(f"ledger-{group}-*.jsonl"):
            if ledger.read_text().count('"step"') >= steps:
                return int(ledger.stem.rsplit("-", 1)[1])
        time.sleep(0.1)
    raise AssertionError(f"group {group} committed no steps in 120 s")


def child_with(pid: int, needle: str) -> int:
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


def standalone_lighthouse() -> tuple[subprocess.Popen[bytes], str]:
    from spikingsail.launchers.replicas import lighthouse_argv

    port = free_port()
    argv = lighthouse_argv(
        ReplicaPlan(groups=2, heartbeat_timeout_ms=1000, join_timeout_ms=2000, lighthouse_port=port)
    )
    return subprocess.Popen(argv, env={**os.environ, "RUST_LOG": "warn"}), f"http://127.0.0.1:{port}"
