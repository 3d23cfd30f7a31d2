"""Property-based fuzzing of the command lines of `sail launch`, `sail submit`, `sail doctor` and
`sail bench comm`, and of hostfiles (hypothesis; seeded and bounded).

Every generated input either is refused with one clear message (exit status 2, no traceback) before
anything starts, or is accepted; and what is accepted is accepted by the later stages too: torchrun
(its own parser and checks, ``tests/launchers/peers.py``) for every command that would start it, ssh
(``ssh -G``) for every ssh command, the engine's config loader at the world size torchrun would give,
the benchmark job's own parser, DeepSpeed's hostfile parser for files in its format, and the Kubeflow
SDK's own PyTorchJob models for every manifest of ``sail submit --target k8s``. The commands
are read through their dry runs (``--dry-run``); the doctor, which has none, through the reading of
its flags that precedes every check."""

from __future__ import annotations

import argparse
import io
import json
import re
import shlex
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest
from deepspeed.launcher.runner import fetch_hostfile
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from kubeflow.training.api_client import ApiClient as KubeflowClient
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.run import get_args_parser

from spikingsail.backends import load_config
from spikingsail.cli import doctor
from spikingsail.cli.main import main
from spikingsail.diagnostics import comm_bench
from spikingsail.errors import LaunchError, SailError
from spikingsail.launchers import plan
from spikingsail.launchers import run as launch_run
from spikingsail.launchers.command import LaunchCommand
from spikingsail.launchers.hostfile import parse_hostfile
from spikingsail.launchers.request import LaunchRequest, parse_request
from tests.launchers.peers import ssh_refusal, torchrun_args, torchrun_config


def fuzz(examples: int) -> settings:
    """Seeded (the same inputs on every run), bounded, and with no time limit per input (a loaded CI
    machine); the workdir fixture is shared by the inputs of one test, which only read it."""
    return settings(
        derandomize=True,
        database=None,
        deadline=None,
        max_examples=examples,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


# --- values -------------------------------------------------------------------------------------

EDGES = ["-1", "0", "1", "2", "3", "65535", "65536", "99999", "-5", "inf", "-inf", "nan", "1e300", "0.5",
         "1.5", "x", "", " ", "٣", "+2", "0x10", "2_0", "9" * 25, "1:2", "2:1"]  # fmt: skip
NUMBERS = st.one_of(st.sampled_from(EDGES), st.integers(-(2**17), 2**17).map(str))
# a command line's words: anything but NUL, which no argv can hold
TEXT = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=12)


def mostly(*good: str, bad: st.SearchStrategy[str] = NUMBERS) -> st.SearchStrategy[str]:
    """A good value two times in three, else a generated bad one: a command line with several flags
    is then accepted often enough for its commands to reach the later stages."""
    return st.one_of(st.sampled_from(good), st.sampled_from(good), bad)


BAD_HOSTS = st.sampled_from(["[::1]", "a b", "-oProxyCommand=x", "", "h1:", "h1,h2"])
HOSTS = mostly("node1", "node2", "127.0.0.1", bad=BAD_HOSTS)
PORTS = mostly("29500", "1", "65535")
ENDPOINTS = st.one_of(st.builds(lambda h, p: f"{h}:{p}", HOSTS, PORTS), HOSTS)
HOST_LISTS = st.lists(st.builds(lambda h, n: f"{h}:{n}", HOSTS, mostly("1", "2")), min_size=1, max_size=3)
FILTERS = st.builds(lambda h, s: f"{h}:{s}", HOSTS, mostly("0", "1"))

LAUNCH = {
    "-n": mostly("1", "2", "cpu", "auto", bad=st.one_of(NUMBERS, st.just("gpu"))),
    "--master-port": PORTS,
    "--master-addr": st.one_of(HOSTS, TEXT),
    "--rdzv-endpoint": ENDPOINTS,
    "--rdzv-backend": st.sampled_from(["static", "c10d"]),
    "--nnodes": mostly("1", "1:1", "2", bad=st.builds(lambda a, b: f"{a}:{b}", NUMBERS, NUMBERS)),
    "--max-restarts": mostly("0", "3"),
    "--ssh-port": mostly("22", "2222"),
    "--connect-timeout": mostly("5", "10"),
    "--heartbeat-timeout": mostly("3", "30"),
    "--ft-replicas": mostly("0", "2", "3"),
    "--ft-heartbeat-timeout": mostly("1", "0.5"),
    "--launcher-args": mostly(
        "--mca btl tcp,self", "-x FOO=1", bad=st.one_of(TEXT, st.sampled_from(["'a", '"-x FOO']))
    ),
    "--launcher": st.sampled_from(["local", "ssh", "pdsh", "mpirun", "slurm"]),
    "-H": HOST_LISTS.map(",".join),
    "-np": mostly("1", "2"),
    "--num_nodes": mostly("1", "2"),
    "--num_gpus": mostly("1"),
    "--include": FILTERS,
    "--exclude": FILTERS,
    "--env": mostly("A=1", "PATH", bad=st.one_of(TEXT, st.just("=x"))),
    "--ssh-config": mostly("ssh_config", bad=st.just("missing")),
}
SUBMIT = {
    "-N": mostly("1", "2"),
    "--gpus-per-node": mostly("0", "4"),
    "--nproc-per-node": mostly("1", "4"),
    "-c": mostly("1", "8"),
    "--signal-before": mostly("120", "1", "65535"),
    "--max-restarts": mostly("0", "2"),
    "--master-port": PORTS,
    "-t": st.sampled_from(["4:00:00", "1-0", "x\ny"]),
    "--dist-init-method": st.sampled_from(["torchrun", "slurm", "x"]),
}
K8S = {
    "--image": st.one_of(st.just("ghcr.io/me/trainer:1"), TEXT),
    "-N": mostly("1", "3"),
    "--gpus-per-node": mostly("0", "8"),
    "--nproc-per-node": mostly("1", "4"),
    "-J": st.one_of(st.sampled_from(["train", "Train_X", "a" * 60, "x-"]), TEXT),
    "--namespace": st.one_of(st.just("research"), TEXT),
    "--env": st.one_of(st.just("NCCL_DEBUG=INFO"), TEXT),
    "--env-secret": st.one_of(st.just("WANDB_API_KEY=wandb:api-key"), TEXT),
    "--workdir": st.one_of(st.just("/app"), TEXT),
    "--master-port": PORTS,
    "--max-restarts": mostly("0", "2"),
}
BENCH = {
    "-b": mostly("1K", "64M", bad=st.one_of(NUMBERS, st.just("3Q"))),
    "-e": mostly("1K", "64M", "1G"),
    "-f": mostly("2", "4"),
    "--iters": mostly("1", "20"),
    "--warmup": mostly("0", "5"),
    "--ops": st.sampled_from(["all_reduce", "x", "", "broadcast,all_gather"]),
    "--dtype": st.sampled_from(["float32", "bfloat16", "int7"]),
}
DOCTOR = {"--timeout": mostly("10", "0.5"), "--color": st.sampled_from(["auto", "never", "x"])}
CONFIGS = {
    "good.json": {"train_micro_batch_size_per_gpu": 2},
    "total.json": {"train_batch_size": 12},
    "bad.json": {"train_batch_size": 0},
}


def flags(table: dict[str, st.SearchStrategy[str]], most: int = 4) -> st.SearchStrategy[list[str]]:
    """Up to ``most`` of the table's flags, each with a generated value, as ``--flag VALUE`` or
    ``--flag=VALUE`` (the only way argparse takes a value that starts with '-')."""

    def pair(flag: str) -> st.SearchStrategy[list[str]]:
        joined = st.booleans() if flag.startswith("--") else st.just(False)
        return st.tuples(table[flag], joined).map(lambda v: [f"{flag}={v[0]}"] if v[1] else [flag, v[0]])

    chosen = st.lists(st.sampled_from(sorted(table)).flatmap(pair), max_size=most)
    return chosen.map(lambda pairs: [word for p in pairs for word in p])


SCRIPT_ARGS: st.SearchStrategy[list[str]] = st.one_of(
    st.just([]),
    st.sampled_from(sorted(CONFIGS)).map(lambda c: ["--sail-config", c]),
    st.just(["--sail-config", "missing.json"]),
)


# --- running sail ---------------------------------------------------------------------------------


def sail(argv: list[str]) -> tuple[int, str, str]:
    """``sail ARGV`` in this process: (exit status, stdout, stderr). An exception other than argparse's
    usage exit is a traceback for the user: it propagates and fails the test with the input."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
    return status, out.getvalue(), err.getvalue()


def refused_clearly(command: str, status: int, err: str) -> None:
    """A refusal: status 2, a message on stderr of `sail COMMAND` or argparse, and no traceback."""
    event("refused")
    assert status == 2, (status, err)
    assert "Traceback" not in err, err
    assert re.search(rf"^sail {command}[ :]|^usage: ", err, re.MULTILINE), err


@pytest.fixture
def workdir(job: Path) -> Path:
    (job / "ssh_config").touch()
    for name, config in CONFIGS.items():
        (job / name).write_text(json.dumps(config))
    return job


def later_stages_accept(request: LaunchRequest, commands: list[LaunchCommand]) -> None:
    """Every command torchrun or ssh would run is accepted by them, and the config the script is given
    loads at the world size torchrun would make."""
    event(f"accepted: {request.launcher}" + (", replica groups" if request.ft_replicas else ""))
    seen: set[tuple[str, ...]] = set()  # replica groups' commands differ in their environment only
    for command in commands:
        args = torchrun_args(command)
        if args is not None and tuple(args) not in seen:
            seen.add(tuple(args))
            config = torchrun_config(args)
            assert not isinstance(config, str), (command.render(), config)
            fixed = config.min_nodes == config.max_nodes
            world = config.nproc_per_node * config.max_nodes * max(request.ft_replicas, 1)
            config_given = [request.script_args[1]] if request.script_args[:1] == ["--sail-config"] else []
            for path in config_given if fixed and not request.nodes else []:
                load_config(path, world)  # a refusal here propagates: sail accepted what the engine refuses
        refusal = ssh_refusal(command)
        assert refusal is None, refusal


def planned(request: LaunchRequest) -> list[LaunchCommand]:
    if request.ft_replicas:
        return launch_run._plan_replica_groups(request)[1]
    return plan(request)


# --- the properties -------------------------------------------------------------------------------


@fuzz(200)
@given(argv=flags(LAUNCH), script_args=SCRIPT_ARGS)
@example(argv=["--launcher-args", "'a"], script_args=[])  # the review's findings, always tried
@example(argv=["--ft-replicas", "2", "--ft-heartbeat-timeout", "inf"], script_args=[])
@example(argv=["--master-port", "99999", "--ssh-port", "-5", "--connect-timeout", "-3"], script_args=[])
@example(argv=["--rdzv-endpoint", "h1:notaport", "--nnodes", "2:1"], script_args=[])
@example(argv=["--ft-replicas", "99999"], script_args=[])
@example(argv=["-n", "2"], script_args=["--sail-config", "total.json"])
@example(argv=["-H", "node1:2,node2:2", "--ssh-port", "2222", "--connect-timeout", "5"], script_args=[])
@example(argv=["-H", "node1:1,node2:1", "--launcher", "pdsh", "--ssh-config", "ssh_config"], script_args=[])
@example(argv=["-H", "node1:1,node2:1", "--ft-replicas", "2"], script_args=[])
def test_launch(workdir: Path, argv: list[str], script_args: list[str]) -> None:
    status, _, err = sail(["launch", "--dry-run", *argv, "train.py", *script_args])
    if status != 0:
        refused_clearly("launch", status, err)
        return
    request = parse_request([*argv, "train.py", *script_args])
    later_stages_accept(request, planned(request))


@fuzz(120)
@given(argv=flags(K8S, most=5), script_args=SCRIPT_ARGS)
@example(argv=["--namespace", "Research", "-J", "-x"], script_args=[])
def test_submit_k8s(workdir: Path, argv: list[str], script_args: list[str]) -> None:
    status, text, err = sail(
        [
            "submit",
            "--target",
            "k8s",
            "--image",
            "ghcr.io/me/trainer:1",
            "--dry-run",
            *argv,
            "train.py",
            *script_args,
        ]
    )
    if status != 0:
        refused_clearly("submit", status, err)
        return
    manifest = json.loads(text)  # what is accepted is a PyTorchJob of the Kubeflow SDK's own models
    client = KubeflowClient()
    job = client.deserialize(SimpleNamespace(data=text), "KubeflowOrgV1PyTorchJob")
    assert client.sanitize_for_serialization(job) == manifest
    names = [
        manifest["metadata"]["name"],
        *([manifest["metadata"]["namespace"]] if "namespace" in manifest["metadata"] else []),
    ]
    assert all(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", n) and len(n) <= 63 for n in names), names


@fuzz(120)
@given(argv=flags(SUBMIT, most=5), requeue=st.booleans(), script_args=SCRIPT_ARGS)
@example(argv=["--nproc-per-node", "-1", "--signal-before", "-5"], requeue=True, script_args=[])
def test_submit(workdir: Path, argv: list[str], requeue: bool, script_args: list[str]) -> None:
    status, script, err = sail(
        ["submit", "--dry-run", *(["--requeue"] if requeue else []), *argv, "train.py", *script_args]
    )
    if status != 0:
        refused_clearly("submit", status, err)
        return
    for key, value in re.findall(r"^#SBATCH --([a-z-]+)=(.*)$", script, re.MULTILINE):
        if key in ("nodes", "ntasks-per-node", "gpus-per-task", "cpus-per-task"):
            assert re.fullmatch(r"[1-9][0-9]*", value), (key, value)  # sbatch's counts
        if key == "signal":  # sbatch: --signal=[B:]SIG[@TIME], TIME from 0 to 65535
            assert 0 <= int(value.rpartition("@")[2]) <= 65535, value
    step = next(line for line in script.splitlines() if line.startswith("srun "))
    shell = {"$SLURM_NNODES": "2", "$MASTER_ADDR": "h1", "$MASTER_PORT": "29500", "$SLURM_JOB_ID": "7"}
    words = shlex.split(re.sub(r"\$[A-Z_]+", lambda m: shell.get(m[0], m[0]), step.removesuffix(" &")))
    if "torch.distributed.run" in words:
        config = torchrun_config(words[words.index("torch.distributed.run") + 1 :])
        assert not isinstance(config, str), (step, config)


@fuzz(80)
@given(argv=flags(DOCTOR, most=2), launch_flags=flags(LAUNCH, most=3))
@example(argv=["--timeout", "inf"], launch_flags=[])
@example(argv=[], launch_flags=["--launcher-args", "'a"])
def test_doctor(workdir: Path, argv: list[str], launch_flags: list[str]) -> None:
    """The doctor's reading of its options and of the `sail launch` flags, before any check runs."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            _, rest = doctor.parse([*argv, *launch_flags])
            request = doctor.job(rest)
        except SystemExit as exit_:
            refused_clearly("doctor", int(exit_.code or 0), err.getvalue())
            return
        except SailError:
            return  # main prints it as one message, exit status 2
    later_stages_accept(request, planned(request))


@fuzz(80)
@given(argv=flags(BENCH), launch_flags=flags(LAUNCH, most=2))
@example(argv=[], launch_flags=["--launcher-args", "'a"])
def test_bench_comm(workdir: Path, argv: list[str], launch_flags: list[str]) -> None:
    status, out, err = sail(["bench", "comm", "--dry-run", *argv, *launch_flags])
    if status != 0:
        refused_clearly("bench", status, err)
        return
    # the job's arguments, as a local command gives them (a remote one holds them in a shell string)
    lines = [
        line for line in out.splitlines() if line.startswith("[localhost]") and comm_bench.__name__ in line
    ]
    if not lines:
        return
    job_args = shlex.split(lines[0])[shlex.split(lines[0]).index(comm_bench.__name__) + 1 :]
    parser = argparse.ArgumentParser()
    comm_bench.add_arguments(parser)
    comm_bench.sweep_config(parser.parse_args(job_args))  # the job's own reading of them


# --- hostfiles ----------------------------------------------------------------------------------

SLOTS = st.one_of(
    st.integers(0, 5000).map(str), st.sampled_from(["", "-1", "٣", "1.5", "4abc", "x", "99999999"])
)
LINES = st.one_of(
    st.builds(
        lambda h, s, sep: f"{h}{sep}slots={s}",
        st.one_of(HOSTS, TEXT),
        SLOTS,
        st.sampled_from([" ", "\t", "  "]),
    ),
    st.builds(lambda h, s: f"{h} {s}", HOSTS, SLOTS),  # seed 000's "HOST N"
    st.sampled_from(["", "# a comment", "   ", "node1 slots=2 # two GPUs", "slots=2"]),
    HOSTS,
    TEXT,
)
DEEPSPEED_LINE = re.compile(r"(\S+)\s+slots=(\d+)")


@fuzz(300)
@given(lines=st.lists(LINES, max_size=5))
def test_hostfiles_against_deepspeeds_parser(
    tmp_path_factory: pytest.TempPathFactory, lines: list[str]
) -> None:
    """Where DeepSpeed's parser and ours both accept a file, they read the same hosts and slots (but for
    a '#' inside a line: a comment from there on, as in Open MPI's hostfiles, where DeepSpeed takes it
    for part of a host name); where DeepSpeed reads a file we refuse, the refusal is one of our
    stricter rules (a host name ssh would take for an option, a slot count outside 1..4096 or not
    ASCII digits, text after the count); a file we accept and DeepSpeed refuses uses one of our other
    forms ('HOST N', a bare host)."""
    path = tmp_path_factory.mktemp("hostfile") / "hostfile"
    path.write_text("\n".join(lines) + "\n")
    try:
        ours: dict[str, int] | str = {n.host: n.nproc for n in parse_hostfile(path, default_slots=2)}
    except LaunchError as err:
        ours = str(err)
    try:
        theirs: dict[str, int] | str = dict(fetch_hostfile(str(path)))
    except ValueError as err:
        theirs = str(err)
    if isinstance(ours, dict) and isinstance(theirs, dict):
        inline_comment = any("#" in line.strip()[1:] for line in lines)
        assert ours == theirs or inline_comment, (lines, ours, theirs)
    elif isinstance(ours, dict):
        content = [line.split("#", 1)[0].strip() for line in lines]
        assert any(line and not DEEPSPEED_LINE.match(line) for line in content), (lines, theirs)
    elif isinstance(theirs, dict):
        stricter = ("is not a host name", "slot count", "cannot read", "listed again", "not UTF-8")
        assert any(reason in ours for reason in stricter), (lines, ours)


# --- torchrun's flags: accepted exactly as torchrun accepts them ----------------------------------

TORCHRUN = {
    "--nnodes": LAUNCH["--nnodes"],
    "--master-port": NUMBERS,
    "--master-addr": LAUNCH["--master-addr"],
    "--rdzv-endpoint": ENDPOINTS,
    "--rdzv-backend": LAUNCH["--rdzv-backend"],
    "--max-restarts": NUMBERS,
}


@fuzz(200)
@given(argv=flags(TORCHRUN))
@example(argv=["--master-port", "99999"])
@example(argv=["--nnodes", "2:1"])
@example(argv=["--rdzv-endpoint", "h1:notaport"])
def test_torchrun_flags_are_refused_where_torchrun_refuses_them(workdir: Path, argv: list[str]) -> None:
    """`sail launch` refuses a torchrun flag's value where torchrun itself would (its parser, its run,
    its rendezvous handler), and nowhere else but for a port the other processes cannot use: a
    --master-port outside 1..65535 (torchrun ignores it unless its rendezvous is static; sail launch
    sets up the rendezvous on it across nodes whatever the backend, and port 0 is any free port,
    which no other process can know), or a --rdzv-endpoint port 0 for more than one node."""
    status, _, err = sail(["launch", "--dry-run", "-n", "1", *argv, "train.py"])
    theirs = torchrun_config(["--nproc-per-node", "1", *argv, "train.py"])
    if isinstance(theirs, str):
        assert status == 2, (argv, theirs)
        return
    ns = get_args_parser().parse_args([*argv, "train.py"])
    unusable = (ns.master_port is not None and not 1 <= ns.master_port <= 65535) or (
        ns.rdzv_endpoint and theirs.max_nodes > 1 and parse_rendezvous_endpoint(ns.rdzv_endpoint, 1)[1] == 0
    )
    assert status == (2 if unusable else 0), (argv, err)
