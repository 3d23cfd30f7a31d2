"""``sail report --ledger RUN_DIR``: did every sample of each finished epoch train exactly once?

Reads the files of ``monitor/ledger.py`` and takes, for every step, the records that stand: an
attempt (a restart, a requeue, a resume on another world size) supersedes what earlier attempts of
the same replica group (or of the job, without groups) wrote from its own first step on — those
steps were taken again — and so does it for other groups' attempts that had ended before it
started (every group restarted from a checkpoint). Then it checks each epoch: no sample twice, and in an epoch whose steps are
all there, every sample it has once; the steps in order, none missing. ``--against OTHER_RUN``
compares two runs step by step: the same sample ids in every step both took.
"""

from __future__ import annotations

import collections
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spikingsail.monitor.ledger import FORMAT, LEDGER_DIR
from spikingsail.monitor.report import ReportError

FACTS = ("samples", "epoch_samples", "steps_per_epoch")
"""What a header says of the training loader."""
SHOWN = 8
"""How many ids or steps a line names before it says how many more."""


@dataclass(slots=True)
class LedgerFile:
    path: Path
    header: dict[str, Any]
    steps: list[tuple[int, int, list[int], int | None, float]] = field(default_factory=list)
    """(step, epoch, ids, quorum, time) of each line after the header, in the file's order."""
    truncated: bool = False
    """The last line was cut short (the process was killed while writing it): left out."""


@dataclass(slots=True)
class Ledger:
    """The records that stand, merged over ranks and groups."""

    path: Path
    steps: dict[int, list[int]]
    epochs: dict[int, int]
    """Each step's epoch."""
    attempts: int
    groups: int
    redone: int
    """Steps an attempt wrote that a later one took again (counted once per attempt)."""
    samples: int | None
    epoch_samples: int | None
    steps_per_epoch: int | None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    repeated: int = 0
    """Extra trainings of samples within an epoch (a sample trained three times counts 2)."""
    lost: int = 0
    """Samples of finished epochs that never trained."""


def _listed(values: list[int]) -> str:
    shown = ", ".join(str(v) for v in values[:SHOWN])
    return shown + (f" and {len(values) - SHOWN} more" if len(values) > SHOWN else "")


def read_files(run: Path) -> list[LedgerFile]:
    """Every process's file under ``run`` (the run's directory, or its ``ledger`` directory)."""
    directory = run / LEDGER_DIR if (run / LEDGER_DIR).is_dir() else run
    found = sorted(directory.glob("*.jsonl")) if directory.is_dir() else []
    if not found:
        raise ReportError(
            f"{run}: no sample ledger ({run / LEDGER_DIR}/*.jsonl)",
            "the engine writes the ledger into the run's directory (sail.log_dir) when sail.ledger is on",
            'train with "sail": {"ledger": true} (and a sail.log_dir), then give that directory',
        )
    return [_read(path) for path in found]


def _read(path: Path) -> LedgerFile:
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    ended = lines[-1] == ""
    lines = lines[:-1] if ended else lines
    parsed: LedgerFile | None = None
    for number, line in enumerate(lines, 1):
        try:
            value = json.loads(line)
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
            if parsed is None:
                if value.get("ledger") != FORMAT or not all(
                    isinstance(value.get(key, 0), int) for key in ("attempt", *FACTS)
                ) or "attempt" not in value or not isinstance(value.get("group"), int | None):  # fmt: skip
                    raise ValueError(f"not a ledger header of format {FORMAT}")
                parsed = LedgerFile(path, value)
                continue
            step, epoch, ids, quorum = value["step"], value["epoch"], value["ids"], value.get("quorum")
            when = value.get("time", 0.0)
            if not (isinstance(step, int) and isinstance(epoch, int) and isinstance(ids, list)
                    and all(isinstance(i, int) for i in ids) and isinstance(quorum, int | None)
                    and isinstance(when, int | float)):  # fmt: skip
                raise ValueError(
                    "step, epoch and quorum must be integers, ids a list of integers, time a number"
                )
        except (ValueError, KeyError) as err:
            if number == len(lines) and not ended:
                if parsed is not None:
                    parsed.truncated = True
                break  # the process died while writing its last line
            raise ReportError(
                f"{path}:{number}: not a line of the sample ledger ({err})",
                "every line is one JSON object the engine wrote: a header, then one per step",
                "the file was changed by hand or by another program: restore it, or move it out of the "
                "ledger directory (its steps then count as missing)",
            ) from None
        parsed.steps.append((step, epoch, ids, quorum, float(when)))
    if parsed is None:
        raise ReportError(f"{path}: an empty ledger file", fix="move it out of the ledger directory")
    return parsed


def resolve(run: Path) -> Ledger:
    """The records that stand (see the module's text), with the problems and notes of the files."""
    files = read_files(run)
    by_group: dict[Any, dict[int, list[LedgerFile]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    for item in files:
        by_group[item.header.get("group")][item.header["attempt"]].append(item)
    facts: dict[str, set[int]] = {key: {f.header[key] for f in files if key in f.header} for key in FACTS}
    known = {key: max(values) if values else None for key, values in facts.items()}
    ledger = Ledger(run, {}, {}, sum(len(a) for a in by_group.values()), len(by_group), 0, known["samples"],
                    known["epoch_samples"], known["steps_per_epoch"])  # fmt: skip
    for key, values in facts.items():
        if len(values) > 1:
            ledger.problems.append(
                f"the attempts disagree on {key}: {sorted(values)} (another dataset or batch size?)"
            )
    _check_files(ledger, files)
    taken: dict[int, dict[int | None, list[int]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    spans = {  # each attempt's first step and the time of its last record (its start, without one)
        (g, a): (min((r[0] for f in own for r in f.steps), default=None),
                 max((r[4] for f in own for r in f.steps), default=a / 1e9))
        for g, attempts in by_group.items() for a, own in attempts.items()
    }  # fmt: skip
    for (group, attempt), (_, ended) in spans.items():
        # from its first step on, an attempt supersedes its group's earlier attempts, and the other
        # groups' attempts that had ended before it started (the job restarted from a checkpoint)
        cut = min((first for (g, a), (first, _) in spans.items() if first is not None and (
            (g == group and a > attempt) or (g != group and a / 1e9 > ended))), default=float("inf"))  # fmt: skip
        redone: set[int] = set()
        for item in by_group[group][attempt]:
            for step, epoch, ids, quorum, _ in item.steps:
                if step >= cut:
                    redone.add(step)
                    continue
                taken[step][quorum].extend(ids)
                if ledger.epochs.setdefault(step, epoch) != epoch:
                    ledger.problems.append(f"step {step} is in epoch {ledger.epochs[step]} in one record and "
                                           f"{epoch} in another")  # fmt: skip
        ledger.redone += len(redone)
    _merge_quorums(ledger, taken)
    _check_steps(ledger)
    return ledger


def _check_files(ledger: Ledger, files: list[LedgerFile]) -> None:
    for item in files:
        if item.truncated:
            ledger.notes.append(f"{item.path.name}: its last line was cut short (the process was killed while "
                                "writing it) and is left out")  # fmt: skip
        order = [record[0] for record in item.steps]
        if any(b <= a for a, b in itertools.pairwise(order)):
            ledger.problems.append(f"{item.path.name}: the steps are not in order ({_listed(order)})")


def _merge_quorums(ledger: Ledger, taken: dict[int, dict[int | None, list[int]]]) -> None:
    """A step's samples over the ranks and groups that took it. Replica groups that did not see each
    other (each in a quorum of its own) may each take the same step alone, with its whole batch: the
    samples count once (one group's state goes on: the states were the same, or the fingerprint
    check heals the others from the first group's). Quorums with other samples all count."""
    apart = []
    for step, quorums in sorted(taken.items()):
        first, *others = quorums.values()
        if others and all(sorted(other) == sorted(first) for other in others):
            apart.append(step)
            ledger.steps[step] = first
        else:
            ledger.steps[step] = [i for ids in quorums.values() for i in ids]
    if apart:
        ledger.notes.append(f"{len(apart)} step(s) were each taken by replica groups apart, in quorums of their "
                            f"own, with the same samples (counted once): {_listed(apart)}")  # fmt: skip


def _check_steps(ledger: Ledger) -> None:
    steps = sorted(ledger.steps)
    if not steps:
        ledger.notes.append("no step was committed")
        return
    if steps[0] != 1:
        ledger.notes.append(f"the ledger starts at step {steps[0]} (a resume of a run without it, or its "
                            "earlier files are elsewhere)")  # fmt: skip
    missing = sorted(set(range(steps[0], steps[-1] + 1)) - set(steps))
    if missing:
        ledger.problems.append(f"{len(missing)} step(s) have no record: {_listed(missing)}")
    per_epoch: dict[int, list[int]] = collections.defaultdict(list)
    for step in steps:
        per_epoch[ledger.epochs[step]].append(step)
    for epoch, in_epoch in sorted(per_epoch.items()):
        counts = collections.Counter(i for step in in_epoch for i in ledger.steps[step])
        twice = sorted(i for i, n in counts.items() if n > 1)
        ledger.repeated += sum(counts[i] - 1 for i in twice)
        if twice:
            where = sorted({s for s in in_epoch for i in ledger.steps[s] if counts[i] > 1})
            ledger.problems.append(f"epoch {epoch}: {len(twice)} sample(s) trained more than once: {_listed(twice)} "
                                   f"(steps {_listed(where)})")  # fmt: skip
        if ledger.steps_per_epoch is None or len(in_epoch) < ledger.steps_per_epoch:
            ledger.notes.append(
                f"epoch {epoch}: not finished ({len(in_epoch)} step(s), {len(counts)} sample(s))"
            )
            continue
        expected = ledger.epoch_samples or 0
        if len(counts) < expected:
            ledger.lost += expected - len(counts)
            named_ids = expected == ledger.samples and expected <= 10**7  # which ids: what every epoch has
            lost = sorted(set(range(expected)) - set(counts)) if named_ids else []
            named = f": {_listed(lost)}" if lost else ""
            ledger.problems.append(f"epoch {epoch}: {expected - len(counts)} of its {expected} samples never "
                                   f"trained{named}")  # fmt: skip
        elif not twice:
            ledger.notes.append(f"epoch {epoch}: {len(counts)} samples, each once")


def report(ledger: Ledger) -> str:
    steps = sorted(ledger.steps)
    span = f"steps {steps[0]} to {steps[-1]}" if steps else "no step"
    groups = f", {ledger.groups} replica groups" if ledger.groups > 1 else ""
    lines = [f"{ledger.path}: {ledger.attempts} attempt(s){groups}, {span}, "
             f"{ledger.redone} step(s) taken again after a restart"]  # fmt: skip
    lines += [f"  {note}" for note in ledger.notes]
    lines += [f"  PROBLEM {problem}" for problem in ledger.problems]
    lines.append("  every committed step's samples are accounted for: none twice in an epoch, none lost"
                 if not ledger.problems else f"  {len(ledger.problems)} problem(s)")  # fmt: skip
    return "\n".join(lines)


def compare(ours: Ledger, theirs: Ledger) -> tuple[list[str], bool]:
    """The steps whose samples differ between two runs (sorted ids), and those only one run took;
    and whether any step both took differs."""
    both = sorted(set(ours.steps) & set(theirs.steps))
    differ = [s for s in both if sorted(ours.steps[s]) != sorted(theirs.steps[s])]
    lines = [f"{len(both) - len(differ)} of {len(both)} step(s) both runs took used the same samples"]
    for step in differ[:SHOWN]:
        a, b = collections.Counter(ours.steps[step]), collections.Counter(theirs.steps[step])
        lines.append(f"  PROBLEM step {step}: only in {ours.path}: {_listed(sorted((a - b).elements()))}; "
                     f"only in {theirs.path}: {_listed(sorted((b - a).elements()))}")  # fmt: skip
    if len(differ) > SHOWN:
        lines.append(f"  PROBLEM and {len(differ) - SHOWN} more step(s) differ")
    for run, mine, other in ((ours, ours.steps, theirs.steps), (theirs, theirs.steps, ours.steps)):
        alone = sorted(set(mine) - set(other))
        if alone:
            lines.append(f"  {len(alone)} step(s) only in {run.path}: {_listed(alone)}")
    return lines, bool(differ)
