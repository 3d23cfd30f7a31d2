"""Reach every host before starting anything: a clear error in bounded time, not a hang."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

from spikingsail.errors import LaunchError
from spikingsail.launchers.request import SSHOptions

_DIAGNOSES = (
    ("Permission denied", "the host refused the key: it wants a password or does not list this key",
     "set up passwordless ssh (ssh-copy-id HOST; ~/.ssh must be 700 and authorized_keys 600 on the host)"),
    ("Host key verification failed", "the host's key is unknown or changed",
     "connect once by hand (ssh HOST) to accept its key, or fix ~/.ssh/known_hosts"),
    ("Could not resolve hostname", "the name does not resolve", "check the hostfile, /etc/hosts or DNS"),
    ("timed out", "nothing answered on the ssh port", "check the address, the firewall and --ssh-port"),
    ("Connection refused", "no ssh server listens on that port", "start sshd, or pass --ssh-port"),
    ("No route to host", "the network cannot reach the host", "check the address and the network"),
)  # fmt: skip


def check_hosts(hosts: list[str], ssh: SSHOptions) -> None:
    """ssh to every host at once (BatchMode, ConnectTimeout); raise one error naming each failure."""
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        results = list(pool.map(lambda h: _probe(h, ssh), hosts))
    failures = [(h, r) for h, r in zip(hosts, results, strict=True) if r is not None]
    if failures:
        lines = [f"{host}: {reason}" for host, reason in failures]
        raise LaunchError(
            f"cannot reach {len(failures)} of {len(hosts)} host(s) over ssh; nothing was started",
            "\n       ".join(lines),
            "fix the hosts named above (`sail doctor -H hostfile` checks every node)",
        )


def _probe(host: str, ssh: SSHOptions) -> str | None:
    argv = ["ssh", *ssh.args(), host, "true"]
    try:
        result = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=ssh.connect_timeout + 10,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"no answer within {ssh.connect_timeout + 10} s"
    if result.returncode == 0:
        return None
    message = (
        result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"ssh exited {result.returncode}"
    )
    for needle, why, fix in _DIAGNOSES:
        if needle in result.stderr:
            return f"{why} ({message}); fix: {fix}"
    return message
