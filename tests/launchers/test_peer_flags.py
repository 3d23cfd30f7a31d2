"""The flags DeepSpeed's and horovodrun's users already type, read as those launchers read them."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from spikingsail.errors import LaunchError
from spikingsail.launchers import deepspeed_flags
from spikingsail.launchers.hostfile import Node
from spikingsail.launchers.request import parse_request, parser
from tests.launchers.plans import plan


@pytest.mark.parametrize(
    ("argv", "nodes"),
    [
        (["-i", "node2:1"], [Node(host="node2", slots=(1,))]),
        (["-inode2:1"], [Node(host="node2", slots=(1,))]),
        (["-e", "node1"], [Node(host="node2", slots=(0, 1))]),
        (["--num_accelerators", "1"], [Node(host="node1", slots=(0,)), Node(host="node2", slots=(0,))]),
    ],
)
def test_deepspeeds_short_flags_and_aliases(job: Path, argv: list[str], nodes: list[Node]) -> None:
    assert parse_request(["-H", "hostfile", *argv, "train.py"]).nodes == nodes


def test_deepspeeds_ssh_port_spelling(job: Path) -> None:
    command = plan(parse_request(["-H", "hostfile", "--ssh_port", "222", "train.py"]))[0]
    assert command.argv[command.argv.index("-p") + 1] == "222"


def test_launcher_args_starting_with_a_dash_reach_the_launcher_and_the_scripts_own_stay(job: Path) -> None:
    """DeepSpeed's `--launcher_args '-mca btl_tcp_if_include eth1'`: argparse alone reads `-mca` as
    torchrun's `-m`. The script's own arguments of that name reach it as written."""
    request = parse_request(
        ["-H", "hostfile", "--launcher", "mpirun", "--launcher_args", "-mca btl_tcp_if_include eth1",
         "train.py", "--launcher_args", "-x"]
    )  # fmt: skip
    assert request.launcher_args == ["-mca", "btl_tcp_if_include", "eth1"]
    assert request.script_args == ["--launcher_args", "-x"]
    assert "btl_tcp_if_include" in plan(request)[0].argv


@pytest.mark.parametrize(
    "hosts", [["-hostfile", "hostfile"], ["--hostfile", "hostfile"], ["--hosts", "node1:2,node2:2"]]
)
@pytest.mark.parametrize("np", [["-np", "3"], ["--num-proc", "3"]])
def test_horovodruns_spellings(job: Path, hosts: list[str], np: list[str]) -> None:
    request = parse_request(["--launcher", "horovodrun", *hosts, *np, "train.py"])
    assert request.nodes == [Node(host="node1", slots=(0, 1)), Node(host="node2", slots=(0,))]
    assert request.world_size == 3


@pytest.mark.parametrize("launcher", [[], ["--launcher", "local"]])
def test_np_without_hosts_runs_here_as_horovodrun_does(job: Path, launcher: list[str]) -> None:
    request = parse_request([*launcher, "-np", "3", "train.py"])
    assert request.nodes is None and request.nproc_per_node == "3" and request.world_size == 3
    assert (
        "--nproc-per-node" in (argv := plan(request)[0].argv)
        and argv[argv.index("--nproc-per-node") + 1] == "3"
    )


def test_np_and_nproc_per_node_without_hosts_are_one_too_many(job: Path) -> None:
    with pytest.raises(LaunchError, match="-np and --nproc-per-node were both given") as err:
        parse_request(["-np", "2", "-n", "2", "train.py"])
    assert "as horovodrun does" in str(err.value)


def test_a_filter_without_hosts_names_its_flag(job: Path) -> None:
    with pytest.raises(LaunchError, match=r"^--num_gpus needs hosts"):
        parse_request(["--num_gpus", "2", "train.py"])


def _deepspeeds_parser() -> argparse.ArgumentParser:
    """The parser of the installed DeepSpeed's launcher (``deepspeed.launcher.runner``), which
    builds it inside ``parse_args``."""
    from deepspeed.launcher import runner

    built: list[argparse.ArgumentParser] = []
    parse = argparse.ArgumentParser.parse_args

    def keep(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        built.append(self)
        return parse(self, ["train.py"])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", keep)
        runner.parse_args([])
    return built[0]


def test_every_flag_of_deepspeeds_launcher_is_known_and_takes_what_it_takes_there() -> None:
    ours = parser()._option_string_actions
    flags = {s: a for a in _deepspeeds_parser()._actions for s in a.option_strings}
    unknown = sorted(set(flags) - set(ours))
    assert not unknown, f"DeepSpeed's launcher flags sail launch does not know: {unknown}"
    for spelling, action in flags.items():
        assert (action.nargs == 0) == (ours[spelling].nargs == 0), spelling


def deepspeed_constants() -> Any:
    from deepspeed.launcher import constants

    return constants


REFUSED = [f for f in deepspeed_flags.FLAGS if not f.accepted]
ACCEPTED = [f for f in deepspeed_flags.FLAGS if f.accepted]


@pytest.mark.parametrize("flag", REFUSED, ids=lambda f: f.spellings[-1])
def test_a_deepspeed_flag_without_counterpart_is_refused_saying_what_to_use(
    job: Path, flag: deepspeed_flags.DeepSpeedFlag
) -> None:
    given = [flag.spellings[0]] + ([] if flag.metavar is None else ["tune"])
    with pytest.raises(LaunchError) as err:
        parse_request(["-H", "hostfile", *given, "train.py"])
    assert str(err.value).startswith(flag.spellings[-1]) and "DeepSpeed's launcher" in str(err.value)


@pytest.mark.parametrize("flag", ACCEPTED, ids=lambda f: f.spellings[-1])
def test_a_deepspeed_flag_for_what_sail_does_anyway_changes_nothing(
    job: Path, flag: deepspeed_flags.DeepSpeedFlag
) -> None:
    for hosts in (["-H", "hostfile"], ["-H", "node1:2"], ["-n", "2"]):
        assert parse_request([*hosts, *flag.spellings, "train.py"]) == parse_request([*hosts, "train.py"])


@pytest.mark.parametrize(
    "name", sorted(v for k, v in vars(deepspeed_constants()).items() if k.endswith("_LAUNCHER"))
)
def test_each_of_deepspeeds_launcher_names_is_sails_or_refused(
    job: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")  # srun starts a job only inside an allocation
    argv = ["-H", "hostfile", "--launcher", name, "train.py"]
    if name in deepspeed_flags.OTHER_MPIS:
        with pytest.raises(
            LaunchError, match=f"--launcher {name}: SpikingSail does not start jobs with this MPI"
        ):
            parse_request(argv)
    else:
        expected = deepspeed_flags.LAUNCHER_NAMES.get(name, name)
        assert parse_request(argv) == parse_request([*argv[:3], expected, "train.py"])
