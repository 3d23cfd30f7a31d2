"""Numbers and strings on `sail launch`, `sail submit`, `sail doctor` and `sail bench comm` command lines
are checked when they are read: one what / why / fix message and exit status 2, never a traceback, and
never accepted only to fail later on the nodes (or be written into an sbatch script)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spikingsail.cli import doctor
from spikingsail.cli.main import main
from spikingsail.errors import LaunchError


def sail(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``sail ARGV`` in this process: its exit status (argparse's usage error exits 2) and stderr."""
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = int(exit_.code or 0)
    return status, capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--master-port", "99999"], "--master-port 99999"),
        (["--master-port", "-1"], "--master-port -1"),
        (["--master-port", "0"], "--master-port 0"),
        (["--ssh-port", "-5"], "--ssh-port -5"),
        (["--ssh-port", "65536"], "--ssh-port 65536"),
        (["--connect-timeout", "-3"], "--connect-timeout -3"),
        (["--connect-timeout", "0"], "--connect-timeout 0"),
        (["--heartbeat-timeout", "99999999"], "--heartbeat-timeout 99999999"),
        (["--rdzv-endpoint", "h1:notaport"], "--rdzv-endpoint 'h1:notaport'"),
        (["--rdzv-endpoint", "h1:65536"], "--rdzv-endpoint 'h1:65536'"),
        (["--rdzv-endpoint", "h1:0", "--nnodes", "2"], "port 0 for a job on more than one node"),
        (["--rdzv-backend", "static", "--rdzv-endpoint", "h1"], "names no port"),
        (["--master-addr", "a b", "--master-port", "29500"], "--master-addr 'a b'"),
        (["--nnodes", "x"], "--nnodes 'x'"),
        (["--nnodes", "2:1"], "--nnodes '2:1'"),
        (["--nnodes", "0"], "--nnodes '0'"),
        (["--nnodes", "1:2:3"], "--nnodes '1:2:3'"),
        (["--max-restarts", "-1"], "--max-restarts -1"),
        (["--ft-replicas", "99999"], "--ft-replicas 99999"),
        (["--ft-replicas", "3", "-H", "a:1,b:1"], "the hosts are 2"),
        (["--ft-replicas", "2", "--ft-heartbeat-timeout", "inf"], "--ft-heartbeat-timeout inf"),
        (["--ft-replicas", "2", "--ft-heartbeat-timeout", "nan"], "--ft-heartbeat-timeout nan"),
        (["--ft-replicas", "2", "--ft-heartbeat-timeout", "1e300"], "--ft-heartbeat-timeout 1e+300"),
        (["--launcher-args", "--mca 'unbalanced"], "No closing quotation"),
        (["-H", "a:1", "--ssh-config", "no-such-file"], "--ssh-config no-such-file: cannot read it"),
    ],
)
def test_launch_refuses_a_bad_value_before_anything_starts(
    job: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    status, err = sail(["launch", "--dry-run", "-n", "1", *flags, "train.py"], capsys)
    assert status == 2 and message in err and "Traceback" not in err, err
    assert err.startswith("sail launch: ") and "why: " in err and "fix: " in err, err


def test_gpu_processes_need_a_gpu_here(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """torchrun refuses --nproc-per-node gpu where torch sees no GPU; on this machine that is known now."""
    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here: --nproc-per-node gpu is one process per GPU")
    status, err = sail(["launch", "--dry-run", "-n", "gpu", "train.py"], capsys)
    assert status == 2 and "--nproc-per-node gpu on a machine where torch sees no CUDA GPU" in err, err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nproc-per-node", "-1"], "--nproc-per-node -1"),
        (["--nproc-per-node", "0"], "--nproc-per-node 0"),
        (["--requeue", "--signal-before", "-5"], "--signal-before -5"),
        (["--signal-before", "70000"], "--signal-before 70000"),
        (["-N", "0"], "--nodes 0"),
        (["--gpus-per-node", "-2"], "--gpus-per-node -2"),
        (["-c", "0"], "--cpus-per-task 0"),
        (["--max-restarts", "-1"], "--max-restarts -1"),
        (["--master-port", "99999"], "--master-port 99999"),
    ],
)
def test_submit_refuses_a_bad_value_before_writing_the_script(
    job: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    status, err = sail(["submit", "--dry-run", *flags, "train.py"], capsys)
    assert status == 2 and message in err and "Traceback" not in err, err
    assert not list(job.glob("*.sbatch"))


@pytest.mark.parametrize("command", [["doctor"], ["bench", "comm", "--dry-run"]])
def test_doctor_and_bench_refuse_an_unbalanced_quote(
    job: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    argv = [*command, "--launcher-args", '"-x FOO']
    if command == ["doctor"]:  # the doctor has no dry run: its reading of the flags, before any check
        _, flags = doctor.parse(argv[1:])
        with pytest.raises(LaunchError, match="No closing quotation"):
            doctor.job(flags)
        return
    status, err = sail(argv, capsys)
    assert status == 2 and "No closing quotation" in err and "Traceback" not in err, err


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0", "1e9"])
def test_the_doctors_timeout_is_a_time(capsys: pytest.CaptureFixture[str], value: str) -> None:
    status, err = sail(["doctor", "--timeout", value], capsys)
    assert status == 2 and f"sail doctor: --timeout {float(value)}" in err, err


@pytest.mark.parametrize(
    "flags",
    [
        ["--master-port", "1"],
        ["--master-port", "65535"],
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h1"],
        ["--rdzv-endpoint", "h1:0"],
        ["--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "[::1]:29400"],
        ["--ssh-port", "65535", "--connect-timeout", "86400"],
        ["--ft-replicas", "2", "--ft-heartbeat-timeout", "0.05"],
    ],
)
def test_the_ends_of_each_range_are_accepted(
    job: Path, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    status, err = sail(["launch", "--dry-run", "-n", "1", *flags, "train.py"], capsys)
    assert status == 0, err
