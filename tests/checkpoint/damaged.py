"""A real run's checkpoint directory (two tags, written by the engine) for the tests that damage one of
its files, and the ways they run ``sail checkpoint`` and inspect what it said."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import spikingsail
from spikingsail.cli.main import main

OLDER, NEWER = "global_step2", "global_step4"


def write_run(root: Path) -> Path:
    """Two checkpoints of a small model: ``OLDER`` and ``NEWER`` (``latest``)."""
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "sail": {"progress_bar": False, "seed": 1}}  # fmt: skip
    engine, _ = spikingsail.initialize(model=torch.nn.Linear(3, 2), config=config)
    for step in range(4):
        engine.backward(engine(torch.ones(2, 3) * step).sum())
        engine.step()
        if engine.global_steps % 2 == 0:
            engine.save_checkpoint(root)
    engine.close()
    return root


def copy_run(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def reseal(checkpoint: Path, name: str) -> None:
    """Record ``name``'s current size and SHA-256 in the manifest: a file written so, not damaged
    on disk afterwards (only the content's shape is wrong)."""
    manifest_path = checkpoint / "manifest.json"
    manifest: dict[str, Any] = json.loads(manifest_path.read_text())
    data = (checkpoint / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest))


@dataclass
class Said:
    code: int
    out: str
    err: str


def sail(*argv: str) -> Said:
    """``sail ARGV`` in this process, its output captured. An exception other than the CLI's own
    errors (which it prints) escapes and fails the calling test with its traceback."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return Said(code, out.getvalue(), err.getvalue())
