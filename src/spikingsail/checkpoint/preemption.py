"""Preemption: SIGTERM (SLURM's default, torchrun's agent) or SIGUSR1 (``sbatch --signal``) asks the
job to stop soon. The engine finishes the optimizer step it is in, saves a checkpoint and exits
with status 75 (EX_TEMPFAIL: "try again"), the signal to requeue the job and resume it.

Ranks receive the signal at slightly different moments, so the decision is shared: at every
optimizer step the ranks agree (one small all-reduce) whether any of them was signalled. The
watch is armed only when a checkpoint path is configured.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from spikingsail.exits import PREEMPTED_EXIT_CODE

__all__ = ["PREEMPTED_EXIT_CODE", "SIGNALS", "PreemptionWatch"]
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatch:
    def __init__(self, armed: bool) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        # signal handlers can only be installed from the main thread (not in a notebook worker thread)
        self.armed = armed and threading.current_thread() is threading.main_thread()
        if self.armed:
            self._previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.received = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received else "none"

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was signalled (a collective when armed and distributed)."""
        if not self.armed:
            return False
        if not dist.is_initialized():
            return self.received is not None
        flag = torch.tensor([0 if self.received is None else self.received], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.received is None:
            self.received = int(flag.item())
        return bool(flag.item())

    def disarm(self) -> None:
        if self.armed:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
            self.armed = False
