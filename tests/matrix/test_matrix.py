"""A seeded sample of the differential matrix, different on every run (the seed is in the report
header and in every test id; replay with SAIL_MATRIX_SEED=S, or one cell with
``python -m tests.matrix --cell ID``). The whole matrix: ``python -m tests.matrix --all``."""

from __future__ import annotations

import pytest

from tests.matrix.cells import SAMPLE_SIZE, Cell, all_cells, sample, session_seed
from tests.matrix.runner import check, run_cell

pytestmark = [pytest.mark.multiprocess, pytest.mark.matrix]
SEED = session_seed()
CELLS = sample(SEED, SAMPLE_SIZE)


@pytest.mark.parametrize("cell", CELLS, ids=[f"seed{SEED}:{c.id}" for c in CELLS])
def test_cell_trains_like_one_process_or_refuses_clearly(cell: Cell) -> None:
    check(cell, run_cell(cell))


def test_the_sample_covers_every_backend_interruption_and_balance() -> None:
    for axis in ("backend", "interruption", "balance"):
        assert {getattr(c, axis) for c in CELLS} == {getattr(c, axis) for c in all_cells()}, axis
    assert sample(SEED, SAMPLE_SIZE) == CELLS  # the seed alone replays it


def test_every_unsupported_cell_names_its_refusal() -> None:
    refusing = [c for c in all_cells() if c.refusal]
    assert {(c.backend, c.interruption) for c in refusing if c.balance == "off"} == {
        ("fsdp", "window"), ("deepspeed-zero2", "window"), ("deepspeed-zero2", "world")}  # fmt: skip
    # DeepSpeed's engine needs equal micro-batches: every balanced DeepSpeed cell refuses; balanced
    # cells of the other backends refuse what they refuse unbalanced
    assert all(c.refusal for c in all_cells() if c.balance != "off" and c.backend == "deepspeed-zero2")
    assert {(c.backend, c.interruption) for c in refusing if c.balance != "off" and c.backend != "deepspeed-zero2"} == {
        ("fsdp", "window")}  # fmt: skip
