"""The doctor's ssh permission findings are exactly what sshd (StrictModes) and ssh refuse.

A real sshd on 127.0.0.1 with StrictModes reads authorized_keys from a home-like directory under
this user's home; each mode is set on the real files, a real BatchMode login is tried, and the
doctor's verdict on the same files (the probe's facts, judged) must match the login: a finding
exactly when the login is refused.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from spikingsail.diagnostics.findings import Status
from spikingsail.diagnostics.machine import ssh_permissions
from spikingsail.diagnostics.probe import ssh_facts

SSHD = "/usr/sbin/sshd"  # sshd re-executes itself and needs its absolute path


@dataclass(frozen=True)
class Server:
    home: Path
    """Stands for the home directory: sshd checks it and everything below it down to the file."""
    port: int
    key: Path

    debian: bool
    """The server's banner names Debian or Ubuntu, whose sshd accepts group-writable private groups."""

    @property
    def ssh_dir(self) -> Path:
        return self.home / ".ssh"

    def reset(self) -> dict[str, Path]:
        """The modes ssh-keygen and ssh-copy-id leave (a login works with them), by name."""
        paths = {"home": self.home, "dir": self.ssh_dir, "authorized_keys": self.ssh_dir / "authorized_keys",
                 "key": self.key}  # fmt: skip
        for name, path in paths.items():
            path.chmod({"home": 0o755, "dir": 0o700}.get(name, 0o600))
        return paths

    def login_works(self) -> bool:
        argv = ["ssh", "-F", "/dev/null", "-p", str(self.port), "-i", str(self.key), "-o", "BatchMode=yes",
                "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "ConnectTimeout=20", f"{pwd.getpwuid(os.getuid()).pw_name}@127.0.0.1", "true"]  # fmt: skip
        return subprocess.run(argv, capture_output=True, timeout=60).returncode == 0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # sshd stops its walk up from authorized_keys at the user's home (from passwd, not $HOME), so
    # the stand-in home lives inside it; the real home above must itself pass StrictModes.
    home = Path(tempfile.mkdtemp(dir=pwd.getpwuid(os.getuid()).pw_dir, prefix=".sail-ssh-modes-"))
    work = Path(tempfile.mkdtemp(prefix="sail-sshd-"))
    (home / ".ssh").mkdir()
    for key in (work / "host_ed25519", home / ".ssh" / "id_ed25519"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    shutil.copy(home / ".ssh" / "id_ed25519.pub", home / ".ssh" / "authorized_keys")
    port = _free_port()
    config = work / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {work / 'host_ed25519'}\nPidFile {work / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {home / '.ssh' / 'authorized_keys'}\nStrictModes yes\nUsePAM no\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
    )
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
    sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stderr=subprocess.PIPE, text=True)
    try:
        banner = _wait_for(port, sshd)
        debian = any(name in banner for name in ("Debian", "Ubuntu"))
        server = Server(home=home, port=port, key=home / ".ssh" / "id_ed25519", debian=debian)
        server.reset()
        assert server.login_works(), "the baseline (755/700/600) must log in"
        yield server
    finally:
        sshd.terminate()
        sshd.communicate(timeout=30)
        shutil.rmtree(home)
        shutil.rmtree(work)


def _wait_for(port: int, sshd: subprocess.Popen[str]) -> str:
    """The server's banner (e.g. SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u3), once it answers."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if sshd.poll() is not None:
            raise RuntimeError(f"sshd did not start: {sshd.communicate()[1]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
                return connection.makefile().readline()
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("sshd did not listen within 30 s")


# (what, mode, accepted): True / False by every sshd; PRIVATE_GROUP: group-writable, and the group
# (root's, here) has the user as its only member, which Debian's and Ubuntu's sshd accept and
# upstream OpenSSH's refuses.
PRIVATE_GROUP = "private group"


@pytest.mark.parametrize(
    ("target", "mode", "accepted"),
    [
        # ~/.ssh: writable by group or others is refused, readable is fine
        ("dir", 0o755, True), ("dir", 0o700, True), ("dir", 0o750, True), ("dir", 0o705, True),
        ("dir", 0o777, False), ("dir", 0o757, False), ("dir", 0o775, PRIVATE_GROUP), ("dir", 0o770, PRIVATE_GROUP),
        # authorized_keys: the same rule for the file
        ("authorized_keys", 0o644, True), ("authorized_keys", 0o600, True), ("authorized_keys", 0o640, True),
        ("authorized_keys", 0o666, False), ("authorized_keys", 0o646, False),
        ("authorized_keys", 0o664, PRIVATE_GROUP),
        # the home directory
        ("home", 0o755, True), ("home", 0o700, True), ("home", 0o777, False), ("home", 0o775, PRIVATE_GROUP),
        # a private key others can read: ssh's own refusal
        ("key", 0o600, True), ("key", 0o400, True), ("key", 0o640, False), ("key", 0o644, False),
        ("key", 0o604, False),
    ],
)  # fmt: skip
def test_a_finding_exactly_when_ssh_refuses(
    server: Server, monkeypatch: pytest.MonkeyPatch, target: str, mode: int, accepted: bool | str
) -> None:
    paths = server.reset()
    expected = server.debian if accepted == PRIVATE_GROUP else accepted
    paths[target].chmod(mode)

    assert server.login_works() == expected

    monkeypatch.setenv("HOME", str(server.home))
    findings = ssh_permissions({"ssh": ssh_facts()}, "")
    if expected:
        assert [f.status for f in findings] == [Status.OK], findings
    else:
        (finding,) = findings
        assert finding.status in (Status.WARN, Status.FAIL)
        assert f"{paths[target]} has mode {mode:o}" in finding.detail
        assert finding.fix.endswith(str(paths[target]))


@pytest.mark.parametrize("target", ["dir", "authorized_keys"])
def test_a_group_with_other_members_is_refused_by_every_sshd(
    server: Server, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    paths = server.reset()
    nogroup = pwd.getpwnam("nobody").pw_gid  # the group of user nobody: not yours alone
    os.chown(paths[target], -1, nogroup)
    paths[target].chmod(0o775 if target == "dir" else 0o664)
    try:
        assert not server.login_works()
        monkeypatch.setenv("HOME", str(server.home))
        (finding,) = ssh_permissions({"ssh": ssh_facts()}, "")
        assert "writable by its group, which is not yours alone" in finding.detail
    finally:
        os.chown(paths[target], -1, os.getgid())


def test_a_file_of_another_user_is_refused_as_sshd_does(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = server.reset()["authorized_keys"]
    os.chown(keys, pwd.getpwnam("nobody").pw_uid, -1)
    try:
        assert not server.login_works()
        monkeypatch.setenv("HOME", str(server.home))
        (finding,) = ssh_permissions({"ssh": ssh_facts()}, "")
        assert finding.status is Status.WARN and f"{keys} belongs to another user" in finding.detail
        assert finding.fix == f"sudo chown $(id -un) {keys}"
    finally:
        os.chown(keys, os.getuid(), -1)
