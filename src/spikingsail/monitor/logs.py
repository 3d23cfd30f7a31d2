"""Log formatting for SpikingSail's own logger: every line says which rank wrote it.

``configure_logging`` is called by the ``sail`` CLI. In a training script the engine calls
``ensure_logging``, which configures nothing when the application already set up logging, and
makes an uncaught SpikingSail error print as its message (what / why / fix) instead of a traceback.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from types import TracebackType

from spikingsail.errors import SailError

_FORMAT = "[{who}] %(asctime)s %(levelname)s %(name)s: %(message)s"
_ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], object]


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
    report_sail_errors(rank)


def report_sail_errors(rank: int | None = None) -> None:
    """Make an uncaught ``SailError`` print as ``[rankN] message`` without a traceback (shown with
    SAIL_LOG_LEVEL=DEBUG) and reach torchrun's error file; other exceptions go to the previous hook.
    The process still exits with status 1. ``rank`` None takes the launcher's RANK, if any."""
    current = sys.excepthook
    previous = current.previous if isinstance(current, _SailErrorHook) else current
    sys.excepthook = _SailErrorHook(rank, previous)


class _SailErrorHook:
    """A ``sys.excepthook``; replacing it again keeps the hook it replaced first."""

    def __init__(self, rank: int | None, previous: _ExceptHook) -> None:
        self.rank, self.previous = rank, previous

    def __call__(self, kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if not isinstance(error, SailError):
            self.previous(kind, error, tb)
            return
        rank = self.rank if self.rank is not None else os.environ.get("RANK")
        prefix = "" if rank is None else f"[rank{rank}] "
        message = "\n".join(prefix + line for line in str(error).splitlines())
        shown = message
        if debugging():
            shown = "".join(traceback.format_exception(kind, error, tb)) + message
        print(shown, file=sys.stderr, flush=True)
        _record_for_torchrun(error, shown)


def debugging() -> bool:
    """Whether tracebacks are wanted: SAIL_LOG_LEVEL=DEBUG, or SpikingSail's logger at DEBUG."""
    wanted = os.environ.get("SAIL_LOG_LEVEL", "").upper() == "DEBUG"
    return wanted or logging.getLogger("spikingsail").isEnabledFor(logging.DEBUG)


def _record_for_torchrun(error: SailError, shown: str) -> None:
    """torchrun gives every worker an error file (TORCHELASTIC_ERROR_FILE) and shows what a failed
    worker wrote there as the failure's root cause: the message, not a traceback (but with DEBUG)."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    # torch is imported only here: the `sail` CLI imports this module and must start quickly
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    class ClearErrorHandler(ErrorHandler):
        """ErrorHandler's record, with ``shown`` where it puts traceback.format_exc() (which is
        empty in an excepthook: no exception is being handled there)."""

        def record_exception(self, e: BaseException) -> None:
            path = self._get_error_file_path()
            if path:
                extra = {"py_callstack": shown, "timestamp": str(int(time.time()))}
                data = {"message": {"message": f"{type(e).__name__}: {e}", "extraInfo": extra}}
                self._write_error_file(path, json.dumps(data))

    ClearErrorHandler().record_exception(error)
