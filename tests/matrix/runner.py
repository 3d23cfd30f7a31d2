"""Running a cell: its processes, its interruption, and the comparison with the reference."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from tests.matrix.cells import WORLD, Cell
from tests.matrix.job import MICRO, run
from tests.multiprocess import run_ranks

ROOT = Path(__file__).resolve().parents[2]
_references: dict[tuple[str, int, str, str, str, str], dict[str, Any]] = {}


def reference(cell: Cell) -> dict[str, Any]:
    """One process, plain DDP backend, the same global batch (see ``one_process``), compiled when the
    cell is; a spiking model runs its whole T steps in one piece there, without time chunks."""
    key = (cell.precision, cell.accumulation, cell.scheduler, cell.model, cell.epoch, cell.compile)
    if key not in _references:
        plain = Cell("ddp", cell.precision, cell.accumulation, cell.scheduler, "none", model=cell.model,
                     epoch=cell.epoch, compile=cell.compile)  # fmt: skip
        spec, accumulation = one_process(plain)
        result = run_ranks(run, 1, {**spec, "whole_time": True}, accumulation, "straight", None)[0]
        assert result is not None and "params" in result, result
        _references[key] = result
    return _references[key]


def one_process(cell: Cell) -> tuple[dict[str, Any], int]:
    """The spec and accumulation that give one process the cell's global batch: micro-batches the
    size of a rank's and twice the accumulation; for synchronised batch norm, micro-batches of the
    whole global micro-batch (its statistics span one) and the same accumulation."""
    if cell.model == "bn":
        return {**cell.spec(), "micro": MICRO * WORLD}, cell.accumulation
    return cell.spec(), cell.accumulation * WORLD


def run_cell(cell: Cell) -> dict[str, Any]:
    """The cell's final rank-0 result (params, lr, steps), or {"refused": message}."""
    spec = cell.spec()
    if cell.topology == "replicas":
        return _run_replica_cell(cell, spec)
    if cell.interruption == "none":
        return _rank0(run_ranks(run, WORLD, spec, cell.accumulation, "straight", None))
    with tempfile.TemporaryDirectory(prefix="sail-matrix-") as tmp:
        checkpoints = str(Path(tmp) / "ck")
        try:
            first = _rank0(run_ranks(run, WORLD, spec, cell.accumulation, "first", checkpoints))
        except ChildFailedError:
            if cell.interruption != "sigkill":
                raise
            first = {"killed": True}
        if "refused" in first:
            return first
        if cell.interruption == "world":  # resume on one process: the same train_batch_size
            return _rank0(run_ranks(run, 1, *one_process(cell), "resume", checkpoints))
        return _rank0(run_ranks(run, WORLD, spec, cell.accumulation, "resume", checkpoints))


def _rank0(results: dict[int, Any]) -> dict[str, Any]:
    result = results[0]
    assert isinstance(result, dict), results
    return result


def check(cell: Cell, result: dict[str, Any]) -> None:
    """Assert the cell's guarantee: its refusal, or the reference's weights within the row's tolerance."""
    if cell.refusal is not None:
        assert "refused" in result, f"{cell.id} must refuse ({cell.refusal}), but ran: {sorted(result)}"
        assert cell.refusal in result["refused"], result["refused"]
        return
    assert "refused" not in result, f"{cell.id} refused: {result['refused']}"
    expected = reference(cell)
    assert result["steps"] == expected["steps"]
    assert abs(result["lr"] - expected["lr"]) <= 1e-9 * max(1.0, abs(expected["lr"])), (
        result["lr"],
        expected["lr"],
    )
    tol = cell.tolerance
    for key, value in expected["params"].items():
        torch.testing.assert_close(result["params"][key], value, rtol=tol.rtol, atol=tol.atol,
                                   msg=lambda m, k=key: f"{cell.id} {k}: {m} (tolerance: {tol.why})")  # fmt: skip


def _run_replica_cell(cell: Cell, spec: dict[str, Any]) -> dict[str, Any]:
    """2 replica groups of 1 process under ``sail launch --ft-replicas``; the groups must end
    bit-identical. "world": the resume is one process without replica groups, from their checkpoints."""
    with tempfile.TemporaryDirectory(prefix="sail-matrix-") as tmp:
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        checkpoints = str(Path(tmp) / "ck")
        if cell.interruption == "none":
            return _groups(spec_file, cell, "straight", "-", Path(tmp) / "straight")
        first = _groups(spec_file, cell, "first", checkpoints, Path(tmp) / "first")
        if "refused" in first:
            return first
        if cell.interruption == "world":
            return _rank0(run_ranks(run, 1, *one_process(cell), "resume", checkpoints))
        return _groups(spec_file, cell, "resume", checkpoints, Path(tmp) / "resume")


AGENT_TRACEBACK = re.compile(
    r"Traceback \(most recent call last\):\n(?:[ \t].*\n)*?.*torch/distributed/run\.py.*\n"
    r"(?:[ \t].*\n)*.*ChildFailedError: *\n=+\n(?:.*\n)*?=+\n"
)
"""A torchrun agent's own traceback and table, the same for every failure."""


def _without_agents(stderr: str, keep: int = 6000) -> str:
    """The end of ``stderr`` less the torchrun agents' tracebacks, which would crowd out the
    workers' errors before them."""
    return AGENT_TRACEBACK.sub("", stderr)[-keep:]


def _groups(spec_file: Path, cell: Cell, phase: str, checkpoints: str, out: Path) -> dict[str, Any]:
    out.mkdir()
    command = [sys.executable, "-m", "spikingsail.cli.main", "launch", "--ft-replicas", str(WORLD), "-n", "1",
               "--max-restarts", "0", "--ft-heartbeat-timeout", "3",
               "-m", "tests.matrix.job", str(spec_file), str(cell.accumulation), phase, checkpoints, str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    if done.returncode != 0:  # only the SIGKILL interruption may end a phase with a failure
        killed = phase == "first" and cell.interruption == "sigkill"
        assert killed, (
            f"{cell.id} {phase}: status {done.returncode}\n{done.stdout[-2000:]}{_without_agents(done.stderr)}"
        )
        return {"killed": True}
    results = [torch.load(out / f"result-{group}.pt") for group in range(WORLD)]
    first, *others = results
    for other in others:  # every group holds the same weights, bit for bit
        if "params" in first:
            assert first["participants"] == other["participants"] == WORLD, (cell.id, phase, "groups apart")
            assert all(torch.equal(first["params"][k], other["params"][k]) for k in first["params"]), cell.id
        else:
            assert sorted(other) == sorted(first), (first, other)
    return first
