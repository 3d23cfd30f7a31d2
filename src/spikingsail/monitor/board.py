"""The hang watches' board: a small dictionary served by rank 0's node's watch, reached by the others.

Standard library only (the watch loads this file by path, without importing SpikingSail or torch).
Nothing read from the network is unpickled or evaluated: a message is JSON, and it is parsed only
after its HMAC-SHA256 under the job's secret checks out.

A frame is a 4-byte big-endian length, a 32-byte MAC and a UTF-8 JSON object. On connecting, the
server sends an unauthenticated hello with a fresh nonce for that connection. A request is
``{"seq": n, "client": C, "op": ..., "key": ..., "value": ...}``, its MAC taken over the server's
nonce and the body, so it cannot be replayed on another connection, and ``seq`` (0, 1, 2, ... on a
connection) so it cannot be replayed on the same one. A response's MAC covers the request's MAC
(which covers the client's own per-connection nonce ``C``), so it answers that request only.

A frame that is too long, late, not authentic, out of sequence or not a request the board knows is
dropped, the connection closed and the drop logged; nothing in it is acted on. Connections that have
not yet shown the key are few (the oldest is closed for a new one) and short-lived, so a neighbour
cannot fill the board's threads or keep the job's own watches out.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import itertools
import json
import logging
import secrets
import socket
import struct
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

SECRET_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
MAX_MESSAGE = 8 << 20
"""A node's report carries every thread's stack of its ranks; far below this."""
HELLO_SECONDS = 10.0
"""A new connection must send its first authentic request within this."""
IDLE_SECONDS = 300.0
"""An authenticated connection may stay silent this long (a node's watch posts every tick)."""
RESPONSE_SECONDS = 60.0
MAX_UNPROVEN = 32
"""Connections that have not yet sent an authentic request; a newer one closes the oldest, so a
flood of silent connections cannot keep a node's watch (which speaks at once) out."""
OPS = ("get", "set", "items")
_LENGTH = struct.Struct(">I")
_REQUEST = b"sail-board/1 request\0"
_RESPONSE = b"sail-board/1 response\0"


class BoardError(ConnectionError):
    """The board cannot be reached, or answered with something that is not authentic."""


class DroppedFrameError(Exception):
    """A frame the board does not act on, and why."""


def parse_secret(text: str) -> bytes:
    """The job's secret from its hex form; a wrong length or a non-hex character is refused."""
    raw = bytes.fromhex(text.strip())
    if len(raw) != SECRET_BYTES:
        raise ValueError(f"the board's secret must be {SECRET_BYTES} bytes, not {len(raw)}")
    return raw


def new_secret() -> str:
    return secrets.token_hex(SECRET_BYTES)


def _mac(secret: bytes, context: bytes, binding: bytes, body: bytes) -> bytes:
    return hmac.new(secret, context + binding + body, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, size: int, deadline: float) -> bytes:
    chunks, left = [], size
    while left:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DroppedFrameError("too slow: the frame did not arrive in time")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except TimeoutError as err:
            raise DroppedFrameError("too slow: the frame did not arrive in time") from err
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket, seconds: float) -> tuple[bytes, bytes]:
    """(MAC, body) of the next frame; EOFError when the peer closed between frames."""
    deadline = time.monotonic() + seconds
    (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size, deadline))
    if not MAC_BYTES <= length <= MAX_MESSAGE:
        raise DroppedFrameError(f"a frame of {length} bytes (at most {MAX_MESSAGE})")
    try:
        frame = _recv_exact(sock, length, deadline)
    except EOFError as err:
        raise DroppedFrameError("the connection ended inside a frame") from err
    return frame[:MAC_BYTES], frame[MAC_BYTES:]


def send_frame(sock: socket.socket, mac: bytes, body: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(mac) + len(body)) + mac + body)


def _encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


class Board:
    """The board's dictionary, shared by the serving watch (directly) and the connections it serves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {}

    def get(self, key: str) -> Any:
        with self._lock:
            return self._data.get(key)

    def set(self, key: str, value: Any) -> None:
        with self._lock:
            self._data[key] = value

    def items(self, prefix: str) -> dict[str, Any]:
        with self._lock:
            return {k: v for k, v in self._data.items() if k.startswith(prefix)}

    def apply(self, op: str, key: str, value: Any) -> Any:
        if op == "get":
            return self.get(key)
        if op == "set":
            self.set(key, value)
            return None
        return self.items(key)


class Server:
    """Serves ``board`` on ``(host, port)`` (port 0: one the system picks), in daemon threads."""

    def __init__(self, board: Board, secret: bytes, host: str, port: int = 0) -> None:
        self.board = board
        self._secret = secret
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(64)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        self._unproven: dict[socket.socket, float] = {}
        self._drops = _DropLog()
        threading.Thread(target=self._accept, name="board-accept", daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if len(self._unproven) >= MAX_UNPROVEN:
                    oldest = min(self._unproven, key=self._unproven.__getitem__)
                    del self._unproven[oldest]
                    with contextlib.suppress(OSError):
                        oldest.shutdown(socket.SHUT_RDWR)  # its thread reads the end and closes it
                    self._drops.note(
                        peer, f"{MAX_UNPROVEN} connections had not shown the key: closed the oldest"
                    )
                self._unproven[conn] = time.monotonic()
            threading.Thread(target=self._serve, args=(conn, peer), name="board-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        proven = False
        try:
            nonce = secrets.token_bytes(16)
            conn.settimeout(HELLO_SECONDS)
            send_frame(conn, bytes(MAC_BYTES), _encode({"board": 1, "nonce": nonce.hex()}))
            for seq in itertools.count():
                mac, body = recv_frame(conn, IDLE_SECONDS if proven else HELLO_SECONDS)
                op, key, value = self._check(mac, body, nonce, seq)
                if not proven:
                    proven = True
                    self._forget(conn)
                result = self.board.apply(op, key, value)
                reply = _encode({"seq": seq, "value": result})
                conn.settimeout(RESPONSE_SECONDS)
                send_frame(conn, _mac(self._secret, _RESPONSE, mac, reply), reply)
        except DroppedFrameError as why:
            self._drops.note(peer, str(why))
        except (EOFError, OSError):
            pass  # the peer went away, or the listener closed
        finally:
            self._forget(conn)
            conn.close()

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._unproven.pop(conn, None)

    def _check(self, mac: bytes, body: bytes, nonce: bytes, seq: int) -> tuple[str, str, Any]:
        """The request in an authentic frame; anything else is dropped before it is parsed."""
        if not hmac.compare_digest(mac, _mac(self._secret, _REQUEST, nonce, body)):
            raise DroppedFrameError(
                "a message without a valid MAC (not from this job, or replayed from another connection)"
            )
        try:
            request = json.loads(body, parse_constant=_no_constant)
        except ValueError as err:
            raise DroppedFrameError(f"an authentic message that is not JSON: {err}") from err
        if not isinstance(request, dict) or request.get("seq") != seq:
            raise DroppedFrameError(f"an authentic message out of sequence (expected {seq}): replayed")
        op, key = request.get("op"), request.get("key")
        if op not in OPS or not isinstance(key, str):
            raise DroppedFrameError(f"an authentic message with an unknown request: op {op!r}")
        return op, key, request.get("value")


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity: a later answer could not carry them


class _DropLog:
    """Logs dropped messages, at most ``burst`` lines in ``window`` seconds (a flood stays short)."""

    def __init__(self, burst: int = 10, window: float = 10.0) -> None:
        self._burst, self._window = burst, window
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._count = self._quiet = 0

    def note(self, peer: Any, why: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._start >= self._window:
                self._start, self._count = now, 0
            self._count += 1
            if self._count > self._burst:
                self._quiet += 1
                return
            quiet, self._quiet = self._quiet, 0
        more = f" ({quiet} more dropped before this, not logged)" if quiet else ""
        log.warning("dropped from %s: %s; not acted on%s", _peer(peer), why, more)


def _peer(peer: Any) -> str:
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Client:
    """Another node's view of the board, with the same ``get`` / ``set`` / ``items`` as ``Board``."""

    def __init__(self, address: str, secret: bytes, *, attempts: int = 20) -> None:
        self._address = split_address(address)
        self._secret = secret
        self._sock: socket.socket | None = None
        for attempt in range(attempts):
            try:
                self._connect()
                return
            except OSError:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.5)

    def _connect(self) -> None:
        self.close()
        sock = socket.create_connection(self._address, timeout=RESPONSE_SECONDS)
        try:
            _mac_unused, hello = recv_frame(sock, RESPONSE_SECONDS)
            self._nonce = bytes.fromhex(json.loads(hello)["nonce"])
        except (DroppedFrameError, EOFError, ValueError, KeyError, TypeError) as err:
            sock.close()
            raise BoardError(f"the board at {join_address(*self._address)} did not say hello: {err}") from err
        self._sock, self._seq, self._client = sock, 0, secrets.token_hex(16)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def get(self, key: str) -> Any:
        return self._request("get", key, None)

    def set(self, key: str, value: Any) -> None:
        self._request("set", key, value)

    def items(self, prefix: str) -> dict[str, Any]:
        return dict(self._request("items", prefix, None))

    def _request(self, op: str, key: str, value: Any) -> Any:
        """Every request is idempotent: one that met a closed connection is sent again once, on a new one."""
        try:
            return self._exchange(op, key, value)
        except BoardError:
            raise
        except (OSError, EOFError):
            self._connect()
            return self._exchange(op, key, value)

    def _exchange(self, op: str, key: str, value: Any) -> Any:
        if self._sock is None:
            raise BoardError("the connection to the board is closed")
        body = _encode({"seq": self._seq, "client": self._client, "op": op, "key": key, "value": value})
        mac = _mac(self._secret, _REQUEST, self._nonce, body)
        send_frame(self._sock, mac, body)
        try:
            reply_mac, reply = recv_frame(self._sock, RESPONSE_SECONDS)
        except DroppedFrameError as err:
            raise BoardError(f"the board's answer: {err}") from err
        if not hmac.compare_digest(reply_mac, _mac(self._secret, _RESPONSE, mac, reply)):
            self.close()
            raise BoardError("an answer without a valid MAC: not the job's board")
        answer = json.loads(reply)
        if answer.get("seq") != self._seq:
            self.close()
            raise BoardError("an answer out of sequence")
        self._seq += 1
        return answer.get("value")
