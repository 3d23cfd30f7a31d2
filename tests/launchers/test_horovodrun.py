"""`sail launch --launcher horovodrun`: the command as data (a golden file), its refusals, and one
real run of two ranks on this machine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from spikingsail.errors import LaunchError
from spikingsail.launchers.failure import Failure
from spikingsail.launchers.horovodrun import remote_hosts
from spikingsail.launchers.remote_env import FORWARDED_NAMES, FORWARDED_PREFIXES
from spikingsail.launchers.replicas import free_port
from spikingsail.launchers.request import parse_request
from tests.launchers.plans import plan

GOLDEN = Path(__file__).with_name("golden")
JOB = Path(__file__).parents[1] / "backends" / "jobs" / "horovod_job.py"


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with train.py and a shell whose variables are known."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").touch()
    for key in list(os.environ):
        if key.startswith((*FORWARDED_PREFIXES, "HOROVOD_", "MASTER_")) or key in {
            *FORWARDED_NAMES,
            "USER",
            "SSH_AUTH_SOCK",
        }:
            monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.sail_env
    monkeypatch.setenv("PATH", "/usr/local/bin:/usr/bin:/bin")
    return tmp_path


def test_horovodrun_command(job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "INFO")  # an allowed prefix: shipped
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "33554432")  # Horovod tuning: shipped
    monkeypatch.setenv("HOROVOD_RANK", "5")  # horovodrun sets it per process: never from the shell
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")  # anything else stays here
    monkeypatch.setenv("HOROVOD_GLOO_TOKEN", "s3cr3t")  # a credential's name: stays here too
    (command,) = plan(parse_request([
        "--launcher", "horovodrun", "-H", "node1:2,node2:2", "-np", "3", "--ssh-port", "222",
        "--master-port", "23456", "--env", "SAIL_PROBE=yes", "--launcher-args=--verbose", "--rdzv-id", "job7",
        "train.py", "--lr", "0.1",
    ]))  # fmt: skip
    expected = (GOLDEN / "horovodrun.txt").read_text().format(python=sys.executable, home=job / "home")
    assert command.render() == expected.rstrip("\n")
    # what the ranks get is horovodrun's whole environment, and no value is on its command line
    assert command.clean_env
    assert command.env == {
        "HOME": str(job / "home"), "PATH": "/usr/local/bin:/usr/bin:/bin", "HOROVOD_FUSION_THRESHOLD": "33554432",
        "MASTER_ADDR": "node1", "MASTER_PORT": "23456", "NCCL_DEBUG": "INFO", "SAIL_PROBE": "yes",
    }  # fmt: skip
    assert command.argv[0] == sys.executable
    assert [arg for arg in command.argv if "=" in arg] == ["sail-run=job7"]  # the ranks' mark, no value


def test_without_hosts_every_process_runs_here(job: Path) -> None:
    for flags in (["-n", "3"], ["-np", "3"]):
        (command,) = plan(parse_request(["--launcher", "horovodrun", *flags, "train.py"]))
        assert command.argv[-8:-3] == ["-np", "3", "-H", "localhost:3", sys.executable]
        assert command.argv[-3] == "-X" and command.argv[-2].startswith("sail-run=sail-")
        assert command.argv[-1] == "train.py"


def test_module_and_no_python(job: Path) -> None:
    (module,) = plan(parse_request(["--launcher", "horovodrun", "-H", "localhost:2", "--rdzv-id", "j", "-m",
                                    "pkg.train", "x"]))  # fmt: skip
    assert module.argv[-7:] == ["localhost:2", sys.executable, "-X", "sail-run=j", "-m", "pkg.train", "x"]
    assert module.relay is not None and module.cleanup is not None and not module.stand_ins
    (binary,) = plan(
        parse_request(["--launcher", "horovodrun", "-H", "localhost:2", "--no-python", "train.py"])
    )
    assert binary.argv[-2:] == ["localhost:2", "train.py"]
    # no Python, no mark to find the ranks by: signals go to horovodrun, which ends every rank with
    # SIGTERM on SIGINT and SIGTERM only
    assert binary.relay is None and binary.cleanup is None
    assert binary.stand_ins == {"SIGHUP": "SIGTERM", "SIGQUIT": "SIGTERM", "SIGUSR1": "SIGTERM"}


# A rank that forks (a data loader worker) and the child, with the same command line.
FORKING_RANK = """
import os, signal, sys, time
out = sys.argv[1]
def note(name):
    def handler(signum, frame):
        open(os.path.join(out, name), "w").close()
    return handler
if os.fork() == 0:
    signal.signal(signal.SIGUSR1, note("child"))
else:
    signal.signal(signal.SIGUSR1, note("rank"))
open(os.path.join(out, f"ready{os.getpid()}"), "w").close()
time.sleep(30)
"""


def test_a_signal_reaches_each_rank_of_the_job_and_not_its_forked_children(job: Path) -> None:
    (command,) = plan(parse_request(["--launcher", "horovodrun", "-H", "localhost:1", "--rdzv-id", "job7",
                                     "train.py"]))  # fmt: skip
    assert command.relay is not None
    script = job / "rank.py"
    script.write_text(FORKING_RANK)
    for out in ("ours", "other"):
        (job / out).mkdir()
    ours = subprocess.Popen([sys.executable, "-X", "sail-run=job7", str(script), str(job / "ours")])
    other = subprocess.Popen([sys.executable, "-X", "sail-run=job77", str(script), str(job / "other")])
    try:
        deadline = time.monotonic() + 30
        while len(list(job.glob("*/ready*"))) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        subprocess.run([*command.relay, "USR1"], check=True, timeout=30)
        deadline = time.monotonic() + 10
        while not (job / "ours" / "rank").exists():
            assert time.monotonic() < deadline, "the rank did not get SIGUSR1"
            time.sleep(0.05)
        time.sleep(0.5)
        assert not (job / "ours" / "child").exists()  # only the rank itself, as torchrun's agent does
        assert not {"rank", "child"} & {f.name for f in (job / "other").iterdir()}  # another job's: untouched
    finally:
        for process in (ours, other):
            process.kill()
        subprocess.run(["pkill", "-KILL", "-f", str(script)], check=False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--launcher", "horovodrun", "--nproc-per-node", "gpu", "train.py"], "--launcher horovodrun needs hosts"),
        (["--launcher", "horovodrun", "-H", "a:2,b:2", "--include", "a:1@b"], "cannot give a a chosen set of slots"),
        (["--launcher", "horovodrun", "-H", "a:2", "--ssh-user", "bob"], "cannot pass --ssh-user to ssh"),
        (["--launcher", "horovodrun", "-H", "a:2", "-np", "3"], "-np 3 but the hosts offer 2 slot"),
    ],
)  # fmt: skip
def test_refusals(job: Path, argv: list[str], message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        plan(parse_request([*argv, "train.py"] if "train.py" not in argv else argv))


def test_without_horovod_installed(job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "horovod", None)  # what an absent package looks like to import
    with pytest.raises(LaunchError, match=r"horovodrun command is not installed(.|\n)*build-horovod\.sh"):
        plan(parse_request(["--launcher", "horovodrun", "-H", "localhost:2", "train.py"]))


def test_only_other_machines_are_checked_over_ssh() -> None:
    local = ["localhost", "127.0.0.1", socket.gethostname()]
    assert remote_hosts([*local, "192.0.2.7", "no-such-host.invalid"]) == [
        "192.0.2.7",
        "no-such-host.invalid",
    ]


@pytest.mark.multiprocess
def test_sail_launch_with_horovodrun_trains_two_ranks(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text('[{"tag": "run", "backend": "horovod"}]')
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": "s3cr3t"}
    argv = [sys.executable, "-m", "spikingsail.cli.main", "launch", "--launcher", "horovodrun",
            "-H", "localhost:2", "--master-port", str(free_port()), "--env", "SAIL_PROBE=yes",
            str(JOB), str(tmp_path), str(tmp_path / "plan.json")]  # fmt: skip
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[localhost] [0]<stderr>:" in done.stdout + done.stderr  # horovodrun's rank prefixes, relayed
    runs = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)["run"] for rank in (0, 1)]
    for run in runs:
        assert run["rank_source"] == "horovod" and run["steps"] == 6
        # what the ranks got: sail's explicit environment, not the launching shell's
        assert run["env"]["MASTER_ADDR"] == "localhost" and run["env"]["SAIL_PROBE"] == "yes"
        assert run["env"]["AWS_SECRET_ACCESS_KEY"] is None
    global_losses = [(a + b) / 2 for a, b in zip(runs[0]["losses"], runs[1]["losses"], strict=True)]
    assert global_losses[-1] < global_losses[0]  # the same run every time: seeds, data and order are fixed
    for key, value in runs[0]["params"].items():
        assert torch.equal(runs[1]["params"][key], value), key


def test_a_failed_rank_is_named_with_its_own_last_output() -> None:
    tail = [
        "[1]<stderr>:Traceback (most recent call last):",
        "[1]<stderr>:ValueError: horovod.op is 'Sum'",
        "[0]<stderr>:[rank0] waiting for rank 1",
        "Traceback (most recent call last):",
        "RuntimeError: Horovod detected that one or more processes exited with non-zero status, thus "
        "causing the job to be terminated. The first process to do so was:",
        "Process name: 1",
        "Exit code: 1",
    ]
    text = Failure(host="localhost", exit_code=1, tail=tail).describe()
    assert text.startswith(
        "horovodrun failed (exit status 1): rank 1 exited with 1 first; its last output:\n"
    )
    assert text.endswith("\n    Traceback (most recent call last):\n    ValueError: horovod.op is 'Sum'")


def test_a_rank_stopped_by_a_sail_error_is_reported_with_its_message() -> None:
    tail = [
        "[1]<stderr>:Traceback (most recent call last):",
        "[1]<stderr>:spikingsail.errors.ConfigError: <dict>: horovod.op is 'Sum'",
        "[1]<stderr>:  why: Horovod sums with op 'Sum' only as 'Average' divided by the size",
        "[0]<stderr>:  why: a line of another rank",
        "[1]<stderr>:  fix: write 'Average'",
        "Process name: 1",
        "Exit code: 1",
    ]
    tail[-2:-2] = ["The first process to do so was:"]
    failure = Failure(host="localhost", exit_code=1, tail=tail)
    assert failure.describe() == (
        "horovodrun failed (exit status 1): rank 1 exited with 1 first; the rank's error:\n"
        "ConfigError: <dict>: horovod.op is 'Sum'\n"
        "  why: Horovod sums with op 'Sum' only as 'Average' divided by the size\n"
        "  fix: write 'Average'"
    )


def test_a_credential_for_remote_hosts_is_refused_not_put_on_their_ssh_command_line(job: Path) -> None:
    with pytest.raises(
        LaunchError, match=r"would show WANDB_API_KEY on the ssh command line of node1"
    ) as err:
        plan(parse_request(["--launcher", "horovodrun", "-H", "node1:2,node2:2", "--env", "WANDB_API_KEY=k3y",
                            "train.py"]))  # fmt: skip
    assert "k3y" not in str(err.value) and "--launcher ssh, pdsh or mpirun" in str(err.value)


def test_a_credential_for_this_machine_only_goes_in_horovodruns_environment(job: Path) -> None:
    (command,) = plan(parse_request(["--launcher", "horovodrun", "-H", "localhost:2", "--env", "WANDB_API_KEY=k3y",
                                     "train.py"]))  # fmt: skip
    assert command.env["WANDB_API_KEY"] == "k3y"
    assert not any("k3y" in arg for arg in command.argv) and "k3y" not in command.render()
