"""What the doctor found: one ``Finding`` per check and host, rendered as a table or as JSON."""

from __future__ import annotations

import enum
import json
import os
import shutil
import sys
import textwrap
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, TextIO


class Status(str, enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(kw_only=True, slots=True, frozen=True)
class Finding:
    check: str
    """Short name of what was checked, e.g. ``/dev/shm`` or ``ssh``."""
    status: Status
    detail: str
    """What was found, in one line."""
    fix: str = ""
    """One line: what to do about it (empty when the status is ok)."""
    host: str = ""
    """The node it concerns; empty for this machine."""


def ok(check: str, detail: str, host: str = "") -> Finding:
    return Finding(check=check, status=Status.OK, detail=detail, host=host)


def warn(check: str, detail: str, fix: str, host: str = "") -> Finding:
    return Finding(check=check, status=Status.WARN, detail=detail, fix=fix, host=host)


def fail(check: str, detail: str, fix: str, host: str = "") -> Finding:
    return Finding(check=check, status=Status.FAIL, detail=detail, fix=fix, host=host)


@dataclass(kw_only=True, slots=True)
class Report:
    findings: list[Finding] = field(default_factory=list)
    tables: dict[str, list[list[str]]] = field(default_factory=dict)
    """Named tables shown after the findings (first row is the header), e.g. DeepSpeed's ops."""
    facts: dict[str, Any] = field(default_factory=dict)
    """The probes' raw facts per host, for --json."""

    @property
    def failed(self) -> bool:
        return any(f.status is Status.FAIL for f in self.findings)

    def counts(self) -> dict[str, int]:
        return {s.value: sum(f.status is s for f in self.findings) for s in Status}

    def to_json(self) -> str:
        findings = [{**asdict(f), "status": f.status.value} for f in self.findings]
        return json.dumps(
            {"ok": not self.failed, "counts": self.counts(), "findings": findings, "tables": self.tables,
             "facts": self.facts},
            indent=2,
        )  # fmt: skip

    def render(self, out: TextIO, color: bool) -> None:
        paint = _Painter(color)
        width = max(60, min(shutil.get_terminal_size((120, 24)).columns, 160))
        check_w = max((len(f.check) for f in self.findings), default=5)
        host_w = max((len(f.host) for f in self.findings), default=0)
        for f in self.findings:
            head = f"{paint.status(f.status)}  {f.check:<{check_w}}  " + (
                f"{f.host:<{host_w}}  " if host_w else ""
            )
            indent = " " * (6 + check_w + 2 + (host_w + 2 if host_w else 0))
            lines = textwrap.wrap(f.detail, width - len(indent)) or [""]
            out.write(head + lines[0] + "\n")
            for line in lines[1:]:
                out.write(indent + line + "\n")
            if f.fix:
                for i, line in enumerate(textwrap.wrap(f.fix, width - len(indent) - 5)):
                    out.write(indent + (paint.dim("fix: ") if i == 0 else "     ") + line + "\n")
        for title, rows in self.tables.items():
            out.write("\n" + paint.bold(title) + "\n" + format_table(rows) + "\n")
        c = self.counts()
        summary = f"{c['ok']} ok, {c['warn']} warning(s), {c['fail']} failure(s)"
        out.write("\n" + (paint.red(summary) if self.failed else paint.green(summary)) + "\n")


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def use_color(stream: TextIO, choice: str = "auto") -> bool:
    """``auto``: colour on a terminal unless NO_COLOR is set (no-color.org)."""
    if choice != "auto":
        return choice == "always"
    return stream.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"


class _Painter:
    _CODES: ClassVar[dict[Status, str]] = {Status.OK: "32", Status.WARN: "33", Status.FAIL: "31"}

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def _wrap(self, code: str, text: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.enabled else text

    def status(self, status: Status) -> str:
        return self._wrap(self._CODES[status] + ";1", f"{status.value.upper():<4}")

    def dim(self, text: str) -> str:
        return self._wrap("2", text)

    def bold(self, text: str) -> str:
        return self._wrap("1", text)

    def red(self, text: str) -> str:
        return self._wrap("31", text)

    def green(self, text: str) -> str:
        return self._wrap("32", text)


def stdout_color(choice: str) -> bool:
    return use_color(sys.stdout, choice)
