"""What a hang watch reads and reports: its ranks' progress records (written by ``heartbeat``), their
process states and Python stacks, and the verdict naming the rank that holds the job up.

Standard library only: the watch (``hangwatch``, run by path) loads this file by path too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import struct
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol


class Node(Protocol):
    """What a node's watch knows of its ranks (``hangwatch.Spec``)."""

    @property
    def records(self) -> dict[str, str]: ...
    @property
    def host(self) -> str: ...
    @property
    def py_spy(self) -> str | None: ...
    @property
    def stack_files(self) -> dict[str, str]: ...


PHASES = ("ready", "forward", "backward", "optimizer", "collective", "checkpoint", "closed")
"""The engine call a rank is in or last left: ``forward`` (``engine(batch)``), ``backward``,
``optimizer`` (``engine.step()``), ``collective`` (``engine.all_reduce``), ``checkpoint`` (a save or
load); ``ready`` before the first call, ``closed`` after ``engine.close()``."""
READY, FORWARD, BACKWARD, OPTIMIZER, COLLECTIVE, CHECKPOINT, CLOSED = range(len(PHASES))

LEFT, INSIDE, WAITING = 0, 1, 2
"""A record's ``inside``: the call was left; the rank is in it; it is in it and the call waits for
the other ranks (a gradient sync, an all-reduce: it counts in ``collectives``)."""

RECORD = struct.Struct("=qqqqqqq")
"""pid, beats, optimizer step, micro-step, phase, inside, collectives entered: seven 64-bit words in
the node's own byte order (the record never leaves its node). No time: a rank writes a record at every
phase of its step, and a clock read there would cost more than the write; the node's watch notes when
it first saw each record (``Progress.time``)."""
PID, BEATS, STEP, MICRO, PHASE, WHERE, COLLECTIVES = range(7)
"""The record's words, for a writer that stores them one by one."""

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
    time: float = 0.0
    """When the node's watch first saw this record (wall clock)."""

    @classmethod
    def unpack(cls, data: bytes) -> Progress:
        pid, beats, step, micro, phase, inside, collectives = RECORD.unpack(data)
        return cls(pid=pid, beats=beats, step=step, micro_step=micro, phase=PHASES[phase],
                   inside=inside, collectives=collectives)  # fmt: skip

    def doing(self) -> str:
        call = {"optimizer": "engine.step()", "collective": "engine.all_reduce"}.get(self.phase, self.phase)
        if self.inside == WAITING:
            what = "the gradient sync of backward" if self.phase == "backward" else call
            return f"{what} (collective #{self.collectives})"
        if self.inside == INSIDE:
            return call
        return f"the script, after {call}" if self.phase not in ("ready", "closed") else self.phase


def read_record(path: Path) -> Progress | None:
    """A rank's last record, or None before it wrote one (or where it cannot be read). Read until two
    reads agree: the rank may be writing it at that moment."""
    try:
        with path.open("rb") as f:
            data = f.read(RECORD.size)
            for _ in range(10):
                f.seek(0)
                again = f.read(RECORD.size)
                if again == data:
                    break
                data = again
    except OSError:  # gone, or not ours to read
        return None
    if len(data) < RECORD.size or data == bytes(RECORD.size):
        return None
    return Progress.unpack(data)


def process_state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    code = stat[stat.rindex(")") + 2]
    return STATES.get(code, code)


def stacks(pid: int, spec: Node, rank: str) -> tuple[list[dict[str, Any]], str | None]:
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


def look(spec: Node, board_records: dict[str, Any]) -> dict[str, Any]:
    """This node's ranks as they are now: record, process state and stacks (read side by side)."""

    def one(rank: str) -> dict[str, Any]:
        record = read_record(Path(spec.records[rank]))
        posted = board_records.get(rank, {})
        pid = record.pid if record else posted.get("pid", 0)
        if record is not None:  # seen now, or when the watch last posted it
            same = (posted.get("pid"), posted.get("beats")) == (record.pid, record.beats)
            record = dataclasses.replace(record, time=posted["time"] if same else time.time())
        state = process_state(pid) if pid else "gone"
        threads, why = stacks(pid, spec, rank) if pid and state != "gone" else ([], "no process")
        return {
            "rank": int(rank), "host": spec.host, "pid": pid, "state": state,
            "progress": asdict(record) if record else None, "threads": threads, "no_stack": why,
        }  # fmt: skip

    with ThreadPoolExecutor(max_workers=min(8, len(spec.records))) as pool:
        return {"ranks": list(pool.map(one, spec.records))}


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
