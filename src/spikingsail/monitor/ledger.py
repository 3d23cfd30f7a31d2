"""The sample ledger (``"sail": {"ledger": true}``): which samples every optimizer step trained on.

Every process appends to a file of its own, ``RUN_DIR/ledger/ATTEMPT-rRANK.jsonl``
(``ATTEMPT-gGROUP-rRANK`` with replica groups): a header line (the attempt, the process's rank and
replica group, the dataset's and an epoch's sample count), then one line per committed optimizer step with the dataset indices of the batches this rank took
in it that counted (``{"step": 12, "epoch": 0, "ids": [...]}``; ``step`` is the engine's
``global_steps`` after it, as in the metrics file). A line is written with one ``write`` as the step
ends, so a killed process loses nothing it committed; a step taken again (the replica groups voted
no) is written once, when it commits.

With replica groups a process also writes, before its gradients go to the other groups, what the step
takes (``{"taking": 12, "epoch": 0, "ids": [...], "quorum": 7}``): the other groups may commit the step
with its gradients after it has died (SIGKILL between the exchange and its own line), and then its
samples trained although it never wrote the step.

``ATTEMPT`` is rank 0's clock when the engine started, shared by every rank of the process group:
a restart, a requeue or a resume on another world size is a later attempt. The ledger's own entry in
the engine's state names the attempt (and replica group) whose state it is and its step; when a
process loads a state — a checkpoint at a resume, or a live group's state when its replica group
heals — it writes where that state came from (``{"from": {"group": 0, "attempt": ...}, "step":
4612}``). ``ledger_check`` follows the final state back through these hand-overs: the steps on that
path are what trained it, and every other step's work was set aside.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from spikingsail.engine.hooks import StepNotes

log = logging.getLogger(__name__)

LEDGER_DIR = "ledger"
FORMAT = 2
"""The header's ``ledger``: 2 added the ``taking`` lines (files of format 1 read the same)."""


def attempt_id(all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None, rank: int) -> int:
    """Rank 0's wall clock in nanoseconds, the same on every rank of the process group (a sum with
    the others' zeros): what orders the attempts of a job."""
    now = torch.tensor([time.time_ns() if rank == 0 else 0], dtype=torch.int64)
    if all_reduce_sum is None:
        return int(now.item())
    return int(all_reduce_sum(now).item())


class SampleLedger:
    """This process's ledger: a step feature (``optimizer_end``, ``discarded``) fed by the training
    loader (``take``), and a ``Stateful`` part of the engine's state (where a state came from)."""

    def __init__(self, run_dir: Path, attempt: int, facts: dict[str, Any], steps: Callable[[], int]) -> None:
        """``facts``: what the header says of the process (rank, world size, replica group, ...);
        ``steps``: the engine's committed optimizer steps."""
        self.directory = run_dir / LEDGER_DIR
        self.attempt, self.facts = attempt, facts
        group = facts.get("group")
        name = f"{attempt}-r{facts['rank']}" if group is None else f"{attempt}-g{group}-r{facts['rank']}"
        self.path = self.directory / f"{name}.jsonl"
        self._file: IO[str] | None = None
        self._ids: list[int] = []
        self._epoch = 0
        self._loader_facts: dict[str, int] | None = None
        self._steps = steps
        self._origins: list[str] = []
        """Lines that wait for the file (a state loaded before the first step)."""

    def loader_made(self, samples: int, epoch_samples: int, step_samples: int) -> None:
        """The training loader's facts, for the header: the dataset's samples, an epoch's (over all
        ranks), and an optimizer step's; an epoch's last step may be short."""
        self._loader_facts = {"samples": samples, "epoch_samples": epoch_samples,
                              "steps_per_epoch": -(-epoch_samples // step_samples)}  # fmt: skip

    def take(self, ids: list[int], epoch: int) -> None:
        """A batch of the training loader, handed out (the loader calls it)."""
        self._ids += ids
        self._epoch = epoch

    def optimizer_end(self, notes: StepNotes) -> None:
        if self._file is None:
            self._open()
        line = {"step": notes.step, "epoch": self._epoch, "ids": self._ids, "time": round(time.time(), 3)}
        if notes.skipped:
            line["skipped"] = True
        if notes.quorum is not None:
            line["quorum"] = notes.quorum
        assert self._file is not None
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._ids = []

    def taking(self, quorum: int) -> None:
        """The step's samples, as its gradients go to the other replica groups of ``quorum``."""
        if self._file is None:
            self._open()
        line = {"taking": self._steps() + 1, "epoch": self._epoch, "ids": self._ids, "quorum": quorum,
                "time": round(time.time(), 3)}  # fmt: skip
        assert self._file is not None
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def discarded(self) -> None:
        """The step is taken again, with the same samples: forget what it took."""
        self._ids = []

    def state_dict(self) -> dict[str, Any]:
        """Whose state this is: this attempt's (and replica group's), at its step."""
        return {"group": self.facts.get("group"), "attempt": self.attempt, "step": self._steps()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """A state was loaded (a checkpoint, or a live replica group's): write whose it was. (A state
        saved without the ledger names nobody; ``ledger_check`` then finds its attempt by its step.)"""
        source = {"group": saved["group"], "attempt": saved["attempt"]}
        line = json.dumps({"from": source, "step": int(saved["step"]), "time": round(time.time(), 3)},
                          separators=(",", ":"))  # fmt: skip
        if self._file is None:
            self._origins.append(line)  # the header comes first, once the loader's facts are known
        else:
            self._file.write(line + "\n")

    def _open(self) -> None:
        if self._loader_facts is None:
            log.warning("sail.ledger: the training batches do not come from engine.dataloader(...); the "
                        "ledger records steps without samples")  # fmt: skip
        self.directory.mkdir(parents=True, exist_ok=True)
        # line-buffered: each step's line reaches the file (and survives a SIGKILL) with one write
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        header = {"ledger": FORMAT, "attempt": self.attempt, **self.facts, **(self._loader_facts or {}),
                  "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}  # fmt: skip
        self._file.write(json.dumps(header, separators=(",", ":")) + "\n")
        for line in self._origins:
            self._file.write(line + "\n")
        self._origins = []

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class QuorumLedger:
    """With replica groups: a step feature (``step_begin``) writing, on an accumulation boundary,
    what the step takes before its gradients are exchanged, when other groups are in its quorum
    (``quorum``: torchft's quorum id then, else None)."""

    def __init__(self, ledger: SampleLedger, quorum: Callable[[], int | None]) -> None:
        self._ledger, self._quorum = ledger, quorum

    def step_begin(self, boundary: bool) -> None:
        if boundary and (quorum := self._quorum()) is not None:
            self._ledger.taking(quorum)
