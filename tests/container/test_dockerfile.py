"""What can be tested of the Dockerfile without Docker: the image is built by the same install script
CI runs (scripts/test.sh → scripts/install.sh, so every CI run runs the image's install steps), and
its health check is a `sail doctor` command that works and exits 0 (healthy) or 1 (a finding)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def test_the_image_and_ci_install_with_the_same_script() -> None:
    runs = re.findall(r"^RUN (.+)$", DOCKERFILE, flags=re.MULTILINE)
    assert any("bash scripts/install.sh" in run for run in runs), runs
    assert 'bash "$root/scripts/install.sh"' in (ROOT / "scripts" / "test.sh").read_text()
    install = (ROOT / "scripts" / "install.sh").read_text()
    assert "scripts/system-deps.sh" in install and 'scripts/setup.sh" --backends' in install
    assert re.search(r"^FROM nvidia/cuda:13\.0\.\d+-devel-ubuntu", DOCKERFILE, flags=re.MULTILINE)
    # the image's CUDA is the pinned torch's (pinned once, in the main job's set that dev.txt includes)
    pins = (ROOT / "requirements" / "main.txt").read_text()
    assert re.search(r"^torch==2\.14\.1$", pins, flags=re.MULTILINE)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored  # the host's environment never enters the image


def test_the_health_check_is_a_working_sail_doctor() -> None:
    health = re.search(r"^HEALTHCHECK .*CMD (\[.+\])$", DOCKERFILE, flags=re.MULTILINE)
    assert health, DOCKERFILE
    argv = json.loads(health[1])
    assert argv[:2] == ["sail", "doctor"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode in (0, 1), result.stderr[-3000:]  # Docker: 0 healthy, 1 unhealthy
    assert "/dev/shm" in result.stdout, result.stdout  # the check that catches a missing --ipc=host
