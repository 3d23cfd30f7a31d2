"""torchrun's flags read once (``TorchrunArgs``), the launchers' names from the registry, and the
doctor's way of telling that ``-H`` names hosts."""

from __future__ import annotations

from pathlib import Path

import pytest

from spikingsail.cli import doctor
from spikingsail.launchers import LAUNCHERS
from spikingsail.launchers.request import FORWARDED_SIGNALS, parse_request, parser
from spikingsail.launchers.torchrun_args import TorchrunArgs, flag_names, names_hosts


def read(*argv: str) -> TorchrunArgs:
    ns = parser().parse_args([*argv, "train.py"])
    return TorchrunArgs.read(ns, list(argv), {"-n": 1, "-H": 1})


def test_flags_are_read_once_with_one_spelling_each() -> None:
    args = read("-n4", "--master_port=29555", "--rdzv_id", "job", "--max-restarts", "2")
    assert (args.nproc_per_node, args.master_port, args.rdzv_id) == ("4", 29555, "job")
    assert args.explicit_nproc and args.short_nproc and args.explicit_master_port
    assert args.chooses_rendezvous and not args.chooses_signals and not args.single_node
    assert args.flags == ["--master_port=29555", "--rdzv_id", "job", "--max-restarts", "2"]
    assert args.without_per_node() == ["--max-restarts", "2"]
    assert flag_names(["--no_python", "-m", "--nproc_per_node=2"]) == {
        "--no-python",
        "-m",
        "--nproc-per-node",
    }


def test_defaults_are_not_taken_for_flags_the_user_wrote() -> None:
    args = read("--max-restarts", "1")
    assert (args.nproc_per_node, args.master_port, args.rdzv_id) == ("1", 29500, None)
    assert not (args.explicit_nproc or args.explicit_master_port or args.chooses_rendezvous)
    assert args.single_node and not args.module and not args.no_python


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["-H", "hostfile"], True),
        (["-Hhostfile"], True),
        (["-Hnode1:2,node2:2"], True),
        (["--hostfile", "hostfile"], True),
        (["--hostfile=hostfile"], True),
        (["-n", "2"], False),
        (["--launcher", "pdsh"], False),
    ],
)
def test_hosts_are_named_in_every_spelling_of_dash_h(flags: list[str], expected: bool) -> None:
    assert names_hosts(flags) is expected


@pytest.mark.parametrize("flags", [["-H", "hostfile"], ["-Hhostfile"], ["--hostfile=hostfile"]])
def test_doctor_checks_the_nodes_for_every_spelling_of_dash_h(
    flags: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[str] = []
    monkeypatch.setattr(doctor, "_nodes", lambda launch_flags, report, timeout: checked.append("nodes"))
    monkeypatch.setattr(doctor, "_here", lambda launch_flags, report, timeout: checked.append("here"))
    assert doctor.run([*flags, "--json"]) == 0
    assert checked == ["nodes"]


def test_the_launcher_names_come_from_the_registry(job: Path) -> None:
    (choices,) = [a.choices for a in parser()._actions if "--launcher" in a.option_strings]
    assert list(LAUNCHERS) == ["local", "ssh", "pdsh", "mpirun", "slurm", "horovodrun"]
    assert list(choices or ()) == [*LAUNCHERS, "openmpi", "mvapich", "impi", "mpich"]  # and DeepSpeed's names
    assert all(name == launcher.name for name, launcher in LAUNCHERS.items())


def test_module_and_no_python_are_read_from_the_command_line(job: Path) -> None:
    assert parse_request(["-n", "2", "-m", "package.train"]).runs_module
    request = parse_request(["--launcher", "horovodrun", "-np", "2", "--no_python", "train.py"])
    assert request.no_python and not request.runs_module


def test_an_attached_hostfile_is_sail_launchs_not_torchruns(job: Path) -> None:
    request = parse_request(["-Hhostfile", "train.py"])
    assert [n.host for n in request.nodes or []] == ["node1", "node2"]
    assert request.torchrun_args == ["--signals-to-handle", FORWARDED_SIGNALS]
