"""SLURM on two real nodes (munge, slurmctld, two slurmd): srun in both of seed 002's modes, and sbatch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.harness import NamespaceCluster
from tests.cluster.test_ssh_pdsh import JOB, SAIL, assert_no_job_left, records

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize(("mode", "source"), [("torchrun", "torchrun"), ("slurm", "slurm")])
def test_sail_launch_inside_an_allocation(
    slurm: NamespaceCluster, tmp_path: Path, mode: str, source: str
) -> None:
    argv = [
        "salloc",
        "-N",
        "2",
        "--ntasks-per-node",
        "1",
        *SAIL,
        "--dist-init-method",
        mode,
        str(JOB),
        str(tmp_path / "out"),
    ]
    result = slurm.run("node1", argv, cwd=tmp_path, env=slurm.slurm_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = records(tmp_path)
    assert [(r["rank"], r["host"], r["world_size"], r["source"]) for r in ranks] == [
        (0, "node1", 2, source),
        (1, "node2", 2, source),
    ]
    assert ranks[0]["digest"] == ranks[1]["digest"]
    assert_no_job_left(slurm)


def test_a_failing_task_ends_the_step(slurm: NamespaceCluster, tmp_path: Path) -> None:
    argv = [
        "salloc",
        "-N",
        "2",
        "--ntasks-per-node",
        "1",
        *SAIL,
        "--dist-init-method",
        "slurm",
        str(JOB),
        str(tmp_path / "out"),
        "--steps",
        "500",
        "--die-rank",
        "1",
    ]
    result = slurm.run("node1", argv, cwd=tmp_path, env=slurm.slurm_env())
    assert result.returncode != 0
    assert records(tmp_path) == []
    assert_no_job_left(slurm)


def test_python_directly_in_a_batch_step_is_one_process(slurm: NamespaceCluster, tmp_path: Path) -> None:
    script = tmp_path / "direct.sh"
    script.write_text(f"#!/bin/bash\n{sys.executable} {JOB} {tmp_path / 'out'}\n")
    argv = ["salloc", "-N", "2", "--ntasks-per-node", "1", "bash", str(script)]
    result = slurm.run("node1", argv, cwd=tmp_path, env=slurm.slurm_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert [(r["rank"], r["world_size"], r["source"]) for r in records(tmp_path)] == [(0, 1, "single")]


SUBMIT = [sys.executable, "-m", "spikingsail.cli.main", "submit"]


def test_sail_submit_runs_the_job_through_sbatch(slurm: NamespaceCluster, tmp_path: Path) -> None:
    argv = [*SUBMIT, "-N", "2", "-J", "sailtest", "--wait", str(JOB), str(tmp_path / "out")]
    result = slurm.run("node1", argv, cwd=tmp_path, env=slurm.slurm_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ended: COMPLETED, exit status 0" in result.stdout
    assert (tmp_path / "sailtest.sbatch").read_text().startswith("#!/bin/bash")
    ranks = records(tmp_path)
    assert [(r["rank"], r["host"], r["source"]) for r in ranks] == [
        (0, "node1", "torchrun"),
        (1, "node2", "torchrun"),
    ]
    assert ranks[0]["digest"] == ranks[1]["digest"]
    assert_no_job_left(slurm)


def test_sail_submit_reports_a_failed_job(slurm: NamespaceCluster, tmp_path: Path) -> None:
    argv = [
        *SUBMIT,
        "-N",
        "2",
        "-J",
        "sailfail",
        "--dist-init-method",
        "slurm",
        "--wait",
        str(JOB),
        str(tmp_path / "out"),
        "--steps",
        "500",
        "--die-rank",
        "1",
    ]
    result = slurm.run("node1", argv, cwd=tmp_path, env=slurm.slurm_env())
    assert result.returncode != 0
    assert "ended: FAILED" in result.stdout, result.stdout + result.stderr
    assert records(tmp_path) == []
    assert_no_job_left(slurm)


ELASTIC_JOB = Path(__file__).parents[1] / "checkpoint" / "jobs" / "elastic_job.py"


def test_sail_submit_requeues_a_preempted_job_which_resumes_exactly(
    slurm: NamespaceCluster, tmp_path: Path
) -> None:
    """SLURM signals the batch shell (as --signal=B:USR1 does before the time limit); the ranks save
    and exit 75, the job is requeued, and the second run finishes from the checkpoint."""
    straight = subprocess.run(
        [*SAIL, "-n", "2", str(ELASTIC_JOB), str(tmp_path / "straight"), "--checkpoints-path",
         str(tmp_path / "ck-straight"), "--resume"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-2000:]

    out, checkpoints = tmp_path / "out", tmp_path / "ck"
    argv = [*SUBMIT, "-N", "2", "-J", "sailrq", "--requeue", "--wait", str(ELASTIC_JOB), str(out),
            "--checkpoints-path", str(checkpoints), "--resume", "--step-sleep", "0.3"]  # fmt: skip
    submit = subprocess.Popen(
        slurm.node_argv("node1", argv), cwd=tmp_path, env=slurm.slurm_env(), stdout=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 90
    progress = out / "progress0"
    while not (progress.exists() and progress.read_text() and int(progress.read_text()) >= 3):
        assert time.monotonic() < deadline and submit.poll() is None, "the job did not get going"
        time.sleep(0.1)
    job_id = slurm.run("node1", ["squeue", "-h", "-o", "%i"], env=slurm.slurm_env()).stdout.split()[0]
    signalled = slurm.run("node1", ["scancel", "--batch", "--signal=USR1", job_id], env=slurm.slurm_env())
    assert signalled.returncode == 0, signalled.stderr
    stdout, _ = submit.communicate(timeout=240)
    assert submit.returncode == 0, stdout
    assert f"job {job_id} ended: COMPLETED, exit status 0" in stdout
    log = (tmp_path / f"sailrq-{job_id}.out").read_text()
    assert "preempted by signal SIGUSR1" in log and "requeueing it" in log, log[-3000:]
    assert "resumed from" in log, log[-3000:]
    job = slurm.run("node1", ["scontrol", "show", "job", "-o", job_id], env=slurm.slurm_env()).stdout
    assert "Restarts=1" in job.split(), job
    result = json.loads((out / "rank0.json").read_text())
    assert result["started_at"] >= 3
    assert result["digest"] == json.loads((tmp_path / "straight" / "rank0.json").read_text())["digest"]
    assert_no_job_left(slurm)


def test_two_jobs_whose_first_node_is_the_same_keep_their_own_rendezvous(
    slurm: NamespaceCluster, tmp_path: Path
) -> None:
    """The second job's agents once found torchrun's port taken on node1, joined the first job's
    store instead, and died when the first job ended. Each job now meets at its own port."""

    def start(name: str) -> subprocess.Popen[str]:
        argv = ["salloc", "-N", "2", "--ntasks-per-node", "1", *SAIL, str(JOB), str(tmp_path / name),
                "--steps", "1", "--until", str(tmp_path / f"{name}.done"), "--step-sleep", "0.2"]  # fmt: skip
        log = (tmp_path / f"{name}.log").open("w")
        return subprocess.Popen(
            slurm.node_argv("node1", argv),
            cwd=tmp_path,
            env=slurm.slurm_env(),
            stdout=log,
            stderr=log,
            text=True,
        )

    def wait_started(name: str, job: subprocess.Popen[str]) -> None:
        deadline = time.monotonic() + 90
        while not all((tmp_path / name / f"started{rank}").exists() for rank in (0, 1)):
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / f"{name}.log").read_text()[
                -3000:
            ]
            time.sleep(0.2)

    first = start("first")
    wait_started("first", first)
    second = start("second")  # its agents meet on node1 while the first job's are there
    wait_started("second", second)
    (tmp_path / "first.done").touch()
    assert first.wait(timeout=180) == 0, (tmp_path / "first.log").read_text()[-3000:]

    # the second job outlives the first: 10 more steps, each an all-reduce of both ranks
    def step() -> int:
        path = tmp_path / "second" / "step0"
        return int(path.read_text() or 0) if path.exists() else 0

    steps = step()
    deadline = time.monotonic() + 60
    while step() < steps + 10:
        assert second.poll() is None and time.monotonic() < deadline, (tmp_path / "second.log").read_text()[
            -3000:
        ]
        time.sleep(0.2)
    (tmp_path / "second.done").touch()
    assert second.wait(timeout=180) == 0, (tmp_path / "second.log").read_text()[-3000:]
    for name in ("first", "second"):
        ranks = [json.loads(p.read_text()) for p in sorted((tmp_path / name).glob("rank*.json"))]
        assert [(r["rank"], r["host"]) for r in ranks] == [(0, "node1"), (1, "node2")]
        assert ranks[0]["steps"] == ranks[1]["steps"] >= 1
    endpoints = [
        re.search(r"--rdzv-endpoint (\S+)", (tmp_path / f"{name}.log").read_text())[1]  # type: ignore[index]
        for name in ("first", "second")
    ]
    assert endpoints[0].startswith("node1:") and endpoints[1].startswith("node1:")
    assert endpoints[0] != endpoints[1]
    assert_no_job_left(slurm)


ARGV_JOB = Path(__file__).with_name("jobs") / "argv_job.py"
HOSTILE = ["$(touch pwned)", 'a"b', "$UNSET", "`touch pwned`", "it's", "two\nlines", "--out=$HOME/x", "*"]


def test_sail_submit_passes_every_argument_as_typed(slurm: NamespaceCluster, tmp_path: Path) -> None:
    argv = [*SUBMIT, "-N", "2", "-J", "sailargs", "--wait", str(ARGV_JOB), str(tmp_path / "out"), *HOSTILE]
    result = slurm.run("node1", argv, cwd=tmp_path, env=slurm.slurm_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ended: COMPLETED, exit status 0" in result.stdout
    for rank in (0, 1):
        assert json.loads((tmp_path / "out" / f"argv{rank}.json").read_text()) == HOSTILE
    assert not (tmp_path / "pwned").exists()
    assert_no_job_left(slurm)
