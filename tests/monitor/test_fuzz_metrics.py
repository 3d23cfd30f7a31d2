"""Generated metrics files through ``sail report``'s reader, summary and plots: lines the engine writes
with values of other types, straggler windows and balance changes of other shapes, events and the
script's own metrics of any content, lines of other JSON and bytes that are not JSON.

The reader must return the run or raise ``ReportError`` (naming the line); what it returns must be
summarised and drawn without an error. Seeded and bounded (derandomized, no example database).
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spikingsail.cli.main import main
from spikingsail.monitor.report import ReportError, Run, draw, read_run, summary

FUZZ = settings(derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])
"""Seeded and bounded: the same examples every run, nothing kept between runs."""

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
NUMBER = st.floats() | st.integers(-(2**70), 2**70)
STEP_KEYS = ["step", "loss", "lr", "samples", "samples_per_sec", "loss_scale", "skipped", "time"]


@st.composite
def windows(draw: st.DrawFn, ranks: int) -> dict[str, Any]:
    phases = draw(st.lists(st.sampled_from(["data", "forward", "backward", "comm", "optimizer"]),
                           min_size=1, max_size=5, unique=True))  # fmt: skip
    return {"window": 2, "scores": draw(st.lists(NUMBER, min_size=ranks, max_size=ranks)),
            "ms_per_step": {p: draw(st.lists(NUMBER, min_size=ranks, max_size=ranks)) for p in phases}}  # fmt: skip


@st.composite
def lines(draw: st.DrawFn, step: int) -> bytes:
    """One line: a step as the engine writes it (maybe with a value of another kind), an event, the
    script's own metrics, other JSON or other bytes."""
    kind = draw(st.sampled_from(["step", "step", "step", "changed", "window", "balance", "event", "log", "json",
                                 "bytes", "blank"]))  # fmt: skip
    record: dict[str, Any] = {"step": step, "loss": draw(NUMBER | st.none()), "lr": 0.1, "samples": 8 * step,
                              "samples_per_sec": draw(NUMBER), "loss_scale": 1.0, "skipped": False, "time": 0.0}  # fmt: skip
    if kind == "changed":
        record[draw(st.sampled_from([*STEP_KEYS, "stragglers", "balance"]))] = draw(JSON)
    elif kind == "window":
        record["stragglers"] = draw(windows(2) if draw(st.booleans()) else JSON)
    elif kind == "balance":
        record["balance"] = draw(st.fixed_dictionaries({"split": JSON, "speeds": JSON}) | JSON)
    elif kind == "event":
        record = {"step": draw(st.integers(0, 10) | JSON), "event": draw(JSON), "message": draw(JSON)}
    elif kind == "log":
        record = {"step": step, "log": draw(JSON)}
    elif kind == "json":
        return json.dumps(draw(JSON)).encode()
    elif kind == "bytes":
        return draw(st.binary(max_size=24)).replace(b"\n", b"")
    elif kind == "blank":
        return b"  "
    return json.dumps(record).encode()


METRICS = (
    st.lists(st.integers(1, 50), min_size=1, max_size=12)
    .flatmap(lambda steps: st.tuples(*(lines(s) for s in steps)))
    .map(lambda parts: b"\n".join(parts) + b"\n")
)


def read(data: bytes) -> Run | None:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "metrics.jsonl"
        path.write_bytes(data)
        try:
            return read_run(path)
        except ReportError as err:
            refused = err
    assert f"{path}" in refused.what  # the message names the file
    return None


@settings(FUZZ, max_examples=150)
@given(data=METRICS)
def test_what_the_reader_accepts_is_summarised(data: bytes) -> None:
    run = read(data)
    if run is not None:
        assert summary(run).startswith("  steps")


@settings(FUZZ, max_examples=8)
@given(data=METRICS)
def test_what_the_reader_accepts_is_drawn(data: bytes) -> None:
    run = read(data)
    if run is not None:
        with tempfile.TemporaryDirectory() as scratch:
            written = draw(run, Path(scratch) / "plots")
            assert all(p.stat().st_size > 0 for p in written)


@settings(FUZZ, max_examples=6)
@given(data=METRICS, out=st.sampled_from(["plots", "metrics.jsonl", "metrics.jsonl/plots", "new/deeper"]))
def test_sail_report_ends_with_a_summary_or_one_message(data: bytes, out: str) -> None:
    accepted = read(data) is not None
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "metrics.jsonl"
        path.write_bytes(data)
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(["report", str(path), "--out", str(Path(scratch) / out)])
        assert path.read_bytes() == data  # the metrics file is never written to
        if accepted and not out.startswith("metrics.jsonl"):
            assert code == 0 and stdout.getvalue().startswith(f"{path}:\n  steps"), stderr.getvalue()
        else:
            assert code == 2 and stderr.getvalue().startswith("sail report: ") and stdout.getvalue() == ""


def test_the_generated_files_are_both_accepted_and_refused() -> None:
    """The generator makes files the reader accepts and files it refuses: the properties above are
    tried on both."""
    found: set[bool] = set()

    @settings(FUZZ, max_examples=40)
    @given(data=METRICS)
    def collect(data: bytes) -> None:
        found.add(read(data) is not None)

    collect()
    assert found == {True, False}
