"""The launch plans' working directory, shared by the tests of this folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spikingsail.launchers.remote_env import FORWARDED_NAMES, FORWARDED_PREFIXES


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with train.py and a hostfile; the shell ships nothing of its own."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").touch()
    (tmp_path / "hostfile").write_text("node1 slots=2\nnode2 slots=2\n")
    for key in list(os.environ):
        if key.startswith(FORWARDED_PREFIXES) or key in FORWARDED_NAMES:
            monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.sail_env
    return tmp_path
