"""Before starting anything: reach every host (a clear error in bounded time, not a hang), and
read the job's config as its engine will (one error here, not one from every rank later)."""

from __future__ import annotations

import math
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spikingsail.config.schema import BATCH_KEYS
from spikingsail.errors import ConfigError, LaunchError, SailError
from spikingsail.launchers.spec import SSHOptions

DICT_SOURCE = "<dict>"
"""What the config loader calls a config given as a dict (``SailConfig.source``)."""

_PASSWORD_WANTED = re.compile(
    r"Permission denied \((?=[^)]*publickey)(?=[^)]*(password|keyboard-interactive))"
)
_DIAGNOSES = (
    ("Permission denied (",  # after the password check: (publickey), (publickey,gssapi-with-mic), ...
     "the host refused the key: its ~/.ssh/authorized_keys lacks this machine's public key, or sshd "
     "ignores the file because ~/.ssh is not 700 or authorized_keys not 600 (StrictModes)",
     "ssh-copy-id {host}; then on {host}: chmod 700 ~/.ssh && chmod 600 ~/.ssh/authorized_keys"),
    ("Host key verification failed", "the host's key is unknown or changed (not in the known_hosts ssh reads)",
     "when an ssh config of its own knows the host (its HostName, IdentityFile and UserKnownHostsFile: "
     "a cluster's, scripts/two-nodes.sh's practice cluster), pass it: sail launch --ssh-config FILE; "
     "else connect once by hand (ssh {host}) to accept its key, or fix ~/.ssh/known_hosts"),
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


# --- the job's config ----------------------------------------------------------------------------

CONFIG_FLAGS = {
    "--sail-config": "sail_config",
    "--sail_config": "sail_config",
    "--deepspeed_config": "deepspeed_config",
    "--deepspeed-config": "deepspeed_config",
}
"""The engine's config flags (``add_config_arguments``), spelled here so that a launch without one
does not import the engine; tests/launchers/test_config_precheck.py holds them equal."""


def config_paths(script_args: list[str], script: str | None = None) -> list[str]:
    """The config files a training script's arguments name (``--sail-config PATH``,
    ``--deepspeed_config=PATH``, ...); the last of a repeated flag, as argparse keeps it.
    Abbreviations are not read: a script's parser may not take them. ``--deepspeed_config`` of a
    ``script`` that does not import SpikingSail is DeepSpeed's own script's: DeepSpeed reads that
    config (a ZeRO-3 config is fine there, where the engine's default backend would refuse it)."""
    found: dict[str, str] = {}
    words = iter(script_args)
    for word in words:
        if word == "--":  # argparse reads no option after it
            break
        name, equals, value = word.partition("=")
        if name in CONFIG_FLAGS:
            found[CONFIG_FLAGS[name]] = value if equals else next(words, "")
    if script is not None and not _imports_spikingsail(script):
        found.pop("deepspeed_config", None)
    return list(dict.fromkeys(path for path in found.values() if path))


def _imports_spikingsail(script: str) -> bool:
    """Whether the file ``script`` imports SpikingSail itself (False for a module name, or a file
    that cannot be read: its config is then left to the job, as before this check)."""
    try:
        text = Path(script).read_text(errors="replace")
    except OSError:
        return False
    return re.search(r"^\s*(from|import)\s+spikingsail\b", text, re.MULTILINE) is not None


def check_config(path: str, world_size: int | None, replica_groups: int = 0) -> None:
    """Check the config file ``path`` here as the engine will on every rank, so that a mistake is
    reported once, before any process starts. ``world_size``: the processes the engine counts, where
    the command line settles it; otherwise a batch size is checked only where no world size fits.

    A file without a batch size passes that check: a script may set it (``examples/imagenet``'s
    ``--batch-size``). What the engine checks against the model (its batch-norm layers) is left to it.
    """
    from spikingsail.backends import backend_class, load_config
    from spikingsail.engine.initialize import check_config as check_loaded

    raw = _json_object(path)
    source: str | dict[str, Any] = path
    world = world_size or 1
    if raw is not None:
        given = {key: raw[key] for key in BATCH_KEYS if raw.get(key) is not None}
        if world_size is None:
            world = _fitting_world(path, given)
        if "train_batch_size" not in given and "train_micro_batch_size_per_gpu" not in given:
            source = {**raw, "train_micro_batch_size_per_gpu": 1}  # any batch size the script sets
    try:
        config = load_config(source, world)
        backend = backend_class(config.sail.backend, config.source)
        check_loaded(config, backend, replica_groups=replica_groups > 0)
    except SailError as err:
        if isinstance(source, str):
            raise
        raise type(err)(err.what.replace(DICT_SOURCE, path), err.why, err.fix) from None


def _json_object(path: str) -> dict[str, Any] | None:
    """The file's object (JSON, or hjson as DeepSpeed reads it), or None when it is not one (the
    loader then says why)."""
    from spikingsail.config.files import read_config

    try:
        return read_config(path)[0]
    except SailError:
        return None


def _fitting_world(path: str, given: dict[str, Any]) -> int:
    """A world size the batch keys agree with, when the command line does not settle it: 1 fits
    unless all three are set; then train_batch_size / (micro × accumulation) must be a whole number."""
    total, micro, accum = (_whole(given.get(key)) for key in BATCH_KEYS)
    if total is None or micro is None or accum is None or min(total, micro, accum) < 1:
        return 1  # the loader reports a missing key or a value out of range
    world, rest = divmod(total, micro * accum)
    if rest or world < 1:
        raise ConfigError(
            f"{path}: train_batch_size {total} is not a multiple of train_micro_batch_size_per_gpu × "
            f"gradient_accumulation_steps = {micro} × {accum}",
            "train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps × world_size, "
            "whatever the number of processes",
            "set two of the three keys and let SpikingSail derive the third",
        )
    return world


def _whole(value: Any) -> int | None:
    """A JSON batch size as the loader reads it (a whole float counts, as in DeepSpeed), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None
