"""The hang watches' board on its own, in this process: what it does with messages that are not its
job's — forged, replayed, too long, too slow, or a flood — and with a fake board's answers."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import shutil
import socket
import struct
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from spikingsail.errors import SailError
from spikingsail.monitor import board
from spikingsail.monitor.heartbeat import bind_address

SECRET = bytes(range(32))
LOGGER = "spikingsail.monitor.board"


@pytest.fixture
def served() -> Iterator[tuple[board.Board, str]]:
    b = board.Board()
    server = board.Server(b, SECRET, "127.0.0.1")
    yield b, board.join_address(*server.address)
    server.close()


def connect(address: str) -> tuple[socket.socket, bytes]:
    """A raw connection and the nonce of the board's hello."""
    sock = socket.create_connection(board.split_address(address), timeout=30)
    length = struct.unpack(">I", recv_exact(sock, 4))[0]
    hello = json.loads(recv_exact(sock, length)[32:])
    return sock, bytes.fromhex(hello["nonce"])


def recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def frame(mac: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(mac) + len(body)) + mac + body


def request(nonce: bytes, seq: int, op: str, key: str, value: Any, secret: bytes = SECRET) -> bytes:
    """A request framed as the protocol says (written here from the module's description)."""
    body = json.dumps({"seq": seq, "client": "c" * 32, "op": op, "key": key, "value": value}).encode()
    return frame(hmac.new(secret, b"sail-board/1 request\0" + nonce + body, hashlib.sha256).digest(), body)


def closed_by_board(sock: socket.socket) -> bool:
    """True once the board closes the connection (it answers nothing it drops)."""
    with contextlib.suppress(ConnectionResetError):
        return sock.recv(1 << 16) == b""
    return True


def drops(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "dropped from" in r.getMessage()]


def test_the_board_answers_its_job(served: tuple[board.Board, str]) -> None:
    b, address = served
    client = board.Client(address, SECRET)
    client.set("node/a/0", {"0": {"pid": 7, "beats": 3}})
    b.set("hang", 12.5)
    assert client.get("node/a/0") == {"0": {"pid": 7, "beats": 3}}
    assert client.get("hang") == 12.5 and client.get("end") is None
    assert client.items("node/") == {"node/a/0": {"0": {"pid": 7, "beats": 3}}}
    client.close()


def test_a_hang_posted_without_the_jobs_mac_is_dropped_and_logged(
    served: tuple[board.Board, str], caplog: pytest.LogCaptureFixture
) -> None:
    b, address = served
    body = json.dumps({"seq": 0, "client": "c" * 32, "op": "set", "key": "hang", "value": 1.0}).encode()
    for attempt in (
        frame(b"\x00" * 32, body),
        frame(b"", body),
        request(b"", 0, "set", "hang", 1.0, bytes(32)),
    ):
        sock, _nonce = connect(address)
        sock.sendall(attempt)
        assert closed_by_board(sock)
        sock.close()
    assert b.get("hang") is None
    assert len(drops(caplog)) == 3, caplog.text
    assert all("without a valid MAC" in line for line in drops(caplog))
    assert board.Client(address, SECRET).get("hang") is None  # the board still serves its job


class Relay:
    """A man in the middle that forwards one connection and keeps what the client sent."""

    def __init__(self, target: str) -> None:
        self.sent = bytearray()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = board.join_address("127.0.0.1", self._listener.getsockname()[1])
        self._target = board.split_address(target)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self._listener.accept()
        upstream = socket.create_connection(self._target)
        threading.Thread(target=self._pump, args=(upstream, client, None), daemon=True).start()
        self._pump(client, upstream, self.sent)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, keep: bytearray | None) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                if keep is not None:
                    keep += data
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def test_a_captured_message_replayed_is_dropped(
    served: tuple[board.Board, str], caplog: pytest.LogCaptureFixture
) -> None:
    b, address = served
    # captured on the wire: node a's watch posts its ranks' records
    relay = Relay(address)
    watched = board.Client(relay.address, SECRET)
    watched.set("node/a/0", {"0": {"beats": 1}})
    watched.close()
    captured = bytes(relay.sent)
    board.Client(address, SECRET).set("node/a/0", {"0": {"beats": 2}})  # the job goes on
    # replayed on a new connection (a new nonce): would make the board see the old records
    sock, _nonce = connect(address)
    sock.sendall(captured)
    assert closed_by_board(sock)
    # replayed on the same connection (the nonce the message was made for, a sequence number used)
    sock, nonce = connect(address)
    first = request(nonce, 0, "set", "node/a/0", {"0": {"beats": 3}})
    sock.sendall(first)
    recv_exact(sock, struct.unpack(">I", recv_exact(sock, 4))[0])  # the answer
    b.set("node/a/0", {"0": {"beats": 4}})
    sock.sendall(first)
    assert closed_by_board(sock)
    assert b.get("node/a/0") == {"0": {"beats": 4}}
    lines = drops(caplog)
    assert len(lines) == 2, caplog.text
    assert "without a valid MAC" in lines[0] and "out of sequence (expected 1): replayed" in lines[1]


def test_a_frame_too_long_or_too_slow_is_dropped(
    served: tuple[board.Board, str], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    b, address = served
    sock, _nonce = connect(address)
    sock.sendall(struct.pack(">I", 0xFFFFFFFF))
    assert closed_by_board(sock)
    monkeypatch.setattr(board, "HELLO_SECONDS", 0.5)
    sock, _nonce = connect(address)
    sock.sendall(struct.pack(">I", 100) + b"x" * 10)  # and then nothing
    assert closed_by_board(sock)
    lines = drops(caplog)
    assert f"a frame of {0xFFFFFFFF} bytes (at most {board.MAX_MESSAGE})" in lines[0], lines
    assert "too slow" in lines[1], lines
    board.Client(address, SECRET).set("end", 1)
    assert b.get("end") == 1


def test_a_flood_of_silent_connections_does_not_keep_the_job_out(
    served: tuple[board.Board, str], caplog: pytest.LogCaptureFixture
) -> None:
    b, address = served
    flood = [connect(address)[0] for _ in range(board.MAX_UNPROVEN + 8)]
    client = board.Client(address, SECRET)
    client.set("node/a/0", {})
    assert b.get("node/a/0") == {}
    assert sum(closed_by_board(sock) for sock in flood[:8]) == 8  # the oldest made room
    assert any("had not shown the key: closed the oldest" in line for line in drops(caplog))
    for sock in flood:
        sock.close()


def test_the_client_refuses_an_answer_that_is_not_the_boards() -> None:
    fake = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = fake.accept()
        conn.sendall(frame(bytes(32), json.dumps({"board": 1, "nonce": "00" * 16}).encode()))
        length = struct.unpack(">I", recv_exact(conn, 4))[0]
        recv_exact(conn, length)
        conn.sendall(frame(bytes(32), json.dumps({"seq": 0, "value": 1.0}).encode()))  # "hang"
        conn.recv(1)

    threading.Thread(target=serve, daemon=True).start()
    client = board.Client(board.join_address("127.0.0.1", fake.getsockname()[1]), SECRET)
    with pytest.raises(board.BoardError, match="an answer without a valid MAC"):
        client.get("hang")
    fake.close()


def local_addresses() -> list[str]:
    """This machine's non-loopback IPv4 addresses (none without iproute2's ``ip``)."""
    if shutil.which("ip") is None:
        return []
    out = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True
    ).stdout
    found = [line.split()[3].split("/")[0] for line in out.splitlines()]
    return [a for a in found if not a.startswith("127.")]


def test_the_board_binds_loopback_for_one_node_and_the_jobs_interface_for_more() -> None:
    assert bind_address("anything", [], nodes=1) == "127.0.0.1"
    if not local_addresses():
        pytest.skip("this machine has no interface but loopback")
    mine = local_addresses()[0]
    # the other nodes reach rank 0's host at an address of this machine: that one, even where this
    # machine resolves its own name to loopback (Debian's 127.0.1.1)
    assert bind_address("localhost", [mine], nodes=2) == mine
    assert bind_address(mine, [], nodes=2) == mine
    elsewhere = "198.51.100.254"  # a documentation address, on no machine
    assert elsewhere not in local_addresses()
    # the other nodes reach rank 0's host through a forwarder (a cluster's service address): this
    # machine's interface towards the other nodes' own addresses
    assert bind_address("localhost", [elsewhere], [mine], nodes=2) == mine
    with pytest.raises(SailError, match="no address of this node for the hang watch's board"):
        bind_address("localhost", [elsewhere], nodes=2)
