"""The hang watch: when no rank of a job makes progress, find out who holds it up and end it.

One process per node, started by the node's lowest rank (``heartbeat.start``) and run by path with
the standard library only (``python -I hangwatch.py SPEC``), so that it starts in a blink and stays
alive when its ranks stop or deadlock. Every ``tick`` it reads its ranks' progress records
(``heartbeat``) and posts them to a board: a dictionary served by rank 0's node's watch
(``multiprocessing.managers``, a shared key) that the other nodes' watches join.

Rank 0's watch decides. When no rank's record has changed for ``hang_timeout_seconds`` (after the
first training call; not while a rank saves a checkpoint; not once a rank has closed its engine) it
posts "hang". Every watch then looks at its own ranks: the process state from ``/proc`` (running,
sleeping, stopped, in D state, gone) and every thread's Python stack (``py-spy dump --nonblocking``,
which reads a stopped or deadlocked process without stopping it; without py-spy, faulthandler in the
rank answers SIGUSR2, which a stopped process cannot). Rank 0's watch gathers the nodes' answers and
prints one report — each rank's host, pid, state, step, engine call and stack top, then a verdict
naming the rank that is behind and the collective the others wait in — writes it as JSON to the run's
log directory, and posts "end". Each watch then kills its ranks (SIGKILL, which also ends a stopped
process), so the job ends with a failure: torchrun's agent restarts it with ``--max-restarts``, or
the launch fails.

A watch ends quietly when its rank closes its standard input (the engine's close, or the rank's
death) or the board goes away (rank 0's node is done).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing.managers import BaseManager, DictProxy
from pathlib import Path
from typing import Any

PHASES = ("ready", "forward", "backward", "optimizer", "collective", "checkpoint", "closed")
"""The engine call a rank is in or last left: ``forward`` (``engine(batch)``), ``backward``,
``optimizer`` (``engine.step()``), ``collective`` (``engine.all_reduce``), ``checkpoint`` (a save or
load); ``ready`` before the first call, ``closed`` after ``engine.close()``."""
READY, FORWARD, BACKWARD, OPTIMIZER, COLLECTIVE, CHECKPOINT, CLOSED = range(len(PHASES))

LEFT, INSIDE, WAITING = 0, 1, 2
"""A record's ``inside``: the call was left; the rank is in it; it is in it and the call waits for
the other ranks (a gradient sync, an all-reduce: it counts in ``collectives``)."""

RECORD = struct.Struct("<qqqqqqqd")
"""pid, beats, optimizer step, micro-step, phase, inside, collectives entered, wall time."""

STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "in D state (uninterruptible I/O)",
    "T": "stopped (SIGSTOP)",
    "t": "stopped by a debugger",
    "Z": "exited",
    "X": "exited",
}
NO_ANSWER = "unknown: its node's watch did not answer"
HELD = ("stopped", "in D state", "exited", "gone", NO_ANSWER)
"""States in which a rank cannot be waiting for the others: it holds them up."""
REPORT_WAIT_SECONDS = 30.0


@dataclass(kw_only=True, slots=True, frozen=True)
class Progress:
    pid: int
    beats: int
    step: int
    micro_step: int
    phase: str
    inside: int
    collectives: int
    time: float

    @classmethod
    def unpack(cls, data: bytes) -> Progress:
        pid, beats, step, micro, phase, inside, collectives, when = RECORD.unpack(data)
        return cls(pid=pid, beats=beats, step=step, micro_step=micro, phase=PHASES[phase],
                   inside=inside, collectives=collectives, time=when)  # fmt: skip

    def doing(self) -> str:
        call = {"optimizer": "engine.step()", "collective": "engine.all_reduce"}.get(self.phase, self.phase)
        if self.inside == WAITING:
            what = "the gradient sync of backward" if self.phase == "backward" else call
            return f"{what} (collective #{self.collectives})"
        if self.inside == INSIDE:
            return call
        return f"the script, after {call}" if self.phase not in ("ready", "closed") else self.phase


def read_record(path: Path) -> Progress | None:
    """A rank's last record, or None before it wrote one. Read until two reads agree: the rank
    may be writing it at that moment."""
    try:
        with path.open("rb") as f:
            data = f.read(RECORD.size)
            for _ in range(10):
                f.seek(0)
                again = f.read(RECORD.size)
                if again == data:
                    break
                data = again
    except FileNotFoundError:
        return None
    if len(data) < RECORD.size or data == bytes(RECORD.size):
        return None
    return Progress.unpack(data)


@dataclass(kw_only=True, slots=True, frozen=True)
class Spec:
    """What a node's watch is told, as JSON on its command line."""

    records: dict[str, str]
    """rank → its record file, for the ranks on this node."""
    host: str
    timeout: float
    world_size: int
    nodes: int
    board: str | None
    """host:port of rank 0's node's board; None on that node, whose watch serves it."""
    authkey: str
    directory: str
    """The node's record directory, removed when the watch ends."""
    report_dir: str
    py_spy: str | None
    stack_files: dict[str, str]
    """rank → where its faulthandler writes (used without py-spy)."""

    @property
    def node(self) -> str:
        return f"{self.host}/{min(map(int, self.records))}"

    def argv(self) -> list[str]:
        return [sys.executable, "-I", str(Path(__file__).resolve()), json.dumps(asdict(self))]


class _Board(BaseManager):
    pass


def serve_board(authkey: bytes) -> tuple[dict[str, Any], int]:
    """The board on rank 0's node: this process's dictionary, and the port it is served on."""
    board: dict[str, Any] = {}
    _Board.register("board", callable=lambda: board, proxytype=DictProxy)
    server = _Board(address=("", 0), authkey=authkey).get_server()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _host, port = server.address  # type: ignore[str-unpack, misc]
    return board, int(port)


def join_board(address: str, authkey: bytes) -> Any:
    host, port = address.rsplit(":", 1)
    _Board.register("board", proxytype=DictProxy)
    manager = _Board(address=(host, int(port)), authkey=authkey)
    for attempt in range(20):
        try:
            manager.connect()
            break
        except OSError:
            if attempt == 19:
                raise
            time.sleep(0.5)
    return manager.board()  # type: ignore[attr-defined]


def process_state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    code = stat[stat.rindex(")") + 2]
    return STATES.get(code, code)


def stacks(pid: int, spec: Spec, rank: str) -> tuple[list[dict[str, Any]], str | None]:
    """Every thread's Python stack, innermost frame first, and why there is none when there is not."""
    if spec.py_spy:
        try:
            result = subprocess.run([spec.py_spy, "dump", "--nonblocking", "--json", "--pid", str(pid)],
                                    capture_output=True, text=True, timeout=20)  # fmt: skip
        except subprocess.TimeoutExpired:
            return [], "py-spy dump took longer than 20 s"
        if result.returncode != 0:
            return [], "py-spy: " + (result.stderr.strip().splitlines() or ["no output"])[-1]
        threads = json.loads(result.stdout)
        return [
            {
                "thread": t.get("thread_name") or str(t.get("thread_id")),
                "frames": [f"{f['name']} ({f['filename']}:{f['line']})" for f in t.get("frames", [])],
            }
            for t in threads
        ], None
    return _faulthandler_stacks(pid, Path(spec.stack_files[rank]))


def _faulthandler_stacks(pid: int, path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """faulthandler's dump, asked for with SIGUSR2: outermost frame last, as a traceback."""
    if process_state(pid).startswith("stopped"):
        return [], "a stopped process cannot answer faulthandler's signal; install py-spy to read its stack"
    before = path.stat().st_size if path.exists() else 0
    try:
        os.kill(pid, signal.SIGUSR2)
    except OSError as err:
        return [], f"could not signal it: {err}"
    time.sleep(1.0)
    text = path.read_text(errors="replace")[before:] if path.exists() else ""
    threads: list[dict[str, Any]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith(("Thread", "Current thread")):
            threads.append({"thread": line.removesuffix(" (most recent call first):"), "frames": []})
        elif line.startswith("File ") and threads:
            # File "x.py", line 3 in f
            where, _, name = line.partition(" in ")
            file, _, number = where.partition(", line ")
            threads[-1]["frames"].append(f"{name} ({file[6:-1]}:{number})")
    return threads, None if threads else "faulthandler wrote nothing"


def look(spec: Spec, board_records: dict[str, Any]) -> dict[str, Any]:
    """This node's ranks as they are now: record, process state and stacks (read side by side)."""

    def one(rank: str) -> dict[str, Any]:
        record = read_record(Path(spec.records[rank]))
        pid = record.pid if record else board_records.get(rank, {}).get("pid", 0)
        state = process_state(pid) if pid else "gone"
        threads, why = stacks(pid, spec, rank) if pid and state != "gone" else ([], "no process")
        return {
            "rank": int(rank), "host": spec.host, "pid": pid, "state": state,
            "progress": asdict(record) if record else None, "threads": threads, "no_stack": why,
        }  # fmt: skip

    with ThreadPoolExecutor(max_workers=min(8, len(spec.records))) as pool:
        return {"ranks": list(pool.map(one, spec.records))}


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {name: value for name, _, value in pairs}


def _main_frames(entry: dict[str, Any]) -> list[str]:
    threads = entry["threads"]
    main = next((t for t in threads if t["thread"] in ("MainThread", "Current thread")), None)
    main = main or next((t for t in threads if "Current thread" in t["thread"]), None)
    return list((main or (threads[0] if threads else {"frames": []}))["frames"])


def stack_top(entry: dict[str, Any]) -> str:
    frames = _main_frames(entry)
    return frames[0] if frames else f"(no stack: {entry['no_stack']})"


def script_frame(entry: dict[str, Any]) -> str | None:
    """The innermost frame of the main thread outside torch and SpikingSail: where in the script."""
    for frame in _main_frames(entry):
        if not any(part in frame for part in ("/torch/", "/spikingsail/", "/threading.py", "/deepspeed/")):
            return frame
    return None


def verdict(entries: list[dict[str, Any]]) -> tuple[list[int], str]:
    """The ranks that hold the job up, and one line that says so."""

    def progress(e: dict[str, Any]) -> Progress | None:
        return Progress(**e["progress"]) if e["progress"] else None

    def key(e: dict[str, Any]) -> tuple[int, int, int]:
        p = progress(e)
        return (p.step, p.micro_step, p.collectives) if p else (-1, -1, -1)

    held = [e for e in entries if e["state"].startswith(HELD)]
    if not held:
        low = min(map(key, entries))
        if low != max(map(key, entries)):
            held = [e for e in entries if key(e) == low]
        else:
            held = [e for e in entries if (p := progress(e)) is None or p.inside != WAITING]
    culprits = sorted(e["rank"] for e in held)
    parts = []
    for e in sorted(held, key=lambda e: e["rank"]):
        p = progress(e)
        where = f"at step {p.step} in {p.doing()}" if p else "before its first engine call"
        place = script_frame(e)
        state = e["state"] if e["state"].startswith(HELD) else f"behind ({e['state']})"
        parts.append(
            f"rank {e['rank']} on {e['host']} is {state} {where}" + (f", at {place}" if place else "")
        )
    waiting = [e for e in entries if e["rank"] not in culprits]
    by_doing: dict[str, list[int]] = {}
    for e in waiting:
        p = progress(e)
        by_doing.setdefault(p.doing() if p else "no engine call yet", []).append(e["rank"])
    for doing, ranks in sorted(by_doing.items(), key=lambda item: item[1]):
        word = "rank" if len(ranks) == 1 else "ranks"
        verb = "waits" if len(ranks) == 1 else "wait"
        parts.append(f"{word} {', '.join(map(str, sorted(ranks)))} {verb} in {doing}")
    if not culprits:
        parts.insert(0, "every rank waits in a collective (ranks that called different collectives?)")
    return culprits, "; ".join(parts)


def render(report: dict[str, Any]) -> str:
    rows = [("rank", "host", "pid", "state", "step", "in", "last beat", "stack top")]
    for e in report["ranks"]:
        p = Progress(**e["progress"]) if e["progress"] else None
        age = f"{report['time'] - p.time:.0f} s ago" if p else "-"
        rows.append((str(e["rank"]), e["host"], str(e["pid"]), e["state"], str(p.step) if p else "-",
                     p.doing() if p else "-", age, stack_top(e)))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = [f"sail: hang: no rank has made progress for {report['timeout']:g} s (sail.hang_timeout_seconds)"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1]
              for row in rows]  # fmt: skip
    for node in report["silent_nodes"]:
        lines.append(f"  node {node} did not answer within {REPORT_WAIT_SECONDS:g} s")
    lines.append(message(report))
    return "\n".join(lines)


def message(report: dict[str, Any]) -> str:
    """The verdict as one of SpikingSail's errors (what / why / fix), which the launcher's failure
    reason quotes."""
    where = (
        f"every rank's stacks are in {report['path']}"
        if report.get("path")
        else "the table above has the stack tops"
    )
    return (
        f"sail: hang: {report['verdict']}\n"
        f"  why: no rank made progress for {report['timeout']:g} s (sail.hang_timeout_seconds); the job was "
        "ended (SIGKILL to every rank)\n"
        f"  fix: {where}; look at what holds up the rank(s) named first, on their host"
    )


class Watch:
    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.tick = min(1.0, max(0.1, spec.timeout / 10))
        self.stopping = threading.Event()
        self.changed: dict[str, tuple[tuple[int, int], float]] = {}
        self.pids: dict[str, int] = {}  # this node's ranks, from their records
        self.board: Any
        if spec.board is None:
            self.board, port = serve_board(spec.authkey.encode())
            print(port, flush=True)
        else:
            self.board = join_board(spec.board, spec.authkey.encode())
        threading.Thread(target=self._watch_stdin, daemon=True).start()

    def _watch_stdin(self) -> None:
        sys.stdin.buffer.read()  # returns when the rank closes it or dies
        self.stopping.set()

    def records(self) -> dict[str, Any]:
        out = {}
        for rank, path in self.spec.records.items():
            record = read_record(Path(path))
            if record is not None:
                out[rank] = asdict(record)
                self.pids[rank] = record.pid
        return out

    def run(self) -> None:
        try:
            while not self.stopping.wait(self.tick):
                self.board.update({f"node/{self.spec.node}": self.records()})
                if self.spec.board is None and "hang" not in self.board:
                    self._judge()
                if "hang" in self.board:
                    self._answer()
                    return
            self.board.update({f"node/{self.spec.node}": self.records()})
        except (OSError, EOFError):
            pass  # the board is gone: rank 0's node is done
        finally:
            self._remove_files()

    def _remove_files(self) -> None:
        """This node's records (nodes may share the directory: containers, the test cluster)."""
        for path in [*self.spec.records.values(), *self.spec.stack_files.values()]:
            with contextlib.suppress(OSError):
                os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(self.spec.directory)  # once the last node's watch has removed its own

    def _judge(self) -> None:
        now = time.monotonic()
        records: dict[str, dict[str, Any]] = {}
        for key, value in list(self.board.items()):
            if key.startswith("node/"):
                records.update(value)
        if len(records) < self.spec.world_size:
            return
        phases = [r["phase"] for r in records.values()]
        if "closed" in phases or all(r["phase"] == "ready" for r in records.values()):
            self.changed.clear()  # not started, or ending: no hang to find
            return
        for rank, r in records.items():
            mark = (r["pid"], r["beats"])
            if rank not in self.changed or self.changed[rank][0] != mark or r["phase"] == "checkpoint":
                self.changed[rank] = (mark, now)
        if now - max(t for _, t in self.changed.values()) >= self.spec.timeout:
            self.board["hang"] = time.time()

    def _answer(self) -> None:
        node_records = self.board.get(f"node/{self.spec.node}", {})
        self.board[f"report/{self.spec.node}"] = look(self.spec, node_records)
        end: dict[str, Any] | None = None
        if self.spec.board is None:
            end = self._report()
            self.board["end"] = end
        else:
            try:
                deadline = time.monotonic() + 2 * REPORT_WAIT_SECONDS
                while end is None and time.monotonic() < deadline:
                    end = self.board.get("end")
                    time.sleep(0.2)
            except (OSError, EOFError):
                pass
        if end is not None:
            self._tell_torchrun(end)
        self._kill_ranks()
        if self.spec.board is None:
            time.sleep(2 * self.tick)  # let the other nodes' watches read "end"

    def _report(self) -> dict[str, Any]:
        deadline = time.monotonic() + REPORT_WAIT_SECONDS
        while time.monotonic() < deadline:
            answered = [k for k in list(self.board.keys()) if k.startswith("report/")]
            if len(answered) >= self.spec.nodes:
                break
            time.sleep(0.2)
        entries: list[dict[str, Any]] = []
        answered_nodes = set()
        for key, value in list(self.board.items()):
            if key.startswith("report/"):
                entries.extend(value["ranks"])
                answered_nodes.add(key.removeprefix("report/"))
        posted = {k.removeprefix("node/"): v for k, v in list(self.board.items()) if k.startswith("node/")}
        silent = sorted(set(posted) - answered_nodes)
        for node in silent:  # its ranks as last posted: the node may be down, or cut off
            host = node.rsplit("/", 1)[0]
            for rank, record in posted[node].items():
                entries.append({"rank": int(rank), "host": host, "pid": record["pid"], "state": NO_ANSWER,
                                "progress": record, "threads": [], "no_stack": "its node's watch did not answer"})  # fmt: skip
        entries.sort(key=lambda e: e["rank"])
        culprits, line = verdict(entries)
        report = {
            "time": time.time(),
            "timeout": self.spec.timeout,
            "verdict": line,
            "culprits": culprits,
            "silent_nodes": silent,
            "ranks": entries,
        }
        report["path"] = self._write(report)
        print(render(report), file=sys.stderr, flush=True)
        progressed = [e["progress"]["time"] for e in entries if e["progress"]]
        return {
            "culprits": culprits,
            "message": message(report),
            "since": max(progressed, default=time.time()),
        }

    def _write(self, report: dict[str, Any]) -> str | None:
        try:
            directory = Path(self.spec.report_dir)
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / time.strftime("hang-report-%Y%m%d-%H%M%S.json")
            partial = path.with_suffix(".json.partial")
            partial.write_text(json.dumps(report, indent=1))
            partial.replace(path)
            return str(path)
        except OSError as err:
            print(f"sail: could not write the hang report to {self.spec.report_dir}: {err}", file=sys.stderr)
            return None

    def _tell_torchrun(self, end: dict[str, Any]) -> None:
        """The culprits' torchrun error files (where torchrun's agent runs them) get the verdict,
        dated when the job last made progress: torchrun names the earliest failure its root cause."""
        for rank, pid in self.pids.items():
            if int(rank) not in end["culprits"]:
                continue
            error_file = _environ(pid).get("TORCHELASTIC_ERROR_FILE")
            if error_file and not os.path.exists(error_file):
                with contextlib.suppress(OSError):
                    Path(error_file).write_text(
                        json.dumps({"message": end["message"], "timestamp": int(end["since"])})
                    )

    def _kill_ranks(self) -> None:
        for pid in self.pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    spec = Spec(**json.loads(argv[1]))
    Watch(spec).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
