"""`sail submit`'s sbatch scripts: a golden file for seed 002's job, and the per-task mode."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spikingsail.errors import LaunchError
from spikingsail.launchers.sbatch import parse_submit

GOLDEN = Path(__file__).with_name("golden")


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").touch()
    return tmp_path


def test_seed_002_job_script(workdir: Path) -> None:
    request, _ = parse_submit([
        "-N", "2", "--gpus-per-task", "4", "-c", "8", "-p", "sdcshare_v100_32g", "-t", "1-00:00:00",
        "-J", "pytorch-trainer", "-o", "20230609%j.out", "-e", "20230609%j.err",
        "--sbatch-arg=--comment=wbsM-SC230825.001", "--master-port", "23445", "--max-restarts", "2",
        "train.py", "/mnt/images", "--epochs=30", "--resume", "--checkpoints-path=./checkpoints",
    ])  # fmt: skip
    expected = (GOLDEN / "seed002.sbatch").read_text().format(workdir=workdir, python=sys.executable)
    assert request.render() == expected


def test_one_task_per_gpu_mode(workdir: Path) -> None:
    request, _ = parse_submit(["-N", "2", "--gpus-per-node", "4", "--dist-init-method", "slurm", "train.py"])
    text = request.render()
    assert "#SBATCH --ntasks-per-node=4\n#SBATCH --gpus-per-task=1\n" in text
    assert text.rstrip().endswith(
        f'srun --nodes "$SLURM_NNODES" --ntasks-per-node 4 --kill-on-bad-exit=1 {sys.executable} -u '
        "-m spikingsail.launchers.as_torchrun train.py"
    )


def test_missing_script(workdir: Path) -> None:
    with pytest.raises(LaunchError, match=r"training script nope\.py does not exist"):
        parse_submit(["nope.py"])


def test_unknown_option_is_refused(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_submit(["--gpus", "2", "train.py"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --gpus" in capsys.readouterr().err


def test_requeue_script_catches_the_signal_and_requeues(workdir: Path) -> None:
    request, _ = parse_submit(["-N", "2", "--requeue", "--signal-before", "300", "train.py", "--resume"])
    text = request.render()
    assert "#SBATCH --signal=B:USR1@300\n#SBATCH --open-mode=append\n#SBATCH --requeue\n" in text
    assert "trap on_signal USR1 TERM\n" in text
    assert "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 train.py --resume &\nstep=$!\n" in text
    assert 'if [ "$preempted" = 1 ] || [ "$status" = 75 ]; then' in text
    assert '    scontrol requeue "$SLURM_JOB_ID"\n' in text


def test_requeue_without_resume_warns(workdir: Path, caplog: pytest.LogCaptureFixture) -> None:
    parse_submit(["--requeue", "train.py"])
    assert "a requeued run starts over" in caplog.text


# Arguments a shell would run, split or stop at if they were not quoted for it.
HOSTILE = ["$(touch pwned)", 'a"b', "$UNSET", "`touch pwned`", "it's", "two\nlines", "--out=$HOME/x", "*"]


@pytest.mark.parametrize("flags", [[], ["--requeue"], ["--dist-init-method", "slurm"]])
def test_every_argument_reaches_the_step_as_typed(workdir: Path, flags: list[str]) -> None:
    """The generated script runs for real under bash (set -euo pipefail), with srun and scontrol as
    shell functions that record what the script passes them."""
    request, _ = parse_submit([*flags, "train.py", *HOSTILE])
    script = request.render().replace(
        "set -euo pipefail\n",
        "set -euo pipefail\n"
        f"srun() {{ printf '%s\\0' \"$@\" > {workdir / 'argv'}; }}\n"
        "scontrol() { echo node1; }\n",
    )
    env = {"PATH": os.environ["PATH"], "HOME": str(workdir), "SLURM_JOB_ID": "7", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "node[1-2]"}  # fmt: skip
    done = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    argv = (workdir / "argv").read_text().split("\0")[:-1]
    assert argv[-len(HOSTILE) - 1 :] == ["train.py", *HOSTILE]
    assert not (workdir / "pwned").exists()
    assert argv[argv.index("--nodes") + 1] == "2"  # the allocation's own words are still expanded
    if "--rdzv-id" in argv:
        assert argv[argv.index("--rdzv-id") + 1] == "7"
        assert re.fullmatch(r"node1:\d+", argv[argv.index("--rdzv-endpoint") + 1])


def test_a_line_break_in_a_directive_is_refused(workdir: Path) -> None:
    with pytest.raises(LaunchError, match=r"--job-name 'x\\ntouch pwned' contains a line break"):
        parse_submit(["-J", "x\ntouch pwned", "train.py"])
    with pytest.raises(LaunchError, match=r"--sbatch-arg '--comment=a\\rb' contains a line break"):
        parse_submit(["--sbatch-arg=--comment=a\rb", "train.py"])
