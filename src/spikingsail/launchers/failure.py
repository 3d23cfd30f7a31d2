"""Why a job failed, read from what its launcher and its ranks printed last.

torchrun, pdsh, mpirun and horovodrun each name the failed rank in words of their own: torchrun's
summary is read here, a launcher's own report by the launcher (``Launcher.read_failure``). A rank
that stopped on one of SpikingSail's errors printed its message (what / why / fix), with or without
a traceback, and torchrun's summary carries it when the rank wrote torchrun's error file. The
failure reason names the rank and ends with that message, not with the launcher's report.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

# A launcher's reader of its own report of a failed rank (``Launcher.read_failure``).
FailureReader = Callable[[str, list[str], int], tuple[str, list[str]] | None]

# torchrun's failure summary, possibly behind pdsh's "node2: " prefixes:
#   time      : 2026-11-22_03:03:39
#   host      : node2
#   rank      : 1 (local_rank: 0)
#   exitcode  : -9 (pid: 7)  (SIGKILL)
ROOT_CAUSE = re.compile(
    r"time\s*:\s*(?P<time>\S+)\s*\n[^\n]*?host\s*:\s*(?P<host>\S+)\s*\n"
    r"[^\n]*?rank\s*:\s*(?P<rank>\d+) \(local_rank: (?P<local>\d+)\)\s*\n"
    r"[^\n]*?exitcode\s*:\s*(?P<code>-?\d+)[^\n]*?(?P<signal>\(SIG\w+\))?[ \t]*$",
    re.M,
)
# A SailError's message: its first line, then "  why: ..." and "  fix: ..." (SailError._render).
_FIELD = re.compile(r"^(?P<prefix>.*?)  (?:why|fix): ")
# The last line of a traceback that ends in one of SpikingSail's exceptions.
_RAISED = re.compile(r"^(?P<prefix>.*?)spikingsail(?:\.\w+)*\.(?P<message>\w*Error: .*)$")
# What may stand before the message on its first line: torchrun's summary field, a log header.
_LEAD = re.compile(r"^\s*(?:traceback\s*:\s*|\[(?:rank\d+|sail)\](?: \d\d:\d\d:\d\d \w+ [\w.]+:)? )")
_CONTINUATION = "       "  # SailError fields that span lines continue under their text
# faulthandler's report of a crash (the engine enables it): "Fatal Python error: Aborted", then every
# thread's stack, then one long line of loaded extension modules, which says nothing about the crash.
_FATAL = re.compile(r"^(?P<prefix>.*?)Fatal Python error: ")
_MODULES = "Extension modules: "
# What C++ printed just before aborting: "terminate called after throwing ...", "  what():  ..."
_ABORT_CAUSE = re.compile(r"terminate called|what\(\):")
CRASH_LINES = 60


def reported_error(lines: list[str]) -> str | None:
    """The first SpikingSail error message in a rank's output (what / why / fix, as the rank
    printed it, without prefixes or traceback), or None."""
    for index, line in enumerate(lines):
        raised = _RAISED.match(line)
        field = _FIELD.match(lines[index + 1]) if index + 1 < len(lines) else None
        if raised is not None:
            prefix, first = raised["prefix"], raised["message"]
        elif field is not None and line.startswith(field["prefix"]) and line[len(field["prefix"]) :].strip():
            prefix, first = field["prefix"], _LEAD.sub("", line[len(field["prefix"]) :])
        else:
            continue
        return "\n".join([first, *_fields(lines[index + 1 :], prefix)])
    return None


def crash_report(lines: list[str]) -> list[str] | None:
    """The first crash faulthandler reported in a rank's output (the error, what C++ said just before
    it, every thread's stack; not the extension modules), or None."""
    for index, line in enumerate(lines):
        if _FATAL.match(line) is None:
            continue
        start = index
        while start > 0 and index - start < 3 and _ABORT_CAUSE.search(lines[start - 1]):
            start -= 1
        end = next((i for i in range(index, len(lines)) if _MODULES in lines[i]), len(lines))
        report = lines[start:end]
        while report and not report[-1].strip():
            report.pop()
        return report[:CRASH_LINES]
    return None


GLOO_EXIT_ABORT = "terminate called without an active exception"


def known_cause(lines: list[str]) -> tuple[str, str] | None:
    """(why, fix) of a failure whose cause is known from its output: torch's gloo abort at the
    interpreter's exit (pytorch/pytorch#190489), else None."""
    if not any(GLOO_EXIT_ABORT in line for line in lines):
        return None
    return (
        f'"{GLOO_EXIT_ABORT}" is, most likely, torch\'s gloo abort at interpreter exit '
        "(pytorch/pytorch#190489, torch 2.13 to 2.14 at least; about one run in ten to twenty of a plain DDP "
        "script): DDP keeps the process group's threads alive, and one frees a work item while Python "
        "shuts down; the training itself had ended if the rank printed its last output",
        "end the script with engine.close() (the engine ends those threads first), or in a plain torchrun "
        "script: del model, optimizer; dist.destroy_process_group(); os._exit(0) — see 'Move a torchrun "
        "script over' in the docs",
    )


def _fields(lines: list[str], prefix: str) -> list[str]:
    out: list[str] = []
    for line in lines:
        rest = line[len(prefix) :] if line.startswith(prefix) else ""
        if rest.startswith(("  why: ", "  fix: ")) or (out and rest.startswith(_CONTINUATION)):
            out.append(rest)
        else:
            break
    return out


def _root_causes(text: str) -> list[re.Match[str]]:
    """Each agent's root cause: the failure under its summary's "Root Cause" heading (the ones
    listed above it failed as well, often only because the root cause's rank was gone)."""
    sections = text.split("Root Cause (first observed failure):")[1:]
    causes = [found for section in sections if (found := ROOT_CAUSE.search(section))]
    return causes or list(ROOT_CAUSE.finditer(text))


@dataclass(kw_only=True, slots=True, frozen=True)
class Failure:
    host: str
    exit_code: int
    tail: list[str]
    lost: float | None = None
    """The node stopped answering the heartbeat connection for this many seconds."""

    @property
    def reported(self) -> str | None:
        """The failed rank's own SpikingSail error message, when it stopped on one."""
        return reported_error(self._who("\n".join(self.tail))[1])

    def describe(self) -> str:
        """Which node and rank failed, as the launcher that saw it reports it, and then the rank's
        own message when it stopped on one of SpikingSail's errors, or the Python stacks when it
        crashed (SIGABRT, SIGSEGV), else the last lines printed."""
        if self.lost is not None:
            return (
                f"lost node {self.host}: no answer for {self.lost:.0f} s on the heartbeat connection (the node "
                "down, or the network to it cut); the job was stopped, and the node ends its part by itself "
                "when the heartbeat stops reaching it"
            )
        who, lines = self._who("\n".join(self.tail))
        reported = reported_error(lines)
        if reported is not None:
            return f"{who}; the rank's error:\n{reported}"
        crash = crash_report(lines)
        if crash is not None:
            shown = "\n".join(f"    {line}" for line in crash)
            return f"{who}; the rank crashed:\n{shown}"
        shown = "\n".join(f"    {line}" for line in lines[-12:])
        return f"{who}; its last output:\n{shown}"

    def _who(self, text: str) -> tuple[str, list[str]]:
        """The failure in the launcher's words, and the lines that belong to the failed rank."""
        for read in _launcher_readers():
            found = read(text, self.tail, self.exit_code)
            if found is not None:
                return found
        # Under pdsh one stream carries every node's summary; the earliest failure is the cause,
        # the others are ranks that lost their peers.
        causes = sorted(_root_causes(text), key=lambda m: m["time"])
        host, detail = self.host, ""
        if causes:
            cause = causes[0]
            host = cause["host"]
            detail = f", rank {cause['rank']} (local rank {cause['local']}) exited with {cause['code']}"
            detail += f" {cause['signal']}" if cause["signal"] else ""
        return f"node {host} failed (agent exit status {self.exit_code}){detail}", self.tail


def _launcher_readers() -> list[FailureReader]:
    """Every registered launcher's reader, in the registry's order."""
    from spikingsail.launchers import LAUNCHERS  # the registry's launchers import this module

    return [launcher.read_failure for launcher in LAUNCHERS.values()]
