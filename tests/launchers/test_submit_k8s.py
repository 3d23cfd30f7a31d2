"""`sail submit --target k8s`: a Kubeflow PyTorchJob, checked against the Kubeflow SDK's own models,
a golden file, and what each pod's `sail launch` makes of the variables the Training Operator sets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kubeflow.training import models
from kubeflow.training.api_client import ApiClient

from spikingsail.errors import LaunchError
from spikingsail.launchers import k8s, submitters

GOLDEN = Path(__file__).with_name("golden")
SAIL = [sys.executable, "-m", "spikingsail.cli.main"]


def sail(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SAIL, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


class _Response:  # what ApiClient.deserialize reads: an HTTP response's body
    def __init__(self, body: dict[str, Any]) -> None:
        self.data = json.dumps(body)


def test_the_manifest_is_a_pytorchjob_of_the_kubeflow_sdks_own_models() -> None:
    request, _ = k8s.parse_submit([
        "--image", "ghcr.io/me/trainer:1", "-N", "3", "--gpus-per-node", "8", "--namespace", "research",
        "--workdir", "/app", "--env", "NCCL_DEBUG=INFO", "--env-secret", "WANDB_API_KEY=wandb:api-key",
        "--max-restarts", "4", "--master-port", "29400",
        "train.py", "--epochs", "30", "--sail-config", "configs/train.json",
    ])  # fmt: skip
    manifest = json.loads(request.render())
    client = ApiClient()
    job = client.deserialize(_Response(manifest), "KubeflowOrgV1PyTorchJob")
    assert isinstance(job, models.KubeflowOrgV1PyTorchJob)
    # written back unchanged: every key is one the PyTorchJob schema has (an unknown one is dropped)
    assert client.sanitize_for_serialization(job) == manifest
    specs = job.spec.pytorch_replica_specs
    assert (specs["Master"].replicas, specs["Worker"].replicas) == (1, 2)
    master = specs["Master"].template.spec.containers[0]
    assert master.name == "pytorch"  # the container the Training Operator gives MASTER_ADDR and the others
    assert [(p.name, p.container_port) for p in master.ports] == [("pytorchjob-port", 29400)]
    assert master.resources.limits == {"nvidia.com/gpu": "8"}
    assert master.command == ["sail", "launch", "--nproc-per-node", "8", "train.py", "--epochs", "30",
                              "--sail-config", "configs/train.json"]  # fmt: skip
    assert master.working_dir == "/app" and (master.env[0].name, master.env[0].value) == (
        "NCCL_DEBUG",
        "INFO",
    )
    secret = master.env[1]  # read from the Secret by the pod, never written into the manifest
    assert (secret.name, secret.value) == ("WANDB_API_KEY", None)
    assert (secret.value_from.secret_key_ref.name, secret.value_from.secret_key_ref.key) == (
        "wandb",
        "api-key",
    )
    assert job.spec.run_policy.backoff_limit == 4 and job.metadata.namespace == "research"
    volumes = specs["Worker"].template.spec.volumes
    assert [(v.name, v.empty_dir.medium) for v in volumes] == [("dshm", "Memory")]


def test_dry_run_prints_the_golden_manifest(tmp_path: Path) -> None:
    (tmp_path / "train_digits.py").touch()
    result = sail("submit", "--target", "k8s", "--image", "ghcr.io/me/trainer:1", "-N", "2", "--gpus-per-node",
                  "4", "--dry-run", "train_digits.py", "--epochs", "3", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == (GOLDEN / "train-digits.pytorchjob.json").read_text()
    assert not list(tmp_path.glob("*.json")), "--dry-run writes nothing"


def test_each_pod_starts_its_node_of_the_job_from_the_operators_variables(tmp_path: Path) -> None:
    request, _ = k8s.parse_submit(["--image", "i", "-N", "2", "--nproc-per-node", "2", "train.py"])
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    command = request.manifest()["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    # what the Training Operator sets in the first Worker's container (pkg/controller.v1/pytorch/envvar.go)
    operator = {"MASTER_ADDR": "train-master-0", "MASTER_PORT": "23456", "RANK": "1", "WORLD_SIZE": "2",
                "PYTHONUNBUFFERED": "0"}  # fmt: skip
    argv = command["command"]
    assert argv[:2] == ["sail", "launch"]
    result = sail("launch", *argv[2:4], "--dry-run", *argv[4:], cwd=tmp_path, env={**os.environ, **operator})
    assert result.returncode == 0, result.stderr
    assert "--nnodes 2 --node-rank 1 --master-addr train-master-0 --master-port 23456" in result.stdout
    assert "--nproc-per-node 2" in result.stdout and "must not run" not in result.stderr


def test_the_target_is_read_among_sails_options_only() -> None:
    assert submitters.target_of(["-N", "2", "train.py", "--target", "k8s"]).module.endswith("sbatch")
    assert submitters.target_of(["-J", "--target", "train.py"]).module.endswith("sbatch")  # -J's value
    assert submitters.target_of(["-N", "2", "--target=k8s", "--image", "i", "train.py"]).module.endswith(
        "k8s"
    )
    with pytest.raises(LaunchError, match=r"--target 'nomad' is not a target"):
        submitters.target_of(["--target", "nomad", "train.py"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--image", "i", "-J", "Train_Job", "t.py"], r"--job-name 'Train_Job' is not a Kubernetes name"),
        (["--image", "i", "-N", "0", "t.py"], r"--nodes"),
        (["--image", "i", "--env", "NOEQUALS", "t.py"], r"--env 'NOEQUALS' is not NAME=VALUE"),
        (["--image", "i", "--master-port", "70000", "t.py"], r"--master-port"),
        (
            ["--image", "i", "--env-secret", "K=nokey", "t.py"],
            r"--env-secret 'K=nokey' does not name a Secret",
        ),
        (["--image", "i b", "t.py"], r"--image 'i b' is not an image reference"),
        (["--image", "i", "--namespace", "Research", "t.py"], r"--namespace 'Research' is not a Kubernetes"),
    ],
)
def test_bad_flags_are_refused_naming_them(argv: list[str], message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        k8s.parse_submit(argv)


def test_without_kubectl_the_manifest_is_kept_and_the_error_says_how_to_create_it(tmp_path: Path) -> None:
    (tmp_path / "train.py").touch()
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # sail's own bin directory: no kubectl
    result = sail("submit", "--target", "k8s", "--image", "i", "train.py", cwd=tmp_path, env=env)
    assert result.returncode != 0
    assert "kubectl is not installed here" in result.stderr
    assert "kubectl create -f train.pytorchjob.json" in result.stderr
    assert json.loads((tmp_path / "train.pytorchjob.json").read_text())["kind"] == "PyTorchJob"
    assert "Traceback" not in result.stderr


def test_a_secret_given_with_env_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    request, _ = k8s.parse_submit(
        ["--image", "i", "--env", "HF_TOKEN=hf_abc", "--env", "NCCL_DEBUG=INFO", "t.py"]
    )
    assert request.env == {"HF_TOKEN": "hf_abc", "NCCL_DEBUG": "INFO"}  # the user's choice stands
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [
        "--env HF_TOKEN writes its value into the manifest (and sail's command line); a secret belongs in a "
        "Kubernetes Secret: --env-secret HF_TOKEN=SECRET:KEY"
    ]
