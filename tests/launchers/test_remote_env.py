"""The environment shipped to the nodes: an allow-list, credentials never unless asked for, values
never on a command line, and the file they travel in."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from spikingsail.errors import LaunchError
from spikingsail.launchers.command import LaunchCommand
from spikingsail.launchers.remote_env import EnvFile, export_lines, looks_secret, read_env_file, remote_env
from spikingsail.launchers.request import parse_request
from tests.launchers.plans import plan
from tests.launchers.test_multinode_plan import remote, setenv


def test_environment_shipped_is_explicit(job: Path) -> None:
    (job / ".sail_env").write_text(
        "# cluster settings\nNCCL_SOCKET_IFNAME=eth0\nexport GLOO_SOCKET_IFNAME='eth0'\n"
    )
    shell = {"NCCL_DEBUG": "INFO", "AWS_SECRET_ACCESS_KEY": "s3cr3t", "HOME": "/root", "OMP_NUM_THREADS": "4"}
    env = remote_env({"NCCL_DEBUG": "WARN"}, shell=shell, search=(job / ".sail_env",))
    assert env == {
        "NCCL_DEBUG": "WARN",
        "OMP_NUM_THREADS": "4",
        "NCCL_SOCKET_IFNAME": "eth0",
        "GLOO_SOCKET_IFNAME": "eth0",
    }


def test_bad_env_file_line_and_flag(job: Path) -> None:
    (job / ".sail_env").write_text("A=1\nnot an assignment\n")
    with pytest.raises(LaunchError, match=r"\.sail_env:2: cannot read 'not an assignment'"):
        read_env_file(job / ".sail_env")
    with pytest.raises(LaunchError, match="--env 'NO-NAME=1' is not KEY=VALUE or KEY"):
        parse_request(["-H", "hostfile", "--env", "NO-NAME=1", "train.py"])
    with pytest.raises(LaunchError, match="--env NOT_SET_HERE: NOT_SET_HERE is not set in this shell"):
        parse_request(["-H", "hostfile", "--env", "NOT_SET_HERE", "train.py"])


def test_env_by_name_ships_this_shells_value(job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", SECRET)
    (node1, _) = plan(parse_request(["-H", "hostfile", "--env", "HF_TOKEN", "train.py"]))
    assert node1.uploads[0].env == {"HF_TOKEN": SECRET} and SECRET not in node1.render()


SECRET = "hf_s3cr3t_value"
EXPLICIT_SECRET = "wandb_s3cr3t_value"


def all_words(command: LaunchCommand) -> str:
    """Every command line the command runs, here or on the nodes (ssh passes its last word on)."""
    argvs = [command.argv, command.cleanup or [], command.relay or [], *(u.argv for u in command.uploads)]
    return " ".join(" ".join(argv) for argv in argvs)


# horovodrun refuses a credential for remote hosts (test_horovodrun.py): it would put it on their
# ssh command lines
@pytest.mark.parametrize("launcher", ["ssh", "pdsh", "mpirun"])
def test_the_environment_ships_by_allow_list_and_no_value_is_on_a_command_line(
    job: Path, monkeypatch: pytest.MonkeyPatch, launcher: str
) -> None:
    setenv(monkeypatch, {
        "HF_TOKEN": SECRET, "HF_HOME": "/data/hf", "NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0",
        "CUDA_LAUNCH_BLOCKING": "1", "TORCH_HUB_TOKEN": SECRET, "SSH_AUTH_SOCK": "/tmp/agent.sock",
        "AWS_SECRET_ACCESS_KEY": SECRET,
    })  # fmt: skip
    commands = plan(
        parse_request(["-H", "hostfile", "--launcher", launcher, "--env", f"WANDB_API_KEY={EXPLICIT_SECRET}",
                       "--env", "SAIL_X=a b'c", "train.py"])
    )  # fmt: skip
    for command in commands:
        assert SECRET not in all_words(command) and EXPLICIT_SECRET not in all_words(command)
        assert "a b" not in all_words(command)  # no value at all
        shipped = [u.env for u in command.uploads] or [command.env]
        for env in shipped:
            assert {k: env[k] for k in ("HF_HOME", "NCCL_DEBUG", "CUDA_LAUNCH_BLOCKING", "SAIL_X", "WANDB_API_KEY")} == {
                "HF_HOME": "/data/hf", "NCCL_DEBUG": "INFO", "CUDA_LAUNCH_BLOCKING": "1", "SAIL_X": "a b'c",
                "WANDB_API_KEY": EXPLICIT_SECRET,
            }  # fmt: skip
            assert (
                not {"HF_TOKEN", "TORCH_HUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "CUDA_VISIBLE_DEVICES"}
                & env.keys()
            )
            if launcher in ("ssh", "pdsh"):  # mpirun's own ssh needs the agent here
                assert "SSH_AUTH_SOCK" not in env
        if launcher == "mpirun":  # what it exports to the ranks, by name
            exported = {command.argv[i + 1] for i, word in enumerate(command.argv) if word == "-x"}
            assert exported == {"HF_HOME", "NCCL_DEBUG", "CUDA_LAUNCH_BLOCKING", "SAIL_X", "WANDB_API_KEY",
                                "MASTER_ADDR", "MASTER_PORT"}  # fmt: skip
        shown = command.render()
        assert SECRET not in shown and EXPLICIT_SECRET not in shown and "HF_TOKEN" not in shown
        assert "WANDB_API_KEY='****'" in shown and "HF_HOME=/data/hf" in shown


def test_a_device_mask_ships_only_when_asked_for(job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    for name in (
        "CUDA_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
    ):
        assert name not in remote_env({}, shell={name: "0", "NCCL_DEBUG": "INFO"}, search=())
        assert remote_env({name: "1,3"}, shell={name: "0"}, search=())[name] == "1,3"
    (node1, node2) = plan(parse_request(["-H", "hostfile", "train.py"]))
    assert node1.uploads == node2.uploads == []  # nothing shipped: the nodes use their own GPUs
    (node1, _) = plan(parse_request(["-H", "hostfile", "--env", "CUDA_VISIBLE_DEVICES=1", "train.py"]))
    assert node1.uploads[0].env == {"CUDA_VISIBLE_DEVICES": "1"}


@pytest.mark.parametrize(
    ("name", "secret"),
    [("HF_TOKEN", True), ("GITHUB_TOKEN", True), ("AWS_SECRET_ACCESS_KEY", True), ("AWS_ACCESS_KEY_ID", True),
     ("WANDB_API_KEY", True), ("OPENAI_APIKEY", True), ("DB_PASSWORD", True), ("MYSQL_PWD", True),
     ("SSH_AUTH_SOCK", True), ("GOOGLE_APPLICATION_CREDENTIALS", True), ("SMTP_PASS", True), ("api_key", True),
     ("NCCL_DEBUG", False), ("CUDA_LAUNCH_BLOCKING", False), ("HF_HOME", False), ("PWD", False),
     ("OMP_NUM_THREADS", False), ("NCCL_IB_PKEY", False), ("TORCH_NCCL_ASYNC_ERROR_HANDLING", False)],
)  # fmt: skip
def test_names_that_look_like_credentials(name: str, secret: bool) -> None:
    assert looks_secret(name) is secret


def test_the_env_file_is_private_and_read_exactly(tmp_path: Path) -> None:
    """The upload's and the agent's shell lines, run for real by sh, as ssh runs them on a node."""
    env = {
        "A": "plain",
        "B": "sp ace",
        "C": 'it\'s "q" $(touch pwned) `id` $HOME',
        "D": "two\nlines",
        "E": "",
    }
    env_file = EnvFile(token="t0k3n")
    shell = {"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path)}
    sent = subprocess.run(["sh", "-c", env_file.receive()], input=export_lines(env), text=True, env=shell,
                          cwd=tmp_path, capture_output=True, check=False)  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    (directory,) = tmp_path.glob("sail-t0k3n-*")
    assert directory.name == f"sail-t0k3n-{socket.gethostname()}"
    assert directory.stat().st_mode & 0o777 == 0o700 and (directory / "env").stat().st_mode & 0o777 == 0o600
    again = subprocess.run(["sh", "-c", env_file.receive()], input="export A=x\n", text=True, env=shell,
                           capture_output=True, check=False)  # fmt: skip
    assert again.returncode != 0  # an existing path is never written into
    show = (
        f"{env_file.source()} && {sys.executable} -c 'import json, os; print(json.dumps(dict(os.environ)))'"
    )
    read = subprocess.run(
        ["sh", "-c", show], env=shell, cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert read.returncode == 0, read.stderr

    seen = json.loads(read.stdout)
    assert {k: seen[k] for k in env} == env
    assert not directory.exists() and not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_ssh_and_pdsh_send_the_environment_ahead(job: Path, launcher: str) -> None:
    commands = plan(
        parse_request(["-H", "hostfile", "--launcher", launcher, "--env", "NCCL_DEBUG=INFO", "train.py"])
    )
    uploads = [u for c in commands for u in c.uploads]
    assert [u.host for u in uploads] == ["node1", "node2"]
    for upload in uploads:
        assert upload.argv[upload.argv.index("--") + 1] == upload.host
        assert "-tt" not in upload.argv  # a terminal would echo what is sent
        assert upload.text == "export NCCL_DEBUG=INFO\n"
    for command in commands:
        assert remote(command.argv)[0] == "."  # the agent's line reads the file first


SAIL = [sys.executable, "-m", "spikingsail.cli.main", "launch"]


def test_dry_run_prints_no_credential(job: Path) -> None:
    env = {**os.environ, "HF_TOKEN": SECRET, "NCCL_DEBUG": "INFO"}
    argv = [*SAIL, "-H", "hostfile", "--dry-run", "--env", f"WANDB_API_KEY={EXPLICIT_SECRET}", "train.py"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    shown = done.stdout + done.stderr
    assert SECRET not in shown and "HF_TOKEN" not in shown and EXPLICIT_SECRET not in shown
    assert "WANDB_API_KEY='****'" in done.stdout and "NCCL_DEBUG=INFO" in done.stdout
