"""How facts are judged on machines this one cannot be: GPUs, drivers, mixed nodes, other launch paths.

The facts start as what the real probe reports here and are changed only where a GPU machine's
would differ, so the judging code reads the probe's real schema.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest

from spikingsail.diagnostics.collect import ProbeResult, run_here
from spikingsail.diagnostics.findings import Report, Status, ok, warn
from spikingsail.diagnostics.machine import machine_findings
from spikingsail.diagnostics.nodes import node_report
from spikingsail.launchers.preflight import diagnose
from spikingsail.launchers.request import parse_request

A100 = {"index": 0, "name": "NVIDIA A100-SXM4-40GB", "memory": 40 << 30, "capability": "8.0", "bf16": True,
        "tflops": 250.0}  # fmt: skip
V100 = {"index": 0, "name": "Tesla V100S-PCIE-32GB", "memory": 32 << 30, "capability": "7.0", "bf16": False,
        "tflops": 100.0}  # fmt: skip


@pytest.fixture(scope="module")
def cpu_facts() -> dict[str, Any]:
    result = run_here([], timeout=120)
    assert result.facts is not None, result.why
    return result.facts


def gpu_machine(
    facts: dict[str, Any], gpus: list[dict[str, Any]], driver_cuda: str = "12.2"
) -> dict[str, Any]:
    out = copy.deepcopy(facts)
    out["torch"].update(cuda="12.1", cudnn=90100, nccl="2.21.5", gpus=gpus, cuda_available=bool(gpus))
    out["driver"].update(version="535.104.05", cuda=driver_cuda, gpus=len(gpus) or 2)
    return out


def judge(facts: dict[str, Any], check: str) -> list[tuple[Status, str, str]]:
    return [(f.status, f.detail, f.fix) for f in machine_findings(facts, Report()) if f.check == check]


def test_gpus_are_listed_with_memory_capability_and_bf16(cpu_facts: dict[str, Any]) -> None:
    ((status, detail, _),) = judge(gpu_machine(cpu_facts, [A100]), "gpus")
    assert status is Status.OK
    assert detail == "driver 535.104.05 (CUDA 12.2); 0: NVIDIA A100-SXM4-40GB, 40 GiB, compute 8.0, bf16 yes"


def test_a_driver_older_than_torchs_cuda(cpu_facts: dict[str, Any]) -> None:
    ((status, detail, fix),) = judge(gpu_machine(cpu_facts, [], driver_cuda="11.4"), "gpus")
    assert status is Status.FAIL
    assert detail == "the driver supports CUDA up to 11.4, torch needs 12.1"
    assert "install a torch built for CUDA ≤ 11.4" in fix


def test_a_container_without_the_gpu_runtime(cpu_facts: dict[str, Any]) -> None:
    facts = gpu_machine(cpu_facts, [])
    facts["driver"].update(version=None, cuda=None, gpus=None, pci_gpus=8)  # the host's GPUs on the bus
    ((status, detail, fix),) = judge(facts, "gpus")
    assert status is Status.FAIL and detail.endswith(
        "no NVIDIA driver is visible (8 NVIDIA GPU(s) on the PCI bus)"
    )
    assert "--gpus all" in fix
    facts["driver"]["pci_gpus"] = None  # no sysfs to read: cannot tell, so the same failure
    ((status, detail, _),) = judge(facts, "gpus")
    assert status is Status.FAIL and detail.endswith("no NVIDIA driver is visible")


def test_a_cuda_torch_on_a_machine_without_gpus_trains_on_the_cpu(cpu_facts: dict[str, Any]) -> None:
    """torch's CUDA build (what the pins install) on a CPU machine: no GPU on the PCI bus, no driver."""
    facts = gpu_machine(cpu_facts, [])
    facts["driver"].update(version=None, cuda=None, gpus=None, pci_gpus=0)
    ((status, detail, _),) = judge(facts, "gpus")
    assert (status, detail) == (
        Status.OK,
        "no GPU on this machine: torch (a CUDA 12.1 build) trains on the CPU with gloo",
    )


def test_the_pci_bus_is_read_from_sysfs(tmp_path: Any) -> None:
    from spikingsail.diagnostics.probe import pci_gpus

    for name, vendor, kind in (("0000:01:00.0", "0x10de", "0x030200"), ("0000:02:00.0", "0x10de", "0x040300"),
                               ("0000:03:00.0", "0x1af4", "0x030000"), ("0000:04:00.0", "0x10de", "0x030000")):  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / "vendor").write_text(vendor + "\n")
        (tmp_path / name / "class").write_text(kind + "\n")
    assert pci_gpus(str(tmp_path)) == 2  # an A100 (3D controller) and a VGA card; not NVIDIA's audio
    assert pci_gpus(str(tmp_path / "missing")) is None


def test_a_cpu_torch_on_a_gpu_machine(cpu_facts: dict[str, Any]) -> None:
    facts = copy.deepcopy(cpu_facts)
    facts["torch"].update(cuda=None, nccl=None, version="2.14.1+cpu")
    facts["driver"].update(version="535.104.05", cuda="12.2", gpus=8)
    ((status, detail, fix),) = judge(facts, "gpus")
    assert status is Status.FAIL and "is a CPU build, but this machine has NVIDIA GPUs" in detail
    assert "download.pytorch.org/whl/cu" in fix


def test_an_empty_cuda_visible_devices_hides_every_gpu(cpu_facts: dict[str, Any]) -> None:
    facts = gpu_machine(cpu_facts, [])
    facts["env"]["CUDA_VISIBLE_DEVICES"] = ""
    ((status, detail, _),) = judge(facts, "CUDA_VISIBLE_DEVICES")
    assert (status, detail) == (Status.FAIL, "is empty: it hides every GPU")


def test_locked_memory_matters_on_gpu_machines(cpu_facts: dict[str, Any]) -> None:
    facts = gpu_machine(cpu_facts, [A100])
    facts["limits"]["memlock"] = [64 << 10, 64 << 10]
    ((status, detail, fix),) = judge(facts, "locked memory")
    assert status is Status.WARN and detail.startswith("ulimit -l is 64.0 KiB")
    assert fix.startswith("ulimit -l unlimited")


def deepspeed_on_gpus(facts: dict[str, Any], nvcc: dict[str, Any]) -> dict[str, Any]:
    """``facts`` on a GPU machine whose DeepSpeed sees the CUDA accelerator and ``nvcc``."""
    assert facts["deepspeed"] and facts["deepspeed"]["error"] is None, "DeepSpeed must import here"
    out = gpu_machine(facts, [A100])
    out["deepspeed"].update(accelerator="cuda", nvcc=nvcc)
    for op in out["deepspeed"]["ops"]:
        op["installed"] = False
    return out


NO_NVCC = {"home": None, "version": None, "error": "CUDA_HOME does not exist, unable to compile CUDA op(s)"}
NVCC = {"home": "/usr/local/cuda", "version": "12.1", "error": None}


def test_no_deepspeed_cuda_finding_without_a_gpu(cpu_facts: dict[str, Any]) -> None:
    assert judge(cpu_facts, "deepspeed cuda ops") == []


def test_fused_adam_that_cannot_be_compiled_is_a_warning_with_the_ways_out(cpu_facts: dict[str, Any]) -> None:
    ((status, detail, fix),) = judge(deepspeed_on_gpus(cpu_facts, NO_NVCC), "deepspeed cuda ops")
    assert status is Status.WARN
    assert detail.startswith(
        "FusedAdam is not prebuilt and cannot be compiled here (CUDA_HOME does not exist"
    )
    assert "Adam or AdamW optimizer stops at its first step" in detail
    assert fix.startswith("install the CUDA toolkit 12.1 (nvcc; set CUDA_HOME) on this node")
    assert "SAIL_DEEPSPEED_CUDA_OPS=1 bash scripts/setup.sh --backends" in fix
    assert '"torch_adam": true' in fix


def test_an_nvcc_of_another_cuda_is_named(cpu_facts: dict[str, Any]) -> None:
    mismatch = {**NVCC, "version": "11.8", "error": "DeepSpeed Op Builder: Installed CUDA version 11.8 does "
                "not match the version torch was compiled with 12.1"}  # fmt: skip
    ((status, detail, _),) = judge(deepspeed_on_gpus(cpu_facts, mismatch), "deepspeed cuda ops")
    assert status is Status.WARN and "Installed CUDA version 11.8 does not match" in detail


def test_an_arch_list_deepspeed_cannot_read_fails_even_with_fused_adam_compiled(
    cpu_facts: dict[str, Any],
) -> None:
    facts = deepspeed_on_gpus(cpu_facts, NVCC)
    facts["env"]["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0a"
    facts["extensions"]["entries"] = [{"path": "/cache/fused_adam", "name": "fused_adam", "tag": None,
                                       "torch_include": None, "cuda": True, "built": None, "load_errors": {},
                                       "libraries": ["/cache/fused_adam/fused_adam.so"]}]  # fmt: skip
    ((status, detail, fix),) = judge(facts, "deepspeed cuda ops")
    assert status is Status.FAIL
    assert "DeepSpeed can neither compile nor load it with TORCH_CUDA_ARCH_LIST='8.0;9.0a'" in detail
    assert fix == 'start jobs with TORCH_CUDA_ARCH_LIST="8.0;9.0"'

    next(op for op in facts["deepspeed"]["ops"] if op["name"] == "fused_adam")["installed"] = True
    assert judge(facts, "deepspeed cuda ops")[0][0] is Status.OK  # prebuilt: nothing is built or read


def test_fused_adam_compiled_at_first_use_prebuilt_or_cached(cpu_facts: dict[str, Any]) -> None:
    facts = deepspeed_on_gpus(cpu_facts, NVCC)
    ((status, detail, _),) = judge(facts, "deepspeed cuda ops")
    assert status is Status.OK and detail.startswith("FusedAdam is compiled at the first deepspeed job")
    assert "nvcc 12.1 in /usr/local/cuda" in detail

    prebuilt = deepspeed_on_gpus(cpu_facts, NO_NVCC)
    next(op for op in prebuilt["deepspeed"]["ops"] if op["name"] == "fused_adam")["installed"] = True
    assert judge(prebuilt, "deepspeed cuda ops") == [(Status.OK, "FusedAdam is prebuilt into DeepSpeed", "")]

    cached = deepspeed_on_gpus(cpu_facts, NO_NVCC)
    build = {
        "path": "/cache/fused_adam",
        "name": "fused_adam",
        "tag": None,
        "torch_include": None,
        "cuda": True,
        "libraries": ["/cache/fused_adam/fused_adam.so"],
        "built": None,
        "load_errors": {},
    }
    cached["extensions"]["entries"] = [{**build, "cuda": False}]  # DeepSpeed's CPU op of the same name
    assert judge(cached, "deepspeed cuda ops")[0][0] is Status.WARN
    cached["extensions"]["entries"] = [build]
    assert judge(cached, "deepspeed cuda ops") == [
        (Status.OK, "FusedAdam is compiled in /cache/fused_adam", "")
    ]


def test_mixed_a100_and_v100_nodes_are_told_to_use_fp16(cpu_facts: dict[str, Any]) -> None:
    request = parse_request(["-H", "node1:1,node2:1", "-m", "spikingsail.diagnostics.allreduce"])
    node1 = gpu_machine(cpu_facts, [A100])
    node2 = gpu_machine(cpu_facts, [V100])
    results = [
        ProbeResult(host=h, facts=f, received=f["time"]) for h, f in (("node1", node1), ("node2", node2))
    ]
    report = Report()
    node_report(request, cpu_facts, results, report)
    (precision,) = [f for f in report.findings if f.check == "precision"]
    assert precision.status is Status.WARN
    assert precision.detail == "bf16 is not supported on node2: Tesla V100S-PCIE-32GB (compute 7.0)"
    assert '"fp16"' in precision.fix
    slots = {f.host: f.status for f in report.findings if f.check == "slots"}
    assert slots == {"node1": Status.OK, "node2": Status.OK}
    clocks = [f for f in report.findings if f.check == "clock"]
    assert all(f.status is Status.OK for f in clocks)


def seed_004_cluster(cpu_facts: dict[str, Any], node1_gpus: list[dict[str, Any]]) -> Report:
    """Seed 004's nodes: node1 with the given GPUs, node2 with two V100S; two processes each."""
    request = parse_request(["-H", "node1:2,node2:2", "-m", "spikingsail.diagnostics.allreduce"])
    node1 = {**gpu_machine(cpu_facts, node1_gpus), "host": "node1"}
    node2 = {**gpu_machine(cpu_facts, [V100, {**V100, "index": 1}]), "host": "node2"}
    results = [ProbeResult(host=f["host"], facts=f, received=f["time"]) for f in (node1, node2)]
    report = Report()
    node_report(request, cpu_facts, results, report)
    return report


def balance(report: Report) -> tuple[Status, str, str]:
    (found,) = [f for f in report.findings if f.check == "balance"]
    return found.status, found.detail, found.fix


def test_a100_and_v100s_nodes_get_balance_weights_by_host(cpu_facts: dict[str, Any]) -> None:
    status, detail, fix = balance(seed_004_cluster(cpu_facts, [A100, {**A100, "index": 1}]))
    assert status is Status.WARN
    assert detail.startswith("ranks of unequal speed (node1 250/250, node2 100/100 TFLOP/s (fp16 matmul))")
    assert fix.startswith('set "sail": {"balance": {"node1": 2.5, "node2": 1.0}} in the config')
    assert '"auto"' in fix


def test_unequal_gpus_inside_a_node_get_one_weight_per_rank(cpu_facts: dict[str, Any]) -> None:
    status, _, fix = balance(seed_004_cluster(cpu_facts, [A100, {**V100, "index": 1}]))
    assert status is Status.WARN
    assert fix.startswith('set "sail": {"balance": [2.5, 1.0, 1.0, 1.0]}')


def test_equal_or_unmeasured_gpus_get_no_weights(cpu_facts: dict[str, Any]) -> None:
    equal = seed_004_cluster(cpu_facts, [{**V100, "tflops": 105.0}, {**V100, "index": 1}])
    assert balance(equal)[:2] == (
        Status.OK,
        "the ranks are about equally fast (node1 105/100, node2 100/100 TFLOP/s (fp16 matmul)): "
        "balance is not needed",
    )
    busy = seed_004_cluster(cpu_facts, [{**A100, "tflops": None}, {**A100, "index": 1}])
    assert balance(busy)[:2] == (
        Status.OK,
        "no weights suggested: a GPU's speed on node1 could not be measured",
    )


def test_fewer_gpus_than_slots_fails(cpu_facts: dict[str, Any]) -> None:
    request = parse_request(["-H", "node1:4", "-m", "spikingsail.diagnostics.allreduce"])
    node1 = gpu_machine(cpu_facts, [A100, {**A100, "index": 1}])
    report = Report()
    node_report(request, cpu_facts, [ProbeResult(host="node1", facts=node1, received=node1["time"])], report)
    (slots,) = [f for f in report.findings if f.check == "slots"]
    assert (slots.status, slots.detail) == (Status.FAIL, "4 process(es) but 2 GPU(s) visible")
    assert slots.fix == "give node1 slots=2 in the hostfile (or --num_gpus 2)"


def test_an_included_slot_the_node_does_not_have_fails(cpu_facts: dict[str, Any]) -> None:
    # the hostfile says 8 slots; the node has 4 GPUs
    request = parse_request(
        ["-H", "node1:8", "--include", "node1:1,5", "-m", "spikingsail.diagnostics.allreduce"]
    )
    node1 = gpu_machine(cpu_facts, [A100, *({**A100, "index": i} for i in (1, 2, 3))])
    report = Report()
    node_report(request, cpu_facts, [ProbeResult(host="node1", facts=node1, received=node1["time"])], report)
    (slots,) = [f for f in report.findings if f.check == "slots"]
    assert slots.status is Status.FAIL and slots.detail.startswith(
        "slot(s) 5 chosen, but the node has GPUs 0-3 only"
    )
    assert slots.fix == "choose slots from 0 to 3 for node1 (--include node1:0,1)"


def test_a_clock_far_off_is_a_warning(cpu_facts: dict[str, Any]) -> None:
    request = parse_request(["-H", "node1:1", "-m", "spikingsail.diagnostics.allreduce"])
    report = Report()
    late = ProbeResult(host="node1", facts=cpu_facts, received=cpu_facts["time"] - 30)
    node_report(request, cpu_facts, [late], report)
    (clock,) = [f for f in report.findings if f.check == "clock"]
    assert clock.status is Status.WARN and clock.detail.startswith("+30.0 s from this machine's clock")


@pytest.mark.parametrize(
    ("stderr", "why", "fix"),
    [
        ("root@node2: Permission denied (publickey).", "the host refused the key", "ssh-copy-id node2; then on node2: chmod 700"),
        ("root@node2: Permission denied (publickey,password).", "the host asks for a password", "ssh-copy-id node2"),
        ("u@node2: Permission denied (publickey,gssapi-keyex,gssapi-with-mic).", "the host refused the key", "chmod 700"),
        ("root@node2: Permission denied (publickey,keyboard-interactive).", "the host asks for a password", "ssh-copy-id node2"),
        ("Host key verification failed.", "the host's key is unknown or changed", "--ssh-config FILE"),
        ("ssh: Could not resolve hostname node2: Name or service not known", "the name does not resolve", "/etc/hosts"),
        ("ssh: connect to host node2 port 222: Connection refused", "no ssh server listens", "--ssh-port"),
    ],
)  # fmt: skip
def test_ssh_failures_are_explained(stderr: str, why: str, fix: str) -> None:
    got_why, got_fix = diagnose("node2", stderr, 255)
    assert got_why.startswith(why) and stderr in got_why
    assert fix in got_fix


def test_a_passing_report_renders_as_a_table_with_a_green_summary_and_plain_without_colour() -> None:
    report = Report(tables={"DeepSpeed ops": [["op", "compiled"], ["fused_adam", "yes"]]})
    report.findings += [ok("ssh", "logs in without a password", "node2"),
                        warn("slots", "2 process(es) but 1 usable CPU core(s)", "give node2 slots=1", "node2")]  # fmt: skip
    painted, plain = io.StringIO(), io.StringIO()
    report.render(painted, color=True)
    report.render(plain, color=False)
    lines = painted.getvalue().splitlines()
    assert lines[0] == "\033[32;1mOK  \033[0m  ssh    node2  logs in without a password"
    assert lines[1].startswith("\033[33;1mWARN\033[0m  slots  node2  2 process(es)")
    assert lines[2].endswith("\033[2mfix: \033[0mgive node2 slots=1")
    assert "\033[1mDeepSpeed ops\033[0m" in lines and "fused_adam  yes" in lines
    assert lines[-1] == "\033[32m1 ok, 1 warning(s), 0 failure(s)\033[0m"
    assert (
        "\033" not in plain.getvalue()
        and plain.getvalue().splitlines()[-1] == "1 ok, 1 warning(s), 0 failure(s)"
    )
