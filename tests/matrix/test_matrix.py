"""A seeded sample of the differential matrix, different on every run (the seed is in the report
header and in every test id; replay with SAIL_MATRIX_SEED=S, or one cell with
``python -m tests.matrix --cell ID``). The whole matrix: ``python -m tests.matrix --all``."""

from __future__ import annotations

import pytest

from tests.matrix.cells import AXES, INTERRUPTIONS, SAMPLE_SIZE, Cell, all_cells, sample, session_seed
from tests.matrix.runner import check, run_cell

pytestmark = [pytest.mark.multiprocess, pytest.mark.matrix]
SEED = session_seed()
CELLS = sample(SEED, SAMPLE_SIZE)


@pytest.mark.parametrize("cell", CELLS, ids=[f"seed{SEED}:{c.id}" for c in CELLS])
def test_cell_trains_like_one_process_or_refuses_clearly(cell: Cell) -> None:
    check(cell, run_cell(cell))


ALWAYS = [
    Cell.parse("ddp-fp32-acc3-client-window-replicas"),
    Cell.parse("ddp-fp32-acc1-config-world-replicas"),
]
"""Run in every sample: a save inside a window refused with replica groups, and their checkpoints
resumed by one process without them."""


@pytest.mark.parametrize("cell", ALWAYS, ids=[c.id for c in ALWAYS])
def test_replica_group_cells_run_in_every_sample(cell: Cell) -> None:
    check(cell, run_cell(cell))


def test_the_sample_covers_every_backend_interruption_balance_and_topology() -> None:
    for axis in AXES:
        assert {getattr(c, axis) for c in CELLS} == {getattr(c, axis) for c in all_cells()}, axis
    assert any(c.topology == "replicas" and not c.refusal for c in CELLS)  # one that must train
    assert sample(SEED, SAMPLE_SIZE) == CELLS  # the seed alone replays it


def test_every_unsupported_cell_names_its_refusal() -> None:
    # replica groups: the ddp and fsdp backends, no ZeRO over ddp, no balance, no save inside a window
    # (each group holds its own share of the window's gradient); every other interruption trains
    replicas = [c for c in all_cells() if c.topology == "replicas"]
    assert {(c.backend, c.balance) for c in replicas if not c.refusal} == {("ddp", "off"), ("fsdp", "off")}
    assert {c.interruption for c in replicas if not c.refusal} == set(INTERRUPTIONS) - {"window"}
    refusing = [c for c in all_cells() if c.refusal and c.topology == "ranks"]
    assert {(c.backend, c.interruption) for c in refusing if c.balance == "off"} == {
        ("fsdp", "window"), ("deepspeed-zero2", "window"), ("deepspeed-zero2", "world")}  # fmt: skip
    # DeepSpeed's engine needs equal micro-batches: every balanced DeepSpeed cell refuses; balanced
    # cells of the other backends refuse what they refuse unbalanced
    assert all(c.refusal for c in all_cells() if c.balance != "off" and c.backend == "deepspeed-zero2")
    assert {(c.backend, c.interruption) for c in refusing if c.balance != "off" and c.backend != "deepspeed-zero2"} == {
        ("fsdp", "window")}  # fmt: skip
