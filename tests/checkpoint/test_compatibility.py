"""What a resume compares: the config as saved against the config as given, key by key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from spikingsail.backends import load_config
from spikingsail.checkpoint import compatibility
from spikingsail.checkpoint.compatibility import check_resumable
from spikingsail.errors import CheckpointError

BASE = {"train_micro_batch_size_per_gpu": 2, "sail": {"backend": "horovod"}}


def as_saved(raw: dict[str, Any]) -> dict[str, Any]:
    """The config of ``raw`` at 2 processes, the way a checkpoint keeps it."""
    return compatibility.as_saved(load_config(raw, world_size=2))


def test_a_backend_sections_change_is_named() -> None:
    saved = as_saved(BASE)
    current = as_saved({**BASE, "horovod": {"compression": "fp16"}})
    with pytest.raises(CheckpointError, match=r"backend_sections\.horovod: saved <unset>"):
        check_resumable(Path("ck"), saved, current, partial_window=False, with_optimizer=True)
    check_resumable(Path("ck"), current, dict(current), partial_window=False, with_optimizer=True)


def test_a_checkpoint_from_before_backend_sections_resumes() -> None:
    current = as_saved(BASE)
    saved = {k: v for k, v in current.items() if k != "backend_sections"}
    assert current["backend_sections"] == {}
    check_resumable(Path("ck"), saved, current, partial_window=False, with_optimizer=True)


def test_a_key_added_after_the_save_counts_as_saved_with_its_default() -> None:
    """A version that did not have a key ran as its default: a checkpoint it wrote resumes while the key
    keeps that default, and is refused, naming the key and the default, when the run sets another."""
    current = as_saved(BASE)
    older = json.loads(json.dumps(current))
    del older["snn"]["encoding"], older["gradient_clipping"]  # keys that shape the training
    check_resumable(Path("ck"), older, current, partial_window=False, with_optimizer=True)
    changed = as_saved({**BASE, "snn": {"encoding": "poisson"}})
    with pytest.raises(CheckpointError, match=r"snn\.encoding: saved <unset> \(a version before snn\.encoding, "
                                              r'which ran as its default "repeat"\), now "poisson"'):  # fmt: skip
        check_resumable(Path("ck"), older, changed, partial_window=False, with_optimizer=True)


def test_a_section_added_after_the_save_counts_as_its_defaults() -> None:
    current = as_saved(BASE)
    older = {k: v for k, v in current.items() if k != "snn"}
    check_resumable(Path("ck"), older, current, partial_window=False, with_optimizer=True)
    with pytest.raises(CheckpointError, match=r"snn\.reset: saved <unset>"):
        check_resumable(Path("ck"), older, as_saved({**BASE, "snn": {"reset": "off"}}), partial_window=False,
                        with_optimizer=True)  # fmt: skip
