"""Local multi-process launch: torchrun's elastic agent on this machine.

The agent and its workers write to this terminal as they would under torchrun, but their standard
error passes through ``sail launch`` (a pseudo-terminal when stderr is a terminal, so that progress
bars and colours stay on): its last lines tell which rank failed and with which of SpikingSail's
errors. The signals torchrun handles and SIGUSR1 are passed on to the agent, which passes them to
the workers (``supervision.watch``, the loop every launch path runs under).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import termios
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import NoReturn

from spikingsail.errors import LaunchError
from spikingsail.launchers.base import Launcher
from spikingsail.launchers.command import LaunchCommand, python_module
from spikingsail.launchers.failure import Failure
from spikingsail.launchers.hostfile import is_this_machine
from spikingsail.launchers.lifeline import die_with_this_process
from spikingsail.launchers.node_output import stopped_by
from spikingsail.launchers.platform import platform_flags
from spikingsail.launchers.spec import LaunchRequest
from spikingsail.launchers.supervision import TIMED_OUT, Signals, watch
from spikingsail.launchers.torchrun_args import TorchrunArgs
from spikingsail.monitor.logs import debugging

TAIL_LINES = 400


class LocalLauncher(Launcher):
    name = "local"
    needs_hosts = False
    agents_here = True
    supervised = False

    def torchrun_flags(self, args: TorchrunArgs, env: Mapping[str, str]) -> list[str]:
        """All of the user's flags; on a platform's node its place in the job (``platform``), else
        for one node a rendezvous of its own."""
        flags = list(args.flags)
        if args.short_nproc:
            flags = ["--nproc-per-node", args.nproc_per_node, *flags]
        platform = None if args.chooses_rendezvous else platform_flags(env)
        if platform:
            return [*platform, *flags]
        if args.single_node:
            # torchrun's default static rendezvous binds port 29500: two jobs on one machine
            # would collide. --standalone picks a free port for a single-node job.
            return ["--standalone", *flags]
        return flags

    def commands(self, request: LaunchRequest) -> list[LaunchCommand]:
        flags, env = list(request.torchrun_args), dict[str, str]()
        if request.nodes:
            flags, env = _this_node(request, flags)
        argv = python_module("torch.distributed.run", *flags, request.script, *request.script_args)
        return [LaunchCommand(host="localhost", argv=argv, env=env)]


def _this_node(request: LaunchRequest, flags: list[str]) -> tuple[list[str], dict[str, str]]:
    """``--launcher local`` with ``-H``: the one host must be this machine; its process count and
    chosen slots (``--include host:1,3``) apply here, the slots as this machine's GPU mask."""
    assert request.nodes
    if len(request.nodes) > 1 or not is_this_machine(request.nodes[0].host):
        hosts = ", ".join(n.host for n in request.nodes)
        raise LaunchError(
            f"--launcher local with -H naming {hosts}",
            "the local launcher starts processes on this machine only",
            "use --launcher ssh (the default with -H) or pdsh for other hosts",
        )
    node = request.nodes[0]
    if not request.explicit_nproc:
        flags = ["--nproc-per-node", str(node.nproc), *flags]
    if node.slots != tuple(range(node.nproc)):
        return flags, {"CUDA_VISIBLE_DEVICES": ",".join(map(str, node.slots))}
    return flags, {}


def run_local(
    command: LaunchCommand, base_env: Mapping[str, str] | None = None, timeout: float | None = None
) -> tuple[int, Failure | None]:
    """Run a command on this machine, passing signals on to it; returns its exit status (128 + the
    signal's number when it was stopped on one; 124 after ``timeout`` seconds) and, when it failed
    by itself, the failure read from its standard error."""
    env = {**(os.environ if base_env is None else base_env), **command.env}
    with Signals() as signals:
        return watch(_LocalJob(command, env), signals, timeout)


class _LocalJob:
    """One command on this machine, its standard error relayed (``supervision.Job``): every signal
    is passed on to it, and it ends when it will."""

    drain_seconds: float | None = None

    def __init__(self, command: LaunchCommand, env: Mapping[str, str]) -> None:
        self._host = command.host
        self._timed_out = False
        reader, writer = _stderr_channel()
        self._child: subprocess.Popen[bytes] | _ForkedAgent
        try:
            # the agent ends (and stops its workers) when sail launch dies, even of SIGKILL
            if _ForkedAgent.can_run(command.argv):
                self._child = _ForkedAgent(command.argv[3:], env, (writer, reader), die_with_this_process())
            else:
                self._child = subprocess.Popen(
                    command.argv,
                    env=env,
                    stderr=writer,
                    preexec_fn=die_with_this_process(),  # noqa: PLW1509
                )
        finally:
            os.close(writer)
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._relay = threading.Thread(target=_relay, args=(reader, self._tail), daemon=True)
        self._relay.start()

    def forward(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._child.send_signal(signum)

    def ended(self, draining: bool) -> bool:
        return self._child.poll() is not None

    def time_out(self) -> None:
        self._timed_out = True

    def stop(self) -> None:
        if self._child.poll() is None:
            self._child.kill()
            self._child.wait()
        # workers that outlived the agent may hold stderr open: do not wait for them
        self._relay.join(timeout=2)

    def status(self) -> tuple[int, Failure | None]:
        code = self._child.wait()
        if self._timed_out:
            return TIMED_OUT, Failure(host=self._host, exit_code=TIMED_OUT, tail=[*self._tail, "(timed out)"])
        if code == 0:
            return code, None
        return code, Failure(host=self._host, exit_code=code, tail=list(self._tail))


class _ForkedAgent:
    """torchrun's agent in a fork of this process, instead of ``python -m torch.distributed.run``:
    reading the command line with torchrun's own parser imported torch here already, and a fork
    starts the agent without a second interpreter importing it again (about a second). The child
    is what ``python -m torch.distributed.run FLAGS`` would be: torchrun's ``main(FLAGS)``, its
    environment ``env``, standard error the write end of ``channel``, and its exit status (1 on
    an exception, with the traceback, as Python's own)."""

    @staticmethod
    def can_run(argv: list[str]) -> bool:
        return (
            argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
            and "torch.distributed.run" in sys.modules
        )

    def __init__(
        self,
        flags: list[str],
        env: Mapping[str, str],
        channel: tuple[int, int],
        arm: Callable[[], None] | None,
    ) -> None:
        self.returncode: int | None = None
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the child; its behaviour is the launch tests'
            self._agent(flags, env, channel, arm)

    @staticmethod
    def _agent(
        flags: list[str], env: Mapping[str, str], channel: tuple[int, int], arm: Callable[[], None] | None
    ) -> NoReturn:
        code = 1
        try:
            writer, reader = channel
            os.dup2(writer, 2)
            os.close(writer)
            os.close(reader)
            if arm is not None:
                arm()
            _name_agent(flags)
            os.environ.clear()
            os.environ.update(env)
            sys.argv = ["torchrun", *flags]
            from torch.distributed.run import main

            main(flags)
            code = 0
        except SystemExit as stop:  # as the interpreter ends on one: a message is printed, status 1
            code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
            if stop.code is not None and not isinstance(stop.code, int):
                print(stop.code, file=sys.stderr)
        except BaseException as err:
            from torch.distributed.elastic.multiprocessing.api import SignalException
            from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

            if isinstance(err, SignalException) and not debugging():
                # a stop asked for (SIGTERM, SIGUSR1: a preemption), not a crash: no traceback
                print(stopped_by(err.sigval), file=sys.stderr)
                code = 128 + err.sigval
            elif isinstance(err, ChildFailedError) and not debugging():
                # torchrun's table of the failed ranks; the agent's own traceback says nothing more
                # (sail launch names the cause last), so it is printed at debug level only
                print(f"torchrun: {err}", file=sys.stderr)
            else:
                traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _name_agent(flags: list[str]) -> None:
    """The forked agent's command line says what it is, in ``ps`` and to ``pkill -f``: a copy of
    ``sail launch ...`` would be killed with sail by ``pkill -f 'sail launch'`` (at the same moment,
    before it could stop its workers). It ends with sail on its own (``PR_SET_PDEATHSIG``)."""
    from setproctitle import setproctitle

    setproctitle(f"torchrun (the local agent of sail, pid {os.getppid()}) {' '.join(flags)}")


def _stderr_channel() -> tuple[int, int]:
    """(read end, write end) for the command's standard error: a pseudo-terminal of this terminal's
    size when stderr is a terminal, else a pipe."""
    if not sys.stderr.isatty():
        return os.pipe()
    import pty  # only here: it imports the module tty, which a script of that name next to sail would shadow

    reader, writer = pty.openpty()
    with contextlib.suppress(OSError):
        size = fcntl.ioctl(sys.stderr.fileno(), termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(writer, termios.TIOCSWINSZ, size)
    return reader, writer


def _relay(reader: int, tail: collections.deque[str]) -> None:
    """Copy the command's stderr to ours as it comes (progress bars rewrite a line without ending
    it), keeping its last lines."""
    partial = ""
    try:
        while chunk := _read(reader):
            _write_all(sys.stderr.fileno(), chunk)
            lines = (partial + chunk.decode(errors="replace")).replace("\r\n", "\n").split("\n")
            partial = lines.pop()
            tail.extend(line.rsplit("\r", 1)[-1] for line in lines)
    finally:
        os.close(reader)
    if partial:
        tail.append(partial)


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):  # a closed terminal must not stop the relay: it drains the job
        while data:
            data = data[os.write(fd, data) :]


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # a pseudo-terminal whose every writer closed reads EIO, not end of file
        return b""
