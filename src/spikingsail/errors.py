"""The exceptions SpikingSail raises for mistakes a user can fix.

Every message has three parts: what was asked, why it cannot work, and what to do.
The CLI prints these without a traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class SailError(Exception):
    """Base class: a problem the user can fix, with a message that says how."""

    def __init__(self, what: str, why: str = "", fix: str = "") -> None:
        self.what, self.why, self.fix = what, why, fix
        super().__init__(self._render())

    def _render(self) -> str:
        parts = [self.what]
        if self.why:
            parts.append(f"  why: {self.why}")
        if self.fix:
            parts.append(f"  fix: {self.fix}")
        return "\n".join(parts)


class ConfigError(SailError):
    """The training config (JSON file or dict) is invalid."""


class RankDiscoveryError(SailError):
    """The environment describes an impossible or ambiguous process layout."""


class BackendError(SailError):
    """The chosen backend cannot run here or cannot honour the config."""


class LaunchError(SailError):
    """`sail launch` was asked for something it cannot start."""


class CheckpointError(SailError):
    """A checkpoint is missing, incomplete or corrupt, or cannot be written or resumed here."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): the "why"
    of a SailError made from an exception a library raised."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
