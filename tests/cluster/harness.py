"""A real two-node cluster on one machine: network namespaces with their own hostname, address and sshd.

Node N lives in namespace ``sail<pid>nN`` at 10.99.0.N, reachable as ``nodeN`` through a hosts file
bind-mounted over /etc/hosts inside the node. Every node runs its own sshd (own config, host key and
authorized key) so the launchers' ssh and pdsh paths run for real. Traffic stays inside the
namespaces. Needs root, iproute2, util-linux and openssh-server (``.ci/run`` installs them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

REQUIRED = ("ip", "nsenter", "unshare", "ssh", "ssh-keygen", "/usr/sbin/sshd")
SUBNET = "10.99.0"
NIC = "sail0"
# The cluster's own services; anything else on a node is a job's, or a test's.
DAEMONS = ("/usr/sbin/sshd", "sshd:", "/usr/sbin/slurmctld", "slurmctld:", "/usr/sbin/slurmd")


class ClusterUnavailableError(RuntimeError):
    """The machine cannot host the test cluster (not root, or tools missing)."""


class NamespaceCluster:
    def __init__(self, workdir: Path, nodes: int = 2) -> None:
        self.workdir = workdir
        self.names = [f"node{i}" for i in range(1, nodes + 1)]
        tag = os.getpid() % 100000
        self.netns = {name: f"sail{tag}n{i}" for i, name in enumerate(self.names, start=1)}
        self.address = {name: f"{SUBNET}.{i}" for i, name in enumerate(self.names, start=1)}
        self.hosts_file = workdir / "hosts"
        self.ssh_config = workdir / "ssh_config"
        self.key = workdir / "id_ed25519"
        self._veth = (f"sv{tag}a", f"sv{tag}b")
        self._munged: int | None = None

    # -- life cycle ------------------------------------------------------------------------------

    def start(self) -> None:
        missing = [t for t in REQUIRED if shutil.which(t) is None]
        if os.geteuid() != 0 or missing:
            raise ClusterUnavailableError(
                f"the test cluster needs root and {', '.join(REQUIRED)}; missing: {missing or 'root'}. "
                "Run the suite through `bash scripts/test.sh`, which installs them."
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._network()
        self._keys()
        for name in self.names:
            self.start_sshd(name)

    def stop(self) -> None:
        for pid_file in self.workdir.glob("slurm/*.pid"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
        for name in self.names:
            self.kill_namespace_processes(name)
            subprocess.run(["ip", "netns", "del", self.netns[name]], check=False, capture_output=True)
        if self._munged is not None:  # the munged start_slurm started; one that ran before is not ours
            with contextlib.suppress(OSError):
                if Path(f"/proc/{self._munged}/comm").read_text().strip() == "munged":
                    os.kill(self._munged, signal.SIGTERM)
            self._munged = None

    # -- running things on a node ----------------------------------------------------------------

    def node_argv(self, name: str, argv: list[str], prelude: str = "") -> list[str]:
        """argv that runs ``argv`` inside node ``name`` (its network, hostname and /etc/hosts).

        ``prelude`` is shell run first inside the node's own mount namespace: what it mounts (a small
        /dev/shm, another file over an installed one) is what the node's processes see, and nothing else.
        """
        setup = f'hostname {name} && mount --bind {self.hosts_file} /etc/hosts && {prelude or "true"} && exec "$@"'
        return ["nsenter", f"--net=/run/netns/{self.netns[name]}", "unshare", "--uts", "--mount",
                "sh", "-c", setup, "sh", *argv]  # fmt: skip

    def run(
        self, name: str, argv: list[str], timeout: float = 180, prelude: str = "", **kwargs: object
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.node_argv(name, argv, prelude),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **kwargs,
        )  # type: ignore[call-overload]

    def pids(self, name: str) -> list[int]:
        """Every process living in the node's network namespace."""
        out = subprocess.run(
            ["ip", "netns", "pids", self.netns[name]], capture_output=True, text=True, check=False
        ).stdout
        return [int(p) for p in out.split()]

    def job_processes(self) -> dict[int, str]:
        """Every process on the nodes that is not one of the cluster's services, by pid."""
        found = {}
        for name in self.names:
            for pid in self.pids(name):
                try:
                    command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                except OSError:
                    continue
                if not command.startswith(DAEMONS):
                    found[pid] = command
        return found

    def kill_namespace_processes(self, name: str) -> None:
        for pid in self.pids(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    # -- sshd --------------------------------------------------------------------------------------

    def start_sshd(
        self,
        name: str,
        authorized_keys: Path | None = None,
        strict_modes: bool = False,
        password: bool = False,
        prelude: str = "",
    ) -> None:
        """(Re)start the node's sshd; every login inherits its mount namespace and CPU affinity.

        ``password`` offers password logins besides keys; ``prelude`` (see ``node_argv``) changes
        the node as its processes see it.
        """
        node_dir = self.workdir / name
        node_dir.mkdir(exist_ok=True)
        pid_file = node_dir / "sshd.pid"
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            pid_file.unlink(missing_ok=True)
            time.sleep(0.3)
        config = node_dir / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    "Port 22",
                    f"ListenAddress {self.address[name]}",
                    f"HostKey {self.workdir / 'host_ed25519'}",
                    f"PidFile {pid_file}",
                    f"AuthorizedKeysFile {authorized_keys or self.workdir / 'authorized_keys'}",
                    f"PermitRootLogin {'yes' if password else 'prohibit-password'}",
                    f"PasswordAuthentication {'yes' if password else 'no'}",
                    f"KbdInteractiveAuthentication {'yes' if password else 'no'}",
                    "UsePAM no",
                    f"StrictModes {'yes' if strict_modes else 'no'}",
                    "",
                ]
            )
        )
        Path("/run/sshd").mkdir(exist_ok=True)
        result = subprocess.run(
            self.node_argv(
                name, ["/usr/sbin/sshd", "-f", str(config), "-E", str(node_dir / "sshd.log")], prelude
            ),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"sshd on {name} did not start: {result.stderr}")
        deadline = time.monotonic() + 10
        while not pid_file.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {name} wrote no pid file: {(node_dir / 'sshd.log').read_text()}")
            time.sleep(0.05)

    # -- SLURM -------------------------------------------------------------------------------------

    @property
    def slurm_conf(self) -> Path:
        return self.workdir / "slurm" / "slurm.conf"

    def slurm_env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.slurm_conf)}

    def start_slurm(self) -> None:
        """munge, slurmctld on node1 and a slurmd on every node (2 CPUs each), one partition."""
        missing = [
            t
            for t in ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "srun")
            if not shutil.which(t)
        ]
        if missing:
            raise ClusterUnavailableError(f"SLURM tests need munge and slurm-wlm; missing {missing}")
        state = self.workdir / "slurm"
        state.mkdir(exist_ok=True)
        self._munged = _start_munge()
        nodes = [
            f"NodeName={n} NodeAddr={self.address[n]} CPUs=2 RealMemory=1000 State=UNKNOWN"
            for n in self.names
        ]
        self.slurm_conf.write_text(
            "\n".join(
                [
                    "ClusterName=sail",
                    f"SlurmctldHost={self.names[0]}({self.address[self.names[0]]})",
                    "SlurmUser=root",
                    "AuthType=auth/munge",
                    # a requeued job waits this long before it may start again (default 120 s)
                    "AuthInfo=cred_expire=10",
                    f"StateSaveLocation={state}/ctld",
                    f"SlurmdSpoolDir={state}/spool-%n",
                    f"SlurmctldPidFile={state}/slurmctld.pid",
                    f"SlurmdPidFile={state}/slurmd-%n.pid",
                    f"SlurmctldLogFile={state}/slurmctld.log",
                    f"SlurmdLogFile={state}/slurmd-%n.log",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "SchedulerType=sched/backfill",
                    "KillWait=5",
                    *nodes,
                    f"PartitionName=debug Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        (state / "ctld").mkdir(exist_ok=True)
        env = self.slurm_env()
        _checked(
            self.run(self.names[0], ["/usr/sbin/slurmctld", "-f", str(self.slurm_conf), "-c", "-i"], env=env)
        )
        for name in self.names:
            _checked(self.run(name, ["/usr/sbin/slurmd", "-f", str(self.slurm_conf)], env=env))
        deadline = time.monotonic() + 30
        while True:
            out = self.run(self.names[0], ["sinfo", "-h", "-o", "%T %D"], env=env).stdout.split()
            if out[:2] == ["idle", str(len(self.names))]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"SLURM nodes did not become idle: {out}; see {state}")
            time.sleep(0.3)

    # -- set-up steps ------------------------------------------------------------------------------

    def _network(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "del", self.netns[name]], check=False, capture_output=True)
            _ip("netns", "add", self.netns[name])
            _ip("-n", self.netns[name], "link", "set", "lo", "up")
        a, b = self._veth
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        for veth, name in zip(self._veth, self.names, strict=False):
            _ip("link", "set", veth, "netns", self.netns[name])
            # one name on every node, as on a cluster (Horovod looks for a common interface by name)
            _ip("-n", self.netns[name], "link", "set", veth, "name", NIC)
            _ip("-n", self.netns[name], "addr", "add", f"{self.address[name]}/24", "dev", NIC)
            _ip("-n", self.netns[name], "link", "set", NIC, "up")
        entries = [f"{address} {name}" for name, address in self.address.items()]
        self.hosts_file.write_text("\n".join(["127.0.0.1 localhost", *entries, f"{SUBNET}.3 node3", ""]))

    def _keys(self) -> None:
        for path in (self.workdir / "host_ed25519", self.key, self.workdir / "stranger_ed25519"):
            if not path.exists():
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
        shutil.copy(self.key.with_suffix(".pub"), self.workdir / "authorized_keys")
        self.ssh_config.write_text(self.client_config(self.key))
        (self.workdir / "stranger_config").write_text(self.client_config(self.workdir / "stranger_ed25519"))

    def client_config(self, key: Path) -> str:
        # Throwaway hosts with fresh host keys: the harness, not the product, skips host-key checks.
        return "\n".join(
            [
                "Host *",
                "  User root",
                f"  IdentityFile {key}",
                "  IdentitiesOnly yes",
                "  StrictHostKeyChecking no",
                "  UserKnownHostsFile /dev/null",
                "  LogLevel ERROR",
                "",
            ]
        )


MUNGED_PID = Path("/run/munge/munged.pid")


def _start_munge() -> int | None:
    """One munged serves every node: the namespaces share the filesystem and its socket. Returns its
    pid when this call started it (``stop`` ends it then), None when one ran already."""
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True, check=False).returncode == 0:
        return None
    Path("/run/munge").mkdir(exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the daemon writes it; a stale one names no munged
        with contextlib.suppress(OSError, ValueError):
            pid = int(MUNGED_PID.read_text())
            if Path(f"/proc/{pid}/comm").read_text().strip() == "munged":
                return pid
        time.sleep(0.1)
    return None


def _checked(result: subprocess.CompletedProcess[str]) -> None:
    if result.returncode != 0:
        raise RuntimeError(f"{result.args[-4:]} failed: {result.stderr}")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def processes_with(marker: str) -> dict[int, str]:
    """Every process on this machine whose command line contains ``marker``, whatever its state
    (stopped ones included), by pid: the nodes share this machine's process table."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in command:
            found[int(entry.name)] = command.strip()
    return found


def main(argv: list[str]) -> int:
    """``python -m tests.cluster.harness [--shell | CMD...]``: a fresh two-node cluster, then on node1
    CMD (``{hostfile}`` and ``{ssh_config}`` in it are replaced by the cluster's files), or with
    ``--shell`` an interactive shell. On node1 the cluster's ssh config, key and known hosts are
    ``~/.ssh`` (bind-mounted in node1's own mount namespace only), so ``ssh node2`` and
    ``sail launch -H HOSTFILE`` work as on a real cluster, without ``--ssh-config``. The cluster is
    torn down when the command or the shell ends."""
    import sys
    import tempfile

    shell = argv[:1] == ["--shell"]
    argv = argv[1:] if shell or argv[:1] == ["--"] else argv
    workdir = Path(tempfile.mkdtemp(prefix="sail-cluster-"))
    cluster = NamespaceCluster(workdir)
    hostfile = workdir / "hostfile"
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
    command = (
        ["bash", "-i"]
        if shell
        else [a.format(hostfile=hostfile, ssh_config=cluster.ssh_config) for a in argv]
    )
    dot_ssh = workdir / "dot_ssh"
    try:
        cluster.start()
        dot_ssh.mkdir(mode=0o700)
        (dot_ssh / "config").write_text(cluster.ssh_config.read_text())
        home_ssh = Path.home() / ".ssh"
        prelude = f"mkdir -p {home_ssh} && mount --bind {dot_ssh} {home_ssh}"
        print(
            f"[cluster] node1 {cluster.address['node1']}, node2 {cluster.address['node2']}\n"
            f"[cluster] hostfile {hostfile} (node1 slots=1, node2 slots=1; $HOSTFILE on node1)\n"
            f"[cluster] ssh config {cluster.ssh_config}: ~/.ssh/config on node1 (ssh node2 works there)\n"
            + ("[cluster] a shell on node1; exit it to tear the cluster down"
               if shell else "[cluster] on node1: " + " ".join(command)),
            flush=True,
        )  # fmt: skip
        env = {**os.environ, "HOSTFILE": str(hostfile)}
        return subprocess.run(
            cluster.node_argv("node1", command, prelude), check=False, stdin=sys.stdin, env=env
        ).returncode
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
