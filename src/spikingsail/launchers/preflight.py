"""Reach every host before starting anything: a clear error in bounded time, not a hang."""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from spikingsail.errors import LaunchError
from spikingsail.launchers.spec import SSHOptions

_PASSWORD_WANTED = re.compile(
    r"Permission denied \((?=[^)]*publickey)(?=[^)]*(password|keyboard-interactive))"
)
_DIAGNOSES = (
    ("Permission denied (",  # after the password check: (publickey), (publickey,gssapi-with-mic), ...
     "the host refused the key: its ~/.ssh/authorized_keys lacks this machine's public key, or sshd "
     "ignores the file because ~/.ssh is not 700 or authorized_keys not 600 (StrictModes)",
     "ssh-copy-id {host}; then on {host}: chmod 700 ~/.ssh && chmod 600 ~/.ssh/authorized_keys"),
    ("Host key verification failed", "the host's key is unknown or changed",
     "connect once by hand (ssh {host}) to accept its key, or fix ~/.ssh/known_hosts"),
    ("Could not resolve hostname", "the name does not resolve", "check the hostfile, /etc/hosts or DNS"),
    ("timed out", "nothing answered on the ssh port", "check the address, the firewall and --ssh-port"),
    ("Connection refused", "no ssh server listens on that port", "start sshd, or pass --ssh-port"),
    ("No route to host", "the network cannot reach the host", "check the address and the network"),
)  # fmt: skip


def diagnose(host: str, stderr: str, returncode: int, ssh_args: list[str] | None = None) -> tuple[str, str]:
    """Why an ssh command (BatchMode) failed and what to do: ``(why, fix)``.

    With ``ssh_args`` (the options the command used) a refused login is checked against the
    identity files ssh would offer: when none exists, the key is missing here, not on the host.
    """
    lines = stderr.strip().splitlines()
    message = lines[-1] if lines else f"ssh exited {returncode}"
    if "Permission denied" in stderr and ssh_args is not None:
        offered = _identity_files(host, ssh_args)
        if offered is not None and not any(Path(p).expanduser().is_file() for p in offered):
            return (
                f"this machine has no ssh key to offer (ssh looks for {', '.join(offered)}) ({message})",
                f"ssh-keygen -t ed25519, then ssh-copy-id {host}",
            )
    if _PASSWORD_WANTED.search(stderr):
        return (
            f"the host asks for a password: this machine's key is not accepted ({message})",
            f"ssh-copy-id {host} (after ssh-keygen -t ed25519 if you have no key), so that logins need none",
        )
    for needle, why, fix in _DIAGNOSES:
        if needle in stderr:
            return f"{why} ({message})", fix.format(host=host)
    return message, "run the same ssh command by hand to see why"


def _identity_files(host: str, ssh_args: list[str]) -> list[str] | None:
    """The identity files ``ssh`` would try for ``host`` (``ssh -G`` prints the resolved options)."""
    options = [a for a in ssh_args if a != "-tt"]
    result = subprocess.run(["ssh", "-G", *options, "--", host], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        return None
    return [line.split(None, 1)[1] for line in result.stdout.splitlines() if line.startswith("identityfile ")]


def check_hosts(hosts: list[str], ssh: SSHOptions, rendezvous: tuple[str, int] | None = None) -> None:
    """ssh to every host at once (BatchMode, ConnectTimeout); raise one error naming each failure.

    ``rendezvous`` (host, port): the job's store, checked free on that host in the same connection.
    A port that another job's torchrun agent listens on would let this job's agents join that
    job's store; they would die when it ends.
    """
    port_of = {rendezvous[0]: rendezvous[1]} if rendezvous else {}
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        results = list(pool.map(lambda h: _probe(h, ssh, port_of.get(h)), hosts))
    failures = [(h, r) for h, r in zip(hosts, results, strict=True) if r.failure is not None]
    if failures:
        lines = [f"{host}: {result.failure}" for host, result in failures]
        raise LaunchError(
            f"cannot reach {len(failures)} of {len(hosts)} host(s) over ssh; nothing was started",
            "\n       ".join(lines),
            "fix the hosts named above (`sail doctor -H hostfile` checks every node)",
        )
    for host, result in zip(hosts, results, strict=True):
        if host in port_of and result.listener:
            _refuse_taken_port(host, port_of[host], result.listener, ssh)


@dataclass(kw_only=True, slots=True, frozen=True)
class _Probe:
    failure: str | None = None
    listener: str = ""
    """``ss``'s line for a socket listening on the rendezvous port, if any."""


def _is_listener(line: str, port: int) -> bool:
    """Whether ``line`` is ss's report of a socket listening on ``port`` (``LISTEN 0 4096 0.0.0.0:29500 ...``)."""
    words = line.split()
    return len(words) >= 4 and words[0] == "LISTEN" and words[3].endswith(f":{port}")


def _refuse_taken_port(host: str, port: int, listener: str, ssh: SSHOptions) -> None:
    found = re.search(r"pid=(\d+)", listener)
    owner = "a process of another user" if found is None else f"pid {found[1]}"
    if found is not None:
        shown = subprocess.run(ssh.command(host, f"ps -o args= -p {found[1]}"), capture_output=True,
                               text=True, stdin=subprocess.DEVNULL, timeout=ssh.connect_timeout + 10,
                               check=False)  # fmt: skip
        if shown.stdout.strip():
            owner += f" ({shown.stdout.strip()[:200]})"
    raise LaunchError(
        f"the rendezvous port {port} on {host} is taken by {owner}; nothing was started",
        "another job's torchrun agent (or another program) listens there: this job's agents would join "
        "its store, and die when it ends",
        "let that job end or stop it, or pass --master-port with a free port",
    )


def _probe(host: str, ssh: SSHOptions, port: int | None = None) -> _Probe:
    remote = "true" if port is None else f"ss -Hltnp 'sport = :{port}' 2>/dev/null | head -n 1; true"
    try:
        result = subprocess.run(
            ssh.command(host, remote),
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=ssh.connect_timeout + 10,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return _Probe(failure=f"no answer within {ssh.connect_timeout + 10} s")
    if result.returncode == 0:
        # ss's line only: a login script of the host may print a banner first
        listening = [
            line for line in result.stdout.splitlines() if port is not None and _is_listener(line, port)
        ]
        return _Probe(listener=listening[0] if listening else "")
    why, fix = diagnose(host, result.stderr, result.returncode, ssh.args())
    return _Probe(failure=f"{why}; fix: {fix}")
