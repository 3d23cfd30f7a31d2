"""`sail launch`: torchrun's flags as data, and real local runs with real signals."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from spikingsail.errors import LaunchError
from spikingsail.launchers import plan
from spikingsail.launchers.command import FORWARDED
from spikingsail.launchers.request import FORWARDED_SIGNALS, parse_request
from tests.cluster.harness import processes_with

SAIL = [sys.executable, "-m", "spikingsail.cli.main"]


def test_n_becomes_nproc_per_node_and_single_node_is_standalone(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.touch()
    (command,) = plan(
        parse_request(["-n", "2", "--max-restarts", "1", str(script), "--lr", "0.1", "-n", "7"])
    )
    assert command.host == "localhost"
    assert command.argv[1:] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--signals-to-handle",
        FORWARDED_SIGNALS,
        str(script),
        "--lr",
        "0.1",
        "-n",
        "7",
    ]


def test_explicit_rendezvous_is_not_overridden(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.touch()
    request = parse_request(["--nproc-per-node=2", "--master-port=29555", str(script)])
    assert request.torchrun_args == [
        "--nproc-per-node=2",
        "--master-port=29555",
        "--signals-to-handle",
        FORWARDED_SIGNALS,
    ]
    request = parse_request(["--nnodes=2", "--rdzv-endpoint=node1:29400", str(script)])
    assert "--standalone" not in request.torchrun_args


def test_missing_script_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match=r"training script .*nope\.py does not exist"):
        parse_request(["-n", "2", str(tmp_path / "nope.py")])


def run_sail(
    *args: str, cwd: Path | None = None, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SAIL, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def test_unknown_flag_is_an_error_with_usage(tmp_path: Path) -> None:
    result = run_sail("launch", "--nprocs", "2", "x.py", cwd=tmp_path)
    assert result.returncode == 2
    assert "usage: sail launch" in result.stderr


def test_cli_error_has_no_traceback(tmp_path: Path) -> None:
    result = run_sail("launch", "-n", "2", "missing.py", cwd=tmp_path)
    assert result.returncode == 2
    assert "training script missing.py does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_dry_run_prints_the_command_and_runs_nothing(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    result = run_sail("launch", "-n", "2", "--dry-run", str(script), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[localhost]" in result.stdout and "--nproc-per-node 2" in result.stdout
    assert "must not run" not in result.stderr


@pytest.mark.multiprocess
def test_a_failing_worker_fails_the_launch(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit('rank 1 broke')\n")
    result = run_sail("launch", "-n", "2", str(script), cwd=tmp_path)
    assert result.returncode != 0
    assert "rank 1 broke" in result.stderr


@pytest.mark.multiprocess
def test_the_agent_is_sail_launch_itself_forked_not_a_second_interpreter(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text(
        "import os, sys\n"
        "agent = os.getppid()\n"
        "with open(f'/proc/{agent}/stat') as stat:\n"
        "    launcher = int(stat.read().rsplit(')', 1)[1].split()[1])\n"
        "def cmdline(pid):\n"
        "    with open(f'/proc/{pid}/cmdline', 'rb') as f:\n"
        "        return f.read().split(b'\\0')\n"
        # one write(2) per line: the two workers share the pipe, and print() writes word by word unbuffered
        "title = b'torchrun (the local agent of sail, pid %d)' % launcher\n"
        "named = b' '.join(cmdline(agent)).startswith(title)\n"
        "os.write(2, f'AGENT {named} {b\"torch.distributed.run\" in cmdline(agent)}\\n'.encode())\n"
    )
    result = run_sail("launch", "-n", "2", str(script), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # the workers' parent (torchrun's agent) is a fork of sail launch, which names it (a second
    # interpreter would run python -m torch.distributed.run)
    assert result.stderr.count("AGENT True False") == 2, result.stderr


@pytest.mark.multiprocess
def test_sigterm_stops_every_worker(tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text(
        "import os, pathlib, time\n"
        f"pathlib.Path(r'{tmp_path}', 'pid' + os.environ['RANK']).write_text(str(os.getpid()))\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen(
        [*SAIL, "launch", "-n", "2", str(script)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    pid_files = [tmp_path / "pid0", tmp_path / "pid1"]
    deadline = time.monotonic() + 60
    while not all(p.exists() and p.read_text() for p in pid_files):
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.2)
    workers = [int(p.read_text()) for p in pid_files]
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) != 0
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived the launcher"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; only its parent has not collected it yet.
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.multiprocess
def test_a_plain_torchrun_script_runs_unchanged(tmp_path: Path) -> None:
    import json

    plain = Path(__file__).parents[1] / "cluster" / "jobs" / "plain_ddp.py"
    result = run_sail("launch", "-n", "2", str(plain), str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("rank*.json"))]
    assert [(r["rank"], r["world_size"], r["local_rank"]) for r in records] == [(0, 2, 0), (1, 2, 1)]
    assert records[0]["digest"] == records[1]["digest"]


SIGNAL_JOB = Path(__file__).parents[1] / "cluster" / "jobs" / "signal_job.py"


def wait_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def wait_for_workers(out: Path) -> None:
    """Until both ranks of ``signal_job.py`` have started."""
    wait_for(lambda: all((out / f"started{r}").exists() for r in (0, 1)), 90, "the workers did not start")


def wait_for_nothing_left(out: Path, after: str) -> None:
    """Until no process of the job writing to ``out`` is left (10 s after ``after``)."""
    wait_for(lambda: not processes_with(str(out)), 10, f"left after {after}: {processes_with(str(out))}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("signum", [*FORWARDED, signal.SIGKILL], ids=lambda s: s.name)
def test_every_forwarded_signal_reaches_the_workers_and_leaves_nothing(
    tmp_path: Path, signum: signal.Signals
) -> None:
    out = tmp_path / "out"
    with (tmp_path / "stderr").open("w") as stderr:
        launcher = subprocess.Popen(
            [*SAIL, "launch", "-n", "2", str(SIGNAL_JOB), str(out)],
            cwd=tmp_path,
            stdout=stderr,
            stderr=stderr,
        )
    try:
        wait_for_workers(out)
        launcher.send_signal(signum)  # SIGKILL: the agent dies with sail (PR_SET_PDEATHSIG)
        # every process of the job, the launcher's included, is gone within 10 s
        wait_for_nothing_left(out, signum.name)
        code = launcher.wait(timeout=5)
        assert code == (-signal.SIGKILL if signum == signal.SIGKILL else 128 + signum)
        if signum == signal.SIGUSR1:
            assert (out / "usr1-0").exists() and (out / "usr1-1").exists()  # the workers got it
    finally:
        (out / "stop").touch()
        launcher.kill()


@pytest.mark.multiprocess
def test_pkill_by_sails_command_line_leaves_nothing_and_names_the_agent(tmp_path: Path) -> None:
    """``pkill -f 'sail launch'``, the usual way to stop a job by name, signals every process whose
    command line says so at the same moment: sail only, since its forked torchrun agent names itself,
    and the agent ends with sail and stops the workers (the pattern is narrowed to this job's output
    directory: other jobs may run on this machine)."""
    out = tmp_path / "out"
    sail = Path(sys.executable).with_name("sail")
    with (tmp_path / "stderr").open("w") as stderr:
        launcher = subprocess.Popen(
            [sys.executable, str(sail), "launch", "-n", "2", str(SIGNAL_JOB), str(out)],
            cwd=tmp_path, stdout=stderr, stderr=stderr,
        )  # fmt: skip
    try:
        wait_for_workers(out)
        named = {pid: line for pid, line in processes_with(str(out)).items() if "sail launch" in line}
        assert list(named) == [launcher.pid], named  # the agent's command line is its own
        agents = [
            line for line in processes_with(str(out)).values() if line.startswith("torchrun (the local agent")
        ]
        assert len(agents) == 1 and str(SIGNAL_JOB) in agents[0], processes_with(str(out))
        subprocess.run(["pkill", "-f", f"sail launch .*{out}"], check=True)
        wait_for_nothing_left(out, "pkill")
        assert launcher.wait(timeout=5) == 128 + signal.SIGTERM
    finally:
        (out / "stop").touch()
        launcher.kill()


@pytest.mark.multiprocess
def test_a_sail_error_of_one_rank_is_the_failure_reason(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, time\n"
        "from spikingsail.errors import ConfigError\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise ConfigError(\"train.json: 'gradient_clipping' is NaN\", 'clipping by NaN turns clipping off',\n"
        "                      'give a positive number, or 0 for no clipping')\n"
        "time.sleep(60)\n"
    )
    result = run_sail("launch", "-n", "2", str(script), cwd=tmp_path)
    assert result.returncode != 0
    assert result.stderr.rstrip().splitlines()[-4:] == [
        "sail launch: node localhost failed (agent exit status 1), rank 1 (local rank 1) exited with 1; "
        "the rank's error:",
        "ConfigError: train.json: 'gradient_clipping' is NaN",
        "  why: clipping by NaN turns clipping off",
        "  fix: give a positive number, or 0 for no clipping",
    ], result.stderr[-3000:]
    # torchrun's table of the failed ranks, without the agent's own traceback (debug level only)
    assert "rank      : 1 (local_rank: 1)" in result.stderr
    assert "ChildFailedError" not in result.stderr, result.stderr[-3000:]
    debug = run_sail(
        "launch", "-n", "2", str(script), cwd=tmp_path, env={**os.environ, "SAIL_LOG_LEVEL": "DEBUG"}
    )
    assert "raise ChildFailedError(" in debug.stderr


def test_a_crashed_rank_shows_where_each_thread_was_not_the_extension_modules(tmp_path: Path) -> None:
    script = tmp_path / "crash.py"
    script.write_text(
        "import faulthandler, os, threading, time, numpy\n"
        "faulthandler.enable()\n"
        "def waiting_helper():\n"
        "    time.sleep(60)\n"
        "def crash_here():\n"
        "    time.sleep(0.5)\n"
        "    os.abort()\n"
        "threading.Thread(target=waiting_helper, daemon=True).start()\n"
        "if os.environ['RANK'] == '1':\n"
        "    crash_here()\n"
        "time.sleep(60)\n"
    )
    result = run_sail("launch", "-n", "2", str(script), cwd=tmp_path)
    assert result.returncode != 0
    reason = result.stderr[result.stderr.rindex("sail launch: ") :].splitlines()
    assert "rank 1 (local rank 1) exited with -6 (SIGABRT); the rank crashed:" in reason[0], reason
    assert reason[1] == "    Fatal Python error: Aborted", reason
    assert any(line.endswith("line 7 in crash_here") for line in reason), reason
    assert any(line.endswith("line 4 in waiting_helper") for line in reason), reason
    assert not any("Extension modules" in line for line in reason), reason


def test_a_c_plus_plus_terminate_at_exit_is_named_as_torchs_gloo_exit_abort_with_its_workaround(
    tmp_path: Path,
) -> None:
    """std::terminate with no exception (what torch's gloo threads hit at interpreter exit,
    pytorch/pytorch#190489) after the training ended: the failure says which bug and what to do."""
    script = tmp_path / "exit_abort.py"
    script.write_text(
        "import ctypes, faulthandler\n"
        "faulthandler.enable()\n"
        "print('training done', flush=True)\n"
        "ctypes.CDLL('libstdc++.so.6')['_ZSt9terminatev']()\n"
    )
    result = run_sail("launch", "-n", "1", str(script), cwd=tmp_path)
    assert result.returncode != 0
    reason = result.stderr[result.stderr.rindex("sail launch: ") :]
    assert "exited with -6 (SIGABRT)" in reason, reason
    assert "torch's gloo abort at interpreter exit (pytorch/pytorch#190489" in reason, reason
    assert "fix: end the script with engine.close()" in reason and "os._exit(0)" in reason, reason


@pytest.mark.multiprocess
def test_an_engine_config_invalid_on_one_rank_is_the_failure_reason(tmp_path: Path) -> None:
    script = tmp_path / "bad_config.py"
    script.write_text(
        "import os, torch, spikingsail\n"
        "config = {'train_micro_batch_size_per_gpu': 8, 'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}}\n"
        "if os.environ['RANK'] == '1':\n"
        "    config['gradient_clipping'] = 'abc'\n"
        "engine, _ = spikingsail.initialize(model=torch.nn.Linear(2, 2), config=config)\n"
        "engine.close()\n"
    )
    result = run_sail("launch", "-n", "2", str(script), cwd=tmp_path)
    assert result.returncode != 0
    reason = result.stderr[result.stderr.rindex("sail launch: ") :].splitlines()
    assert "rank 1 (local rank 1) exited with 1; the rank's error:" in reason[0], reason
    # the rank's message, however the worker printed it (a traceback, or the message alone)
    assert "gradient_clipping" in reason[1] and "'abc'" in reason[1], reason
    assert all(line.startswith(("  why: ", "  fix: ", "       ")) for line in reason[2:]), reason


def test_stderr_stays_a_terminal_for_the_workers(tmp_path: Path) -> None:
    """When sail launch's stderr is a terminal, the workers' is too (progress bars stay on)."""
    import pty

    script = tmp_path / "which_stderr.py"
    script.write_text(
        "import os, sys\nprint(f\"rank{os.environ['RANK']} isatty={sys.stderr.isatty()}\", file=sys.stderr)\n"
    )
    reader, writer = pty.openpty()
    launcher = subprocess.Popen([*SAIL, "launch", "-n", "2", str(script)], cwd=tmp_path, stderr=writer,
                                stdout=subprocess.DEVNULL)  # fmt: skip
    os.close(writer)
    said = b""
    while chunk := _read(reader):
        said += chunk
    os.close(reader)
    assert launcher.wait(timeout=60) == 0
    assert b"rank0 isatty=True" in said and b"rank1 isatty=True" in said, said.decode(errors="replace")


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # EIO: every writer of the pseudo-terminal closed
        return b""


@pytest.mark.multiprocess
def test_a_closed_terminal_ends_the_whole_job(tmp_path: Path) -> None:
    """sail launch on a terminal of its own (``script``, as a login shell or tmux gives it); the
    terminal goes away (its master side closes) and the kernel hangs the session up."""
    out = tmp_path / "out"
    command = shlex.join([*SAIL, "launch", "-n", "2", str(SIGNAL_JOB), str(out)])
    terminal = subprocess.Popen(["script", "-qfec", command, "/dev/null"], cwd=tmp_path,
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_for_workers(out)
        terminal.kill()  # the terminal's master side closes with it
        wait_for_nothing_left(out, "the hang-up")
    finally:
        (out / "stop").touch()
        terminal.kill()
        terminal.wait()


@pytest.mark.multiprocess
def test_a_signal_the_kernel_hands_to_another_thread_of_sail_still_reaches_the_job(tmp_path: Path) -> None:
    """A process-directed signal goes to whichever of sail's threads the kernel picks (a closed
    terminal's SIGHUP landed on the thread relaying the workers' output once in CI); Python runs the
    handler on the main thread only, so a main thread blocked until the job ends would never pass it on.
    The signal is sent to the relay thread here (tgkill), which is what the kernel may do."""
    import ctypes

    out = tmp_path / "out"
    launcher = subprocess.Popen([*SAIL, "launch", "-n", "2", str(SIGNAL_JOB), str(out)], cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_for_workers(out)
        others = [int(t) for t in os.listdir(f"/proc/{launcher.pid}/task") if int(t) != launcher.pid]
        assert others, "sail launch runs no thread beside its main one: nothing to send the signal to"
        tgkill = ctypes.CDLL(None, use_errno=True).tgkill
        assert tgkill(launcher.pid, others[0], int(signal.SIGHUP)) == 0, os.strerror(ctypes.get_errno())
        assert launcher.wait(timeout=60) == 128 + signal.SIGHUP
        wait_for_nothing_left(out, "the signal")
    finally:
        (out / "stop").touch()
        launcher.kill()
        launcher.wait()


def test_local_launcher_with_a_host_list_uses_its_count_and_chosen_slots_here(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.touch()
    (command,) = plan(parse_request(["--launcher", "local", "-H", "localhost:4", "--include", "localhost:1,3",
                                     str(script)]))  # fmt: skip
    assert command.env == {"CUDA_VISIBLE_DEVICES": "1,3"}
    assert command.argv[command.argv.index("--nproc-per-node") + 1] == "2"
    with pytest.raises(LaunchError, match="--launcher local with -H naming localhost, node9"):
        plan(parse_request(["--launcher", "local", "-H", "localhost:1,node9:1", str(script)]))
