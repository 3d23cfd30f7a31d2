"""What a job of replica groups (``sail launch --ft-replicas``) exposes: where torchft's services
listen, and what a healing group accepts from the process group it heals over.

A real job's listening sockets are read from /proc; the heal transport runs between two real
processes over a real gloo group, with a peer that sends what an attacker would."""

from __future__ import annotations

import ipaddress
import os
import secrets
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fault.replicas import launch, wait_for_worker
from tests.multiprocess import run_ranks
from tests.neighbour import python_as_neighbour

SECRET = bytes(range(32))  # the same in every process of a test (each imports this module)
TIMEOUT = timedelta(seconds=30)


# -- where a job listens ---------------------------------------------------------------------------


def listening(pid: int) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """The (address, port) of every TCP socket process ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                raw, port = fields[1].split(":")
                data = bytes.fromhex(raw)  # each 32-bit word in the host's (little-endian) order
                words = b"".join(data[i : i + 4][::-1] for i in range(0, len(data), 4))
                found.append((ipaddress.ip_address(words), int(port, 16)))
    return found


def loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def descendants(pid: int) -> dict[int, str]:
    """Every process under ``pid``, with its command line."""
    children: dict[int, list[int]] = {}
    commands = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = commands.get(child, "")
            todo.append(child)
    return found


@pytest.mark.multiprocess
@pytest.mark.alone
def test_every_torchft_service_of_a_job_on_one_machine_listens_on_loopback_only(tmp_path: Path) -> None:
    """The lighthouse, each group's manager (gRPC) and the groups' process group: on loopback, and
    no checkpoint HTTP server at all (torchft's listened on every interface). torchrun's agents are
    left out: their c10d store is torch's, not torchft's, and listens on every interface whatever
    its host (torch gives it no bind address). The job's secret is on no command line, and another
    user of the machine cannot read the job's environment."""
    out = tmp_path / "run"
    job = launch(out, "--step-sleep", "0.5", wait=False)
    try:
        workers = [wait_for_worker(out, group) for group in (0, 1)]
        processes = descendants(job.pid)
        lighthouse = next(pid for pid, command in processes.items() if "torchft_lighthouse" in command)
        torchft = {pid: listening(pid) for pid in [job.pid, lighthouse, *workers]}
        secret = _environment(workers[0])["SAIL_REPLICA_SECRET"]
        seen = python_as_neighbour(_LOOK_AROUND, *map(str, processes))
    finally:
        job.send_signal(signal.SIGINT)
        job.communicate(timeout=120)
    assert torchft[lighthouse], "the lighthouse listens on nothing"
    for worker in workers:  # the manager's server and the process group's connections
        assert len(torchft[worker]) >= 2, torchft[worker]
    exposed = {pid: [a for a in found if not loopback(a[0])] for pid, found in torchft.items()}
    assert exposed == {pid: [] for pid in torchft}, "listening beyond loopback: " + repr(exposed)
    # the job's secret: in its processes' environment, which a neighbour cannot read, on no command line
    assert len(bytes.fromhex(secret)) == 32
    assert seen.returncode == 0, seen.stderr
    assert "cmdlines-done" in seen.stdout and "replica_worker.py" in seen.stdout  # it saw the job's
    assert secret not in seen.stdout
    assert "environ-read" not in seen.stdout


_LOOK_AROUND = """
import sys
from pathlib import Path
for proc in Path("/proc").iterdir():
    try:
        print(proc.name, (proc / "cmdline").read_bytes().replace(bytes(1), b" ").decode(errors="replace"))
    except OSError:
        pass
print("cmdlines" + "-done")  # split: the program's own command line holds its text
for pid in sys.argv[1:]:
    try:
        print(pid, "environ" + "-read", Path(f"/proc/{pid}/environ").read_bytes())
    except OSError:
        pass
"""


def _environment(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)


# -- what a healing group accepts ------------------------------------------------------------------


def _group(address: str) -> Any:
    """Ranks 0 and 1 of a run_ranks job as two replicas of torchft's process group, on ``address``."""
    from spikingsail.engine.replica_transport import BoundGloo

    pg = BoundGloo(address, TIMEOUT)
    store = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}/heal"
    pg.configure(store, f"replica{os.environ['RANK']}", int(os.environ["RANK"]), 2)
    return pg


def _heal(case: str, address: str, marker: str) -> dict[str, Any]:
    """Rank 0 sends (as the live group, or as an attacker in the process group), rank 1 heals."""
    from spikingsail.engine.replica_transport import HealRefusedError, SignedStateTransport, _mac

    pg = _group(address)
    rank = int(os.environ["RANK"])
    own = [(str(a), p) for a, p in listening(os.getpid())]
    state = {"user": {"sail": {"model": {"w": torch.arange(6.0).view(2, 3)}, "engine": {"steps": 7, "lr": [0.1]}}},
             "torchft": {"step": 7, "batches_committed": 14}}  # fmt: skip
    transport = SignedStateTransport(pg, SECRET, torch.device("cpu"))
    try:
        if rank == 1 and case == "unsigned-ask":  # a rank without the secret asks for the state
            pg.send([torch.zeros(64, dtype=torch.uint8)], 0, tag=1).wait(TIMEOUT)
            return {"listening": own}
        if rank == 1:
            return {"listening": own, "state": transport.recv_checkpoint(0, "", 7, TIMEOUT)}
        if case in ("genuine", "unsigned-ask"):
            transport.send_checkpoint([1], 7, state, TIMEOUT)
            return {"listening": own}
        ask = torch.empty(64, dtype=torch.uint8)  # the healing rank's nonce and proof
        pg.recv([ask], 1, tag=1).wait(TIMEOUT)
        body = _payload(marker)
        key = SECRET if case == "pickle" else secrets.token_bytes(32)
        mac = _mac(key, b"sail-heal-state", bytes(ask[:32].tolist()), 7, body)
        for tensor, tag in ((torch.tensor([len(body)]), 2), (torch.tensor(list(mac), dtype=torch.uint8), 3),
                            (torch.frombuffer(bytearray(body), dtype=torch.uint8), 4)):  # fmt: skip
            pg.send([tensor], 1, tag=tag).wait(TIMEOUT)
        return {"listening": own}
    except HealRefusedError as err:
        return {"listening": own, "refused": str(err)}
    finally:
        _barrier()
        pg.shutdown()


def _barrier() -> None:
    """Both ranks here before either tears its connections down (a send completes before its data is read)."""
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    store.add("heal-done", 1)
    store.wait(["heal-done-" + str(n) for n in range(0)])
    while int(store.add("heal-done", 0)) < 2:
        time.sleep(0.01)


class _RunsCode:
    """Unpickled, it opens (creates) a file: what a crafted state would do to a plain ``torch.load``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _payload(marker: str) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save({"user": {"sail": _RunsCode(marker)}, "torchft": {"step": 7}}, buffer)
    return buffer.getvalue()


@pytest.mark.multiprocess
def test_a_group_heals_over_the_process_group_bound_to_the_address_given(tmp_path: Path) -> None:
    """127.0.0.2: not what the host name resolves to, so a socket there is the address given."""
    results = run_ranks(_heal, 2, "genuine", "127.0.0.2", str(tmp_path / "ran"))
    healed = results[1]["state"]
    assert torch.equal(healed["user"]["sail"]["model"]["w"], torch.arange(6.0).view(2, 3))
    assert healed["user"]["sail"]["engine"] == {"steps": 7, "lr": [0.1]} and healed["torchft"]["step"] == 7
    for rank in (0, 1):
        addresses = {str(address) for address, _ in results[rank]["listening"]}
        assert addresses == {"127.0.0.2"}, results[rank]["listening"]


@pytest.mark.multiprocess
def test_a_state_that_would_run_code_is_refused_even_signed_with_the_jobs_secret(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(
        Exception, match=r"Unsupported global: GLOBAL io\.open"
    ):  # the payload is live: a plain load runs it
        torch.load(_io(_payload(str(tmp_path / "control"))), weights_only=True)
    torch.load(_io(_payload(str(tmp_path / "control"))), weights_only=False)
    assert (tmp_path / "control").exists()
    results = run_ranks(_heal, 2, "pickle", "127.0.0.1", str(marker))
    assert "is not tensors and plain data" in results[1]["refused"]
    assert "Unsupported global: GLOBAL io.open" in results[1]["refused"]
    assert not marker.exists(), "the crafted state ran code in the healing group"


@pytest.mark.multiprocess
def test_a_state_not_signed_with_the_jobs_secret_is_refused_before_it_is_read(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    results = run_ranks(_heal, 2, "forged", "127.0.0.1", str(marker))
    assert "is not signed with the job's secret" in results[1]["refused"]
    assert not marker.exists()


@pytest.mark.multiprocess
def test_the_live_group_sends_its_state_only_to_a_rank_holding_the_jobs_secret(tmp_path: Path) -> None:
    results = run_ranks(_heal, 2, "unsigned-ask", "127.0.0.1", str(tmp_path / "ran"))
    assert "asked for this group's state at step 7 without the job's secret" in results[0]["refused"]


def _io(data: bytes) -> Any:
    import io

    return io.BytesIO(data)


def test_a_group_without_the_jobs_secret_is_refused_before_it_starts() -> None:
    from spikingsail.engine.replicas import ReplicaEnv
    from spikingsail.errors import ConfigError

    env = {"REPLICA_GROUP_ID": "0", "NUM_REPLICA_GROUPS": "2", "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:1"}
    with pytest.raises(ConfigError, match="SAIL_REPLICA_SECRET is not set"):
        ReplicaEnv.from_env(env)
    with pytest.raises(ConfigError, match="not 64 hex digits"):
        ReplicaEnv.from_env({**env, "SAIL_REPLICA_SECRET": "ab" * 31 + "zz"})
    assert ReplicaEnv.from_env({**env, "SAIL_REPLICA_SECRET": SECRET.hex()}).secret == SECRET  # type: ignore[union-attr]
