"""The hang watch: when no rank of a job makes progress, find out who holds it up and end it.

One process per node, started by the node's lowest rank (``heartbeat.start``) and run by path with
the standard library only (``python -I hangwatch.py SPEC``), so that it starts in a blink and stays
alive when its ranks stop or deadlock. Every ``tick`` it reads its ranks' progress records
(``heartbeat``) and posts them to a board: a dictionary served by rank 0's node's watch that the
other nodes' watches join (``board``: JSON over TCP, every message authenticated with the job's
secret, which the watch reads from its standard input; on loopback for a single node, else on the
address the other nodes reach rank 0's node at).

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
import dataclasses
import importlib.util
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

log = logging.getLogger(__name__)


def _sibling(name: str) -> ModuleType:
    """A module next to this file, loaded by path: run as a script (``python -I hangwatch.py``), the
    watch must not import SpikingSail, whose package imports torch."""
    spec = importlib.util.spec_from_file_location(
        f"sail_hangwatch_{name}", Path(__file__).with_name(f"{name}.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


if TYPE_CHECKING or __package__:
    from spikingsail.monitor import board, hangreport
else:
    board, hangreport = _sibling("board"), _sibling("hangreport")

# The engine's names for the calls a rank reports (``hangreport`` has what they mean).
PHASES: tuple[str, ...] = hangreport.PHASES
READY: int = hangreport.READY
FORWARD: int = hangreport.FORWARD
BACKWARD: int = hangreport.BACKWARD
OPTIMIZER: int = hangreport.OPTIMIZER
COLLECTIVE: int = hangreport.COLLECTIVE
CHECKPOINT: int = hangreport.CHECKPOINT
CLOSED: int = hangreport.CLOSED


@dataclass(kw_only=True, slots=True, frozen=True)
class Spec:
    """What a node's watch is told, as JSON on its command line. Nothing secret: every local user can
    read a command line. The board's secret comes as the first line of the watch's standard input."""

    records: dict[str, str]
    """rank → its record (``/proc/PID/fd/N``: a page of shared memory), for the ranks on this node."""
    host: str
    timeout: float
    world_size: int
    nodes: int
    board: str | None
    """ip:port of rank 0's node's board; None on that node, whose watch serves it."""
    bind: str
    """On rank 0's node: the address the board listens on (loopback for a single node)."""
    report_dir: str
    py_spy: str | None
    stack_files: dict[str, str]
    """rank → where its faulthandler writes (used without py-spy), as ``records``."""

    @property
    def node(self) -> str:
        return f"{self.host}/{min(map(int, self.records))}"

    def argv(self) -> list[str]:
        return [sys.executable, "-I", str(Path(__file__).resolve()), json.dumps(asdict(self))]


def _held(paths: dict[str, str]) -> dict[str, str]:
    """``paths`` (another process's file descriptors) as this process's own: ``/proc/self/fd/N``
    of a descriptor opened now, which stays readable after the other process has ended. A path
    that cannot be opened (its rank has ended already) stays as it is."""
    held = {}
    for rank, path in paths.items():
        try:
            held[rank] = f"/proc/self/fd/{os.open(path, os.O_RDONLY)}"
        except OSError as err:  # no hang is found while a rank's record is missing: say so
            log.warning("cannot read rank %s's progress record %s (%s): no hang will be reported", rank, path,
                        err.strerror or err)  # fmt: skip
            held[rank] = path
    return held


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {name: value for name, _, value in pairs}


class Watch:
    def __init__(self, spec: Spec, secret: bytes) -> None:
        # Each record held open from the start: it is still read after its rank has ended (how it
        # ended is part of a report), and it goes with the watch's own end, however that comes.
        self.spec = dataclasses.replace(
            spec, records=_held(spec.records), stack_files=_held(spec.stack_files)
        )
        self.tick = min(1.0, max(0.1, spec.timeout / 10))
        self.stopping = threading.Event()
        self.changed: dict[str, tuple[tuple[int, int], float]] = {}
        self.pids: dict[str, int] = {}  # this node's ranks, from their records
        self.seen: dict[str, tuple[tuple[int, int], float]] = {}  # per rank: (pid, beats), first seen at
        self.board: board.Board | board.Client
        if spec.board is None:
            self.board = board.Board()
            server = board.Server(self.board, secret, spec.bind)
            print(server.address[1], flush=True)
        else:
            self.board = board.Client(spec.board, secret)
        threading.Thread(target=self._watch_stdin, daemon=True).start()

    def _watch_stdin(self) -> None:
        sys.stdin.buffer.read()  # returns when the rank closes it or dies
        self.stopping.set()

    def records(self) -> dict[str, Any]:
        out = {}
        for rank, path in self.spec.records.items():
            record = hangreport.read_record(Path(path))
            if record is not None:
                mark = (record.pid, record.beats)
                if rank not in self.seen or self.seen[rank][0] != mark:
                    self.seen[rank] = (mark, time.time())
                out[rank] = {**asdict(record), "time": self.seen[rank][1]}
                self.pids[rank] = record.pid
        return out

    def run(self) -> None:
        try:
            while not self.stopping.wait(self.tick):
                self.board.set(f"node/{self.spec.node}", self.records())
                if self.spec.board is None and self.board.get("hang") is None:
                    self._judge()
                if self.board.get("hang") is not None:
                    self._answer()
                    return
            self.board.set(f"node/{self.spec.node}", self.records())
        except board.BoardError as err:
            log.warning("left the board: %s", err)  # not the job's board: nothing it said is acted on
        except (OSError, EOFError):
            pass  # the board is gone: rank 0's node is done

    def _judge(self) -> None:
        now = time.monotonic()
        records: dict[str, dict[str, Any]] = {}
        for value in self.board.items("node/").values():
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
            self.board.set("hang", time.time())

    def _answer(self) -> None:
        node_records = self.board.get(f"node/{self.spec.node}") or {}
        self.board.set(f"report/{self.spec.node}", hangreport.look(self.spec, node_records))
        end: dict[str, Any] | None = None
        if self.spec.board is None:
            end = self._report()
            self.board.set("end", end)
        else:
            try:
                deadline = time.monotonic() + 2 * hangreport.REPORT_WAIT_SECONDS
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
        deadline = time.monotonic() + hangreport.REPORT_WAIT_SECONDS
        while time.monotonic() < deadline:
            if len(self.board.items("report/")) >= self.spec.nodes:
                break
            time.sleep(0.2)
        entries: list[dict[str, Any]] = []
        answered_nodes = set()
        for key, value in self.board.items("report/").items():
            entries.extend(value["ranks"])
            answered_nodes.add(key.removeprefix("report/"))
        posted = {k.removeprefix("node/"): v for k, v in self.board.items("node/").items()}
        silent = sorted(set(posted) - answered_nodes)
        for node in silent:  # its ranks as last posted: the node may be down, or cut off
            host = node.rsplit("/", 1)[0]
            for rank, record in posted[node].items():
                entries.append({"rank": int(rank), "host": host, "pid": record["pid"], "state": hangreport.NO_ANSWER,
                                "progress": record, "threads": [], "no_stack": "its node's watch did not answer"})  # fmt: skip
        entries.sort(key=lambda e: e["rank"])
        culprits, line = hangreport.verdict(entries)
        report = {
            "time": time.time(),
            "timeout": self.spec.timeout,
            "verdict": line,
            "culprits": culprits,
            "silent_nodes": silent,
            "ranks": entries,
        }
        report["path"] = self._write(report)
        print(hangreport.render(report), file=sys.stderr, flush=True)
        progressed = [e["progress"]["time"] for e in entries if e["progress"]]
        return {
            "culprits": culprits,
            "message": hangreport.message(report),
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
    logging.basicConfig(stream=sys.stderr, format="sail: hang watch: %(message)s", level=logging.INFO)
    spec = Spec(**json.loads(argv[1]))
    secret = board.parse_secret(sys.stdin.buffer.readline().decode())  # before the lifeline: see heartbeat
    Watch(spec, secret).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
