"""`sail doctor -H` on the two-node namespace cluster, with every fault injected for real on node2.

Each fault is made the way it happens on a real cluster — node2's sshd restarted with another
authorized_keys, password logins or StrictModes; node2's mount namespace given a 1 MiB /dev/shm,
another torch or spikingsail version file, or a stale extension cache; node2's processes pinned to one
core; a process holding, or a firewall dropping, the rendezvous port on node1 — and the doctor must
name the node and the fix. Node2 is put back to health after each test. Faults that different
checks find (node2's versions, its /dev/shm and its extension cache) share one run, which each of
their tests judges.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cluster.harness import NamespaceCluster

pytestmark = pytest.mark.cluster
DOCTOR = [sys.executable, "-m", "spikingsail.cli.main", "doctor"]
Restart = Callable[..., None]


def doctor(
    cluster: NamespaceCluster, tmp_path: Path, *flags: str, hostfile: str = "node1 slots=1\nnode2 slots=1\n"
) -> tuple[int, dict[str, Any], str]:
    (tmp_path / "hostfile").write_text(hostfile)
    argv = [
        *DOCTOR,
        "--json",
        "-H",
        str(tmp_path / "hostfile"),
        "--ssh-config",
        str(cluster.ssh_config),
        *flags,
    ]
    result = cluster.run("node1", argv, cwd=tmp_path)
    assert result.stdout.strip(), result.stderr[-3000:]
    return result.returncode, json.loads(result.stdout), result.stderr


def findings(report: dict[str, Any], check: str, host: str | None = None) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["check"] == check and (host is None or f["host"] == host)]


def failed(report: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f["check"], f["host"]) for f in report["findings"] if f["status"] == "fail"]


@pytest.fixture
def node2(cluster: NamespaceCluster) -> Iterator[Restart]:
    """Restart node2's sshd with a fault; the healthy sshd is back after the test."""
    yield lambda **options: cluster.start_sshd("node2", **options)
    cluster.start_sshd("node2")


@pytest.fixture
def strict_node2(cluster: NamespaceCluster, node2: Restart) -> Iterator[tuple[Path, Path]]:
    """node2's sshd with StrictModes on (OpenSSH's default), reading a key from a tidy ``.ssh``
    (700, its authorized_keys 600): yields both paths. sshd checks the modes of authorized_keys and
    its directories up to the user's home, so they live under root's home (/tmp above them would
    fail StrictModes itself)."""
    home = Path(tempfile.mkdtemp(dir=Path.home(), prefix=".sail-doctor-"))
    try:
        ssh_dir = home / ".ssh"
        ssh_dir.mkdir(mode=0o700)
        keys = ssh_dir / "authorized_keys"
        shutil.copy(cluster.key.with_suffix(".pub"), keys)
        keys.chmod(0o600)
        node2(authorized_keys=keys, strict_modes=True)
        yield ssh_dir, keys
    finally:
        shutil.rmtree(home)


# Open MPI needs the namespaces' subnet named, as on any multi-homed machine
MPIRUN = ("--launcher-args", "--mca btl_tcp_if_include 10.99.0.0/24 --mca oob_tcp_if_include 10.99.0.0/24")


@pytest.mark.parametrize("launcher", ["ssh", "pdsh", "mpirun"])
def test_a_healthy_cluster_passes(
    cluster: NamespaceCluster, strict_node2: tuple[Path, Path], tmp_path: Path, launcher: str
) -> None:
    """node2 under StrictModes, as OpenSSH's default is, with a 700 .ssh and a 600 authorized_keys:
    a pass (test_loose_ssh_permissions_under_strict_modes loosens them)."""
    code, report, _ = doctor(
        cluster, tmp_path, "--launcher", launcher, *(MPIRUN if launcher == "mpirun" else ())
    )
    assert code == 0, failed(report)
    assert report["ok"] and report["counts"]["fail"] == 0
    (allreduce,) = findings(report, "all-reduce")
    assert allreduce["status"] == "ok" and "node1, node2" in allreduce["detail"], allreduce
    assert f"through {launcher}" in allreduce["detail"]
    assert {f["host"] for f in findings(report, "ssh")} == {"node1", "node2"}
    reachable = findings(report, "rendezvous port", "node2")
    assert reachable[0]["status"] == "ok" and "10.99.0.1" in reachable[0]["detail"]
    # DeepSpeed's ops that scripts/setup.sh built load on both nodes: the staleness check does not cry wolf
    for node in ("node1", "node2"):
        entries = report["facts"][node]["extensions"]["entries"]
        assert {e["name"] for e in entries} >= {"fused_adam"}, entries
        assert all(not e["load_errors"] for e in entries)
    assert set(report["facts"]) == {"this machine", "node1", "node2"}
    (balance,) = findings(report, "balance")
    assert balance["status"] == "ok" and "balance is not needed" in balance["detail"], balance


def test_the_text_report_is_a_coloured_table_with_the_fixes_and_a_summary(
    cluster: NamespaceCluster, node2: Restart, tmp_path: Path
) -> None:
    """Without --json: a row per finding, coloured by its status, each failure's fix under it, and
    the counts last, red when anything failed. node2 refuses the key, so no all-reduce is started;
    the green summary of a pass is test_judgement.py's."""
    keys = tmp_path / "authorized_keys"
    shutil.copy(cluster.workdir / "stranger_ed25519.pub", keys)
    node2(authorized_keys=keys)
    (tmp_path / "hostfile").write_text("node1 slots=1\nnode2 slots=1\n")
    argv = [
        *DOCTOR,
        "--color",
        "always",
        "-H",
        str(tmp_path / "hostfile"),
        "--ssh-config",
        str(cluster.ssh_config),
    ]
    result = cluster.run("node1", argv, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    ok_row = [line for line in lines if line.startswith("\033[32;1mOK  \033[0m  ssh") and "node1" in line]
    fail_row = [
        i for i, line in enumerate(lines) if line.startswith("\033[31;1mFAIL\033[0m  ssh") and "node2" in line
    ]
    assert ok_row and fail_row, result.stdout
    after = " ".join(" ".join(lines[fail_row[0] :]).split())
    assert "refused the key" in after and "\033[2mfix: \033[0mssh-copy-id node2" in after, result.stdout
    failures = sum(line.startswith("\033[31;1mFAIL") for line in lines)  # node2's ssh, the all-reduce
    assert failures >= 2 and lines[-1].startswith("\033[31m"), result.stdout
    assert f", {failures} failure(s)" in lines[-1], result.stdout


def test_a_node_whose_authorized_keys_lacks_the_key(
    cluster: NamespaceCluster,
    node2: Restart,
    tmp_path: Path,
) -> None:
    keys = tmp_path / "authorized_keys"
    shutil.copy(cluster.workdir / "stranger_ed25519.pub", keys)  # another machine's key only
    node2(authorized_keys=keys)
    code, report, _ = doctor(cluster, tmp_path)
    assert code == 1
    (ssh,) = findings(report, "ssh", "node2")
    assert ssh["status"] == "fail" and "refused the key" in ssh["detail"], ssh
    assert "ssh-copy-id node2" in ssh["fix"]
    assert findings(report, "ssh", "node1")[0]["status"] == "ok"
    assert findings(report, "all-reduce")[0]["detail"].startswith("not tried")


def test_no_key_on_this_machine(cluster: NamespaceCluster, tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text(cluster.client_config(tmp_path / "id_ed25519"))  # a key that was never generated
    (tmp_path / "hostfile").write_text("node1 slots=1\nnode2 slots=1\n")
    argv = [*DOCTOR, "--json", "-H", str(tmp_path / "hostfile"), "--ssh-config", str(config)]
    result = cluster.run("node1", argv, cwd=tmp_path)
    report = json.loads(result.stdout)
    assert result.returncode == 1
    for node in ("node1", "node2"):
        (ssh,) = findings(report, "ssh", node)
        assert ssh["detail"].startswith(
            f"this machine has no ssh key to offer (ssh looks for {tmp_path / 'id_ed25519'})"
        )
        assert ssh["fix"] == f"ssh-keygen -t ed25519, then ssh-copy-id {node}"


def test_an_unknown_host_key(cluster: NamespaceCluster, tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    strict = cluster.client_config(cluster.key).replace(
        "StrictHostKeyChecking no", "StrictHostKeyChecking yes"
    )
    config.write_text(strict.replace("/dev/null", str(tmp_path / "known_hosts")))
    (tmp_path / "hostfile").write_text("node1 slots=1\nnode2 slots=1\n")
    argv = [*DOCTOR, "--json", "-H", str(tmp_path / "hostfile"), "--ssh-config", str(config)]
    result = cluster.run("node1", argv, cwd=tmp_path)
    report = json.loads(result.stdout)
    assert result.returncode == 1
    (ssh,) = findings(report, "ssh", "node2")
    assert ssh["detail"].startswith("the host's key is unknown or changed")
    assert "ssh node2" in ssh["fix"]


def test_a_node_that_wants_a_password(cluster: NamespaceCluster, node2: Restart, tmp_path: Path) -> None:
    keys = tmp_path / "authorized_keys"
    shutil.copy(cluster.workdir / "stranger_ed25519.pub", keys)
    node2(authorized_keys=keys, password=True)
    code, report, _ = doctor(cluster, tmp_path)
    assert code == 1
    (ssh,) = findings(report, "ssh", "node2")
    assert ssh["status"] == "fail" and "asks for a password" in ssh["detail"], ssh
    assert "ssh-copy-id node2" in ssh["fix"]


def test_loose_ssh_permissions_under_strict_modes(
    cluster: NamespaceCluster, strict_node2: tuple[Path, Path], tmp_path: Path
) -> None:
    """The modes test_a_healthy_cluster_passes runs under (700/600), loosened one at a time."""
    ssh_dir, keys = strict_node2
    for loose, mode, tidy in (
        (ssh_dir, 0o777, 0o700),
        (keys, 0o666, 0o600),
    ):  # the directory, then the file
        loose.chmod(mode)
        code, report, _ = doctor(cluster, tmp_path)
        assert code == 1, loose
        (ssh,) = findings(report, "ssh", "node2")
        assert ssh["status"] == "fail" and "StrictModes" in ssh["detail"], (loose, ssh)
        assert "chmod 700 ~/.ssh && chmod 600 ~/.ssh/authorized_keys" in ssh["fix"]
        loose.chmod(tidy)


def _patched_copy(original: Path, tmp_path: Path, old: str, new: str) -> Path:
    text = original.read_text()
    assert old in text
    patched = tmp_path / original.name
    patched.write_text(text.replace(old, new))
    return patched


@dataclass(frozen=True)
class NodeFaults:
    code: int
    report: dict[str, Any]
    sail_version: str
    cache: Path


@pytest.fixture(scope="module")
def node2_faults(_cluster_session: NamespaceCluster, tmp_path_factory: pytest.TempPathFactory) -> NodeFaults:
    """One doctor run with node2's torch and spikingsail version files replaced, a 1 MiB /dev/shm
    and a stale op in its extension cache (each judged by another check); node2 is healthy again
    before any test sees the report."""
    cluster, tmp_path = _cluster_session, tmp_path_factory.mktemp("node2-faults")
    version_py = Path(torch.__file__).with_name("version.py").resolve()
    fake_torch = _patched_copy(version_py, tmp_path, f"'{torch.__version__}'", "'2.12.0+cpu'")
    metadata = Path(str(importlib.metadata.distribution("spikingsail").locate_file(""))) / (
        f"spikingsail-{importlib.metadata.version('spikingsail')}.dist-info/METADATA"
    )
    mine = importlib.metadata.version("spikingsail")
    fake_sail = _patched_copy(metadata.resolve(), tmp_path, f"Version: {mine}\n", "Version: 0.0.9\n")
    cache = Path(os.environ["TORCH_EXTENSIONS_DIR"])  # shipped to the nodes like every TORCH_* variable
    stale = tmp_path / "stale-cache"
    _stale_op(stale / "fused_adam")
    mounts = [
        f"mount --bind {fake_torch} {version_py}",
        f"mount --bind {fake_sail} {metadata.resolve()}",
        "mount -t tmpfs -o size=1m tmpfs /dev/shm",
        f"mount --bind {shlex.quote(str(stale))} {shlex.quote(str(cache.resolve()))}",
    ]
    cluster.start_sshd("node2", prelude=" && ".join(mounts))
    try:
        code, report, _ = doctor(cluster, tmp_path)
    finally:
        cluster.start_sshd("node2")
    return NodeFaults(code=code, report=report, sail_version=mine, cache=cache)


def test_another_torch_and_spikingsail_version_on_one_node(node2_faults: NodeFaults) -> None:
    code, report, mine = node2_faults.code, node2_faults.report, node2_faults.sail_version
    assert code == 1
    torch_mismatch, sail_mismatch = sorted(
        findings(report, "versions", "node2"), key=lambda f: f["detail"][:5] != "torch"
    )
    assert torch_mismatch["status"] == sail_mismatch["status"] == "fail"
    assert torch_mismatch["detail"] == f"torch 2.12.0+cpu on node2, {torch.__version__} on this machine"
    assert f"install torch {torch.__version__} on node2" in torch_mismatch["fix"]
    assert sail_mismatch["detail"] == f"spikingsail 0.0.9 on node2, {mine} on this machine"
    assert f"install spikingsail {mine} on node2" in sail_mismatch["fix"]
    assert not findings(report, "versions", "node1")
    table = report["tables"]["Versions that differ between nodes"]
    assert table == [
        ["", "this machine", "node1", "node2"],
        ["torch", torch.__version__, torch.__version__, "2.12.0+cpu"],
        ["spikingsail", mine, mine, "0.0.9"],
    ]


def test_a_busy_rendezvous_port(cluster: NamespaceCluster, tmp_path: Path) -> None:
    holder = subprocess.Popen(
        cluster.node_argv("node1", [sys.executable, "-c", _LISTEN.format(port=29611)]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "listening"
        code, report, _ = doctor(cluster, tmp_path, "--master-port", "29611")
    finally:
        holder.kill()
        holder.wait()
    assert code == 1
    (busy,) = [f for f in findings(report, "rendezvous port", "node1") if f["status"] == "fail"]
    assert "29611 on node1 cannot be bound (EADDRINUSE)" in busy["detail"]
    assert "--master-port" in busy["fix"]
    assert findings(report, "all-reduce")[0]["detail"].startswith("not tried")


_LISTEN = """
import socket, time
s = socket.socket(); s.bind(("", {port})); s.listen(); print("listening", flush=True); time.sleep(300)
"""


def test_a_firewalled_rendezvous_port(cluster: NamespaceCluster, tmp_path: Path) -> None:
    rule = ["INPUT", "-p", "tcp", "--dport", "29612", "-j", "DROP"]
    iptables = ["ip", "netns", "exec", cluster.netns["node1"], "iptables"]
    subprocess.run([*iptables, "-A", *rule], check=True)
    try:
        code, report, _ = doctor(cluster, tmp_path, "--master-port", "29612")
    finally:
        subprocess.run([*iptables, "-D", *rule], check=True)
    assert code == 1
    assert findings(report, "rendezvous port", "node1")[0]["status"] == "ok"  # node1 itself can bind it
    (blocked,) = findings(report, "rendezvous port", "node2")
    assert blocked["status"] == "fail"
    assert "node1:29612 does not answer from node2: a firewall drops the packets" in blocked["detail"]
    assert "open TCP port 29612 on node1" in blocked["fix"]


def test_fewer_cores_than_slots_warns_and_gets_a_smaller_balance_weight(
    cluster: NamespaceCluster, node2: Restart, tmp_path: Path
) -> None:
    """node2 has one usable core and two slots, node1 two cores and one slot: node2 is oversubscribed,
    and each of its ranks gets half a core against node1's rank's two, a weight of 1 to 4 (one doctor
    run checks both)."""
    node2(prelude="taskset -p -c 0 $$ >/dev/null")  # node2's processes get one core, node1's two
    code, report, _ = doctor(cluster, tmp_path, hostfile="node1 slots=1\nnode2 slots=2\n")
    (slots,) = findings(report, "slots", "node2")
    assert slots["status"] == "warn"
    assert slots["detail"].startswith("2 process(es) but 1 usable CPU core(s)")
    assert "give node2 slots=1 in the hostfile" in slots["fix"]
    assert code == 0  # oversubscribed CPUs are slow, not broken: the all-reduce still passes
    assert findings(report, "all-reduce")[0]["status"] == "ok"
    (balance,) = findings(report, "balance")
    assert balance["status"] == "warn", balance
    assert balance["detail"].startswith("ranks of unequal speed (node1 2, node2 0.5/0.5 core(s) per process)")
    assert balance["fix"].startswith('set "sail": {"balance": {"node1": 4.0, "node2": 1.0}}')


def test_more_slots_asked_than_the_hostfile_has(cluster: NamespaceCluster, tmp_path: Path) -> None:
    (tmp_path / "hostfile").write_text("node1 slots=1\nnode2 slots=1\n")
    argv = [
        *DOCTOR,
        "-H",
        str(tmp_path / "hostfile"),
        "--num_gpus",
        "2",
        "--ssh-config",
        str(cluster.ssh_config),
    ]
    result = cluster.run("node1", argv, cwd=tmp_path)
    assert result.returncode == 2
    assert "--num_gpus 2 is more than the slots of node1, node2" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_tiny_dev_shm_and_a_stale_extension_cache(node2_faults: NodeFaults) -> None:
    code, report, cache = node2_faults.code, node2_faults.report, node2_faults.cache
    assert code == 1
    (shm,) = findings(report, "/dev/shm", "node2")
    assert shm["status"] == "fail" and shm["detail"].startswith("is 1.0 MiB"), shm
    assert "--ipc=host" in shm["fix"] and "--shm-size" in shm["fix"]
    assert not findings(report, "/dev/shm", "node1")  # healthy nodes report only what is wrong
    (ext,) = findings(report, "torch extensions", "node2")
    assert ext["status"] == "fail"
    assert "undefined symbol" in ext["detail"] and "built against another torch" in ext["detail"]
    assert ext["fix"] == f"rm -rf {cache / 'fused_adam'} (rebuilt on next use)"  # the path as node2 sees it


def _stale_op(directory: Path) -> None:
    """A JIT op as another torch left it: compiled for real, against a symbol this torch lacks."""
    directory.mkdir(parents=True)
    source = directory / "fused_adam.cpp"
    source.write_text(
        "namespace at { void removed_in_this_torch(); }\n"
        'extern "C" void fused_adam_step() { at::removed_in_this_torch(); }\n'
    )
    subprocess.run(
        ["g++", "-shared", "-fPIC", "-o", str(directory / "fused_adam.so"), str(source)], check=True
    )
    (directory / "build.ninja").write_text(
        "cflags = -isystem /opt/conda/lib/python3.8/site-packages/torch/include -fPIC\n"
    )
    (directory / "fused_adam.so").chmod(stat.S_IRWXU)
