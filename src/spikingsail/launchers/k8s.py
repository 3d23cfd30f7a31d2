"""``sail submit --target k8s``: a Kubeflow PyTorchJob that runs the training script on Kubernetes.

The Training Operator starts one pod per node (a Master and NODES - 1 Workers) and gives each
MASTER_ADDR (the Master's service), MASTER_PORT (the container port named ``pytorchjob-port``),
RANK (the pod's index, the Master's 0) and WORLD_SIZE (the pod count). Each pod runs
``sail launch --nproc-per-node G SCRIPT ARGS``, which reads those four as platform mode does: node
RANK of WORLD_SIZE, G processes under torchrun's agent. The image must hold SpikingSail and the
script (its path as the image sees it, from ``--workdir``); /dev/shm is a memory volume, as the
data loader's workers and NCCL need more than a container's default 64 MB.

The manifest is written as JSON, which ``kubectl`` reads as it reads YAML; ``sail submit`` hands it
to ``kubectl create``, or prints it with ``--dry-run``.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spikingsail.errors import LaunchError
from spikingsail.launchers.hostfile import MAX_SLOTS
from spikingsail.launchers.remote_env import looks_secret
from spikingsail.launchers.spec import check_counts, check_port

DEFAULT_PORT = 23456
"""The Training Operator's default MASTER_PORT."""
MAX_NODES = 100_000
# a Kubernetes object name: a DNS-1123 subdomain (the operator adds "-master-0" to name the pods)
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_NAME_MAX = 50
_LABEL_MAX = 63
log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True, frozen=True)
class PyTorchJobRequest:
    script: str
    script_args: list[str]
    job_name: str
    image: str
    nodes: int
    nproc_per_node: int
    gpus_per_node: int | None = None
    namespace: str | None = None
    workdir: str | None = None
    master_port: int = DEFAULT_PORT
    max_restarts: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    secret_env: dict[str, tuple[str, str]] = field(default_factory=dict)
    """NAME → (Secret, key): variables read from a Kubernetes Secret, never written into the manifest."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    def command(self) -> list[str]:
        """What each pod runs: sail launch as node RANK of WORLD_SIZE (platform mode)."""
        return [
            "sail",
            "launch",
            "--nproc-per-node",
            str(self.nproc_per_node),
            self.script,
            *self.script_args,
        ]

    def replica(self, count: int, port: bool) -> dict[str, Any]:
        container: dict[str, Any] = {"name": "pytorch", "image": self.image, "command": self.command()}
        if self.workdir is not None:
            container["workingDir"] = self.workdir
        env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in self.env.items()]
        env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
                for k, (secret, key) in self.secret_env.items()]  # fmt: skip
        if env:
            container["env"] = env
        if port:
            container["ports"] = [{"name": "pytorchjob-port", "containerPort": self.master_port}]
        if self.gpus_per_node:
            container["resources"] = {"limits": {"nvidia.com/gpu": str(self.gpus_per_node)}}
        # the pod's own shared memory, not a temporary file
        container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]  # noqa: S108
        pod = {"containers": [container], "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]}
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": pod}}

    def manifest(self) -> dict[str, Any]:
        replicas = {"Master": self.replica(1, port=True)}
        if self.nodes > 1:
            replicas["Worker"] = self.replica(self.nodes - 1, port=False)
        metadata = {"name": self.job_name} | ({"namespace": self.namespace} if self.namespace else {})
        # runPolicy is required by the PyTorchJob schema; "None" keeps finished pods for their logs
        policy: dict[str, Any] = {"cleanPodPolicy": "None"}
        if self.max_restarts is not None:
            policy["backoffLimit"] = self.max_restarts
        spec: dict[str, Any] = {"pytorchReplicaSpecs": replicas, "runPolicy": policy}
        return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": metadata, "spec": spec}

    def render(self) -> str:
        return json.dumps(self.manifest(), indent=2) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sail submit --target k8s",
        description="Write a Kubeflow PyTorchJob that runs a training script on Kubernetes, one pod per "
        "node, and create it with kubectl.",
        allow_abbrev=False,
    )
    p.add_argument("--target", choices=["k8s"], default="k8s", help="where the job runs: k8s here")
    p.add_argument("--image", required=True, help="the container image (with SpikingSail and the script)")
    p.add_argument(
        "-N", "--nodes", type=int, default=1, help="pods, one per node (a Master and NODES-1 Workers)"
    )
    p.add_argument("--gpus-per-node", type=int, help="GPUs each pod asks for (nvidia.com/gpu)")
    p.add_argument("--nproc-per-node", type=int, help="processes per pod (default: the GPUs per node, or 1)")
    p.add_argument("-J", "--job-name", help="the PyTorchJob's name (default: the script's name, as Kubernetes "
                   "spells names)")  # fmt: skip
    p.add_argument("--namespace", help="the job's namespace (default: kubectl's current one)")
    p.add_argument("--workdir", help="the container's working directory (default: the image's)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable of every pod (repeatable); not for secrets, which it "
                   "would write into the manifest")  # fmt: skip
    p.add_argument("--env-secret", action="append", default=[], metavar="NAME=SECRET:KEY",
                   help="an environment variable of every pod read from key KEY of the Kubernetes Secret "
                   "SECRET (repeatable), e.g. WANDB_API_KEY=wandb:api-key")  # fmt: skip
    p.add_argument(
        "--master-port", type=int, default=DEFAULT_PORT, help=f"the rendezvous port (default {DEFAULT_PORT})"
    )
    p.add_argument(
        "--max-restarts", type=int, help="pod restarts before the job fails (runPolicy.backoffLimit)"
    )
    p.add_argument("--manifest-path", dest="script_path",
                   help="where to write the manifest (default: JOB_NAME.pytorchjob.json)")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="print the manifest, create nothing")
    p.add_argument("script", help="the training script, as the image sees it")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the training script's own arguments")
    return p


def parse_submit(argv: list[str]) -> tuple[PyTorchJobRequest, argparse.Namespace]:
    ns = parser().parse_args(argv)
    check_counts(
        {
            "--nodes": (ns.nodes, 1, MAX_NODES),
            "--gpus-per-node": (ns.gpus_per_node, 0, MAX_SLOTS),
            "--nproc-per-node": (ns.nproc_per_node, 1, MAX_SLOTS),
            "--max-restarts": (ns.max_restarts, 0, 1_000_000),
        }
    )
    check_port("--master-port", ns.master_port, f"give a port the pods may listen on, e.g. {DEFAULT_PORT}")
    env = dict(_variable("--env", item, "NAME=VALUE") for item in ns.env)
    secret_env = {}
    for item in ns.env_secret:
        name, reference = _variable("--env-secret", item, "NAME=SECRET:KEY")
        secret, colon, key = reference.partition(":")
        if not colon or not _NAME.fullmatch(secret) or not re.fullmatch(r"[-._a-zA-Z0-9]+", key):
            raise LaunchError(f"--env-secret {item!r} does not name a Secret and a key",
                              "the pods read the variable from key KEY of the Kubernetes Secret SECRET",
                              "give it as --env-secret NAME=SECRET:KEY, e.g. WANDB_API_KEY=wandb:api-key")  # fmt: skip
        secret_env[name] = (secret, key)
    for name in env:
        if looks_secret(name):
            log.warning("--env %s writes its value into the manifest (and sail's command line); a secret belongs "
                        "in a Kubernetes Secret: --env-secret %s=SECRET:KEY", name, name)  # fmt: skip
    if not ns.image or any(c.isspace() for c in ns.image):
        raise LaunchError(f"--image {ns.image!r} is not an image reference", "each pod pulls it by that name",
                          "give the image as docker would, e.g. ghcr.io/me/trainer:1")  # fmt: skip
    if ns.namespace is not None and (len(ns.namespace) > _LABEL_MAX or not _NAME.fullmatch(ns.namespace)):
        raise LaunchError(
            f"--namespace {ns.namespace!r} is not a Kubernetes namespace",
            f"a namespace is lower-case letters, digits and '-', starting and ending with a letter or digit, "
            f"at most {_LABEL_MAX} characters",
            "give an existing namespace (kubectl get namespaces), or leave it out for kubectl's current one",
        )
    name = ns.job_name or _kubernetes_name(Path(ns.script).stem)
    if len(name) > _NAME_MAX or not _NAME.fullmatch(name):
        raise LaunchError(
            f"--job-name {name!r} is not a Kubernetes name",
            f"Kubernetes names the job and its pods from it: lower-case letters, digits and '-', starting and "
            f"ending with a letter or digit, at most {_NAME_MAX} characters here (the pods add a suffix)",
            "give --job-name, e.g. train-digits",
        )
    request = PyTorchJobRequest(
        script=ns.script,
        script_args=list(ns.script_args),
        job_name=name,
        image=ns.image,
        nodes=ns.nodes,
        nproc_per_node=ns.nproc_per_node or ns.gpus_per_node or 1,
        gpus_per_node=ns.gpus_per_node,
        namespace=ns.namespace,
        workdir=ns.workdir,
        master_port=ns.master_port,
        max_restarts=ns.max_restarts,
        env=env,
        secret_env=secret_env,
    )
    return request, ns


def _variable(flag: str, item: str, form: str) -> tuple[str, str]:
    name, equals, value = item.partition("=")
    if not equals or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", name):
        raise LaunchError(f"{flag} {item!r} is not {form}", f"each {flag} sets one variable of every pod",
                          f"give it as {flag} {form}")  # fmt: skip
    return name, value


def _kubernetes_name(stem: str) -> str:
    """``train_digits`` → ``train-digits``: a script's name as Kubernetes spells names."""
    return re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")[:_NAME_MAX].strip("-") or "train"


def submit(path: Path) -> str:
    """``kubectl create -f PATH``: the created job's name."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise LaunchError(
            "kubectl is not installed here",
            f"sail submit --target k8s hands the manifest it wrote ({path}) to kubectl create",
            f"install kubectl and point it at the cluster, or create the job yourself: kubectl create -f {path}",
        )
    result = subprocess.run([kubectl, "create", "-f", str(path), "-o", "name"], capture_output=True, text=True,
                            check=False)  # fmt: skip
    if result.returncode != 0:
        raise LaunchError(
            f"kubectl rejected {path}",
            result.stderr.strip() or f"kubectl exited {result.returncode}",
            "check that the cluster runs Kubeflow's Training Operator (the PyTorchJob kind), or read the "
            "manifest with --dry-run",
        )
    return result.stdout.strip()


def submitted(request: PyTorchJobRequest, job_id: str, path: Path) -> str:
    where = f" -n {request.namespace}" if request.namespace else ""
    return f"created {job_id} ({path}); follow it with: kubectl logs{where} -f {request.job_name}-master-0"
