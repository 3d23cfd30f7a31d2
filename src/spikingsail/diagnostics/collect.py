"""Run ``probe.py`` here or on a node over ssh and read its facts back.

The probe's source goes to the node's Python on stdin (``python -``), so a node needs no copy of
SpikingSail — and a node with another version, or with none, is reported instead of failing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spikingsail.diagnostics.probe import MARKER

if TYPE_CHECKING:
    from spikingsail.launchers.request import SSHOptions

PROBE = Path(__file__).with_name("probe.py")
_SSH_FAILED = 255


@dataclass(kw_only=True, slots=True, frozen=True)
class ProbeResult:
    host: str
    facts: dict[str, Any] | None
    """None when the probe did not run; ``why`` and ``fix`` say what stopped it."""
    why: str = ""
    fix: str = ""
    received: float = 0.0
    """This machine's clock when the probe's output arrived (for the clock comparison)."""
    ssh_failed: bool = False


def run_here(args: list[str], timeout: float) -> ProbeResult:
    return _run("localhost", [sys.executable, "-", *args], timeout, ssh=False)


def run_on(host: str, ssh: SSHOptions, env: dict[str, str], args: list[str], timeout: float) -> ProbeResult:
    """The probe on ``host`` with the Python, working directory and environment `sail launch` uses."""
    from spikingsail.launchers.agents import remote_shell_command  # imports torch: not for the local report

    remote = remote_shell_command([sys.executable, "-", *args], env)
    return _run(host, ["ssh", *ssh.args(), host, remote], timeout, ssh=True)


def _run(host: str, argv: list[str], timeout: float, ssh: bool) -> ProbeResult:
    try:
        result = subprocess.run(
            argv, input=PROBE.read_text(), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return ProbeResult(
            host=host,
            facts=None,
            why=f"no answer within {timeout:.0f} s",
            fix="check that the node is up and not overloaded; raise --timeout for slow file systems",
        )
    received = time.time()
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(MARKER):
            return ProbeResult(host=host, facts=json.loads(line[len(MARKER) :]), received=received)
    if ssh and result.returncode == _SSH_FAILED:
        from spikingsail.launchers.preflight import diagnose

        why, fix = diagnose(host, result.stderr, result.returncode)
        return ProbeResult(host=host, facts=None, why=why, fix=fix, ssh_failed=True)
    why, fix = _why_no_probe(host, result)
    return ProbeResult(host=host, facts=None, why=why, fix=fix)


def _why_no_probe(host: str, result: subprocess.CompletedProcess[str]) -> tuple[str, str]:
    err = result.stderr.strip()
    if sys.executable in err and "No such file" in err:
        return (f"{sys.executable} does not exist on {host}",
                "install the same Python environment at the same path on every node "
                "(sail launch starts the launching machine's Python there)")  # fmt: skip
    if "cd" in err and ("can't cd" in err or "No such file" in err):
        return (f"the working directory does not exist on {host} ({err.splitlines()[-1]})",
                "run from a directory every node has (a shared file system), as for sail launch")  # fmt: skip
    tail = err.splitlines()[-1] if err else f"exit status {result.returncode}"
    return f"the probe failed on {host}: {tail}", "run it by hand to see the whole error"
