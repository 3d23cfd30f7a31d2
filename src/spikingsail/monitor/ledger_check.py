"""``sail report --ledger RUN_DIR``: did every sample of each finished epoch train exactly once?

Reads the files of ``monitor/ledger.py`` and follows the final state back to step 1: through the
steps of the attempt (and replica group) that holds it, and wherever a state was loaded — a resume
from a checkpoint, a group healed from a live one — on into the attempt whose state it was, from
that step down. A step on that path counts with the samples of every process that took it with it:
the ranks of its attempt, or (replica groups) every group in the same torchft quorum (a group alone
in its quorum records none: it took the step with its own ranks only; a group killed after its
gradients went to the quorum, before it wrote the step, counts with what it wrote it took). Every other
step's work was set aside (taken again after a restart, or dropped by a group that healed from
another). Then it checks each epoch: no sample twice, and in an epoch whose steps are all there,
every sample it has once; the steps in order, none missing. Replica groups that ended together
must have the same history. ``--against OTHER_RUN`` compares two runs step by step: the same
sample ids in every step both took.
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

Chain = tuple[int | None, int]
"""An attempt of a replica group (None without groups): (group, attempt)."""
Record = tuple[int, int, list[int], int | None, float]
"""A committed step: (step, epoch, ids, quorum, time)."""
Taken = tuple[Chain, int, Record]
"""A step on the final state's path: the chain, its segment and the record."""


@dataclass(slots=True)
class Segment:
    """What a process trained from one state on: the state's step and where it came from (None:
    the file's start, with no state loaded), then its steps."""

    start: int
    source: Chain | None
    since: float
    records: dict[int, Record] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)
    """The steps in the file's order (a step written twice is in ``records`` once)."""
    taking: dict[int, Record] = field(default_factory=dict)
    """Replica groups: what each step took as its gradients went to the other groups in its quorum."""


@dataclass(slots=True)
class LedgerFile:
    path: Path
    header: dict[str, Any]
    segments: list[Segment] = field(default_factory=list)
    truncated: bool = False
    """The last line was cut short (the process was killed while writing it): left out."""

    @property
    def chain(self) -> Chain:
        return self.header.get("group"), self.header["attempt"]

    @property
    def last(self) -> Record | None:
        """The step written last (None: the process committed none)."""
        written = [s for s in self.segments if s.order]
        return written[-1].records[written[-1].order[-1]] if written else None


@dataclass(slots=True)
class Ledger:
    """The records on the final state's path, merged over ranks and groups."""

    path: Path
    steps: dict[int, list[int]]
    epochs: dict[int, int]
    """Each step's epoch."""
    attempts: int
    groups: int
    redone: int
    """Steps an attempt wrote whose work was set aside (counted once per attempt)."""
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


def _named(chain: Chain) -> str:
    group, attempt = chain
    return f"attempt {attempt}" + ("" if group is None else f" of replica group {group}")


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
                parsed = LedgerFile(path, _header(value))
            elif "from" in value:
                parsed.segments.append(_origin(value))
            else:
                _add_step(parsed, value)
        except (ValueError, KeyError, TypeError) as err:
            if number == len(lines) and not ended:
                if parsed is not None:
                    parsed.truncated = True
                break  # the process died while writing its last line
            raise ReportError(
                f"{path}:{number}: not a line of the sample ledger ({err})",
                "every line is one JSON object the engine wrote: a header, then one per step or loaded state",
                "the file was changed by hand or by another program: restore it, or move it out of the "
                "ledger directory (its steps then count as missing)",
            ) from None
    if parsed is None:
        raise ReportError(f"{path}: an empty ledger file", fix="move it out of the ledger directory")
    return parsed


def _add_step(parsed: LedgerFile, value: dict[str, Any]) -> None:
    """A committed step's line, or (``taking``) what a step took as its gradients left for the quorum."""
    taking = "taking" in value
    record = _record({**value, "step": value["taking"]} if taking else value)
    if taking and record[3] is None:
        raise ValueError("a taking line names its quorum")
    if not parsed.segments:
        parsed.segments.append(Segment(record[0] - 1, None, float(parsed.header.get("started", 0))))
    if taking:
        parsed.segments[-1].taking[record[0]] = record
    else:
        parsed.segments[-1].records[record[0]] = record
        parsed.segments[-1].order.append(record[0])


def _header(value: dict[str, Any]) -> dict[str, Any]:
    if value.get("ledger") not in range(1, FORMAT + 1) or not all(
        isinstance(value.get(key, 0), int) for key in ("attempt", "rank", *FACTS)
    ) or "attempt" not in value or not isinstance(value.get("group"), int | None):  # fmt: skip
        raise ValueError(f"not a ledger header of a format up to {FORMAT}")
    return value


def _origin(value: dict[str, Any]) -> Segment:
    source, step, when = value["from"], value["step"], value.get("time", 0.0)
    if not (isinstance(source, dict) and isinstance(source.get("group"), int | None)
            and isinstance(source.get("attempt"), int) and isinstance(step, int) and step >= 0
            and isinstance(when, int | float)):  # fmt: skip
        raise ValueError("a loaded state's line names its group and attempt (integers) and its step")
    return Segment(step, (source["group"], source["attempt"]), float(when))


def _record(value: dict[str, Any]) -> Record:
    step, epoch, ids, quorum = value["step"], value["epoch"], value["ids"], value.get("quorum")
    when = value.get("time", 0.0)
    if not (isinstance(step, int) and isinstance(epoch, int) and isinstance(ids, list)
            and all(isinstance(i, int) for i in ids) and isinstance(quorum, int | None)
            and isinstance(when, int | float)):  # fmt: skip
        raise ValueError("step, epoch and quorum must be integers, ids a list of integers, time a number")
    return step, epoch, ids, quorum, float(when)


def resolve(run: Path) -> Ledger:
    """The records on the final state's path (see the module's text), with the problems and notes."""
    files = read_files(run)
    chains: dict[Chain, list[LedgerFile]] = collections.defaultdict(list)
    for item in files:
        chains[item.chain].append(item)
    facts: dict[str, set[int]] = {key: {f.header[key] for f in files if key in f.header} for key in FACTS}
    known = {key: max(values) if values else None for key, values in facts.items()}
    ledger = Ledger(run, {}, {}, len(chains), len({group for group, _ in chains}), 0, known["samples"],
                    known["epoch_samples"], known["steps_per_epoch"])  # fmt: skip
    for key, values in facts.items():
        if len(values) > 1:
            ledger.problems.append(
                f"the attempts disagree on {key}: {sorted(values)} (another dataset or batch size?)"
            )
    _check_files(ledger, files)
    # the samples of a step: every process in its quorum, or (without one) every rank of its attempt
    taken: dict[tuple[int, Any], list[int]] = collections.defaultdict(list)
    epochs: dict[tuple[int, Any], set[int]] = collections.defaultdict(set)
    for item in files:
        for index, segment in enumerate(item.segments):
            for step, epoch, ids, quorum, _ in segment.records.values():
                at = step, _together(item, index, quorum)
                taken[at].extend(ids)
                epochs[at].add(epoch)
    _count_taken_by_the_dead(files, taken, epochs)
    # a chain's path is read in the file of its lowest rank (every rank loads the same states)
    lead = {chain: min(own, key=lambda f: f.header.get("rank", 0)) for chain, own in chains.items()}
    last = {chain: record for chain, item in lead.items() if (record := item.last) is not None}
    ending = sorted(last, key=lambda c: (last[c][4], c[1], -1 if c[0] is None else c[0]))
    path: dict[int, Taken] = {}
    if ending:  # the newest state, and the groups that took its last step with it
        final = ending[-1]
        path, handovers = _path(lead, final, ledger)
        if handovers:
            ledger.notes.append(f"the final state's history crosses {handovers} load(s) of another attempt's "
                                "or group's state (a resume or a heal)")  # fmt: skip
        _check_ending(ledger, lead, taken, [(chain, last[chain]) for chain in ending], path)
    used = set()
    for step, entry in sorted(path.items()):
        at = step, _key(lead, entry)
        used.add(at)
        ledger.steps[step] = list(taken[at])
        ledger.epochs[step] = entry[2][1]
        if len(together := epochs[at]) > 1:
            ledger.problems.append(f"step {step} is in epochs {sorted(together)} in the records of the processes "
                                   "that took it together")  # fmt: skip
    for item in lead.values():
        ledger.redone += sum((step, _together(item, index, quorum)) not in used
                             for index, segment in enumerate(item.segments)
                             for step, _, _, quorum, _ in segment.records.values())  # fmt: skip
    _check_steps(ledger)
    return ledger


def _count_taken_by_the_dead(
    files: list[LedgerFile], taken: dict[tuple[int, Any], list[int]], epochs: dict[tuple[int, Any], set[int]]
) -> None:
    """A process killed after its gradients went to its quorum, before it wrote the step, which the
    quorum's other groups committed: its samples trained in that step too."""
    for item in files:
        for index, segment in enumerate(item.segments):
            for step, epoch, ids, quorum, _ in segment.taking.values():
                at = step, _together(item, index, quorum)
                if step not in segment.records and at in taken:
                    taken[at].extend(ids)
                    epochs[at].add(epoch)


def _check_ending(
    ledger: Ledger, lead: dict[Chain, LedgerFile], taken: dict[tuple[int, Any], list[int]],
    ending: list[tuple[Chain, Record]], path: dict[int, Taken],
) -> None:  # fmt: skip
    """The groups that took the final state's last step with it (its quorum) hold the same state:
    their histories must have the same samples at every step. ``ending``: each attempt's last step,
    the final state's last."""
    final, (last, _, _, quorum, _) = ending[-1]
    for chain, record in ending[:-1]:
        if quorum is None or record[0::3] != (last, quorum):
            continue  # it did not take the last step with the final state's group
        other, _ = _path(lead, chain, ledger)
        differ = sorted(path.keys() ^ other.keys()) + [
            s for s in sorted(path.keys() & other.keys())
            if sorted(taken[s, _key(lead, path[s])]) != sorted(taken[s, _key(lead, other[s])])
        ]  # fmt: skip
        if differ:
            ledger.problems.append(f"{_named(chain)} took step {last} with {_named(final)} but has another "
                                   f"history: other samples or no record at steps {_listed(sorted(differ))}")  # fmt: skip


def _together(item: LedgerFile, segment: int, quorum: int | None) -> Any:
    """Who took a step of ``item``'s ``segment`` with it: torchft's quorum of that step in this job,
    or (without replica groups) the ranks of its attempt, from the same loaded state on."""
    return ("quorum", item.header.get("job"), quorum) if quorum is not None else (item.chain, segment)


def _key(lead: dict[Chain, LedgerFile], entry: Taken) -> Any:
    chain, segment, (_, _, _, quorum, _) = entry
    return _together(lead[chain], segment, quorum)


def _path(lead: dict[Chain, LedgerFile], final: Chain, ledger: Ledger) -> tuple[dict[int, Taken], int]:
    """The record of every step from the final state of ``final`` back to step 1 (or to where the
    ledger starts): down a segment's steps, then into the state it started from; and how many such
    hand-overs it passed."""
    path: dict[int, Taken] = {}
    chain, index = final, len(lead[final].segments) - 1
    step = max(lead[chain].segments[index].records, default=lead[chain].segments[index].start)
    handovers, seen = 0, set()
    while step > 0:
        segment = lead[chain].segments[index]
        for number in sorted((s for s in segment.records if segment.start < s <= step), reverse=True):
            # a step with no record is named by _check_steps
            path[number] = (chain, index, segment.records[number])
        step = min(step, segment.start)
        if step <= 0:
            break
        source = segment.source or _earlier(lead, chain, step)
        if source is None:
            break  # the ledger starts here: a resume of a run without it
        # a process that loaded a state of its own (a checkpoint it saved) took it from before
        found = _segment_at(lead.get(source), step, segment.since, index if source == chain else None)
        if found is None or (source, found, step) in seen:
            ledger.problems.append(
                f"the state at step {step} of {_named(chain)} came from {_named(source)}, "
                + ("whose ledger has no such state" if source in lead else "whose ledger files are not here")
            )
            break
        seen.add((source, found, step))
        chain, index, handovers = source, found, handovers + 1
    return path, handovers


def _segment_at(item: LedgerFile | None, step: int, before: float, below: int | None = None) -> int | None:
    """The segment of ``item`` that held its state at ``step`` when another process loaded it at
    time ``before`` (or its own segment ``below`` did): one that started at that step or took it.
    Of two (the state at that step was replaced by another group's, as when groups at the same step
    held different states), the later one that had begun by then."""
    if item is None:
        return None
    held = [i for i, s in enumerate(item.segments[:below]) if s.start == step or step in s.records]
    begun = [i for i in held if item.segments[i].since <= before]
    return (begun or held)[-1] if held else None


def _earlier(lead: dict[Chain, LedgerFile], chain: Chain, step: int) -> Chain | None:
    """For a state loaded with no record of whose it was (a checkpoint saved without the ledger, or
    a file from before it recorded it): the latest earlier attempt that took ``step``, of the same
    group if one did."""
    group, attempt = chain
    took = [c for c, item in lead.items() if c[1] < attempt and any(step in s.records for s in item.segments)]
    return max(took, key=lambda c: (c[0] == group, c[1]), default=None)


def _check_files(ledger: Ledger, files: list[LedgerFile]) -> None:
    for item in files:
        if item.truncated:
            ledger.notes.append(f"{item.path.name}: its last line was cut short (the process was killed while "
                                "writing it) and is left out")  # fmt: skip
        for segment in item.segments:  # a loaded state may be an earlier one: its steps start again
            if any(b <= a for a, b in itertools.pairwise(segment.order)):
                ledger.problems.append(
                    f"{item.path.name}: the steps are not in order ({_listed(segment.order)})"
                )


def _check_steps(ledger: Ledger) -> None:
    steps = sorted(ledger.steps)
    if not steps:
        ledger.notes.append("no step was committed")
        return
    if steps[0] != 1:
        ledger.notes.append(f"the ledger starts at step {steps[0]} (a resume of a run without it, or its "
                            "earlier files are elsewhere)")  # fmt: skip
    gaps = [(a, b) for a, b in itertools.pairwise(steps) if b > a + 1]
    if gaps:
        count = sum(b - a - 1 for a, b in gaps)
        named = ", ".join(
            str(s) for s in itertools.islice((s for a, b in gaps for s in range(a + 1, b)), SHOWN)
        )
        more = f" and {count - SHOWN} more" if count > SHOWN else ""
        ledger.problems.append(f"{count} step(s) have no record: {named}{more}")
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
             f"{ledger.redone} step(s) taken again after a restart or a heal"]  # fmt: skip
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
