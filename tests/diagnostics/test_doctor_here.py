"""`sail doctor` on this machine: the real probe, real broken set-ups, a real 2-process all-reduce."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from spikingsail.diagnostics.collect import run_here
from spikingsail.diagnostics.findings import Report, Status
from spikingsail.diagnostics.machine import machine_findings

DOCTOR = [sys.executable, "-m", "spikingsail.cli.main", "doctor"]


def sail_doctor(
    *flags: str, env: dict[str, str] | None = None, shell: str = ""
) -> tuple[int, dict[str, Any]]:
    argv = [*DOCTOR, "--json", *flags]
    if shell:  # e.g. a ulimit applied to the doctor and everything it starts
        argv = ["bash", "-c", f'{shell} && exec "$@"', "bash", *argv]
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.stdout.strip(), result.stderr[-3000:]
    return result.returncode, json.loads(result.stdout)


def by_check(report: dict[str, Any], check: str) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["check"] == check]


def judged() -> list[Any]:
    """The probe run for real in a child (with the environment the test set), its facts judged."""
    result = run_here([], timeout=120)
    assert result.facts is not None, result.why
    return machine_findings(result.facts, Report())


@pytest.mark.multiprocess
@pytest.mark.horovod  # the report's Horovod row names its controllers
def test_a_healthy_machine_passes_with_a_real_all_reduce() -> None:
    code, report = sail_doctor()
    assert code == 0, [f for f in report["findings"] if f["status"] != "ok"]
    facts = report["facts"]["this machine"]
    assert facts["python"]["executable"] == sys.executable
    assert facts["torch"]["version"] == torch.__version__
    (allreduce,) = by_check(report, "all-reduce")
    assert allreduce["status"] == "ok" and allreduce["detail"].startswith("2 processes on ")
    assert "gloo group through local" in allreduce["detail"]
    # DeepSpeed's own op list, read in a child: importing DeepSpeed here would change this process's environment
    listing = "from deepspeed.ops.op_builder.all_ops import ALL_OPS; print(','.join(ALL_OPS))"
    all_ops = subprocess.run([sys.executable, "-c", listing], capture_output=True, text=True, check=True)
    (ops,) = [rows for title, rows in report["tables"].items() if title.startswith("DeepSpeed ops")]
    assert ops[0] == ["op name", "installed", "compatible"]
    assert [row[0] for row in ops[1:]] == all_ops.stdout.strip().splitlines()[-1].split(",")
    for check in (
        "torch",
        "deepspeed",
        "horovod",
        "mpi4py",
        "spikingjelly",
        "/dev/shm",
        "open files",
        "network",
    ):
        assert by_check(report, check)[0]["status"] == "ok", check
    assert "controllers mpi, gloo" in by_check(report, "horovod")[0]["detail"]


@pytest.mark.multiprocess
def test_a_torch_that_does_not_import_is_a_finding_not_a_crash(tmp_path: Path) -> None:
    # Another libc10.so loaded ahead of torch's own: torch fails with "undefined symbol", as with seed
    # 004's libcublas. (torch 2.14's wheels find their libraries by RPATH, ahead of LD_LIBRARY_PATH,
    # so the library is preloaded here.) The doctor itself must not need torch to say so.
    (tmp_path / "other.c").write_text("int other_build(void) { return 0; }\n")
    library = tmp_path / "libc10.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libc10.so", "-o", str(library), str(tmp_path / "other.c")],
                   check=True)  # fmt: skip
    code, report = sail_doctor(env={**os.environ, "LD_PRELOAD": str(library)})
    assert code == 1
    (broken,) = by_check(report, "torch")
    assert broken["status"] == "fail"
    assert "undefined symbol" in broken["detail"] and f"LD_PRELOAD={library}" in broken["detail"]
    assert broken["fix"].startswith("unset LD_PRELOAD")
    assert by_check(report, "all-reduce")[0]["detail"].startswith("not tried")


@pytest.mark.multiprocess
def test_a_low_open_files_limit() -> None:
    code, report = sail_doctor(shell="ulimit -n 512")
    (limit,) = by_check(report, "open files")
    assert limit["status"] == "warn" and limit["detail"].startswith("ulimit -n is 512")
    assert "ulimit -n" in limit["fix"]
    assert code == 0


def test_an_extension_cache_built_for_another_python_and_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Seed 000's container (Python 3.6, CUDA 10.1) left its ops in the shared cache.
    old = tmp_path / "torch_extensions" / "py36_cu101" / "fused_adam"
    old.mkdir(parents=True)
    (old / "fused_adam.so").write_bytes(b"\x7fELF")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    found = [f for f in judged() if f.check == "torch extensions"]
    assert [(f.status, f.fix) for f in found] == [(Status.WARN, f"rm -rf {old} (rebuilt on next use)")]
    this = f"py{sys.version_info[0]}{sys.version_info[1]}_" + (
        f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    )
    assert f"built for py36_cu101, not for this Python and torch ({this})" in found[0].detail


def test_an_extension_built_before_this_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = tmp_path / "cpu_adam"
    built.mkdir()
    (built / "build.ninja").write_text(f"cflags = -isystem {Path(torch.__file__).parent / 'include'} -fPIC\n")
    (built / "lib.c").write_text("int cpu_adam(void) { return 0; }\n")
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(built / "cpu_adam.so"), str(built / "lib.c")], check=True
    )
    os.utime(built / "cpu_adam.so", (1_000_000_000, 1_000_000_000))  # 2001: older than this torch
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    found = [f for f in judged() if f.check == "torch extensions"]
    assert [(f.status, f.detail) for f in found] == [
        (
            Status.WARN,
            f"{built}: built before this torch was installed: it may not load, or load with another ABI",
        )
    ]


def test_an_extension_another_environment_built_warns_and_one_that_does_not_load_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same torch in another virtual environment built it: it loads here, so a plain DDP job,
    which never uses the op, is not failed for it; a build whose symbols do not resolve is."""
    built = tmp_path / "deepspeed_shm_comm"
    built.mkdir()
    (built / "build.ninja").write_text(
        "cflags = -isystem /other/venv/lib/python3.11/site-packages/torch/include\n"
    )
    (built / "lib.c").write_text("int shm_comm(void) { return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(built / "shm.so"), str(built / "lib.c")], check=True)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ((status, detail),) = [(f.status, f.detail) for f in judged() if f.check == "torch extensions"]
    assert status is Status.WARN, detail
    assert "built against the torch at /other/venv/" in detail and "it loads here" in detail
    (built / "lib.c").write_text(
        "extern int sail_missing_symbol(void);\nint shm_comm(void) { return sail_missing_symbol(); }\n"
    )
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(built / "shm.so"), str(built / "lib.c")], check=True)
    ((status, detail),) = [(f.status, f.detail) for f in judged() if f.check == "torch extensions"]
    assert status is Status.FAIL and "does not load" in detail and "sail_missing_symbol" in detail


def test_loose_ssh_files_and_an_unprotected_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ssh = tmp_path / ".ssh"
    ssh.mkdir(mode=0o777)
    ssh.chmod(0o777)  # world-writable: sshd refuses it (755 is fine, see test_ssh_modes.py)
    (ssh / "authorized_keys").write_text("")
    (ssh / "authorized_keys").chmod(0o666)
    (ssh / "id_ed25519").write_text("")
    (ssh / "id_ed25519").chmod(0o644)
    tmp_path.chmod(0o755)
    monkeypatch.setenv("HOME", str(tmp_path))
    found = [f for f in judged() if f.check == "ssh permissions"]
    assert [(f.status, f.fix) for f in found] == [
        (Status.WARN, f"chmod 700 {ssh}"),
        (Status.WARN, f"chmod 600 {ssh / 'authorized_keys'}"),
        (Status.FAIL, f"chmod 600 {ssh / 'id_ed25519'}"),
    ]


def test_a_socket_interface_that_does_not_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    found = [f for f in judged() if "IFNAME" in f.check]
    assert [(f.check, f.status) for f in found] == [("GLOO_SOCKET_IFNAME", Status.FAIL)]
    assert found[0].detail.startswith("=eth9 matches no interface here (") and "lo" in found[0].detail


def test_import_spikingsail_does_not_import_torch() -> None:
    code = "import sys, spikingsail; assert 'torch' not in sys.modules; spikingsail.SpikingSail; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.stdout.strip() == "ok", result.stderr
