"""Log formatting for SpikingSail's own logger: every line says which rank wrote it.

``configure_logging`` is called by the ``sail`` CLI. In a training script the engine calls
``ensure_logging``, which configures nothing when the application already set up logging.
"""

from __future__ import annotations

import logging
import os

_FORMAT = "[{who}] %(asctime)s %(levelname)s %(name)s: %(message)s"


class _RankZeroInfo(logging.Filter):
    """Lets other ranks through only from WARNING up, so INFO is printed once, not N times."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.WARNING


def configure_logging(rank: int | None = None, level: str | int | None = None) -> None:
    """Handlers for the ``spikingsail`` logger; ``rank`` None is the launcher itself."""
    logger = logging.getLogger("spikingsail")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler()
    who = "sail" if rank is None else f"rank{rank}"
    handler.setFormatter(logging.Formatter(_FORMAT.format(who=who), datefmt="%H:%M:%S"))
    handler.addFilter(_RankZeroInfo(rank or 0))
    logger.addHandler(handler)
    logger.setLevel(level or os.environ.get("SAIL_LOG_LEVEL", "INFO").upper())
    logger.propagate = False


def ensure_logging(rank: int) -> None:
    if not logging.getLogger().handlers and not logging.getLogger("spikingsail").handlers:
        configure_logging(rank)
