"""Run ``probe.py`` here or on a node over ssh and read its facts back.

The probe's source goes to the node's Python on stdin (its length first, then the source, which a
one-line ``python -c`` runs), so a node needs no copy of SpikingSail — and a node with another
version, or with none, is reported instead of failing. What follows the source on stdin is the
doctor's cue: its end tells a probe holding the rendezvous port open that the other nodes are done.
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
from typing import IO, TYPE_CHECKING, Any

from spikingsail.diagnostics.probe import MARKER

if TYPE_CHECKING:
    from spikingsail.launchers.request import SSHOptions

PROBE = Path(__file__).with_name("probe.py")
_BOOT = "import sys; i = sys.stdin.buffer; exec(compile(i.read(int(i.readline())), 'probe.py', 'exec'))"
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
    return _run("localhost", [sys.executable, "-c", _BOOT, *args], timeout)


def run_on(
    host: str,
    ssh: SSHOptions,
    env: dict[str, str],
    args: list[str],
    timeout: float,
    hold: threading.Event | None = None,
) -> ProbeResult:
    """The probe on ``host`` with the Python, working directory and environment `sail launch` uses.
    With ``hold``, its stdin stays open until ``hold`` is set (``probe.py --stop-on-eof``)."""
    from spikingsail.launchers.agents import remote_shell_command  # imports torch: not for the local report

    remote = remote_shell_command([sys.executable, "-c", _BOOT, *args], env)
    return _run(host, ["ssh", *ssh.args(), host, remote], timeout, ssh_args=ssh.args(), hold=hold)


def _run(
    host: str,
    argv: list[str],
    timeout: float,
    ssh_args: list[str] | None = None,
    hold: threading.Event | None = None,
) -> ProbeResult:
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdin and process.stdout and process.stderr, "all three are pipes"
    stdout, stderr = process.stdout, process.stderr
    timer = threading.Timer(timeout, process.kill)
    timer.start()
    errors: list[str] = []
    reader = threading.Thread(
        target=lambda: errors.extend(line.decode(errors="replace") for line in stderr), daemon=True
    )
    reader.start()
    threading.Thread(target=_send, args=(process.stdin, hold), daemon=True).start()
    facts, received = None, 0.0
    try:
        for raw in stdout:
            line = raw.decode(errors="replace")
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


def _send(stdin: IO[bytes], hold: threading.Event | None) -> None:
    """The probe's length and source, then (once ``hold`` is set) the end of its input."""
    source = PROBE.read_bytes()
    with contextlib.suppress(OSError):  # the node closed stdin early (ssh failed before reading it)
        stdin.write(b"%d\n%s" % (len(source), source))
        stdin.flush()
    if hold is not None:
        hold.wait()
    with contextlib.suppress(OSError):
        stdin.close()


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
