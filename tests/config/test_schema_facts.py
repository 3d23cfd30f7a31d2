"""Each config fact is said once, by the field: the parser's table of sections, what DeepSpeed is
handed and what may change on resume are read from the fields' declarations."""

from __future__ import annotations

from dataclasses import dataclass, field

from spikingsail.backends.deepspeed import DeepSpeedBackend
from spikingsail.checkpoint import compatibility
from spikingsail.checks import Range
from spikingsail.config import parse
from spikingsail.config.schema import Section, free, internal, keys_where, ranged, scalars, section, sections


@dataclass(kw_only=True, frozen=True)
class Knobs:
    depth: int = 1
    verbose: bool = free(False)
    window: int = ranged(3, Range(1, integer=True), resume="chunks")


@dataclass(kw_only=True, frozen=True)
class Made:
    rows: int = field(metadata={"resume": "split"})
    clip: float = 0.0
    knobs: Knobs = section(Knobs, deepspeed=False)
    kept: Knobs = section(Knobs, deepspeed=True, resume="free", aliases=("kept_too",))
    plan: Knobs | None = section(None, deepspeed=True)
    where: str = internal(default="<dict>", resume="free")


def test_the_declarations_are_read_from_the_fields() -> None:
    assert keys_where("free", Made) == ("knobs.verbose", "kept", "plan.verbose", "where")
    assert keys_where("split", Made) == ("rows",)
    assert keys_where("chunks", Made) == ("knobs.window", "plan.window")
    assert keys_where("fixed", Made) == ("clip", "knobs.depth", "plan.depth")
    kept = Section("kept", Knobs, deepspeed=True)
    assert sections(Made) == {
        "knobs": Section("knobs", Knobs, deepspeed=False), "kept": kept, "kept_too": kept,
        "plan": Section("plan", Knobs, deepspeed=True),
    }  # fmt: skip
    assert scalars(Made) == {"rows": int, "clip": float}


def test_the_parser_deepspeed_and_resume_use_those_declarations() -> None:
    assert sections() == parse._SECTIONS and scalars() == parse._SCALARS
    assert {"checkpoint", "snn", "fault_tolerance", "sail"} == parse.NOT_FOR_DEEPSPEED
    assert {"bf16", "bfloat16", "fp16", "optimizer", "scheduler", "zero_optimization"} <= parse.TOP_LEVEL_KEYS
    assert keys_where("free") == compatibility.FREE and keys_where("split") == compatibility.SPLIT
    assert DeepSpeedBackend is not None  # the backend that reads NOT_FOR_DEEPSPEED
