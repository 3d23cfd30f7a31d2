"""Run ``probe.py`` here or on a node over ssh and read its facts back.

The probe's source goes to the node's Python on stdin (``python -``), so a node needs no copy of
SpikingSail — and a node with another version, or with none, is reported instead of failing.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
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
    return _run("localhost", [sys.executable, "-", *args], timeout)


def run_on(host: str, ssh: SSHOptions, env: dict[str, str], args: list[str], timeout: float) -> ProbeResult:
    """The probe on ``host`` with the Python, working directory and environment `sail launch` uses."""
    from spikingsail.launchers.agents import remote_shell_command  # imports torch: not for the local report

    remote = remote_shell_command([sys.executable, "-", *args], env)
    return _run(host, ["ssh", *ssh.args(), host, remote], timeout, ssh_args=ssh.args())


def _run(host: str, argv: list[str], timeout: float, ssh_args: list[str] | None = None) -> ProbeResult:
    process = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdin and process.stdout and process.stderr, "all three are pipes"
    stdin, stdout, stderr = process.stdin, process.stdout, process.stderr
    timer = threading.Timer(timeout, process.kill)
    timer.start()
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.extend(stderr), daemon=True)
    reader.start()
    facts, received = None, 0.0
    try:
        with contextlib.suppress(OSError):  # the node closed stdin early (ssh failed before reading it)
            stdin.write(PROBE.read_text())
            stdin.close()
        for line in stdout:
            if line.startswith(MARKER):
                # stamped now, not when the node's interpreter has finished shutting down
                facts, received = json.loads(line[len(MARKER) :]), time.time()
        returncode = process.wait()
        reader.join()
    finally:
        timed_out = not timer.is_alive() and facts is None
        timer.cancel()
    if facts is not None:
        return ProbeResult(host=host, facts=facts, received=received)
    if timed_out:
        return ProbeResult(
            host=host,
            facts=None,
            why=f"no answer within {timeout:.0f} s",
            fix="check that the node is up and not overloaded; raise --timeout for slow file systems",
        )
    text = "".join(errors)
    if ssh_args is not None and returncode == _SSH_FAILED:
        from spikingsail.launchers.preflight import diagnose

        why, fix = diagnose(host, text, returncode, ssh_args)
        return ProbeResult(host=host, facts=None, why=why, fix=fix, ssh_failed=True)
    why, fix = _why_no_probe(host, text, returncode)
    return ProbeResult(host=host, facts=None, why=why, fix=fix)


def _why_no_probe(host: str, stderr: str, returncode: int) -> tuple[str, str]:
    err = stderr.strip()
    if sys.executable in err and "No such file" in err:
        return (f"{sys.executable} does not exist on {host}",
                "install the same Python environment at the same path on every node "
                "(sail launch starts the launching machine's Python there)")  # fmt: skip
    if "cd" in err and ("can't cd" in err or "No such file" in err):
        return (f"the working directory does not exist on {host} ({err.splitlines()[-1]})",
                "run from a directory every node has (a shared file system), as for sail launch")  # fmt: skip
    tail = err.splitlines()[-1] if err else f"exit status {returncode}"
    return f"the probe failed on {host}: {tail}", "run it by hand to see the whole error"
