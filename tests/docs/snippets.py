"""The fenced code blocks of README.md and docs/, and what the test suite does with each.

A block's language says how it is checked: ``python`` runs as a script, ``bash`` runs with ``bash -eu
-o pipefail``, ``json`` is loaded as a training config by the real parser; ``text`` is output or a
listing shown to the reader, not code. A runnable block that cannot run here (a GPU, a real cluster,
minutes of training) carries ``<!-- not run: REASON -->`` on the line before its fence. A block
with ``<!-- file: NAME -->`` before it is a file the page's later blocks use (a script, a config,
a hostfile): it is written as NAME into the page's working directory, and a later block of the page
that runs must name it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LANGUAGES = ("python", "bash", "json", "text")
RUNNABLE = ("python", "bash", "json")
_NOT_RUN = re.compile(r"^<!-- not run: (.*) -->$")
_FILE = re.compile(r"^<!-- file: (\S+) -->$")
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    """The line of the opening fence, 1-based."""
    language: str
    code: str
    not_run: str | None
    """The reason given for not running it, or None."""
    file: str | None = None
    """The file name it is written to for the page's later blocks, or None."""

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_hooks" not in p.parts)
    return [ROOT / "README.md", *docs]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, in order."""
    lines = path.read_text().split("\n")
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, language = opening.groups()
        end = next(
            (i for i in range(index + 1, len(lines)) if lines[i].strip() == "```"),
            None,
        )
        if end is None:
            raise ValueError(f"{path}:{index + 1}: a code block that is never closed")
        previous = lines[index - 1].strip() if index else ""
        marker, file = _NOT_RUN.match(previous), _FILE.match(previous)
        code = "\n".join(line.removeprefix(indent) for line in lines[index + 1 : end]) + "\n"
        found.append(
            Block(
                path,
                index + 1,
                language,
                code,
                marker.group(1).strip() if marker else None,
                file.group(1) if file else None,
            )
        )
        index = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for page in pages() for block in blocks(page)]
