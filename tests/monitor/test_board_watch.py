"""The board as a neighbour on a shared login node meets it: a second, unprivileged local user
(``tests/neighbour.py``) looks for the job's secret where every user can look and tries the board.

A watch started on its own (no process group) shows where the secret is not and what the board
listens on; a real two-rank job under ``sail launch`` shows that a neighbour's attempts — the pickle
that once ran code in the watch, a forged "hang" — are dropped and logged, and the job trains on."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spikingsail.monitor import board, hangwatch, heartbeat
from spikingsail.monitor.hangwatch import Spec
from tests.monitor.jobs.hang_job import listening
from tests.monitor.test_board import local_addresses
from tests.monitor.test_hang import training
from tests.neighbour import python_as_neighbour

WATCH = str(Path(hangwatch.__file__).resolve())
LOOK = r"""
import json, os, sys
found = {"cmdlines": [], "keys": [], "environ": []}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        argv = [p.decode(errors="replace") for p in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0") if p]
    except OSError:
        continue
    if pid == str(os.getpid()) or not any("hangwatch.py" in part for part in argv):
        continue
    found["cmdlines"].append(argv)
    try:
        found["environ"].append(open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace"))
    except OSError as err:
        found["environ"].append(type(err).__name__)
    try:  # the old watch's spec carried its key
        values = json.loads(argv[-1]).values()
        found["keys"] += [v for v in values if isinstance(v, str) and len(v) >= 32 and set(v) <= set("0123456789abcdef")]
    except ValueError:
        pass
"""

ATTACK = (
    LOOK
    + r"""
import pickle, socket, struct, multiprocessing.connection as mpc
port, proof = int(sys.argv[1]), sys.argv[2]

class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {proof}",))

def drain(sock):
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass

# (a) the old attack: multiprocessing's handshake with each key found (or a guess), then a pickle
for key in found["keys"] or ["0" * 32]:
    try:
        conn = mpc.Client(("127.0.0.1", port), authkey=key.encode())
        conn.send(Payload())
        conn.recv()
    except Exception:
        pass
# ... and the pickle straight on the socket, framed as multiprocessing frames it
with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
    data = pickle.dumps(Payload())
    sock.sendall(struct.pack("!i", len(data)) + data)
    drain(sock)
# (b) a well-formed "hang" in JSON, with a MAC that is not the job's, and with none
body = json.dumps({"seq": 0, "client": "n" * 32, "op": "set", "key": "hang", "value": 1.0}).encode()
for mac in (bytes(32), b""):
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(struct.pack(">I", len(mac) + len(body)) + mac + body)
        drain(sock)
print(json.dumps(found))
"""
)


def spawn(tmp_path: Path, bind: str) -> tuple[subprocess.Popen[bytes], int, str]:
    """A node's watch that serves the board, for a rank that has not written its record yet."""
    spec = Spec(records={"0": str(tmp_path / "rank-0")}, host="h", timeout=60, world_size=1, nodes=1, board=None,
                bind=bind, report_dir=str(tmp_path), py_spy=None,
                stack_files={})  # fmt: skip
    secret = board.new_secret()
    process, port = heartbeat._spawn(spec, secret, serves=True)
    return process, port, secret


@pytest.fixture
def watches() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        heartbeat.stop(process)


def test_the_secret_is_on_no_command_line_and_in_no_environment(
    tmp_path: Path, watches: list[subprocess.Popen[bytes]]
) -> None:
    process, port, secret = spawn(tmp_path, "127.0.0.1")
    watches.append(process)
    seen = python_as_neighbour(LOOK + "print(json.dumps(found))")
    assert seen.returncode == 0, seen.stderr
    found = json.loads(seen.stdout)
    assert any(WATCH in argv for argv in found["cmdlines"])  # the neighbour sees the watch ...
    assert not any(secret in " ".join(argv) for argv in found["cmdlines"])  # ... not the secret
    assert found["keys"] == []
    assert set(found["environ"]) == {"PermissionError"}
    assert secret.encode() not in Path(f"/proc/{process.pid}/environ").read_bytes()  # not there at all
    assert board.Client(f"127.0.0.1:{port}", board.parse_secret(secret)).get("hang") is None  # its key


def test_the_watch_listens_only_on_the_address_it_is_given(
    tmp_path: Path, watches: list[subprocess.Popen[bytes]]
) -> None:
    for bind in ["127.0.0.1", *local_addresses()[:1]]:
        process, port, _secret = spawn(tmp_path / bind, bind)
        watches.append(process)
        assert listening(process.pid) == [f"{bind}:{port}"]


@pytest.mark.multiprocess
def test_a_neighbour_cannot_act_on_a_running_jobs_board(tmp_path: Path) -> None:
    log_dir, stop, proof = tmp_path / "log", tmp_path / "stop", tmp_path / "proof"
    job = training(tmp_path, timeout=30, until=stop)
    try:
        deadline = time.monotonic() + 120
        while not (log_dir / "watch0.json").exists():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
            time.sleep(0.2)
        (address,) = json.loads((log_dir / "watch0.json").read_text())["listening"]
        tried = python_as_neighbour(ATTACK, address.rsplit(":", 1)[1], str(proof))
        assert tried.returncode == 0, tried.stderr
        found = json.loads(tried.stdout)
        assert found["cmdlines"], found  # the neighbour saw the watch's command line
        seen = {
            "code run in the watch": proof.exists(),
            "keys on its command line": found["keys"],
            "its environment": set(found["environ"]),
            "listens on": address.rsplit(":", 1)[0],
        }
        assert seen == {
            "code run in the watch": False,
            "keys on its command line": [],
            "its environment": {"PermissionError"},
            "listens on": "127.0.0.1",  # one node: loopback only
        }
        stop.touch()
        _out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 0, err[-3000:]  # the job trained on and ended as it should
    assert not proof.exists()
    assert not list(log_dir.glob("hang-report-*.json")) and "sail: hang:" not in err
    drops = [
        line for line in err.splitlines() if line.startswith("sail: hang watch: dropped from 127.0.0.1:")
    ]
    assert len(drops) >= 3, err[-3000:]  # the raw pickle and both forged hangs
