"""What `sail launch -H` must never do on real nodes: show a secret on a command line, ship the
launching shell's GPU mask, ignore a signal, or leave a process behind after one."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from spikingsail.launchers.command import FORWARDED
from spikingsail.launchers.lifeline import AGENT_GRACE_SECONDS
from spikingsail.monitor.heartbeat import py_spy
from tests.cluster.harness import NamespaceCluster, processes_with
from tests.cluster.test_ssh_pdsh import SAIL, assert_no_job_left, hostfile

pytestmark = pytest.mark.cluster
JOB = Path(__file__).with_name("jobs") / "signal_job.py"


def wait_for(condition: Callable[[], bool], seconds: float, what: Callable[[], str]) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what()
        time.sleep(0.05)


def left(out: str, what: str) -> str:
    """What is left of the job writing to ``out``, with each process's Python stacks (py-spy): where
    a process that should have ended is waiting."""
    found, spy, stacks = processes_with(out), py_spy(), []
    for pid in found if spy else []:
        try:
            dump = subprocess.run(
                [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
            )
            stacks.append(dump.stdout or dump.stderr)
        except subprocess.TimeoutExpired:
            stacks.append(f"{pid}: py-spy dump took over 30 s")
    return f"left after {what}: {found}\n" + "\n".join(stacks)


def start(
    cluster: NamespaceCluster,
    tmp_path: Path,
    flags: list[str],
    job_args: list[str],
    env: dict[str, str],
    sail: list[str] = SAIL,
) -> subprocess.Popen[str]:
    argv = [*sail, "-H", str(hostfile(tmp_path)), "--ssh-config", str(cluster.ssh_config), *flags,
            str(JOB), str(tmp_path / "out"), *job_args]  # fmt: skip
    log = (tmp_path / "launch.log").open("w")
    return subprocess.Popen(
        cluster.node_argv("node1", argv), cwd=tmp_path, env=env, stdout=log, stderr=log, text=True
    )


def stop(tmp_path: Path) -> None:
    """Ask the job to end by itself (signal_job.py watches for the file)."""
    (tmp_path / "out").mkdir(exist_ok=True)
    (tmp_path / "out" / "stop").touch()


def started(tmp_path: Path) -> bool:
    return all((tmp_path / "out" / f"started{rank}").exists() for rank in (0, 1))


def command_lines(cluster: NamespaceCluster) -> list[str]:
    """The command line of every process on both nodes."""
    lines = []
    for name in cluster.names:
        for pid in cluster.pids(name):
            try:
                lines.append(
                    Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
            except OSError:
                continue  # it ended meanwhile
    return lines


@pytest.mark.parametrize("launcher", ["ssh", "pdsh", "mpirun"])
def test_no_secret_on_any_command_line_and_only_the_allowed_environment_arrives(
    cluster: NamespaceCluster, tmp_path: Path, launcher: str
) -> None:
    shell_secret, given_secret = f"hf_{secrets.token_hex(8)}", f"wandb_{secrets.token_hex(8)}"
    env = {**cluster.slurm_env(), "HF_TOKEN": shell_secret, "WANDB_API_KEY": given_secret,
           "CUDA_VISIBLE_DEVICES": "0", "NCCL_DEBUG": "WARN"}  # fmt: skip
    names = ["HF_TOKEN", "WANDB_API_KEY", "CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "SAIL_NOTE"]
    # asked for by name, so that the value is on no command line, not even sail's own
    process = start(
        cluster, tmp_path, ["--launcher", launcher, "--env", "WANDB_API_KEY", "--env", "SAIL_NOTE=two words"],
        [arg for name in names for arg in ("--env", name)], env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        seen = 0
        # from the launch until both ranks run, and a while after: every process on both nodes
        while not started(tmp_path) or seen < 40:
            assert process.poll() is None, (tmp_path / "launch.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the job did not start on both nodes"
            for line in command_lines(cluster):
                assert shell_secret not in line and given_secret not in line, line
            seen += started(tmp_path)
            time.sleep(0.02)
    finally:
        stop(tmp_path)
    assert process.wait(timeout=60) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / "out" / f"env{rank}.json").read_text())
        assert got == {"HF_TOKEN": None, "WANDB_API_KEY": given_secret, "CUDA_VISIBLE_DEVICES": None,
                       "NCCL_DEBUG": "WARN", "SAIL_NOTE": "two words"}  # fmt: skip
    log = (tmp_path / "launch.log").read_text()
    assert shell_secret not in log and given_secret not in log
    leftovers = [p for p in Path("/tmp").glob("sail-*/env") if given_secret in p.read_text(errors="replace")]
    assert not leftovers  # the file the environment travelled in is gone
    assert_no_job_left(cluster)


def test_dry_run_shows_no_secret(cluster: NamespaceCluster, tmp_path: Path) -> None:
    shell_secret, given_secret = f"hf_{secrets.token_hex(8)}", f"wandb_{secrets.token_hex(8)}"
    argv = [*SAIL, "-H", str(hostfile(tmp_path)), "--dry-run", "--env", f"WANDB_API_KEY={given_secret}",
            str(JOB), str(tmp_path / "out")]  # fmt: skip
    result = cluster.run("node1", argv, cwd=tmp_path, env={**cluster.slurm_env(), "HF_TOKEN": shell_secret})
    assert result.returncode == 0, result.stderr
    assert "HF_TOKEN" not in result.stdout and shell_secret not in result.stdout + result.stderr
    assert "WANDB_API_KEY='****'" in result.stdout and given_secret not in result.stdout + result.stderr


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def sail_pid(out: str) -> int:
    """The ``sail launch`` process of the job writing to ``out`` (salloc's command line names it too:
    sail is the one that starts with its Python)."""
    (pid,) = [p for p, line in processes_with(out).items() if line.startswith(" ".join(SAIL))]
    return pid


# SIGKILL cannot be caught: sail's watchdog ends the trees of the clients sail started, and each
# node's part of the job ends when its connection drops.
SIGNALS = [*FORWARDED, signal.SIGKILL]
# Every launcher forwards the catchable signals through one code path (its ``agent_signals`` or
# relay): ssh runs all of them; the others run one forwarded signal, the preemption signal and SIGKILL.
SOME_SIGNALS = [signal.SIGTERM, signal.SIGUSR1, signal.SIGKILL]
LAUNCHER_SIGNALS = [
    (launcher, signum)
    for launcher in ("ssh", "pdsh", "mpirun", "horovodrun")
    for signum in (SIGNALS if launcher == "ssh" else SOME_SIGNALS)
]


def signal_the_launcher(process: subprocess.Popen[str], tmp_path: Path, signum: signal.Signals) -> None:
    """Once both ranks run, send ``signum`` to sail; within 10 s no process of the job, stopped ones
    included, is left on either node (they share this process table)."""
    out = str(tmp_path / "out")
    wait_for(lambda: started(tmp_path), 90, lambda: (tmp_path / "launch.log").read_text()[-3000:])
    os.kill(sail_pid(out), signum)
    wait_for(lambda: not processes_with(out), 10, lambda: left(out, signum.name))
    code = process.wait(timeout=10)
    if signum != signal.SIGKILL:  # a wrapper (salloc) reports a killed child in words of its own
        assert code == 128 + signum
    if signum == signal.SIGUSR1:
        assert (tmp_path / "out" / "usr1-0").exists() and (tmp_path / "out" / "usr1-1").exists()


def launch_with(
    cluster: NamespaceCluster, tmp_path: Path, launcher: str, flags: list[str] | None = None
) -> subprocess.Popen[str]:
    """``start`` with ``--launcher LAUNCHER``; horovodrun's ssh takes no -F, so for it node1's own
    ssh_config is the cluster's, as ~/.ssh/config would be, and the hosts are a host list."""
    flags = ["--launcher", launcher, *(flags or [])]
    if launcher != "horovodrun":
        return start(cluster, tmp_path, flags, [], cluster.slurm_env())
    argv = [*SAIL, "-H", "node1:1,node2:1", *flags, str(JOB), str(tmp_path / "out")]
    log = (tmp_path / "launch.log").open("w")
    prelude = f"mount --bind {cluster.ssh_config} /etc/ssh/ssh_config"
    return subprocess.Popen(cluster.node_argv("node1", argv, prelude=prelude), cwd=tmp_path,
                            env=cluster.slurm_env(), stdout=log, stderr=log, text=True)  # fmt: skip


@pytest.mark.parametrize(
    ("launcher", "signum"), LAUNCHER_SIGNALS, ids=[f"{s.name}-{launcher}" for launcher, s in LAUNCHER_SIGNALS]
)
def test_every_signal_to_the_launcher_reaches_both_nodes_and_leaves_nothing(
    cluster: NamespaceCluster, tmp_path: Path, launcher: str, signum: signal.Signals
) -> None:
    process = launch_with(cluster, tmp_path, launcher)
    try:
        signal_the_launcher(process, tmp_path, signum)
    finally:
        stop(tmp_path)
        process.kill()
    assert_no_job_left(cluster)


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_pkill_by_sails_command_line_leaves_nothing_on_either_node(
    cluster: NamespaceCluster, tmp_path: Path, launcher: str
) -> None:
    """``pkill -f 'sail launch'`` (narrowed to this job: other jobs may run here) signals every
    process whose command line says so at once: sail alone (no process on either node carries its
    command line), which passes the signal on to both nodes and leaves nothing."""
    sail = [sys.executable, str(Path(sys.executable).with_name("sail")), "launch"]
    process = start(cluster, tmp_path, ["--launcher", launcher], [], cluster.slurm_env(), sail=sail)
    out = str(tmp_path / "out")
    try:
        wait_for(lambda: started(tmp_path), 90, lambda: (tmp_path / "launch.log").read_text()[-3000:])
        named = [line for line in processes_with(out).values() if "sail launch" in line]
        assert len(named) == 1, processes_with(out)
        subprocess.run(["pkill", "-f", f"sail launch .*{out}"], check=True)
        wait_for(lambda: not processes_with(out), 10, lambda: left(out, "pkill"))
        assert process.wait(timeout=10) == 128 + signal.SIGTERM
    finally:
        stop(tmp_path)
        process.kill()
    assert_no_job_left(cluster)


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_a_signal_travels_over_the_nodes_tethers_when_no_new_connection_can_be_made(
    cluster: NamespaceCluster, tmp_path: Path, launcher: str
) -> None:
    # once the job runs, every node's sshd takes no new connection (its SYNs are dropped): the
    # signal reaches both nodes' agents over the tethers' connections, which stand already
    process = launch_with(cluster, tmp_path, launcher)
    rule = ["INPUT", "-p", "tcp", "--syn", "--dport", "22", "-j", "DROP"]
    blocked = []
    try:
        wait_for(lambda: started(tmp_path), 90, lambda: (tmp_path / "launch.log").read_text()[-3000:])
        for name in cluster.names:
            subprocess.run(["ip", "netns", "exec", cluster.netns[name], "iptables", "-A", *rule], check=True)
            blocked.append(name)
        signal_the_launcher(process, tmp_path, signal.SIGUSR1)
    finally:
        for name in blocked:
            subprocess.run(["ip", "netns", "exec", cluster.netns[name], "iptables", "-D", *rule], check=True)
        stop(tmp_path)
        process.kill()
    assert_no_job_left(cluster)


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
def test_every_signal_to_the_launcher_reaches_the_tasks_of_an_allocation(
    slurm: NamespaceCluster, tmp_path: Path, signum: signal.Signals
) -> None:
    argv = ["salloc", "-N", "2", "--ntasks-per-node", "1", *SAIL, str(JOB), str(tmp_path / "out")]
    log = (tmp_path / "launch.log").open("w")
    process = subprocess.Popen(slurm.node_argv("node1", argv), cwd=tmp_path, env=slurm.slurm_env(), stdout=log,
                               stderr=log, text=True)  # fmt: skip
    try:
        signal_the_launcher(process, tmp_path, signum)
    finally:
        stop(tmp_path)
        process.kill()
    assert_no_job_left(slurm)


def test_a_second_launch_onto_a_live_jobs_rendezvous_port_is_refused_naming_it(
    cluster: NamespaceCluster, tmp_path: Path
) -> None:
    out = str(tmp_path / "out")
    first = start(cluster, tmp_path, [], [], cluster.slurm_env())
    try:
        wait_for(lambda: started(tmp_path), 90, lambda: (tmp_path / "launch.log").read_text()[-3000:])
        argv = [*SAIL, "-H", str(hostfile(tmp_path)), "--ssh-config", str(cluster.ssh_config), str(JOB),
                str(tmp_path / "second")]  # fmt: skip
        second = cluster.run("node1", argv, cwd=tmp_path, env=cluster.slurm_env())
        assert second.returncode != 0
        # node1's torchrun agent holds the store (node2's runs the same command line)
        (agent,) = [pid for pid, line in processes_with(out).items()
                    if line.startswith(f"{sys.executable} -m torch.distributed.run")
                    and pid in cluster.pids("node1")]  # fmt: skip
        assert f"the rendezvous port 29500 on node1 is taken by pid {agent} (" in second.stderr, second.stderr
        assert "torch.distributed.run" in second.stderr and "--master-port" in second.stderr
        assert not (tmp_path / "second").exists()  # nothing of the second job started
        assert first.poll() is None  # the first job runs on
    finally:
        stop(tmp_path)
    assert first.wait(timeout=60) == 0
    assert_no_job_left(cluster)


@pytest.mark.alone  # a 3 s heartbeat timeout and a 5 s bound
@pytest.mark.parametrize("launcher", ["ssh", "pdsh", "mpirun", "horovodrun"])
def test_a_network_cut_from_the_launching_host_ends_the_other_nodes_part_within_the_bound(
    cluster: NamespaceCluster, tmp_path: Path, launcher: str
) -> None:
    timeout = 3
    flags = ["--heartbeat-timeout", str(timeout)]
    if launcher == "mpirun":  # the namespaces' only link (Open MPI tries every interface otherwise)
        flags += [
            "--launcher-args",
            "--mca btl_tcp_if_include 10.99.0.0/24 --mca oob_tcp_if_include 10.99.0.0/24",
        ]
    process = launch_with(cluster, tmp_path, launcher, flags)
    try:
        wait_for(lambda: started(tmp_path), 90, lambda: (tmp_path / "launch.log").read_text()[-3000:])
        node2 = set(cluster.pids("node2"))
        out = str(tmp_path / "out")
        on_node2 = [pid for pid in processes_with(out) if pid in node2]
        assert on_node2, "the job runs on node2"
        link = ["ip", "-n", cluster.netns["node1"], "link", "set", "sail0"]
        subprocess.run([*link, "down"], check=True)
        cut = time.monotonic()
        try:
            # node2's part ends by itself: no heartbeat for the timeout, then its agent stops the worker
            wait_for(lambda: not [p for p in processes_with(out) if p in node2], timeout + AGENT_GRACE_SECONDS,
                     lambda: f"left on node2: {processes_with(out)}")  # fmt: skip
            ended = time.monotonic() - cut
            time.sleep(max(0.0, 5 - (time.monotonic() - cut)))
        finally:
            subprocess.run([*link, "up"], check=True)
        assert ended < 5, f"node2's part took {ended:.1f} s, more than the 5 s cut"
        code = process.wait(timeout=90)
        log = (tmp_path / "launch.log").read_text()
        assert code != 0, log[-3000:]
        assert "sail launch: lost node node2: no answer for 3 s on the heartbeat connection" in log, log[
            -3000:
        ]
    finally:
        stop(tmp_path)
        process.kill()
    assert not (tmp_path / "out" / "usr1-1").exists()
    assert_no_job_left(cluster)


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
def test_platform_mode_every_signal_to_each_nodes_launcher_leaves_nothing(
    cluster: NamespaceCluster, tmp_path: Path, signum: signal.Signals
) -> None:
    """A platform (Kubernetes, a cloud job service) starts sail on every node with MASTER_ADDR,
    RANK (the node's) and WORLD_SIZE (nodes), and signals every node's sail when it stops the job."""
    out = str(tmp_path / "out")
    processes = []
    for rank, node in enumerate(cluster.names):
        env = {**cluster.slurm_env(), "MASTER_ADDR": "node1", "MASTER_PORT": "29612", "RANK": str(rank),
               "WORLD_SIZE": "2"}  # fmt: skip
        log = (tmp_path / f"launch{rank}.log").open("w")
        argv = [*SAIL, "--nproc-per-node", "1", str(JOB), out]
        processes.append(subprocess.Popen(cluster.node_argv(node, argv), cwd=tmp_path, env=env, stdout=log,
                                          stderr=log, text=True))  # fmt: skip
    try:
        logs = lambda: "".join((tmp_path / f"launch{r}.log").read_text()[-2000:] for r in (0, 1))  # noqa: E731
        wait_for(lambda: started(tmp_path), 90, logs)
        found = [p for p, line in processes_with(out).items() if line.startswith(" ".join(SAIL))]
        # each sail's torchrun agent is a fork of it, under a name of its own: the sails are the parents
        sails = [p for p in found if parent(p) not in found]
        assert len(sails) == 2, processes_with(out)
        for pid in sails:
            os.kill(pid, signum)
        wait_for(lambda: not processes_with(out), 10, lambda: left(out, signum.name))
        if signum != signal.SIGKILL:
            assert [p.wait(timeout=10) for p in processes] == [128 + signum] * 2, logs()
        if signum == signal.SIGUSR1:
            assert (tmp_path / "out" / "usr1-0").exists() and (tmp_path / "out" / "usr1-1").exists()
    finally:
        stop(tmp_path)
        for process in processes:
            process.kill()
    assert_no_job_left(cluster)
